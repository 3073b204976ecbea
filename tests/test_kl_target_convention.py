"""
The KL a callback compares with an algorithm's ``target_kl`` is the KL that target bounds: KLMonitorCallback logs the
update's exact KL in the algorithm's convention beside ``kl/target`` (whatever convention it measures in), and
KLAlarmCallback's spike checks use it. Also: the tail ratio is p99/mean whatever quantiles are logged, a ``k1``
monitor does not call sampling noise a bug, quantile keys are exact and distinct, and ``sb3-kl report`` reads every
KL figure of a run from one source in one convention.
"""

import copy
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from sb3_contrib import TRPO
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv
from torch.distributions import kl_divergence

from sb3_kl import KLPPO, KLTRPO
from sb3_kl.callbacks import KLAlarmCallback, KLMonitorCallback
from sb3_kl.common.callbacks_alarm import NEGATIVE_K1_STANDARD_ERRORS
from sb3_kl.common.kl import quantile_name
from sb3_kl.diagnostics.logs import find_runs, load_run
from sb3_kl.diagnostics.report import format_text, summarize_run


class ActionEnv(gym.Env):
    """Random observations in R^4, 20-step episodes; actions (of any space) rewarded for following the observations."""

    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)

    def __init__(self, action_space: spaces.Space):
        self.action_space = action_space
        self._rng = np.random.default_rng(0)
        self._obs = np.zeros(4, np.float32)
        self._t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        self._obs = self._rng.uniform(-1, 1, 4).astype(np.float32)
        return self._obs, {}

    def step(self, action):
        action = np.asarray(action, dtype=np.float64)
        reward = float(np.tanh(self._obs.sum()) * np.sum(action) - 0.1 * np.sum(action**2))
        self._t += 1
        self._obs = self._rng.uniform(-1, 1, 4).astype(np.float32)
        return self._obs, reward, False, self._t >= 20, {}


def _env(action_space: spaces.Space) -> DummyVecEnv:
    env = DummyVecEnv([lambda: ActionEnv(action_space), lambda: ActionEnv(action_space)])
    env.seed(0)
    return env


def _wide_env(n_dims: int = 10) -> DummyVecEnv:
    return _env(spaces.Box(-1.0, 1.0, (n_dims,), np.float32))


class IndependentDistributions(BaseCallback):
    """torch.distributions of copies of the policy before and after each update, on the rollout's states."""

    def __init__(self):
        super().__init__()
        self.pairs: list[tuple[th.distributions.Distribution, th.distributions.Distribution]] = []
        self._pending = None

    def _on_step(self) -> bool:
        return True

    def _distribution(self, policy, obs):
        policy.set_training_mode(False)
        with th.no_grad():
            return policy.get_distribution(th.as_tensor(obs)).distribution

    def _on_rollout_end(self) -> None:
        obs = self.model.rollout_buffer.observations
        self._pending = obs.reshape(-1, *obs.shape[2:]).copy()
        self._old = self._distribution(copy.deepcopy(self.model.policy), self._pending)

    def _measure(self) -> None:
        if self._pending is None:
            return
        self.pairs.append((self._old, self._distribution(copy.deepcopy(self.model.policy), self._pending)))
        self._pending = None

    def _on_rollout_start(self) -> None:
        self._measure()

    def _on_training_end(self) -> None:
        self._measure()

    def mean_kl(self, index: int, direction: str, reduction: str) -> float:
        old, new = self.pairs[index]
        if isinstance(old, list):  # MultiDiscrete: one Categorical per sub-action
            pairs = list(zip(old, new, strict=True))
        else:
            pairs = [(old, new)]
        parts = [kl_divergence(p, q) if direction == "forward" else kl_divergence(q, p) for p, q in pairs]
        kl = th.stack(parts, dim=1) if len(parts) > 1 else parts[0]
        if kl.ndim == 2:  # independent dimensions (Gaussian, Bernoulli, sub-actions)
            kl = kl.sum(dim=1) if reduction == "sum" else kl.mean(dim=1)
        return float(kl.double().mean())


CASES = [
    # sb3-contrib's TRPO bounds KL(new||old) averaged over Box dimensions, summed for discrete actions
    (lambda: TRPO("MlpPolicy", _wide_env(4), n_steps=64, seed=0), "reverse/analytic/mean"),
    (lambda: TRPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=2, seed=0), n_steps=64, seed=0), "reverse/analytic/sum"),
    (lambda: TRPO("MlpPolicy", _env(spaces.MultiBinary(3)), n_steps=64, seed=0), "reverse/analytic/mean"),
    (lambda: TRPO("MlpPolicy", _env(spaces.MultiDiscrete([3, 2, 4])), n_steps=64, seed=0), "reverse/analytic/sum"),
    # KLTRPO in TRPO's convention, and KLPPO in a non-default one: their own
    (
        lambda: KLTRPO("MlpPolicy", _wide_env(4), n_steps=64, kl_reduction="sb3_contrib", seed=0),
        "reverse/analytic/mean",
    ),
    (
        lambda: KLTRPO("MlpPolicy", _env(spaces.MultiBinary(3)), n_steps=64, kl_reduction="sb3_contrib", seed=0),
        "reverse/analytic/mean",
    ),
    (
        lambda: KLPPO("MlpPolicy", _env(spaces.MultiDiscrete([3, 2, 4])), n_steps=64, batch_size=64, kl_reduction="mean"),
        "forward/analytic/mean",
    ),
    (
        lambda: KLPPO("MlpPolicy", _wide_env(4), n_steps=64, batch_size=64, kl_direction="reverse", kl_reduction="mean"),
        "reverse/analytic/mean",
    ),
    # SB3's PPO stops on an estimate of KL(old||new) of the joint action
    (lambda: PPO("MlpPolicy", _wide_env(4), n_steps=64, batch_size=64, target_kl=0.03, seed=0), "forward/analytic/sum"),
]


@pytest.mark.parametrize("make_model, convention", CASES)
@pytest.mark.parametrize("monitor_estimator", ["analytic", "k3"])
def test_monitor_logs_the_kl_in_the_targets_convention_beside_the_target(make_model, convention, monitor_estimator):
    model = make_model()
    monitor = KLMonitorCallback(estimator=monitor_estimator)
    reference = IndependentDistributions()
    model.learn(3 * model.n_steps * 2, callback=[monitor, reference])
    direction, _, reduction = convention.split("/")
    assert len(monitor.history) == len(reference.pairs) == 3
    for i, record in enumerate(monitor.history):
        assert record["target_convention"] == convention
        # exact in the target's convention, even when the monitor estimates its own KL from samples
        assert record["mean_in_target_convention"] == pytest.approx(
            reference.mean_kl(i, direction, reduction), rel=1e-4, abs=1e-8
        )
    values = model.logger.name_to_value
    assert values["kl/target_convention"] == convention
    assert values["kl/mean_in_target_convention"] == monitor.history[-1]["mean_in_target_convention"]
    target = model._current_target_kl() if hasattr(model, "_current_target_kl") else model.target_kl
    assert values["kl/target"] == target
    if isinstance(model, KLTRPO):  # the trust region holds in its own convention
        assert all(r["mean_in_target_convention"] <= target * (1 + 1e-4) for r in monitor.history)


def test_alarm_judges_trpo_by_the_kl_trpo_bounds():
    """
    sb3-contrib's TRPO on 10 action dimensions holds its per-dimension KL(new||old) under target_kl, while the joint
    KL(old||new) the monitor measures by default is several times the target: no runaway KL, so no kl_spike.
    """
    model = TRPO("MlpPolicy", _wide_env(10), n_steps=128, target_kl=0.01, seed=0)
    alarm = KLAlarmCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(8 * 256, callback=alarm)
    history = alarm.monitor.history
    joint = [r["mean"] / 0.01 for r in history]
    # compared with the joint KL, 3 consecutive updates would have been a sustained spike (5 x target)
    assert any(all(ratio > alarm.spike_factor for ratio in joint[i : i + 3]) for i in range(len(joint) - 2))
    assert all(r["mean_in_target_convention"] <= 0.01 * 1.5 for r in history)
    assert [a.kind for a in alarm.alarms if a.kind == "kl_spike"] == []
    # a target given to the callback is in the monitor's convention: then the joint KL is what counts
    own = KLAlarmCallback(target_kl=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TRPO("MlpPolicy", _wide_env(10), n_steps=128, target_kl=0.01, seed=0).learn(8 * 256, callback=own)
    spikes = [a for a in own.alarms if a.kind == "kl_spike"]
    assert spikes and "forward/analytic/sum" in spikes[0].message


def test_tail_ratio_is_p99_over_mean_whatever_quantiles_are_logged():
    for quantiles in ((0.9, 0.5), (0.25,), ()):
        model = PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=64, learning_rate=1e-2, seed=0)
        monitor = KLMonitorCallback(quantiles=quantiles)
        model.learn(64, callback=monitor)
        per_state = monitor.last_per_state
        expected = np.quantile(per_state, 0.99) / per_state.mean()
        assert monitor.history[-1]["tail_ratio"] == pytest.approx(expected, rel=1e-9)
        assert model.logger.name_to_value["kl/tail_ratio"] == pytest.approx(expected, rel=1e-9)


def test_k1_monitor_alarms_only_on_a_mean_significantly_below_zero():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=128, batch_size=64, learning_rate=1e-4, seed=0)
    monitor = KLMonitorCallback(estimator="k1")
    alarm = KLAlarmCallback(monitor=monitor, tail_ratio=50.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(8 * 128, callback=[monitor, alarm])
    history = alarm.monitor.history
    # small updates: k1 means scatter around the exact KL, some below 0, none significantly
    assert any(r["mean"] < 0 for r in history)
    assert all(np.isnan(r["tail_ratio"]) for r in history)  # no tail ratio of signed samples
    assert [a.kind for a in alarm.alarms if a.kind in ("negative_kl", "heavy_tail")] == []
    # a mean many standard errors below 0 is a bug (e.g. a wrong sign) and alarms
    per_state = np.full(100, -0.05) + np.linspace(-1e-3, 1e-3, 100)
    standard_error = per_state.std(ddof=1) / 10
    assert -per_state.mean() > NEGATIVE_K1_STANDARD_ERRORS * standard_error
    record = dict(history[-1], mean=float(per_state.mean()), update=99)
    alarm._active = True  # as during training
    with pytest.warns(UserWarning, match="standard errors below 0"):
        alarm._on_kl_measured(record, per_state)
    assert alarm.alarms[-1].kind == "negative_kl"


def test_quantile_keys_are_exact_and_distinct():
    assert [quantile_name(q) for q in (0.5, 0.99, 0.999, 0.9999999, 0.99999999, 0.123456789)] == [
        "p50",
        "p99",
        "p99.9",
        "p99.99999",
        "p99.999999",
        "p12.3456789",
    ]
    model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, kl_quantiles=(0.9999999, 0.99999999), seed=0)
    model.learn(64)
    values = model.logger.name_to_value
    assert "train/kl_p99.99999" in values and "train/kl_p99.999999" in values and "train/kl_p100" not in values
    with pytest.raises(ValueError, match="`kl_quantiles` lists a quantile twice"):
        KLPPO("MlpPolicy", "CartPole-v1", kl_quantiles=(0.5, 0.5))
    with pytest.raises(ValueError, match="`quantiles` lists a quantile twice"):
        KLMonitorCallback(quantiles=(0.9, 0.9))


def _csv_run(tmp_path, model, callbacks, steps):
    from stable_baselines3.common.logger import configure

    model.set_logger(configure(str(tmp_path), ["csv"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(steps, callback=callbacks)
    model.logger.close()
    return load_run(*find_runs(str(tmp_path))[0])


def test_report_judges_a_stock_trpo_run_by_the_kl_its_target_bounds(tmp_path, capsys):
    model = TRPO("MlpPolicy", _wide_env(10), n_steps=128, target_kl=0.01, seed=0)
    monitor = KLMonitorCallback()
    run = _csv_run(tmp_path, model, [monitor], 8 * 256)
    report = summarize_run(run)
    kl = np.array([r["mean_in_target_convention"] for r in monitor.history])
    # the last update is only in the logger's memory (as SB3's own last train/ values), not in the CSV
    logged = run.get("kl_mean").values
    assert logged == pytest.approx(kl[: len(logged)], rel=1e-6)
    assert report.above == pytest.approx(np.mean(logged > 2.0 * 0.01))
    assert report.above < 0.5  # the joint KL(old||new) the monitor measures is above 5 x target on most updates
    assert np.mean([r["mean"] > 2.0 * 0.01 for r in monitor.history]) > 0.5
    text = format_text(report)
    assert "mean=kl/mean_in_target_convention (reverse/analytic/mean)" in text
    assert "p99=None" in text and "kl/p99 is in the monitor's convention" in text


def test_report_takes_every_kl_figure_of_an_sb3_kl_run_from_the_algorithm(tmp_path):
    model = KLPPO("MlpPolicy", _wide_env(10), n_steps=64, batch_size=64, kl_reduction="mean", kl_quantiles=(0.5, 0.9), seed=0)
    run = _csv_run(tmp_path, model, [KLMonitorCallback()], 4 * 128)
    assert run.key_for("kl_mean") == "train/kl" and run.key_for("target_kl") == "train/target_kl"
    # the monitor's p99 is a joint KL: it does not stand beside the algorithm's per-dimension mean
    assert "kl/p99" in run.scalars and run.key_for("kl_p99") is None
    assert "mean=train/kl (forward/analytic/mean)" in format_text(summarize_run(run))


def test_a_tensorboard_run_takes_its_conventions_from_the_csv_beside_it(tmp_path):
    from stable_baselines3.common.logger import configure

    model = KLPPO("MlpPolicy", _wide_env(3), n_steps=64, batch_size=64, kl_reduction="mean", seed=0)
    model.set_logger(configure(str(tmp_path), ["csv", "tensorboard"]))  # SB3's usual pair, in one folder
    model.learn(3 * 128)
    model.logger.close()
    ((name, path, source),) = find_runs(str(tmp_path))
    run = load_run(name, path, source)
    assert source == "tensorboard" and run.convention_of("train/kl") == "forward/analytic/mean"
    assert "mean=train/kl (forward/analytic/mean)" in format_text(summarize_run(run))


def test_k1_alarm_takes_gsde_noise_blocks_as_the_samples():
    """
    With gSDE the states of one env share an exploration matrix until it is resampled, so their k1 samples move
    together: the standard error of the mean comes from the blocks' means. Counted per state, small updates on
    Pendulum with 4 envs and one matrix per rollout read as 'many standard errors below 0' in 3 of 8 updates.
    """
    env = make_vec_env("Pendulum-v1", n_envs=4, seed=0)
    model = KLPPO(
        "MlpPolicy", env, use_sde=True, n_steps=64, batch_size=64, seed=0, policy_kwargs=dict(net_arch=[16]), device="cpu"
    )
    monitor = KLMonitorCallback(estimator="k1")
    alarm = KLAlarmCallback(monitor=monitor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(256 * 8, callback=[monitor, alarm])
    assert [a for a in alarm.alarms if a.kind == "negative_kl"] == []

    # blocks of 16 steps x 4 envs: a shift shared within each block counts once per block, not once per state
    rng = np.random.default_rng(0)
    model.sde_sample_freq = 16
    block_shift = np.repeat(rng.normal(size=(4, 4)), 16, axis=0)  # (64 steps, 4 envs)
    per_state = (block_shift + 0.01 * rng.normal(size=(64, 4))).reshape(-1)
    block_means = per_state.reshape(64, 4).reshape(4, 16, 4).mean(axis=1).reshape(-1)
    expected = block_means.std(ddof=1) / np.sqrt(16)
    assert alarm._k1_standard_error(per_state) == pytest.approx(expected)
    model.sde_sample_freq, model.n_envs = -1, 1
    assert alarm._k1_standard_error(per_state) == float("inf")  # one env, one matrix: untestable
    model.use_sde = False
    assert alarm._k1_standard_error(per_state) == pytest.approx(per_state.std(ddof=1) / 16)
