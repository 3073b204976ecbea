"""
The update is pinned: short KLPPO, ClipKLPPO, MaskableKLPPO and RecurrentKLPPO runs must end with the parameters
recorded in ``tests/fixtures/update_pins.npz`` (written by the training loop as it stood before its host
synchronisations were taken out of the minibatch loop: speed work must not change an update), to a relative tolerance
of 1e-5. Not bit for bit: another CPU or torch build may pick other kernels and round differently (measured: 2.6e-7
relative on one parameter between two machines with the same torch build and CPU capability). Bit-for-bit claims
compare two runs made in the same process (``tests/test_determinism.py``).
Rewrite the pins only for a change that is meant to change updates: ``python tests/test_update_pinned.py --write``.
"""

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch as th
from stable_baselines3.common.env_util import make_vec_env

PINS = Path(__file__).parent / "fixtures" / "update_pins.npz"

# name: (algorithm, env id, extra keyword arguments); every case is two updates of a small network
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Box actions, no ratio clip, the per-epoch KL stop judged
    "klppo_pendulum": ("KLPPO", "Pendulum-v1", dict(kl_stop_factor=1.5)),
    # Discrete actions with PPO's clip
    "clip_klppo_cartpole": ("ClipKLPPO", "CartPole-v1", {}),
    # gSDE: state-dependent std
    "klppo_pendulum_gsde": ("KLPPO", "Pendulum-v1", dict(use_sde=True, sde_sample_freq=4)),
    # beta at its upper bound from the start: the per-minibatch stop at the bound is judged
    "klppo_at_kl_coef_bound": ("KLPPO", "CartPole-v1", dict(kl_coef=1.0, kl_coef_bounds=(1e-4, 1.0), learning_rate=3e-2)),
    # a sample estimator in the reverse direction, mean over action dimensions
    "klppo_k3_reverse": ("KLPPO", "Pendulum-v1", dict(kl_estimator="k3", kl_direction="reverse", kl_reduction="mean")),
    # action masks
    "maskable_klppo": ("MaskableKLPPO", "masked", {}),
    # an LSTM policy (its own minibatch loop, the same optimizer step)
    "recurrent_klppo": ("RecurrentKLPPO", "CartPole-v1", dict(policy_kwargs=dict(net_arch=[16], lstm_hidden_size=8))),
}


def short_run(name: str) -> dict[str, np.ndarray]:
    """:return: the policy's parameters after the case's two updates"""
    import sb3_kl

    algo, env_id, extra = CASES[name]
    if env_id == "masked":
        from sb3_contrib.common.envs import InvalidActionEnvDiscrete

        env = make_vec_env(lambda: InvalidActionEnvDiscrete(dim=20, n_invalid_actions=10), n_envs=2, seed=0)
    else:
        env = make_vec_env(env_id, n_envs=2, seed=0)
    kwargs = dict(n_steps=64, batch_size=32, n_epochs=3, policy_kwargs=dict(net_arch=[16]), seed=0, device="cpu")
    policy = "MlpLstmPolicy" if algo == "RecurrentKLPPO" else "MlpPolicy"
    model = getattr(sb3_kl, algo)(policy, env, **{**kwargs, **extra})
    model.learn(2 * 64 * 2)
    return {key: value.detach().numpy().copy() for key, value in model.policy.state_dict().items()}


def write_pins() -> None:
    th.set_num_threads(1)
    np.savez(PINS, **{f"{name}/{key}": value for name in CASES for key, value in short_run(name).items()})


@pytest.mark.parametrize("name", list(CASES))
def test_update_matches_pinned_parameters(name: str) -> None:
    pins = np.load(PINS)
    params = short_run(name)
    pinned = {key.split("/", 1)[1]: pins[key] for key in pins.files if key.startswith(name + "/")}
    assert pinned.keys() == params.keys()
    for key, value in params.items():
        np.testing.assert_allclose(value, pinned[key], rtol=1e-5, atol=1e-7, err_msg=f"{name}: {key} moved")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_pins()
