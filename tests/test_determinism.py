"""
Determinism on CPU: the same seed gives bit-identical parameters, logged KL values and beta trajectories across two
runs in one process, for KLPPO, ClipKLPPO and KLTRPO, on discrete and continuous actions (gSDE included), and for
the KL monitor on stock PPO. A different seed gives a different run (so the comparison is not vacuous).

Sources of nondeterminism are listed in docs/reliability.md; these tests run with one torch thread (conftest.py),
the setting under which CPU results are reproducible bit for bit.
"""

from typing import Any

import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.callbacks import KLMonitorCallback

ALGOS = [KLPPO, ClipKLPPO, KLTRPO]
N_STEPS, N_ENVS = 32, 2

CONFIGS = {
    "cartpole": ("CartPole-v1", {}),
    "pendulum_gsde": ("Pendulum-v1", {"use_sde": True, "sde_sample_freq": 8}),
}


def run(algo: type, env_id: str, extra: dict[str, Any], seed: int) -> tuple[np.ndarray, dict[str, Any], Any]:
    kwargs = dict(n_critic_updates=2, cg_max_steps=4) if algo is KLTRPO else dict(n_epochs=2)
    env = make_vec_env(env_id, n_envs=N_ENVS, seed=seed)
    tiny = dict(n_steps=N_STEPS, batch_size=16, policy_kwargs=dict(net_arch=[8]), seed=seed, device="cpu")
    model = algo("MlpPolicy", env, **tiny, **kwargs, **extra)
    model.learn(3 * N_STEPS * N_ENVS)
    params = th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().numpy().copy()
    logged = {key: value for key, value in model.logger.name_to_value.items() if key.startswith("train/")}
    return params, logged, model


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("algo", ALGOS)
def test_same_seed_same_run(algo: type, config: str) -> None:
    env_id, extra = CONFIGS[config]
    params_a, logged_a, model_a = run(algo, env_id, extra, seed=3)
    params_b, logged_b, model_b = run(algo, env_id, extra, seed=3)
    np.testing.assert_array_equal(params_a, params_b)
    assert logged_a.keys() == logged_b.keys()
    for key, value in logged_a.items():
        assert value == logged_b[key] or (value != value and logged_b[key] != logged_b[key]), key  # NaN == NaN here
    assert "train/kl" in logged_a
    assert model_a.kl_controller.kl_coef_history == model_b.kl_controller.kl_coef_history
    assert model_a.kl_controller.kl_history == model_b.kl_controller.kl_history
    np.testing.assert_array_equal(model_a.rollout_buffer.observations, model_b.rollout_buffer.observations)


@pytest.mark.parametrize("algo", ALGOS)
def test_different_seed_different_run(algo: type) -> None:
    params_a, _, _ = run(algo, "CartPole-v1", {}, seed=3)
    params_b, _, _ = run(algo, "CartPole-v1", {}, seed=4)
    assert not np.array_equal(params_a, params_b)


def test_monitor_on_ppo_is_deterministic() -> None:
    histories = []
    for _ in range(2):
        env = make_vec_env("Pendulum-v1", n_envs=2, seed=1)
        tiny = dict(n_steps=N_STEPS, batch_size=16, n_epochs=2, policy_kwargs=dict(net_arch=[8]), seed=1, device="cpu")
        model = PPO("MlpPolicy", env, **tiny)
        monitor = KLMonitorCallback(top_k=4)
        model.learn(3 * N_STEPS * 2, callback=monitor)
        histories.append((monitor.history, monitor.last_per_state.copy()))
    assert histories[0][0] == histories[1][0]
    np.testing.assert_array_equal(histories[0][1], histories[1][1])


_CHILD = """
import hashlib, sys, numpy as np, torch as th
th.set_num_threads(1)
from stable_baselines3.common.env_util import make_vec_env
from sb3_kl import {algo}
model = {algo}("MlpPolicy", make_vec_env("CartPole-v1", n_envs=2, seed=5), n_steps=32, batch_size=16,
               policy_kwargs=dict(net_arch=[8]), seed=5, device="cpu", {extra})
model.learn(128)
params = th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().numpy()
print(hashlib.sha256(params.tobytes()).hexdigest(), repr(model.logger.name_to_value["train/kl"]))
"""


@pytest.mark.slow  # ~17 s on a loaded 2-core machine, mostly the child's imports
def test_same_seed_same_run_across_processes() -> None:
    """A fresh interpreter reproduces the run bit for bit (no hidden dependence on process state)."""
    import hashlib
    import os
    import subprocess
    import sys

    algo, extra = KLTRPO, dict(n_critic_updates=2, cg_max_steps=4)
    code = _CHILD.format(algo=algo.__name__, extra=", ".join(f"{k}={v!r}" for k, v in extra.items()))
    env = {**os.environ, "SB3_LOGDIR": os.environ.get("SB3_LOGDIR", "/tmp")}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, timeout=300)
    model = algo(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=2, seed=5),
        n_steps=32,
        batch_size=16,
        policy_kwargs=dict(net_arch=[8]),
        seed=5,
        device="cpu",
        **extra,
    )
    model.learn(128)
    params = th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().numpy()
    digest, kl = child.stdout.split()
    assert digest == hashlib.sha256(params.tobytes()).hexdigest()
    assert float(kl) == model.logger.name_to_value["train/kl"]
