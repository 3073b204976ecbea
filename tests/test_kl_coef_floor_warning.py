"""
An algorithm whose beta sits at the lower bound of ``kl_coef_bounds`` while every update's KL stays far below the
target warns once (the penalty is not what holds the KL down), with a counter that survives save/load.
"""

import pytest

from sb3_kl import KLPPO
from sb3_kl.common.on_policy_algorithm import STALLED_AT_FLOOR_UPDATES

N_STEPS = 32


def _floor_warnings(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if issubclass(w.category, UserWarning) and "lower bound" in str(w.message)]


def test_beta_at_its_floor_with_a_stalled_kl_warns_once_across_save_and_load(tmp_path, recwarn, capsys):
    # a learning rate far too small for a large target: the KL stays ~0 and beta sits at its floor from the start
    model = KLPPO(
        "MlpPolicy",
        "CartPole-v1",
        learning_rate=1e-7,
        target_kl=0.5,
        kl_coef=1e-4,
        n_steps=N_STEPS,
        batch_size=N_STEPS,
        n_epochs=1,
        policy_kwargs=dict(net_arch=[8]),
        seed=0,
        verbose=1,
    )
    half = STALLED_AT_FLOOR_UPDATES // 2
    model.learn(half * N_STEPS)
    assert model.kl_coef == pytest.approx(1e-4) and model.kl_coef_floor_updates == half
    assert _floor_warnings(recwarn) == [] and not model.kl_coef_floor_warned

    model.save(tmp_path / "model.zip")
    model = KLPPO.load(tmp_path / "model.zip", env=model.get_env())
    assert model.kl_coef_floor_updates == half  # the count goes on from the saved one
    model.learn((STALLED_AT_FLOOR_UPDATES - half) * N_STEPS, reset_num_timesteps=False)
    (message,) = _floor_warnings(recwarn)
    assert model.kl_coef_floor_warned and model.kl_coef_floor_updates == STALLED_AT_FLOOR_UPDATES
    assert "learning rate is too small" in message and "KLAdaptiveLRCallback" in message and "smaller `target_kl`" in message
    assert 'learning_rate="auto"' in message  # the KLPPO family adapts its own rate

    model.save(tmp_path / "warned.zip")
    model = KLPPO.load(tmp_path / "warned.zip", env=model.get_env())
    model.learn(half * N_STEPS, reset_num_timesteps=False)
    assert len(_floor_warnings(recwarn)) == 1  # once per model, a reloaded one included
    assert model.kl_coef_floor_updates == STALLED_AT_FLOOR_UPDATES + half
    assert capsys.readouterr().out.count("has sat at the lower bound") == 1  # printed with verbose=1


def test_a_healthy_run_with_beta_at_its_floor_does_not_warn(recwarn):
    # beta at its floor too, but a learning rate that moves the policy: the KL reaches a tenth of the target
    model = KLPPO(
        "MlpPolicy",
        "CartPole-v1",
        learning_rate=3e-3,
        target_kl=0.01,
        kl_coef=1e-4,
        n_steps=64,
        batch_size=32,
        n_epochs=5,
        policy_kwargs=dict(net_arch=[16]),
        seed=0,
    )
    model.learn(15 * 64)
    assert model.kl_coef == pytest.approx(1e-4)
    assert _floor_warnings(recwarn) == [] and not model.kl_coef_floor_warned
    assert model.kl_coef_floor_updates < STALLED_AT_FLOOR_UPDATES
