"""
Host synchronisations of ``train()``: every read of a tensor's value on the host (``.item()``, ``bool()``, ``float()``,
``.cpu()``, ``.numpy()``, ``.tolist()``) makes a GPU wait for its queue. Counted here on the CPU, where the same calls
happen, with a ``TorchFunctionMode`` that sees each of them: KLPPO's and ClipKLPPO's minibatch loops make none
(stock PPO makes five or more per minibatch; an LSTM policy reads
one value per pass whoever trains it); what they read, they read once per epoch or update.
"""

import copy
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch as th
from sb3_contrib import RecurrentPPO
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from torch.distributions import Distribution as TorchDistribution
from torch.overrides import TorchFunctionMode

from sb3_kl import KLPPO, ClipKLPPO, MaskableKLPPO, RecurrentKLPPO
from sb3_kl.common.host_sync import DeviceLog, no_distribution_validation

HOST_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "__array__", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that read a value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def reads_per_update(algo: type, env_id: str, batch_size: int, **kwargs: Any) -> int:
    """Host reads of one ``train()`` call (n_steps 64 x 2 envs, 2 epochs, minibatches of ``batch_size``)."""
    if algo is MaskableKLPPO:
        from sb3_contrib.common.envs import InvalidActionEnvDiscrete

        env = make_vec_env(lambda: InvalidActionEnvDiscrete(dim=10, n_invalid_actions=4), n_envs=2, seed=0)
    else:
        env = make_vec_env(env_id, n_envs=2, seed=0)
    policy = "MlpLstmPolicy" if algo in (RecurrentKLPPO, RecurrentPPO) else "MlpPolicy"
    settings = dict(n_steps=64, batch_size=batch_size, n_epochs=2, policy_kwargs=dict(net_arch=[16]), seed=0)
    model = algo(policy, env, **{**settings, **kwargs})
    train, reads = model.train, HostReads()

    def counted_train() -> None:
        with reads:
            train()

    model.train = counted_train  # type: ignore[method-assign]
    model.learn(128)
    return sum(reads.counts.values())


def reads_per_minibatch(algo: type, env_id: str, **kwargs: Any) -> float:
    """Extra host reads per extra minibatch: 4 minibatches per epoch against 2, the rest of the update the same."""
    return (reads_per_update(algo, env_id, 32, **kwargs) - reads_per_update(algo, env_id, 64, **kwargs)) / (2 * 2)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_stock_ppo_reads_the_host_in_every_minibatch(env_id: str) -> None:
    # the yardstick: SB3's PPO (its default Adam, and the fused kernel sb3-kl uses) reads several values per minibatch
    assert reads_per_minibatch(PPO, env_id) >= 5
    fused = dict(policy_kwargs=dict(net_arch=[16], optimizer_kwargs=dict(fused=True)))
    assert reads_per_minibatch(PPO, env_id, **fused) >= 5


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
@pytest.mark.parametrize("algo", [KLPPO, ClipKLPPO])
def test_minibatch_loop_reads_nothing_on_the_host(algo: type, env_id: str) -> None:
    # kl_stop_factor is judged once per epoch, not per minibatch: off here so that the count is the loop's own
    assert reads_per_minibatch(algo, env_id, kl_stop_factor=None) == 0
    # the whole update, log included, reads a handful of values
    assert reads_per_update(algo, env_id, 32, kl_stop_factor=None) <= 16


def test_maskable_minibatch_loop_reads_nothing_on_the_host() -> None:
    assert reads_per_minibatch(MaskableKLPPO, "CartPole-v1", kl_stop_factor=None) == 0


def test_recurrent_minibatch_loop_reads_only_what_the_lstm_policy_reads() -> None:
    # sb3-contrib's LSTM policy checks each sequence batch for episode starts (one bool() per pass) whoever trains it
    ours = reads_per_minibatch(RecurrentKLPPO, "CartPole-v1", kl_stop_factor=None)
    assert ours < reads_per_minibatch(RecurrentPPO, "CartPole-v1")


def test_stop_at_beta_bound_reads_once_per_minibatch_only_while_beta_is_at_it() -> None:
    at_bound = dict(kl_coef=1.0, kl_coef_bounds=(1e-4, 1.0), kl_stop_factor=None)
    assert reads_per_minibatch(KLPPO, "CartPole-v1", **at_bound) <= 1


def fused_model() -> KLPPO:
    model = KLPPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.learn(64)
    assert all(group["fused"] for group in model.policy.optimizer.param_groups)
    return model


def test_nonfinite_step_is_skipped_on_the_device() -> None:
    model = fused_model()
    params = copy.deepcopy(model.policy.state_dict())
    optimizer_state = copy.deepcopy(model.policy.optimizer.state_dict()["state"])
    observations = th.zeros((4, 3))
    values, _ = model._forward(observations)
    applied = model._optimizer_step(values.mean() * float("nan"))
    assert isinstance(applied, th.Tensor) and not bool(applied)
    for key, value in model.policy.state_dict().items():
        assert th.equal(value, params[key]), key
    for index, state in model.policy.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert th.equal(value, optimizer_state[index][name]), (index, name)
    assert not hasattr(model.policy.optimizer, "found_inf")
    # a finite loss steps, and counts its step
    values, _ = model._forward(observations)
    assert bool(model._optimizer_step(values.mean()))
    assert not th.equal(model.policy.value_net.weight, params["value_net.weight"])


def test_distribution_validation_is_restored() -> None:
    before = TorchDistribution._validate_args
    with no_distribution_validation():
        assert TorchDistribution._validate_args is False
        with no_distribution_validation():
            assert TorchDistribution._validate_args is False
        assert TorchDistribution._validate_args is False
    assert TorchDistribution._validate_args == before
    fused_model()
    assert TorchDistribution._validate_args == before


def test_device_log_means_are_those_of_the_values_read_one_by_one() -> None:
    generator = th.Generator().manual_seed(0)
    values = [th.randn((), generator=generator) for _ in range(37)]
    log = DeviceLog("a", "b")
    for value in values:
        log.add("a", value)
    means = log.means()
    assert means["a"] == np.mean([value.item() for value in values])
    assert np.isnan(means["b"])


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "dict"])
def test_minibatches_from_device_fields_equal_sb3s_copies(env_id: str) -> None:
    from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer
    from stable_baselines3.common.envs import SimpleMultiObsEnv

    if env_id == "dict":
        env = make_vec_env(SimpleMultiObsEnv, n_envs=2, seed=0)
        model = KLPPO("MultiInputPolicy", env, n_steps=32, batch_size=16, n_epochs=1, seed=0)
    else:
        model = KLPPO("MlpPolicy", make_vec_env(env_id, n_envs=2, seed=0), n_steps=32, batch_size=16, n_epochs=1, seed=0)
    stock = DictRolloutBuffer if env_id == "dict" else RolloutBuffer
    for _ in range(2):  # two rollouts: the fields are remade for the second
        model.learn(64, reset_num_timesteps=False)
        buffer = model.rollout_buffer
        indices = np.random.default_rng(0).permutation(64)[:16]
        ours = buffer._get_samples(indices)
        theirs = stock._get_samples(buffer, indices)
        for field in theirs._fields:
            a, b = getattr(ours, field), getattr(theirs, field)
            for key in a if isinstance(a, dict) else [None]:
                x, y = (a[key], b[key]) if key is not None else (a, b)
                assert x.dtype == y.dtype and th.equal(x, y), (field, key)
        assert th.equal(ours.old_dist_params, th.as_tensor(buffer.old_dist_params[indices]))
