"""
``kl/normalization_shift``: the KL by which ``VecNormalize``'s statistics update alone moves the acting policy over a
rollout, checked against an independent computation: raw observations and statistics recorded by a separate callback,
normalized with VecNormalize's formula written out here, a copy of the policy, and ``torch.distributions``.
"""

import copy
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from sb3_contrib import MaskablePPO, RecurrentPPO
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecFrameStack, VecNormalize
from torch.distributions import Categorical, Normal, kl_divergence

from sb3_kl import KLPPO
from sb3_kl.callbacks import KLMonitorCallback


def _normalize(raw: np.ndarray, mean: np.ndarray, var: np.ndarray, normalizer: VecNormalize) -> np.ndarray:
    """VecNormalize's observation normalization, written out."""
    return np.clip((raw - mean) / np.sqrt(var + normalizer.epsilon), -normalizer.clip_obs, normalizer.clip_obs).astype(
        np.float32
    )


class RolloutRecorder(BaseCallback):
    """Keeps, for every rollout, the raw observations of its states, the statistics at its start and end, and a copy
    of the policy that acted (with the recurrent buffer's first LSTM states and episode starts, and action masks)."""

    def __init__(self, key: str | None = None):
        super().__init__()
        self.key = key  # the normalized key of Dict observations (the others are kept as the model saw them)
        self.rollouts: list[dict] = []

    def _stats(self):
        rms = self.model.get_vec_normalize_env().obs_rms
        rms = rms[self.key] if self.key is not None else rms
        return rms.mean.copy(), rms.var.copy()

    def _raw(self):
        raw = self.model.get_vec_normalize_env().get_original_obs()
        return (raw[self.key] if self.key is not None else raw).copy()

    def _others(self, observation):
        return {k: v.copy() for k, v in observation.items() if k != self.key} if self.key is not None else {}

    def _on_rollout_start(self) -> None:
        self.start = self._stats()
        self.raw = [self._raw()]
        self.others = [self._others(self.model._last_obs)]

    def _on_step(self) -> bool:
        self.raw.append(self._raw())
        self.others.append(self._others(self.locals["new_obs"]))
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        rollout = dict(
            start=self.start,
            end=self._stats(),
            raw=np.stack(self.raw[: buffer.buffer_size]),
            others={k: np.stack([o[k] for o in self.others[: buffer.buffer_size]]) for k in self.others[0]},
            key=self.key,
            policy=copy.deepcopy(self.model.policy),
        )
        if hasattr(buffer, "hidden_states_pi"):
            rollout["lstm"] = (buffer.hidden_states_pi[0].copy(), buffer.cell_states_pi[0].copy())
            rollout["episode_starts"] = buffer.episode_starts.copy()
        if hasattr(buffer, "action_masks"):
            rollout["masks"] = buffer.action_masks.copy()
        self.rollouts.append(rollout)


def _torch_distributions(rollout: dict, normalizer: VecNormalize, stats: tuple) -> list:
    """The policy copy's torch distributions on every state of the rollout, normalized with ``stats``."""
    policy = rollout["policy"]
    policy.set_training_mode(False)
    observations = th.as_tensor(_normalize(rollout["raw"], *stats, normalizer))  # (n_steps, n_envs, *shape)
    if rollout["key"] is not None:  # Dict observations: the normalized key beside the others
        observations = [
            {rollout["key"]: observations[step], **{k: th.as_tensor(v[step]) for k, v in rollout["others"].items()}}
            for step in range(len(observations))
        ]
    distributions = []
    with th.no_grad():
        if "lstm" in rollout:  # one step at a time, the LSTM state carried and reset at episode starts
            lstm = tuple(th.as_tensor(state) for state in rollout["lstm"])
            for step in range(len(observations)):
                starts = th.as_tensor(rollout["episode_starts"][step]).float()
                features = policy.extract_features(observations[step], policy.pi_features_extractor)
                latent, lstm = policy._process_sequence(features, lstm, starts, policy.lstm_actor)
                latent = policy.mlp_extractor.forward_actor(latent)
                distributions.append(policy._get_action_dist_from_latent(latent).distribution)
        else:
            for step in range(len(observations)):
                distribution = policy.get_distribution(observations[step])
                if "masks" in rollout:
                    logits = distribution.distribution.logits
                    masks = th.as_tensor(rollout["masks"][step]).bool()
                    distributions.append(Categorical(logits=th.where(masks, logits, th.tensor(-1e8))))
                else:
                    distributions.append(distribution.distribution)
    return [_double(distribution) for distribution in distributions]


def _double(distribution):
    """The same distribution in float64: a small KL is a difference of nearly equal terms, which float32 rounds."""
    if isinstance(distribution, Normal):
        return Normal(distribution.loc.double(), distribution.scale.double())
    return Categorical(logits=distribution.logits.double())


def independent_shift(rollout: dict, normalizer: VecNormalize, direction: str = "forward", per_dim: bool = False) -> float:
    """The mean over the rollout's states of KL(pi_start || pi_end) (``reverse``: KL(pi_end || pi_start))."""
    start = _torch_distributions(rollout, normalizer, rollout["start"])
    end = _torch_distributions(rollout, normalizer, rollout["end"])
    values = []
    for at_start, at_end in zip(start, end, strict=True):
        kl = kl_divergence(at_start, at_end) if direction == "forward" else kl_divergence(at_end, at_start)
        if isinstance(at_start, Normal):
            kl = kl.mean(-1) if per_dim else kl.sum(-1)
        values.append(kl)
    return float(th.cat(values).mean())


def _measured_and_expected(model, env, steps: int, monitor: KLMonitorCallback, key: str | None = None, every: int = 1, **kw):
    """Train with the monitor beside an independent recorder; :return: the monitor's shifts and the independent ones
    of the rollouts it measured (every ``every``-th; ``kw`` go to :func:`independent_shift`)."""
    recorder = RolloutRecorder(key=key)
    model.learn(steps, callback=CallbackList([recorder, monitor]))
    measured = [record["normalization_shift"] for record in monitor.history]
    return measured, [independent_shift(r, env, **kw) for r in recorder.rollouts[::every]]


def _pendulum(n_envs: int = 2) -> VecNormalize:
    return VecNormalize(make_vec_env("Pendulum-v1", n_envs=n_envs, seed=0))


# Non-orthogonal initialisation and a large learning rate: a policy whose output depends on its input, so the shift
# is far from zero
_POLICY = dict(ortho_init=False)


@pytest.mark.parametrize(
    "algo, direction, reduction",
    [(PPO, "forward", "sum"), (KLPPO, "reverse", "mean"), (KLPPO, "forward", "sum")],
)
def test_normalization_shift_matches_independent_kl(algo, direction, reduction):
    env = _pendulum()
    model = algo("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=2, learning_rate=3e-3, policy_kwargs=_POLICY, seed=0)
    monitor = KLMonitorCallback(direction=direction, reduction=reduction)
    measured, expected = _measured_and_expected(model, env, 5 * 128, monitor, direction=direction, per_dim=reduction == "mean")
    assert len(measured) == len(expected) == 5
    assert min(expected) > 1e-6  # the statistics move the policy: the comparison is not of zeros
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-9)
    assert model.logger.name_to_value["kl/normalization_shift"] == pytest.approx(measured[-1])


def test_normalization_shift_is_zero_when_the_statistics_are_frozen_and_absent_without_normalization():
    env = _pendulum()
    env.training = False
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, policy_kwargs=_POLICY, seed=0)
    monitor = KLMonitorCallback()
    model.learn(256, callback=monitor)
    assert [record["normalization_shift"] for record in monitor.history] == [0.0, 0.0]

    for model, monitor in (
        (PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2), n_steps=64, batch_size=64), KLMonitorCallback()),
        (PPO("MlpPolicy", _pendulum(), n_steps=64, batch_size=64), KLMonitorCallback(normalization_shift=False)),
        (PPO("MlpPolicy", VecNormalize(make_vec_env("Pendulum-v1"), norm_obs=False), n_steps=64), KLMonitorCallback()),
    ):
        model.learn(256, callback=monitor)
        assert all("normalization_shift" not in record for record in monitor.history)
        assert "kl/normalization_shift" not in model.logger.name_to_value


def test_normalization_shift_every_other_update():
    env = _pendulum()
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, learning_rate=3e-3, policy_kwargs=_POLICY, seed=1)
    measured, expected = _measured_and_expected(model, env, 5 * 128, KLMonitorCallback(every=2), every=2)
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-9)


def test_normalization_shift_of_a_recurrent_policy():
    env = _pendulum()
    model = RecurrentPPO(
        "MlpLstmPolicy",
        env,
        n_steps=64,
        batch_size=64,
        n_epochs=2,
        learning_rate=3e-3,
        policy_kwargs=dict(ortho_init=False, lstm_hidden_size=16),
        seed=0,
    )
    measured, expected = _measured_and_expected(model, env, 3 * 128, KLMonitorCallback())
    assert min(expected) > 1e-7
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-9)


class MaskedDriftEnv(gym.Env):
    """Box observations far from zero mean that drift (so the normalization keeps moving), four actions of which a
    random subset is valid at each step; a Dict variant carries the same observation under "state" beside an
    unnormalized "phase"."""

    def __init__(self, dict_observations: bool = False):
        box = spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float32)
        self.dict_observations = dict_observations
        if dict_observations:
            self.observation_space = spaces.Dict({"state": box, "phase": spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)})
        else:
            self.observation_space = box
        self.action_space = spaces.Discrete(4)
        self._t = 0

    def _obs(self):
        state = (5.0 + 0.2 * self._t + self.np_random.normal(size=3) * (1.0 + 0.05 * self._t)).astype(np.float32)
        if self.dict_observations:
            return {"state": state, "phase": np.array([self._t % 10 / 10.0], dtype=np.float32)}
        return state

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        self._mask = np.ones(4, dtype=bool)
        return self._obs(), {}

    def step(self, action):
        reward = float(action == 0)
        self._t += 1
        self._mask = self.np_random.random(4) < 0.6
        self._mask[self.np_random.integers(4)] = True
        return self._obs(), reward, False, self._t >= 40, {}

    def action_masks(self) -> np.ndarray:
        return self._mask


def test_normalization_shift_with_action_masks():
    env = VecNormalize(make_vec_env(MaskedDriftEnv, n_envs=2, seed=0), norm_reward=False)
    model = MaskablePPO("MlpPolicy", env, n_steps=64, batch_size=64, learning_rate=3e-3, policy_kwargs=_POLICY, seed=0)
    measured, expected = _measured_and_expected(model, env, 3 * 128, KLMonitorCallback())
    assert min(expected) > 1e-6
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-9)


def test_normalization_shift_with_dict_observations_normalizes_only_the_normalized_keys():
    env = VecNormalize(
        make_vec_env(MaskedDriftEnv, n_envs=2, seed=0, env_kwargs=dict(dict_observations=True)),
        norm_obs_keys=["state"],
        norm_reward=False,
    )
    model = PPO("MultiInputPolicy", env, n_steps=64, batch_size=64, learning_rate=3e-3, policy_kwargs=_POLICY, seed=0)
    measured, expected = _measured_and_expected(model, env, 3 * 128, KLMonitorCallback(), key="state")
    assert min(expected) > 1e-6
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-9)


def test_normalization_shift_not_measured_behind_another_observation_wrapper():
    env = VecFrameStack(_pendulum(), n_stack=2)
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64)
    monitor = KLMonitorCallback()
    with pytest.warns(UserWarning, match="Put VecNormalize last"):
        model.learn(128, callback=monitor)
    assert "normalization_shift" not in monitor.history[0]
    assert monitor.history[0]["mean"] >= 0.0  # the update's KL is still measured


def test_normalization_shift_option_is_checked():
    with pytest.raises(TypeError, match="normalization_shift"):
        KLMonitorCallback(normalization_shift="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KLMonitorCallback(normalization_shift=False)


def test_callbacks_that_measure_privately_do_not_measure_the_shift_but_a_shared_monitor_does():
    from sb3_kl.callbacks import KLAlarmCallback

    model = PPO("MlpPolicy", _pendulum(), n_steps=64, batch_size=64, policy_kwargs=_POLICY, seed=0)
    alarm = KLAlarmCallback(target_kl=0.03)
    model.learn(256, callback=alarm)
    assert all("normalization_shift" not in record for record in alarm.monitor.history)
    monitor = KLMonitorCallback()
    model.learn(256, callback=[monitor, KLAlarmCallback(target_kl=0.03, monitor=monitor)])
    assert all(record["normalization_shift"] >= 0.0 for record in monitor.history)


def test_normalization_shift_of_a_recurrent_policy_on_dict_observations():
    env = VecNormalize(
        make_vec_env(MaskedDriftEnv, n_envs=2, seed=0, env_kwargs=dict(dict_observations=True)),
        norm_obs_keys=["state"],
        norm_reward=False,
    )
    model = RecurrentPPO(
        "MultiInputLstmPolicy",
        env,
        n_steps=64,
        batch_size=64,
        n_epochs=2,
        learning_rate=3e-3,
        policy_kwargs=dict(ortho_init=False, lstm_hidden_size=16),
        seed=0,
    )
    # chunk_size=64: several chunks of envs
    measured, expected = _measured_and_expected(model, env, 3 * 128, KLMonitorCallback(chunk_size=64), key="state")
    assert min(expected) > 1e-7
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-9)
