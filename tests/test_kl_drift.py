"""
``kl/drift``: the KL between the policy ``drift_lag`` updates before the updated one and the updated policy, on the
rollout's states, checked against an independent computation: copies of the whole policy kept by a separate callback
after every update and ``torch.distributions.kl_divergence``.
"""

import copy

import pytest
import torch as th
from sb3_contrib import TRPO, MaskablePPO, RecurrentPPO
from sb3_contrib.common.envs import InvalidActionEnvDiscrete
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from torch.distributions import kl_divergence

from sb3_kl import KLPPO
from sb3_kl.callbacks import KLAlarmCallback, KLMonitorCallback

TINY = dict(policy_kwargs=dict(net_arch=[16]), seed=0, learning_rate=1e-2)


def _copy_policy(policy):
    """An independent copy of the whole policy, built the way SB3's policy.save/load does."""
    clone = type(policy)(**policy._get_constructor_parameters())
    clone.load_state_dict(copy.deepcopy(policy.state_dict()))
    clone.set_training_mode(False)
    return clone


class PolicyKeeper(BaseCallback):
    """Keeps the policy that acted in every rollout, the rollout's states, and the policy at the end of training."""

    def __init__(self):
        super().__init__()
        self.policies = []
        self.observations = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self.policies.append(_copy_policy(self.model.policy))
        obs = self.model.rollout_buffer.observations
        self.observations.append(obs.reshape(-1, *obs.shape[2:]).copy())

    def _on_training_end(self) -> None:
        self.policies.append(_copy_policy(self.model.policy))

    def drift(self, update: int, lag: int, direction: str = "forward", reduction: str = "sum") -> float:
        """KL between the policy ``lag`` updates before the result of ``update`` and that result, on its rollout."""
        # policies[i] acted in rollout i, the result of update i acted in rollout i + 1 (or is the final one)
        lagged, updated = self.policies[update + 1 - lag], self.policies[update + 1]
        obs = th.as_tensor(self.observations[update])
        with th.no_grad():
            p = lagged.get_distribution(obs).distribution
            q = updated.get_distribution(obs).distribution
            kl = kl_divergence(p, q) if direction == "forward" else kl_divergence(q, p)
            if kl.ndim == 2:  # independent Gaussian dimensions
                kl = kl.sum(dim=1) if reduction == "sum" else kl.mean(dim=1)
        return float(kl.double().mean())


@pytest.mark.parametrize("algo", [PPO, TRPO, KLPPO])
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_drift_matches_the_kl_between_policy_copies_lag_updates_apart(algo, env_id):
    model = algo("MlpPolicy", make_vec_env(env_id, n_envs=2, seed=0), n_steps=64, batch_size=64, **TINY)
    monitor = KLMonitorCallback(drift_lag=3)
    keeper = PolicyKeeper()
    model.learn(6 * 128, callback=[keeper, monitor])

    assert len(monitor.history) == 6
    # the policy 3 updates before the updated one exists from the third update on (the rollout policy of update 0)
    assert [("drift" in record) for record in monitor.history] == [False, False, True, True, True, True]
    for update in range(2, 6):
        record = monitor.history[update]
        assert record["drift_lag"] == 3
        assert record["drift"] == pytest.approx(keeper.drift(update, 3), rel=1e-3, abs=1e-7)
    # the policy moved: the comparison is not between zeros
    assert max(record["drift"] for record in monitor.history[2:]) > 1e-4
    values = model.logger.name_to_value
    assert values["kl/drift"] == pytest.approx(monitor.history[-1]["drift"])
    assert values["kl/drift_lag"] == 3


def test_drift_follows_the_monitors_direction_and_reduction_and_is_exact_with_a_sample_estimator():
    model = PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2, seed=0), n_steps=64, batch_size=64, **TINY)
    monitor = KLMonitorCallback(direction="reverse", reduction="mean", estimator="k3", drift_lag=2)
    keeper = PolicyKeeper()
    model.learn(4 * 128, callback=[keeper, monitor])
    for update in range(1, 4):
        expected = keeper.drift(update, 2, direction="reverse", reduction="mean")
        assert monitor.history[update]["drift"] == pytest.approx(expected, rel=1e-3, abs=1e-7)


def test_drift_counts_updates_not_measured_updates():
    # every=2 measures updates 0, 2, 4: the lag is still in updates of the model
    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=2, seed=0), n_steps=64, batch_size=64, **TINY)
    monitor = KLMonitorCallback(every=2, drift_lag=3)
    keeper = PolicyKeeper()
    model.learn(6 * 128, callback=[keeper, monitor])
    assert [record["update"] for record in monitor.history] == [0, 2, 4]
    assert "drift" not in monitor.history[0]
    for record in monitor.history[1:]:
        assert record["drift"] == pytest.approx(keeper.drift(record["update"], 3), rel=1e-3, abs=1e-7)


@pytest.mark.parametrize("kind", ["ppo", "maskable", "recurrent"])
def test_drift_of_one_update_is_that_updates_exact_kl(kind):
    if kind == "maskable":
        model = MaskablePPO(
            "MlpPolicy", InvalidActionEnvDiscrete(dim=8, n_invalid_actions=5), n_steps=64, batch_size=32, **TINY
        )
    elif kind == "recurrent":
        model = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=32, batch_size=32, **TINY)
    else:
        model = PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, **TINY)
    monitor = KLMonitorCallback(drift_lag=1)
    model.learn(3 * model.n_steps, callback=monitor)
    assert len(monitor.history) == 3
    for record in monitor.history:
        assert record["drift"] == pytest.approx(record["mean"], rel=1e-6, abs=1e-12)
    assert max(record["mean"] for record in monitor.history) > 0


def test_drift_restarts_with_each_learn_call_and_is_off_in_private_monitors():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, **TINY)
    monitor = KLMonitorCallback(drift_lag=2)
    model.learn(3 * 64, callback=monitor)
    model.learn(3 * 64, callback=monitor, reset_num_timesteps=False)
    assert [("drift" in record) for record in monitor.history] == [False, True, True, False, True, True]

    alarm = KLAlarmCallback()
    model.learn(2 * 64, callback=alarm)
    assert alarm.monitor.drift_lag is None
    assert not any("drift" in record for record in alarm.monitor.history)


def test_drift_is_off_with_none():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, **TINY)
    monitor = KLMonitorCallback(drift_lag=None)
    model.learn(3 * 64, callback=monitor)
    assert not any("drift" in record for record in monitor.history)
    assert "kl/drift" not in model.logger.name_to_value


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_bad_drift_lag_names_the_argument(value):
    with pytest.raises((TypeError, ValueError), match=r"`drift_lag`.*None: the drift is not measured"):
        KLMonitorCallback(drift_lag=value)


def test_drift_default_is_ten_updates():
    assert KLMonitorCallback().drift_lag == 10


def test_a_monitor_attached_to_another_model_measures_the_drift_of_that_models_policy():
    monitor = KLMonitorCallback(drift_lag=2)
    PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, **TINY).learn(3 * 64, callback=monitor)
    # another architecture and action space: the lagged copy of the first model's policy would not fit it
    model = PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2, seed=0), n_steps=64, batch_size=64, **TINY)
    keeper = PolicyKeeper()
    model.learn(3 * 128, callback=[keeper, monitor])
    for update in (1, 2):
        record = monitor.history[3 + update]
        assert record["drift"] == pytest.approx(keeper.drift(update, 2), rel=1e-3, abs=1e-7)


@pytest.mark.parametrize("algo, squash_output", [(PPO, False), (KLPPO, False), (PPO, True)])
def test_drift_of_a_gsde_policy(algo, squash_output):
    # gSDE's distribution holds its sampled exploration matrices (non-leaf tensors): the monitor's lagged policy copy
    # must not depend on deep-copying the module
    kwargs = dict(TINY, policy_kwargs=dict(net_arch=[16], squash_output=squash_output))
    model = algo("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2, seed=0), n_steps=64, batch_size=64, use_sde=True, **kwargs)
    monitor = KLMonitorCallback(drift_lag=2)
    keeper = PolicyKeeper()
    model.learn(4 * 128, callback=[keeper, monitor])

    assert [("drift" in record) for record in monitor.history] == [False, True, True, True]
    for update in range(1, 4):
        assert monitor.history[update]["drift"] == pytest.approx(keeper.drift(update, 2), rel=1e-3, abs=1e-7)
    assert monitor.history[-1]["drift"] > 1e-6


@pytest.mark.parametrize("use_sde", [False, True])
def test_the_monitor_leaves_the_training_unchanged(use_sde):
    # the lagged policy is built once the lag is reached: it must not draw from the generators the training uses
    def train(callback):
        env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
        model = PPO("MlpPolicy", env, n_steps=32, batch_size=64, use_sde=use_sde, **TINY)
        model.learn(5 * 64, callback=callback)
        return th.nn.utils.parameters_to_vector(model.policy.parameters()).detach()

    monitor = KLMonitorCallback(drift_lag=2)
    assert th.equal(train(None), train(monitor))
    assert sum("drift" in record for record in monitor.history) == 4
