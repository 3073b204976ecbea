import inspect

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback

from sb3_kl import KLPPO, ClipKLPPO

TINY = dict(n_steps=256, batch_size=64, n_epochs=10, policy_kwargs=dict(net_arch=[16]))


def snapshot(model) -> th.nn.Module:
    """An independent copy of the model's policy, in eval mode."""
    policy = model.policy_class(
        model.observation_space, model.action_space, model.lr_schedule, use_sde=model.use_sde, **model.policy_kwargs
    )
    policy.load_state_dict(model.policy.state_dict())
    policy.set_training_mode(False)
    return policy


def reference_kl(old_policy, new_policy, obs: np.ndarray) -> np.ndarray:
    """Per-state joint KL(old || new) from torch.distributions.kl_divergence (independent of sb3_kl)."""
    with th.no_grad():
        obs_tensor = th.as_tensor(obs)
        old = old_policy.get_distribution(obs_tensor).distribution
        new = new_policy.get_distribution(obs_tensor).distribution
        kl = th.distributions.kl_divergence(old, new)
    return (kl.sum(dim=-1) if kl.dim() > 1 else kl).numpy()


class UpdateKLCallback(BaseCallback):
    """Snapshot before each update (``_on_rollout_end``), KL to the policy after it (next rollout start or the end)."""

    def __init__(self):
        super().__init__()
        self.pending = None
        self.updates: list[np.ndarray] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        observations = self.model.rollout_buffer.observations
        self.pending = (snapshot(self.model), observations.reshape(-1, *observations.shape[2:]).copy())

    def _measure(self) -> None:
        if self.pending is not None:
            self.updates.append(reference_kl(*self.pending[:1], self.model.policy, self.pending[1]))
            self.pending = None

    def _on_rollout_start(self) -> None:
        self._measure()

    def _on_training_end(self) -> None:
        self._measure()


def test_defaults_and_name():
    model = ClipKLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32)
    assert isinstance(model, KLPPO)
    assert model.clip_range(1.0) == 0.2
    assert model.kl_stop_factor == 2.0
    assert model.target_kl(1.0) == 0.02  # KLPPO's default for discrete actions
    assert inspect.signature(ClipKLPPO.learn).parameters["tb_log_name"].default == "ClipKLPPO"
    # Every PPO argument is accepted
    ppo = inspect.signature(PPO.__init__).parameters
    ours = inspect.signature(ClipKLPPO.__init__).parameters
    assert all(name in ours for name in ppo)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_stops_early_when_kl_runs_away(env_id):
    """
    With a huge learning rate the KL runs away in the first epoch: the update stops after it, and the KL measured
    from outside is above kl_stop_factor * target (what triggered the stop); the same update without the stop runs
    every epoch. The clip fraction is logged.
    """
    results = {}
    for stop in (2.0, None):
        callback = UpdateKLCallback()
        model = ClipKLPPO("MlpPolicy", gym.make(env_id), learning_rate=0.2, kl_stop_factor=stop, seed=0, **TINY)
        model.learn(TINY["n_steps"], callback=callback)
        results[stop] = (callback.updates[0], dict(model.logger.name_to_value), model.target_kl(1.0))
    (kl_stop, logs_stop, target), (_, logs_free, _) = results[2.0], results[None]
    assert logs_stop["train/early_stop_epoch"] < TINY["n_epochs"]
    assert logs_stop["train/n_updates"] == logs_stop["train/early_stop_epoch"]
    assert logs_free["train/early_stop_epoch"] == logs_free["train/n_updates"] == TINY["n_epochs"]
    assert kl_stop.mean() > 2.0 * target
    assert logs_stop["train/kl"] == pytest.approx(kl_stop.mean(), rel=1e-3)
    assert 0.0 < logs_stop["train/clip_fraction"] <= 1.0
    assert logs_stop["train/clip_range"] == 0.2


def test_normal_learning_rate_keeps_kl_near_target():
    """At a sane learning rate the controller and the stop keep every update's KL (measured outside) bounded."""
    callback = UpdateKLCallback()
    model = ClipKLPPO("MlpPolicy", "CartPole-v1", learning_rate=1e-3, seed=0, **TINY)
    model.learn(6 * TINY["n_steps"], callback=callback)
    means = np.array([kl.mean() for kl in callback.updates])
    target = model.target_kl(1.0)
    assert means.max() > 0.1 * target, "real steps"
    # The stop is judged after an epoch, so one epoch can overshoot; it cannot run on for ten
    assert np.all(means < 5 * target), means
    assert "train/clip_fraction" in model.logger.name_to_value
    assert "train/kl_coef" in model.logger.name_to_value


def test_save_load_round_trip(tmp_path):
    model = ClipKLPPO("MlpPolicy", "Pendulum-v1", learning_rate=3e-3, clip_range=0.1, kl_stop_factor=3.0, seed=0, **TINY)
    model.learn(2 * TINY["n_steps"])
    kl_coef = model.kl_coef
    assert kl_coef != 1.0, "the coefficient should have adapted"
    obs = np.stack([model.observation_space.sample() for _ in range(8)])
    actions, _ = model.predict(obs, deterministic=True)
    model.save(tmp_path / "clip_klppo.zip")
    loaded = ClipKLPPO.load(tmp_path / "clip_klppo.zip", env=gym.make("Pendulum-v1"))
    np.testing.assert_allclose(loaded.predict(obs, deterministic=True)[0], actions)
    assert loaded.kl_coef == kl_coef
    assert loaded.clip_range(1.0) == 0.1
    assert loaded.kl_stop_factor == 3.0
    loaded.learn(TINY["n_steps"], reset_num_timesteps=False)
    assert loaded.logger.name_to_value["train/clip_range"] == 0.1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clip_range=None), "clip_range"),
        (dict(clip_range=0.0), "clip_range"),
        (dict(clip_range=-0.2), "clip_range"),
        (dict(kl_stop_factor=0.0), "kl_stop_factor"),
        (dict(kl_stop_factor=-1.0), "kl_stop_factor"),
        (dict(kl_hinge_coef=-1.0), "kl_hinge_coef"),
        (dict(kl_hinge_factor=0.0), "kl_hinge_factor"),
        (dict(target_kl=0.0), "target_kl"),
        (dict(kl_estimator="k2"), "kl_estimator"),
        (dict(kl_direction="both"), "kl_direction"),
        (dict(min_std=0.1), "min_std"),  # CartPole has discrete actions
    ],
)
def test_bad_arguments_raise(kwargs, match):
    # ValueError for a value out of range, TypeError for a value of the wrong type; the message names the argument
    with pytest.raises((ValueError, TypeError), match=match):
        ClipKLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, **kwargs)
