"""
Faults from the environment: NaN/inf observations, rewards, terminal observations or reset observations stop
training with a ValueError naming the env index, the step of the rollout and the timestep, before the value
reaches the policy or the rollout buffer (so the policy is never updated on it and stays finite).
"""

import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.envs import FakeImageEnv, SimpleMultiObsEnv
from stable_baselines3.common.vec_env import DummyVecEnv

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.common.on_policy_algorithm import NonFiniteEnvCheck, NonFiniteEnvError, NonFiniteUpdateError

ALGOS = [KLPPO, ClipKLPPO, KLTRPO]
N_STEPS = 16


class FaultyEnv(gym.Wrapper):
    """
    Puts ``value`` (NaN or inf) into the reward, the observation or the terminal observation of call number
    ``at_step`` (1-based) to ``step()``, or into the first reset observation (``where="reset"``).
    """

    def __init__(self, env: gym.Env, where: str, at_step: int = 1, value: float = math.nan):
        super().__init__(env)
        self.where, self.at_step, self.value = where, at_step, value
        self.n_calls = 0
        self.n_resets = 0

    def _spoil(self, obs: Any) -> Any:
        if isinstance(obs, dict):
            key = next(k for k, v in obs.items() if np.asarray(v).dtype.kind == "f")
            return {**obs, key: np.full_like(obs[key], self.value)}
        return np.full_like(obs, self.value)

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self.n_resets += 1
        if self.where == "reset" and self.n_resets == 1:
            obs = self._spoil(obs)
        return obs, info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.n_calls += 1
        if self.n_calls == self.at_step:
            if self.where == "reward":
                reward = self.value
            elif self.where == "obs":
                obs = self._spoil(obs)
            elif self.where == "terminal_obs":
                obs, terminated = self._spoil(obs), True
        return obs, reward, terminated, truncated, info


def make_env(where: str | None = None, at_step: int = 1, value: float = math.nan, base: str = "CartPole-v1") -> Any:
    def _init() -> gym.Env:
        env = gym.make(base)
        return FaultyEnv(env, where, at_step, value) if where is not None else env

    return _init


def build(algo: type, env: Any, **kwargs: Any) -> Any:
    extra = dict(n_critic_updates=1, cg_max_steps=3) if algo is KLTRPO else dict(n_epochs=1)
    tiny = dict(n_steps=N_STEPS, batch_size=16, policy_kwargs=dict(net_arch=[8]), seed=0, device="cpu")
    return algo("MlpPolicy", env, **tiny, **extra, **kwargs)


def policy_snapshot(model: Any) -> np.ndarray:
    return th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().numpy().copy()


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(
    "where, value, kind, what",
    [
        ("reward", math.nan, "NaN", "reward"),
        ("reward", math.inf, "inf", "reward"),
        ("obs", math.nan, "NaN", "observation"),
        ("obs", -math.inf, "inf", "observation"),
        ("terminal_obs", math.nan, "NaN", "terminal observation"),
    ],
)
def test_nonfinite_step_output_raises_with_env_and_step(algo: type, where: str, value: float, kind: str, what: str) -> None:
    # env 1 of 2 goes bad on its 40th step: step 40 - 1 - 16 - 16 = 7 of the third rollout, timestep 2 * 39 = 78
    env = DummyVecEnv([make_env(), make_env(where, at_step=40, value=value)])
    model = build(algo, env)
    message = rf"env 1 returned a {kind} {what} at step 7 of the rollout \(timestep 78\)"
    with pytest.raises(ValueError, match=message) as info:
        model.learn(10 * N_STEPS * 2)
    assert "VecCheckNan" in str(info.value)
    assert isinstance(info.value, NonFiniteEnvError) and isinstance(info.value, NonFiniteUpdateError)
    # two full rollouts were trained on; the faulty step is not counted and the third rollout never reached train()
    assert model.num_timesteps == 78
    assert model.policy_version == 2
    assert np.all(np.isfinite(policy_snapshot(model)))
    # the bad value is not in the rollout buffer either (it stopped at the step that returned it)
    assert model.rollout_buffer.pos == 7
    assert np.all(np.isfinite(model.rollout_buffer.rewards)) and np.all(np.isfinite(model.rollout_buffer.observations))


@pytest.mark.parametrize("algo", ALGOS)
def test_nonfinite_reset_observation(algo: type) -> None:
    env = DummyVecEnv([make_env("reset")])
    model = build(algo, env)
    before = policy_snapshot(model)
    message = r"env 0 returned a NaN observation \(carried over from the last reset or step\) at step 0"
    with pytest.raises(ValueError, match=message):
        model.learn(N_STEPS)
    np.testing.assert_array_equal(policy_snapshot(model), before)


def test_dict_observation_key_checked() -> None:
    def _init() -> gym.Env:
        return FaultyEnv(SimpleMultiObsEnv(random_start=False), "obs", at_step=5)

    env = DummyVecEnv([_init])
    model = KLPPO("MultiInputPolicy", env, n_steps=N_STEPS, batch_size=16, policy_kwargs=dict(net_arch=[8]), seed=0)
    with pytest.raises(ValueError, match=r"env 0 returned a NaN observation at step 4 of the rollout \(timestep 4\)"):
        model.learn(2 * N_STEPS)


def test_integer_observations_not_checked() -> None:
    """uint8 images cannot hold NaN: they are skipped (no false alarm, no cost)."""
    env = DummyVecEnv([lambda: FakeImageEnv(screen_height=36, screen_width=36)])
    policy_kwargs = dict(net_arch=[8], features_extractor_kwargs=dict(features_dim=8))
    model = KLPPO("CnnPolicy", env, n_steps=N_STEPS, batch_size=16, n_epochs=1, seed=0, policy_kwargs=policy_kwargs)
    model.learn(N_STEPS)
    assert model.policy_version == 1


def test_check_is_transparent() -> None:
    """The stand-in forwards every attribute and returns the env's step results unchanged."""
    venv = DummyVecEnv([make_env(), make_env()])
    venv.seed(3)
    venv.reset()
    check = NonFiniteEnvCheck(venv, start_timestep=100)
    assert check.num_envs == 2 and check.observation_space == venv.observation_space
    obs, rewards, dones, infos = check.step(np.array([0, 1]))
    assert obs.shape == (2, 4) and rewards.shape == (2,) and len(infos) == 2
    assert check.n_steps == 1
    bad = np.zeros((2, 3), dtype=np.float32)
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match=r"env 1 returned a inf observation at step 1 of the rollout \(timestep 102\)"):
        check.check_observation(bad)
    check.check_observation(np.array([[1, 2]], dtype=np.int64))  # integers are not checked


def test_nonfinite_update_error_is_not_triggered_by_clean_env() -> None:
    """Guard against false positives: a normal run has no skipped optimizer step."""
    model = build(KLPPO, DummyVecEnv([make_env()]))
    model.learn(2 * N_STEPS)
    assert model.nonfinite_steps_total == 0
    assert model.logger.name_to_value["train/nonfinite_steps"] == 0
