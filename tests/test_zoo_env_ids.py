"""
An sb3_kl algorithm given the id of one of the RL Zoo's own environments (``CartPoleNoVel-v1``: registered by importing
``rl_zoo3.import_envs``) builds it without that import; an id nobody registers keeps gymnasium's error.
"""

import sys
import warnings

import gymnasium as gym
import pytest
from gymnasium.envs import registration

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO, MaskableKLPPO, RecurrentKLPPO

pytest.importorskip("rl_zoo3")


def _zoo_registered(spec: registration.EnvSpec) -> bool:
    entry_point = spec.entry_point
    module = entry_point if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
    return module.startswith("rl_zoo3")


@pytest.fixture
def without_zoo_envs(monkeypatch):
    """Gymnasium's registry as in a process that never imported ``rl_zoo3.import_envs`` (restored afterwards)."""
    registry = {env_id: spec for env_id, spec in registration.registry.items() if not _zoo_registered(spec)}
    monkeypatch.setattr(registration, "registry", registry)
    monkeypatch.delitem(sys.modules, "rl_zoo3.import_envs", raising=False)
    with pytest.raises(gym.error.NameNotFound):
        gym.spec("CartPoleNoVel-v1")
    return registry


@pytest.mark.parametrize(
    "algo_class, policy",
    [
        (KLPPO, "MlpPolicy"),
        (ClipKLPPO, "MlpPolicy"),
        (KLTRPO, "MlpPolicy"),
        (MaskableKLPPO, "MlpPolicy"),
        (RecurrentKLPPO, "MlpLstmPolicy"),
    ],
)
def test_a_zoo_env_id_is_registered_on_use(without_zoo_envs, algo_class, policy):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Overriding environment")  # no id registered twice
        model = algo_class(policy, "CartPoleNoVel-v1", n_steps=128, policy_kwargs=dict(net_arch=[16]))
    assert "CartPoleNoVel-v1" in without_zoo_envs
    obs = model.env.reset()
    assert obs.shape == (1, 4) and obs[0, 0] != 0 and obs[0, 1] == 0 and obs[0, 3] == 0  # the velocities are masked
    model.env.close()


def test_an_unknown_env_id_keeps_gymnasiums_error(without_zoo_envs):
    with pytest.raises(gym.error.NameNotFound, match="NoSuchEnv"):
        KLPPO("MlpPolicy", "NoSuchEnv-v0")


def test_a_zoo_env_id_without_a_working_zoo_keeps_gymnasiums_error(without_zoo_envs, monkeypatch):
    monkeypatch.setitem(sys.modules, "rl_zoo3.import_envs", None)  # its import fails
    with pytest.raises(gym.error.NameNotFound, match="CartPoleNoVel"):
        KLPPO("MlpPolicy", "CartPoleNoVel-v1")
