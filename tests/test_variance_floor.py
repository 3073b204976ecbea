"""
The variance floor: the algorithms' ``min_std`` and ``VarianceFloorCallback`` share one definition of the floor of
``log_std`` (gSDE's ``expln`` with SB3's epsilon included), and a floored std equals ``min_std`` to float precision.
"""

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.logger import configure

from sb3_kl import KLPPO
from sb3_kl.callbacks import VarianceFloorCallback

# (use_sde, use_expln, min_std): plain Gaussian, gSDE with exp, gSDE with expln below and above 1 (its two branches)
CASES = [(False, False, 0.3), (True, False, 0.3), (True, True, 0.3), (True, True, 1.1)]


def policy_kwargs(use_sde: bool, use_expln: bool) -> dict:
    kwargs = dict(net_arch=[16], log_std_init=-4.0)
    if use_sde:
        kwargs["use_expln"] = use_expln
    return kwargs


def std_parameters(policy) -> th.Tensor:
    """The std the floor acts on, in float64 (only the float32 storage of ``log_std`` limits the precision)."""
    log_std = policy.log_std.detach().double()
    return policy.action_dist.get_std(log_std) if hasattr(policy.action_dist, "get_std") else th.exp(log_std)


def per_state_std(policy, obs: th.Tensor, min_std: float) -> tuple[th.Tensor, th.Tensor]:
    """
    The action std at each state and what it must be when every std parameter is ``min_std``: ``min_std`` for a
    plain Gaussian; for gSDE ``sqrt(min_std^2 |latent|^2 + epsilon)`` (SB3's action variance is
    ``sum_j latent_j^2 std_jk^2``, plus its epsilon).
    """
    with th.no_grad():
        scale = policy.get_distribution(obs).distribution.scale.double()
        expected = th.full_like(scale, min_std)
        if policy.use_sde:
            latent_sq = (policy.action_dist._latent_sde.double() ** 2).sum(dim=-1, keepdim=True)
            expected = th.sqrt(min_std**2 * latent_sq + policy.action_dist.epsilon).expand_as(scale)
    return scale, expected


def assert_floored(policy, min_std: float, obs: th.Tensor) -> None:
    std = std_parameters(policy)
    assert th.all(std >= min_std * (1 - 1e-7))
    # every entry started far below the floor and sits on it: exactly min_std, up to float32 storage of log_std
    np.testing.assert_allclose(std.numpy(), min_std, rtol=1e-7, atol=0)
    scale, expected = per_state_std(policy, obs, min_std)
    np.testing.assert_allclose(scale.numpy(), expected.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("use_sde, use_expln, min_std", CASES)
def test_algorithm_floor_is_exact(use_sde, use_expln, min_std):
    model = KLPPO(
        "MlpPolicy",
        "Pendulum-v1",
        n_steps=64,
        batch_size=32,
        use_sde=use_sde,
        min_std=min_std,
        policy_kwargs=policy_kwargs(use_sde, use_expln),
        seed=0,
    )
    assert float(std_parameters(model.policy).max()) < min_std  # starts below the floor
    model._apply_variance_floor()
    obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(8)]))
    assert_floored(model.policy, min_std, obs)


@pytest.mark.parametrize("use_sde, use_expln, min_std", CASES)
def test_callback_floor_is_exact_and_the_algorithms(use_sde, use_expln, min_std):
    model = PPO(
        "MlpPolicy",
        "Pendulum-v1",
        n_steps=64,
        batch_size=32,
        use_sde=use_sde,
        policy_kwargs=policy_kwargs(use_sde, use_expln),
        seed=0,
    )
    model.set_logger(configure(None, []))
    callback = VarianceFloorCallback(min_std=min_std)
    callback.init_callback(model)
    callback.on_training_start(locals(), globals())  # applies the floor once (and hooks the optimizer)
    obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(8)]))
    assert_floored(model.policy, min_std, obs)
    callback.on_training_end()
    # one definition: the callback's floor of log_std is the algorithms'
    algorithm = KLPPO(
        "MlpPolicy",
        "Pendulum-v1",
        n_steps=64,
        batch_size=32,
        use_sde=use_sde,
        min_std=min_std,
        policy_kwargs=policy_kwargs(use_sde, use_expln),
    )
    assert callback._floor == algorithm._min_log_std_parameter()


class SmallActionsPay(gym.Env):
    """Reward ``-10 ||a||^2``: the Gaussian's std shrinks fast. Episodes of 16 steps."""

    observation_space = gym.spaces.Box(-5.0, 5.0, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.normal(size=3).astype(np.float32), {}

    def step(self, action):
        self.t += 1
        reward = -10.0 * float(np.sum(np.square(action)))
        return self.np_random.normal(size=3).astype(np.float32), reward, False, self.t >= 16, {}


@pytest.mark.parametrize("algo", ["TRPO", "KLTRPO"])
def test_callback_floor_holds_after_line_search_steps_without_critic_steps(algo):
    # A line search writes the parameters without an optimizer step, and with n_critic_updates=0 no step follows:
    # every step of every rollout must still act with std >= min_std
    from sb3_contrib import TRPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_kl import KLTRPO

    class ActingStd(BaseCallback):
        def __init__(self):
            super().__init__()
            self.values = []

        def _on_step(self) -> bool:
            self.values.append(float(th.exp(self.model.policy.log_std.detach()).min()))
            return True

    cls = TRPO if algo == "TRPO" else KLTRPO
    min_std = 0.55
    env = make_vec_env(SmallActionsPay, n_envs=2, seed=0)
    model = cls(
        "MlpPolicy",
        env,
        n_steps=128,
        batch_size=64,
        n_critic_updates=0,
        target_kl=0.05,
        seed=0,
        policy_kwargs=dict(net_arch=[16], log_std_init=-0.5),
    )
    acting = ActingStd()
    model.learn(128 * 2 * 6, callback=[VarianceFloorCallback(min_std=min_std), acting])
    assert len(acting.values) == 128 * 6
    assert min(acting.values) >= min_std * (1 - 1e-6)


def test_callback_floor_redraws_gsde_noise_drawn_below_the_floor():
    # SB3 draws gSDE's exploration matrix just before on_rollout_start: drawn with a std under the floor, the floor
    # applied at rollout start draws it again, so every rollout acts with the floored std
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_kl import KLTRPO

    min_std = 1.0
    env = make_vec_env(SmallActionsPay, n_envs=2, seed=0)
    model = KLTRPO(
        "MlpPolicy",
        env,
        n_steps=64,
        n_critic_updates=0,
        target_kl=0.05,
        use_sde=True,
        seed=0,
        policy_kwargs=dict(net_arch=[16], log_std_init=-1.0),
    )
    draws = []  # the std each exploration matrix was drawn with
    original = model.policy.reset_noise

    def reset_noise(n_envs: int = 1) -> None:
        draws.append(float(model.policy.action_dist.get_std(model.policy.log_std.detach()).min()))
        original(n_envs)

    model.policy.reset_noise = reset_noise

    class ActingDraw(BaseCallback):
        """After the floor: the std of the draw the rollout acts with."""

        def __init__(self):
            super().__init__()
            self.values = []

        def _on_rollout_start(self) -> None:
            self.values.append(draws[-1])

        def _on_step(self) -> bool:
            return True

    acting = ActingDraw()
    model.learn(64 * 2 * 5, callback=[VarianceFloorCallback(min_std=min_std), acting])
    assert len(acting.values) == 5
    assert min(draws) < min_std  # the line search did take the std under the floor
    assert min(acting.values) >= min_std * (1 - 1e-6)
