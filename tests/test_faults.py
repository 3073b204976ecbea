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
from hypothesis import given, settings
from hypothesis import strategies as st
import torch as th
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import FakeImageEnv, SimpleMultiObsEnv
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import DummyVecEnv, VecCheckNan, VecNormalize

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.common.buffers import StalePolicyError
from sb3_kl.common.on_policy_algorithm import KLOnPolicyAlgorithm, NonFiniteEnvCheck, NonFiniteEnvError, NonFiniteUpdateError

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
    # env 1 of 2 goes bad on its 40th step: step 40 - 1 - 16 - 16 = 7 (0-based) of the third rollout, timestep 2 * 39 = 78
    env = DummyVecEnv([make_env(), make_env(where, at_step=40, value=value)])
    model = build(algo, env)
    message = rf"env 1 returned a {kind} {what} at step 7 of the rollout \(timestep 78\)"
    with pytest.raises(ValueError, match=message) as info:
        model.learn(10 * N_STEPS * 2)
    assert "VecCheckNan" in str(info.value)
    assert isinstance(info.value, NonFiniteEnvError) and isinstance(info.value, NonFiniteUpdateError)
    # two full rollouts were trained on; the third one never reached train()
    assert model.policy_version == 2
    assert np.all(np.isfinite(policy_snapshot(model)))
    if where == "reward":
        # rewards reach the policy only through train(): checked once the rollout is complete, before the update
        assert model.num_timesteps == 96 and model.rollout_buffer.full
    else:
        # observations are checked at the step that returned them, before the policy acts on them
        assert model.num_timesteps == 78 and model.rollout_buffer.pos == 7
        assert np.all(np.isfinite(model.rollout_buffer.observations))


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
    obs, rewards, _dones, infos = check.step(np.array([0, 1]))
    assert obs.shape == (2, 4) and rewards.shape == (2,) and len(infos) == 2
    obs, _, _, _ = check.step(np.array([0, 1]))  # second call: the cached fast path
    assert check.n_steps == 2
    bad = np.zeros((2, 3), dtype=np.float32)
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match=r"env 1 returned a inf observation at step 2 of the rollout \(timestep 104\)"):
        check.check_observation(bad)
    check.check_observation(np.array([[1, 2]], dtype=np.int64))  # integers are not checked
    rewards = np.zeros((5, 2), dtype=np.float32)
    check.check_rewards(rewards)
    rewards[3, 1], rewards[4, 0] = np.nan, np.inf
    with pytest.raises(ValueError, match=r"env 1 returned a NaN reward at step 3 of the rollout \(timestep 106\)"):
        check.check_rewards(rewards)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.float16, np.float32, np.float64]),
    st.integers(1, 4),
    st.integers(1, 50),
    st.sampled_from([None, np.nan, np.inf, -np.inf]),
    st.floats(-1e30, 1e30),
    st.data(),
)
def test_fast_check_agrees_with_isfinite(dtype: Any, n_envs: int, dim: int, bad: Any, scale: float, data: Any) -> None:
    """The dot-with-zeros test flags exactly the arrays np.isfinite flags (huge finite values included)."""
    with np.errstate(over="ignore"):
        array = np.full((n_envs, dim), scale).astype(dtype)  # may overflow to inf in float16, which is then a real inf
    if bad is not None:
        row, col = data.draw(st.integers(0, n_envs - 1)), data.draw(st.integers(0, dim - 1))
        array[row, col] = bad
    check = NonFiniteEnvCheck(DummyVecEnv([make_env()] * n_envs), start_timestep=0)
    finite = bool(np.isfinite(array).all())
    try:
        check.check_observation(array)
        assert finite
    except NonFiniteEnvError:
        assert not finite


def test_nonfinite_update_error_is_not_triggered_by_clean_env() -> None:
    """Guard against false positives: a normal run has no skipped optimizer step."""
    model = build(KLPPO, DummyVecEnv([make_env()]))
    model.learn(2 * N_STEPS)
    assert model.nonfinite_steps_total == 0
    assert model.logger.name_to_value["train/nonfinite_steps"] == 0


# ---------------------------------------------------------------------------------------------------------------
# Stale data: a rollout buffer only updates the policy version that collected it


@pytest.mark.parametrize("algo", ALGOS)
def test_reusing_a_rollout_buffer_raises_stale_policy_error(algo: type) -> None:
    model = build(algo, DummyVecEnv([make_env()]))
    model.learn(N_STEPS)  # one rollout, one update: the buffer now describes the previous policy
    before = policy_snapshot(model)
    with pytest.raises(StalePolicyError, match=r"collected by policy version 0, but the policy is now at version 1"):
        model.train()
    np.testing.assert_array_equal(policy_snapshot(model), before)  # nothing was applied


@pytest.mark.parametrize("algo", ALGOS)
def test_new_weights_make_the_buffer_stale(algo: type) -> None:
    """Loading other weights (set_parameters) between collection and update also invalidates the rollout."""
    model = build(algo, DummyVecEnv([make_env()]))
    model._setup_learn(N_STEPS, None)
    callback = model._init_callback(None)
    model.collect_rollouts(model.env, callback, model.rollout_buffer, N_STEPS)
    model.set_parameters(model.get_parameters())
    with pytest.raises(StalePolicyError):
        model.train()
    # a fresh rollout is accepted again
    model.collect_rollouts(model.env, callback, model.rollout_buffer, N_STEPS)
    model.train()
    assert model.policy_version == 2


def test_empty_buffer_raises_stale_policy_error() -> None:
    model = build(KLPPO, DummyVecEnv([make_env()]))
    with pytest.raises(StalePolicyError, match="not full"):
        model.train()


@pytest.mark.parametrize("flatten_first", [False, True])
def test_ordered_samples_reads_the_buffer_in_order_without_random_draws(flatten_first: bool) -> None:
    """
    ordered_samples() gives every sample once, in get()'s flattened order (env-major), whether or not get() has
    flattened the buffer yet, and leaves numpy's global generator where it was.
    """
    model = build(KLPPO, DummyVecEnv([make_env(), make_env()]))
    model._setup_learn(N_STEPS, None)
    model.collect_rollouts(model.env, model._init_callback(None), model.rollout_buffer, N_STEPS)
    buffer = model.rollout_buffer
    expected = buffer.swap_and_flatten(buffer.observations.copy())  # (step, env) -> env-major
    if flatten_first:
        next(buffer.get(batch_size=None))
    state = np.random.get_state()
    chunks = list(buffer.ordered_samples(chunk_size=5))
    after = np.random.get_state()
    assert np.array_equal(after[1], state[1]) and after[2] == state[2]
    assert [len(chunk.observations) for chunk in chunks] == [5] * (2 * N_STEPS // 5) + (
        [2 * N_STEPS % 5] if 2 * N_STEPS % 5 else []
    )
    np.testing.assert_array_equal(th.cat([chunk.observations for chunk in chunks]).numpy(), expected)


@pytest.mark.parametrize("algo", ALGOS)
def test_training_recovers_after_the_env_is_fixed(algo: type) -> None:
    """After the error, the model is intact: swap in a clean env and training goes on (partial rollout discarded)."""
    model = build(algo, DummyVecEnv([make_env("obs", at_step=20)]))
    with pytest.raises(NonFiniteEnvError):
        model.learn(10 * N_STEPS)
    assert (model.num_timesteps, model.policy_version) == (19, 1)
    model.set_env(DummyVecEnv([make_env()]))
    model.learn(4 * N_STEPS, reset_num_timesteps=False)
    assert (model.num_timesteps, model.policy_version) == (19 + 4 * N_STEPS, 5)
    assert np.isfinite(model.logger.name_to_value["train/kl"])
    assert np.all(np.isfinite(policy_snapshot(model)))


def test_vec_normalize_nan_is_reported_and_vec_check_nan_underneath_protects_the_statistics() -> None:
    """
    VecNormalize sits between the env and the algorithm: when the check sees a NaN observation, VecNormalize's running
    statistics have already absorbed it. The error is still raised (no NaN reaches the policy); putting
    VecCheckNan under VecNormalize, as the message suggests, stops the NaN before the statistics see it.
    """
    normalized = VecNormalize(DummyVecEnv([make_env("obs", at_step=20)]))
    model = build(KLPPO, normalized)
    with pytest.raises(NonFiniteEnvError, match="env 0 returned a NaN observation at step 3"):
        model.learn(10 * N_STEPS)
    assert not np.isfinite(normalized.obs_rms.mean).all()  # the limitation, documented in docs/reliability.md
    assert np.all(np.isfinite(policy_snapshot(model)))

    protected = VecNormalize(VecCheckNan(DummyVecEnv([make_env("obs", at_step=20)]), raise_exception=True))
    model = build(KLPPO, protected)
    with pytest.raises(ValueError, match="observation"):
        model.learn(10 * N_STEPS)
    assert np.isfinite(protected.obs_rms.mean).all()


@pytest.mark.parametrize("algo", ALGOS)
def test_check_changes_nothing_on_a_clean_run(algo: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit-identical training with and without the check (SB3's collect_rollouts plus the buffer's version stamp)."""

    def run() -> np.ndarray:
        env = make_vec_env("CartPole-v1", n_envs=2, seed=0)  # short episodes: terminal observations are checked too
        model = build(algo, env, gamma=0.9)
        model.learn(3 * N_STEPS * 2)
        return policy_snapshot(model)

    checked = run()

    def unchecked(self: Any, env: Any, callback: Any, rollout_buffer: Any, n_rollout_steps: int) -> bool:
        result = OnPolicyAlgorithm.collect_rollouts(self, env, callback, rollout_buffer, n_rollout_steps)
        rollout_buffer.policy_version = self.policy_version
        return result

    monkeypatch.setattr(KLOnPolicyAlgorithm, "collect_rollouts", unchecked)
    np.testing.assert_array_equal(checked, run())


@pytest.mark.parametrize("algo", [KLPPO, KLTRPO])
def test_one_nonfinite_critic_gradient_is_skipped_and_counted(algo: type) -> None:
    # One NaN gradient on the value head in the whole run: the step is skipped (KLTRPO's critic fit as KLPPO's
    # optimizer step), counted, and the critic stays finite, so the rewards bootstrapped with its values do too
    model = algo("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, seed=0, policy_kwargs=dict(net_arch=[16]))
    calls = {"n": 0}

    def poison(grad: th.Tensor) -> th.Tensor:
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 3 else grad

    model.policy.value_net.bias.register_hook(poison)
    model.learn(64 * 4)
    assert calls["n"] > 3
    assert model.nonfinite_steps_total == 1
    assert all(bool(th.isfinite(p).all()) for p in model.policy.parameters())
    assert "train/nonfinite_steps" in model.logger.name_to_value


def test_kltrpo_raises_when_every_critic_step_is_nonfinite() -> None:
    model = KLTRPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, seed=0, policy_kwargs=dict(net_arch=[16]))
    model.policy.value_net.bias.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(NonFiniteUpdateError, match="critic"):
        model.learn(64)
    assert all(bool(th.isfinite(p).all()) for p in model.policy.parameters())
