"""
The KL callbacks on sb3-contrib's RecurrentPPO: the per-state KL of a recurrent policy is measured on each env's
sequence (the LSTM re-run in time order from the state stored at the env's first step, episode starts resetting it),
checked against an independent step-by-step computation with torch.distributions.
"""

import copy
import os

import numpy as np
import pytest
import torch as th
from sb3_contrib import RecurrentPPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import FakeImageEnv, SimpleMultiObsEnv
from torch.distributions import Categorical, Normal, kl_divergence

from sb3_kl.callbacks import KLAdaptiveLRCallback, KLAlarmCallback, KLMonitorCallback, VarianceFloorCallback
from sb3_kl.common.callbacks_monitor import distribution_params_for_policy
from sb3_kl.common.recurrent import RolloutSequences, evaluate_sequences, step_major

os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")

LSTM_VARIANTS = {
    "separate": dict(enable_critic_lstm=True),
    "shared": dict(shared_lstm=True, enable_critic_lstm=False),
    "no_critic_lstm": dict(enable_critic_lstm=False),
}


def _model(env_id, n_envs=2, lstm="separate", **kwargs):
    policy_kwargs = dict(net_arch=[16], lstm_hidden_size=16, **LSTM_VARIANTS[lstm])
    env = make_vec_env(env_id, n_envs=n_envs, seed=0)
    kwargs = {"n_steps": 64, "batch_size": 32, "n_epochs": 4, "seed": 0, "policy_kwargs": policy_kwargs, **kwargs}
    return RecurrentPPO("MlpLstmPolicy", env, **kwargs)


def _copy_policy(policy):
    """An independent copy of the whole policy, rebuilt from its constructor arguments and a copy of its weights."""
    kwargs = policy._get_constructor_parameters()
    kwargs.update(
        lstm_hidden_size=policy.lstm_actor.hidden_size,
        n_lstm_layers=policy.lstm_actor.num_layers,
        shared_lstm=policy.shared_lstm,
        enable_critic_lstm=policy.enable_critic_lstm,
    )
    clone = type(policy)(**kwargs)
    clone.load_state_dict(copy.deepcopy(policy.state_dict()))
    return clone


def _stepwise_distributions(policy, observations, episode_starts, lstm_states):
    """
    The policy's torch distribution at every stored step, stepping its LSTM one step at a time over all envs, as
    during the rollout (independent of sb3_kl's sequence re-run).

    :return: a list over steps of torch distributions with batch (n_envs,)
    """
    policy.set_training_mode(False)
    states = (th.as_tensor(lstm_states[0]), th.as_tensor(lstm_states[1]))
    distributions = []
    with th.no_grad():
        for t in range(len(episode_starts)):
            dist, states = policy.get_distribution(th.as_tensor(observations[t]), states, th.as_tensor(episode_starts[t]))
            inner = dist.distribution  # float64 for the KL: float32 rounds a small KL to ~1e-7
            if isinstance(inner, Normal):
                distributions.append(Normal(inner.loc.double(), inner.scale.double()))
            else:
                distributions.append(Categorical(logits=inner.logits.double()))
    return distributions


class IndependentRecurrentKL(BaseCallback):
    """
    Deep copy of the policy before train() (end of rollout) and after it; both stepped over the buffer's rollout;
    KL(old || new) per stored step with torch.distributions, in step-major order.
    """

    def __init__(self):
        super().__init__()
        self.results = []
        self._pending = None

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        data = (
            buffer.observations.copy(),
            buffer.episode_starts.copy(),
            (buffer.hidden_states_pi[0].copy(), buffer.cell_states_pi[0].copy()),
        )
        self._pending = (_copy_policy(self.model.policy), data)

    def _measure(self) -> None:
        if self._pending is None:
            return
        old_policy, data = self._pending
        self._pending = None
        new_policy = _copy_policy(self.model.policy)
        kls = []
        for p, q in zip(_stepwise_distributions(old_policy, *data), _stepwise_distributions(new_policy, *data), strict=True):
            kl = kl_divergence(p, q)
            kls.append(kl.sum(dim=-1) if kl.ndim == 2 else kl)
        self.results.append(th.stack(kls).reshape(-1).numpy().astype(np.float64))

    def _on_rollout_start(self) -> None:
        self._measure()

    def _on_training_end(self) -> None:
        self._measure()


class RolloutLogProbs(BaseCallback):
    """Re-runs the rollout policy over the buffer's sequences at the end of each rollout: its log-probs vs the rollout's."""

    def __init__(self):
        super().__init__()
        self.errors = []
        self.episode_starts = 0

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        sequences = RolloutSequences.from_buffer(buffer)
        dist_params = distribution_params_for_policy(self.model.policy.action_dist)
        evaluation = evaluate_sequences(self.model.policy, sequences, dist_params, with_log_prob=True, chunk_size=64)
        log_prob = step_major(evaluation.log_prob).numpy()
        self.errors.append(float(np.abs(log_prob - buffer.log_probs.reshape(-1)).max()))
        self.episode_starts += int(buffer.episode_starts[1:].sum())


@pytest.mark.parametrize("lstm", sorted(LSTM_VARIANTS))
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_sequence_rerun_reproduces_rollout_log_probs(env_id, lstm):
    model = _model(env_id, lstm=lstm, n_steps=128, n_epochs=2)
    check = RolloutLogProbs()
    # chunk_size=64 < n_envs * n_steps: the envs are re-run in several chunks
    model.learn(2 * 256, callback=check)
    assert len(check.errors) == 2
    assert max(check.errors) < 5e-6
    if env_id == "CartPole-v1":
        assert check.episode_starts > 0  # episodes started inside the sequences (resets exercised)


def test_sequence_rerun_after_get():
    # the buffer flattened by get() (env-major) gives the same sequences as before
    model = _model("CartPole-v1")
    model.learn(128)
    buffer = model.rollout_buffer
    before = RolloutSequences.from_buffer(buffer)
    next(buffer.get(batch_size=32))
    after = RolloutSequences.from_buffer(buffer)
    assert th.equal(before.observations, after.observations)
    assert th.equal(before.episode_starts, after.episode_starts)
    assert th.equal(before.actions, after.actions)
    for a, b in zip(before.lstm_states, after.lstm_states, strict=True):
        assert th.equal(a, b)


@pytest.mark.parametrize("lstm", ["separate", "shared"])
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_monitor_matches_independent_kl_on_recurrent_ppo(env_id, lstm):
    model = _model(env_id, lstm=lstm, learning_rate=1e-2)
    monitor = KLMonitorCallback(quantiles=(0.5, 0.9, 0.99), per_env=True)
    per_state = []
    monitor.add_listener(lambda record, values: per_state.append(values.copy()))
    reference = IndependentRecurrentKL()
    model.learn(4 * 128, callback=[reference, monitor])

    assert len(monitor.history) == len(reference.results) == len(per_state) == 4
    for record, values, kl in zip(monitor.history, per_state, reference.results, strict=True):
        np.testing.assert_allclose(values, kl, rtol=1e-4, atol=1e-7)
        assert record["mean"] == pytest.approx(kl.mean(), rel=1e-4)
        for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
            assert record[name] == pytest.approx(np.quantile(kl, q), rel=1e-4, abs=1e-8)
        assert record["env_means"] == pytest.approx([kl[0::2].mean(), kl[1::2].mean()], rel=1e-4)
    assert min(r["mean"] for r in monitor.history) > 1e-4  # the policy moved: not a comparison of zeros
    values = model.logger.name_to_value
    assert values["kl/mean"] == pytest.approx(reference.results[-1].mean(), rel=1e-4)
    assert values["kl/p99"] == pytest.approx(np.quantile(reference.results[-1], 0.99), rel=1e-4)


def test_monitor_sample_estimator_and_top_k_on_recurrent_ppo(tmp_path):
    model = _model("CartPole-v1", learning_rate=1e-2)
    monitor = KLMonitorCallback(estimator="k3", top_k=4, top_k_path=str(tmp_path / "top.npz"))
    reference = IndependentRecurrentKL()
    model.learn(2 * 128, callback=[reference, monitor])
    assert len(monitor.history) == 2
    # k3 of the stored actions is an unbiased estimate of the exact KL: same order of magnitude here
    exact = reference.results[-1].mean()
    assert 0.2 * exact < monitor.history[-1]["mean"] < 5 * exact
    top = np.load(tmp_path / "top.npz")
    assert top["observations"].shape == (8, 4)
    # the kept observations are the ones stored at (step, env)
    assert np.all(top["kl"][:4] >= top["kl"][3])


@pytest.mark.parametrize(
    "policy, env",
    [
        ("CnnLstmPolicy", lambda: FakeImageEnv(screen_height=36, screen_width=36, n_channels=1, discrete=True)),
        ("MultiInputLstmPolicy", lambda: SimpleMultiObsEnv(random_start=True)),
    ],
)
def test_monitor_on_cnn_and_multi_input_lstm(policy, env):
    policy_kwargs = dict(lstm_hidden_size=8, net_arch=[8])
    if policy == "CnnLstmPolicy":
        policy_kwargs["features_extractor_kwargs"] = dict(features_dim=16)
    model = RecurrentPPO(
        policy, make_vec_env(env, n_envs=2, seed=0), n_steps=16, batch_size=16, n_epochs=2, seed=0, policy_kwargs=policy_kwargs
    )
    monitor = KLMonitorCallback()
    check = RolloutLogProbs()
    model.learn(2 * 32, callback=[check, monitor])
    assert len(monitor.history) == 2
    assert all(np.isfinite(r["mean"]) and r["min"] >= -1e-6 for r in monitor.history)
    assert max(check.errors) < 5e-6


def test_control_callbacks_on_recurrent_ppo():
    model = _model("Pendulum-v1", learning_rate=1e-3)
    monitor = KLMonitorCallback()
    adaptive = KLAdaptiveLRCallback(target_kl=1e-6, monitor=monitor)  # unreachable target: the rate must drop
    alarm = KLAlarmCallback(target_kl=1e-6, monitor=monitor, patience=1)
    floor = VarianceFloorCallback(min_std=0.9)
    model.learn(3 * 128, callback=[monitor, adaptive, alarm, floor])
    assert adaptive.learning_rate < 1e-3
    assert model.policy.optimizer.param_groups[0]["lr"] == pytest.approx(adaptive.learning_rate)
    assert len(alarm.alarms) > 0
    assert float(th.exp(model.policy.log_std.detach()).min()) >= 0.9 - 1e-6
