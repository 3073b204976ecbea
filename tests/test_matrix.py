"""
Coverage matrix: every supported action space, observation kind, exploration mode, VecEnv type and batch layout,
for KLPPO, ClipKLPPO and KLTRPO, and the KL callbacks on stock PPO.

Each case trains for two tiny rollouts and checks that the update KL was measured (finite, >= 0), that the policy's
parameters changed, that beta moved as its controller says, and that ``predict`` returns actions of the right space.
"""

import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import (
    FakeImageEnv,
    IdentityEnv,
    IdentityEnvBox,
    IdentityEnvMultiBinary,
    IdentityEnvMultiDiscrete,
    SimpleMultiObsEnv,
)
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.callbacks import KLAdaptiveLRCallback, KLAlarmCallback, KLMonitorCallback, VarianceFloorCallback

ALGOS = [KLPPO, ClipKLPPO, KLTRPO]
N_STEPS = 32
TINY = dict(n_steps=N_STEPS, policy_kwargs=dict(net_arch=[8]), seed=0, device="cpu")


def small_image_env() -> gym.Env:
    # 36x36 is the smallest screen NatureCNN accepts
    return FakeImageEnv(screen_height=36, screen_width=36, n_channels=1, discrete=True)


# name -> (env factory, policy, extra policy_kwargs, extra algorithm kwargs)
CASES: dict[str, tuple[Callable[[], gym.Env], str, dict[str, Any], dict[str, Any]]] = {
    "discrete": (lambda: IdentityEnv(4, ep_length=20), "MlpPolicy", {}, {}),
    "box": (lambda: IdentityEnvBox(ep_length=20), "MlpPolicy", {}, {}),
    "multidiscrete": (lambda: IdentityEnvMultiDiscrete(3, ep_length=20), "MlpPolicy", {}, {}),
    "multibinary": (lambda: IdentityEnvMultiBinary(3, ep_length=20), "MlpPolicy", {}, {}),
    "dict_obs": (lambda: SimpleMultiObsEnv(random_start=True), "MultiInputPolicy", {}, {}),
    "image_obs": (small_image_env, "CnnPolicy", {"features_extractor_kwargs": {"features_dim": 16}}, {}),
    "gsde_box": (lambda: IdentityEnvBox(ep_length=20), "MlpPolicy", {}, {"use_sde": True, "sde_sample_freq": 4}),
}


def algo_kwargs(algo: type, batch_size: int = 16) -> dict[str, Any]:
    """Tiny settings: two epochs (or the critic updates and CG steps of KLTRPO) on minibatches of ``batch_size``."""
    if algo is KLTRPO:
        return dict(batch_size=batch_size, n_critic_updates=2, cg_max_steps=4, target_kl=0.02)
    return dict(batch_size=batch_size, n_epochs=2)


def flat_parameters(model: Any) -> np.ndarray:
    return th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().cpu().numpy().copy()


def check_predict(model: Any, env: Any) -> None:
    obs = env.reset()
    actions, _ = model.predict(obs, deterministic=True)
    assert len(actions) == env.num_envs
    for action in actions:
        assert env.action_space.contains(np.asarray(action, dtype=env.action_space.dtype).reshape(env.action_space.shape))


def train_and_check(model: Any, env: Any, n_rollouts: int = 2) -> None:
    """
    Train ``n_rollouts`` rollouts and check what every case must satisfy. A KLMonitorCallback rides along: its
    independent measurement of each update's KL (same convention) must match the algorithm's own ``train/kl``.
    """
    before = flat_parameters(model)
    monitor = KLMonitorCallback(
        direction=model.kl_settings.direction, estimator="analytic", reduction=model.kl_settings.reduction
    )
    model.learn(n_rollouts * N_STEPS * env.num_envs, callback=monitor)
    assert len(monitor.history) == n_rollouts
    after = flat_parameters(model)
    assert np.all(np.isfinite(after)), "non-finite parameters after training"
    assert not np.allclose(before, after), "training did not change the policy"
    logged = model.logger.name_to_value
    kl = logged["train/kl"]
    assert np.isfinite(kl) and kl >= 0.0
    assert logged["train/kl_max"] >= kl - 1e-6
    if model.kl_settings.estimator == "analytic":
        assert monitor.history[-1]["mean"] == pytest.approx(kl, rel=1e-4, abs=1e-7)
    assert model.policy_version >= n_rollouts
    controller = model.kl_controller
    if isinstance(model, KLTRPO):
        # hard trust region: every accepted step is inside it (the line search checks the exact KL on the batch)
        assert kl <= 1.5 * model.target_kl(1.0) + 1e-6
    else:
        assert len(controller.kl_coef_history) == n_rollouts
        low, high = controller.kl_coef_bounds
        assert all(low <= beta <= high for beta in controller.kl_coef_history)
        assert logged["train/kl_coef"] == controller.kl_coef
    check_predict(model, env)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("algo", ALGOS)
def test_spaces(algo: type, case: str) -> None:
    make_env, policy, policy_kwargs, extra = CASES[case]
    env = DummyVecEnv([make_env])
    model = algo(
        policy,
        env,
        n_steps=N_STEPS,
        policy_kwargs=dict(net_arch=[8], **policy_kwargs),
        seed=0,
        device="cpu",
        **algo_kwargs(algo),
        **extra,
    )
    train_and_check(model, env)


@pytest.mark.parametrize("algo", ALGOS)
def test_vec_normalize_n_envs(algo: type) -> None:
    """VecNormalize on several envs, continuous actions: the KL is measured on the normalized observations."""
    env = VecNormalize(make_vec_env("Pendulum-v1", n_envs=3, seed=0))
    model = algo("MlpPolicy", env, **TINY, **algo_kwargs(algo))
    train_and_check(model, env)
    assert env.obs_rms.count > 1  # statistics were updated while collecting


@pytest.mark.parametrize("algo", ALGOS)
def test_batch_size_not_dividing_buffer(algo: type) -> None:
    """SB3 warns about the truncated last minibatch (32 * 2 = 64 states, minibatches of 24); training still works."""
    env = make_vec_env("CartPole-v1", n_envs=2, seed=0)
    with pytest.warns(UserWarning, match="mini-batch size of 24"):
        model = algo("MlpPolicy", env, **TINY, **algo_kwargs(algo, 24))
    train_and_check(model, env)


@pytest.mark.parametrize("algo", ALGOS)
def test_subproc_vec_env(algo: type) -> None:
    """Two worker processes (fork start: fast, and the test's env factories need no pickling)."""
    if "fork" not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip("the fork start method is not available on this platform")
    env = make_vec_env("CartPole-v1", n_envs=2, seed=0, vec_env_cls=SubprocVecEnv, vec_env_kwargs=dict(start_method="fork"))
    try:
        model = algo("MlpPolicy", env, **TINY, **algo_kwargs(algo))
        train_and_check(model, env)
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------------
# The callbacks on stock PPO

MONITOR_CASES = ["discrete", "box", "multidiscrete", "multibinary", "dict_obs", "image_obs", "gsde_box"]


@pytest.mark.parametrize("case", MONITOR_CASES)
def test_monitor_on_ppo(case: str) -> None:
    make_env, policy, policy_kwargs, extra = CASES[case]
    env = DummyVecEnv([make_env, make_env]) if case == "box" else DummyVecEnv([make_env])
    policy_kwargs = dict(net_arch=[8], **policy_kwargs)
    model = PPO(policy, env, n_steps=N_STEPS, batch_size=16, n_epochs=2, policy_kwargs=policy_kwargs, seed=0, **extra)
    monitor = KLMonitorCallback(per_env=env.num_envs > 1)
    model.learn(2 * N_STEPS * env.num_envs, callback=monitor)
    assert len(monitor.history) == 2
    for record in monitor.history:
        assert np.isfinite(record["mean"]) and record["mean"] >= 0.0
        assert record["max"] >= record["mean"] - 1e-6
    assert monitor.last_per_state.shape == (N_STEPS * env.num_envs,)
    if env.num_envs > 1:
        assert len(monitor.history[-1]["env_means"]) == env.num_envs


def test_control_callbacks_on_ppo_box_vecnormalize() -> None:
    """Variance floor, adaptive learning rate and alarms together, sharing one monitor, on two normalized envs."""
    env = VecNormalize(make_vec_env("Pendulum-v1", n_envs=2, seed=0))
    policy_kwargs = dict(net_arch=[8], log_std_init=-3.0)
    model = PPO("MlpPolicy", env, n_steps=N_STEPS, batch_size=16, n_epochs=2, policy_kwargs=policy_kwargs, seed=0)
    monitor = KLMonitorCallback()
    floor = VarianceFloorCallback(min_std=0.1)
    adaptive_lr = KLAdaptiveLRCallback(target_kl=0.01, monitor=monitor)
    alarm = KLAlarmCallback(target_kl=0.01, monitor=monitor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # alarms may warn on such a short run; they are not what is checked here
        model.learn(3 * N_STEPS * 2, callback=[monitor, floor, adaptive_lr, alarm])
    assert th.exp(model.policy.log_std).min().item() >= 0.1 - 1e-6
    assert len(monitor.history) == 3
    lr = model.policy.optimizer.param_groups[0]["lr"]
    assert np.isfinite(lr) and lr > 0 and lr != 3e-4  # the callback moved it (the KL is never exactly on target)


# ---------------------------------------------------------------------------------------------------------------
# Device


@pytest.mark.skipif(not th.cuda.is_available(), reason="no CUDA device on this machine (th.cuda.is_available() is False)")
@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_device(algo: type) -> None:
    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = algo("MlpPolicy", env, **{**TINY, "device": "cuda"}, **algo_kwargs(algo))
    assert model.device.type == "cuda"
    assert model.rollout_buffer.device.type == "cuda"
    train_and_check(model, env)
    assert all(p.device.type == "cuda" for p in model.policy.parameters())
