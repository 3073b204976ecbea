"""
Resume: N updates, save, load, M more updates == N + M uninterrupted updates, for KLPPO, ClipKLPPO and KLTRPO.

What SB3's ``save()`` keeps and what it does not (see docs/reliability.md):

- kept: parameters, optimizer state (Adam moments), every plain attribute, hence the KL controller (beta, its
  histories, the adaptive controller's window of recent KLs), ``policy_version``, ``num_timesteps``, ``_n_updates``,
  ``_last_obs`` and ``_last_episode_starts``;
- not kept: the global RNG states (python ``random``, numpy, torch) and the environment's internal state.
  Moreover ``load()`` runs ``_setup_model()``, which calls ``set_random_seed(model.seed)``: the global RNGs are
  re-seeded to the *initial* seed, the policy is re-initialised (consuming torch RNG) before the saved weights are
  loaded, ``action_space`` is re-seeded and the env gets pending seeds for its next explicit ``reset()``.

So a bit-exact resume needs the RNG states restored after ``load()`` and the same environment (state) continued
with ``force_reset=False``; this is what ``test_resume_is_bit_exact`` does, and then parameters, logged KL,
beta trajectory and controller state are *exactly* equal. Without restoring the RNGs (the usual resume in a new
process), the restored state is still exact at load time and the beta trajectory continues from the saved one;
the continuation samples different actions, so only structural properties are compared.
"""

import hashlib
import json
import random
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch as th
from stable_baselines3.common.callbacks import CheckpointCallback
from stable_baselines3.common.env_util import make_vec_env

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO

ALGOS = [KLPPO, ClipKLPPO, KLTRPO]
N_ENVS, N_STEPS = 2, 32
ROLLOUT = N_ENVS * N_STEPS
N, M = 2, 2


def make_env() -> Any:
    return make_vec_env("CartPole-v1", n_envs=N_ENVS, seed=0)


def make_model(algo: type, env: Any) -> Any:
    extra = dict(n_critic_updates=2, cg_max_steps=4) if algo is KLTRPO else dict(n_epochs=2)
    tiny = dict(n_steps=N_STEPS, batch_size=16, policy_kwargs=dict(net_arch=[8]), seed=0, device="cpu")
    return algo("MlpPolicy", env, **tiny, **extra)


def parameters(model: Any) -> np.ndarray:
    return th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().numpy().copy()


def optimizer_state(model: Any) -> list[np.ndarray]:
    state = model.policy.optimizer.state_dict()["state"]
    return [value.numpy().copy() for key in sorted(state) for value in state[key].values() if isinstance(value, th.Tensor)]


def controller_state(model: Any) -> dict[str, Any]:
    state = dict(vars(model.kl_controller))
    if "recent_kls" in state:
        state["recent_kls"] = list(state["recent_kls"])
    return state


def assert_same_run(a: Any, b: Any) -> None:
    np.testing.assert_array_equal(parameters(a), parameters(b))
    for x, y in zip(optimizer_state(a), optimizer_state(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert controller_state(a) == controller_state(b)
    if a.has_kl_coef:
        assert a.kl_coef == b.kl_coef
    for key in ("train/kl", "train/kl_max", "train/approx_kl" if not isinstance(a, KLTRPO) else "train/kl_p50"):
        assert a.logger.name_to_value[key] == b.logger.name_to_value[key], key
    assert (a.num_timesteps, a._n_updates, a.policy_version) == (b.num_timesteps, b._n_updates, b.policy_version)


@pytest.mark.parametrize("algo", ALGOS)
def test_resume_is_bit_exact(algo: type, tmp_path: Any) -> None:
    uninterrupted = make_model(algo, make_env())
    uninterrupted.learn((N + M) * ROLLOUT)

    env = make_env()
    first = make_model(algo, env)
    first.learn(N * ROLLOUT)
    rng_states = (random.getstate(), np.random.get_state(), th.get_rng_state())
    first.save(tmp_path / "model.zip")
    saved_controller = controller_state(first)

    resumed = algo.load(tmp_path / "model.zip", env=env, force_reset=False, device="cpu")
    # exact at load time: weights, optimizer, controller and counters
    np.testing.assert_array_equal(parameters(resumed), parameters(first))
    assert controller_state(resumed) == saved_controller
    assert resumed.policy_version == first.policy_version + 1  # set_parameters marks any old rollout stale
    random.setstate(rng_states[0])
    np.random.set_state(rng_states[1])
    th.set_rng_state(rng_states[2])
    resumed.learn(M * ROLLOUT, reset_num_timesteps=False)

    # policy_version differs by the one bump of set_parameters: compare it relative to that
    resumed.policy_version -= 1
    assert_same_run(uninterrupted, resumed)
    if algo is not KLTRPO:
        assert len(resumed.kl_controller.kl_coef_history) == N + M


@pytest.mark.parametrize("algo", [KLPPO, KLTRPO])
def test_resume_without_rng_restore_continues_controller(algo: type, tmp_path: Any) -> None:
    """The usual resume (new env, RNGs not restored): state restored exactly, beta trajectory continued."""
    first = make_model(algo, make_env())
    first.learn(N * ROLLOUT)
    first.save(tmp_path / "model.zip")
    resumed = algo.load(tmp_path / "model.zip", env=make_env(), device="cpu")
    assert controller_state(resumed) == controller_state(first)
    resumed.learn(M * ROLLOUT, reset_num_timesteps=False)
    assert resumed.num_timesteps == (N + M) * ROLLOUT
    assert resumed._n_updates == first._n_updates * (N + M) // N
    history = resumed.kl_controller.kl_coef_history
    assert history[:N] == first.kl_controller.kl_coef_history
    if algo is not KLTRPO:
        assert len(history) == N + M
        low, high = resumed.kl_controller.kl_coef_bounds
        assert all(low <= beta <= high and np.isfinite(beta) for beta in history)
    assert np.isfinite(resumed.logger.name_to_value["train/kl"])


def test_load_with_kl_coef_override(tmp_path: Any) -> None:
    model = make_model(KLPPO, make_env())
    model.learn(ROLLOUT)
    model.save(tmp_path / "model.zip")
    loaded = KLPPO.load(tmp_path / "model.zip", kl_coef=0.25, device="cpu")
    assert loaded.kl_coef == 0.25
    assert loaded.kl_controller.kl_coef_history == model.kl_controller.kl_coef_history


class BetaRecorder(CheckpointCallback):
    """CheckpointCallback that also remembers beta at each save."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.saved: dict[int, float] = {}

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            self.saved[self.num_timesteps] = self.model.kl_coef
        return super()._on_step()


@pytest.mark.parametrize("algo", [KLPPO, ClipKLPPO])
def test_checkpoint_callback_mid_training(algo: type, tmp_path: Any) -> None:
    model = make_model(algo, make_env())
    # every 24 calls = 48 timesteps: checkpoints fall in the middle of rollouts, between updates
    checkpoint = BetaRecorder(save_freq=24, save_path=str(tmp_path), name_prefix="ckpt")
    model.learn(4 * ROLLOUT, callback=checkpoint)
    assert len(checkpoint.saved) == 5
    for timesteps, beta in checkpoint.saved.items():
        path = tmp_path / f"ckpt_{timesteps}_steps.zip"
        assert path.exists()
        loaded = algo.load(path, env=make_env(), device="cpu")
        assert loaded.num_timesteps == timesteps
        assert loaded.kl_coef == beta
        n_done = (timesteps - 1) // ROLLOUT  # updates finished before this step
        assert loaded.kl_controller.kl_coef_history == model.kl_controller.kl_coef_history[:n_done]
    # the last checkpoint trains on
    loaded.learn(ROLLOUT, reset_num_timesteps=False)
    assert len(loaded.kl_controller.kl_coef_history) == n_done + 1


# ---------------------------------------------------------------------------------------------------------------
# Forward-compatibility guard: models saved by this version (tests/fixtures, made by make_fixtures.py) must load

FIXTURES_DIR = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES_DIR / "expected.json").read_text())["models"]
ALGO_BY_NAME = {algo.__name__: algo for algo in ALGOS}


def fixture_controller_state(model: Any) -> dict[str, Any]:
    state = vars(model.kl_controller)
    return {key: list(value) if isinstance(value, (tuple, list, deque)) else value for key, value in state.items()}


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_fixture_loads_and_predicts(stem: str) -> None:
    expected = EXPECTED[stem]
    algo = ALGO_BY_NAME[expected["algo"]]
    model = algo.load(FIXTURES_DIR / f"{stem}.zip", device="cpu")
    assert type(model.kl_controller).__name__ == expected["controller_class"]
    if model.has_kl_coef:
        assert model.kl_coef == expected["kl_coef"]
    else:  # KLTRPO: no penalty, so no beta to read (the saved controller is unused)
        assert not hasattr(model, "kl_coef")
    assert fixture_controller_state(model) == expected["controller"]
    assert (model.num_timesteps, model._n_updates) == (expected["num_timesteps"], expected["n_updates"])
    assert model.target_kl(1.0) == expected["target_kl"]
    assert model.min_std == expected["min_std"]
    if expected["ref_controller"] is not None:
        state = vars(model.ref_kl_controller)
        assert {k: list(v) if isinstance(v, (tuple, list, deque)) else v for k, v in state.items()} == expected[
            "ref_controller"
        ]
    if expected["ref_parameters_sha256"] is not None:
        # the frozen reference comes back from the zip's ref_policy.pth, not from the original file or model
        ref_params = th.nn.utils.parameters_to_vector(model.ref_policy.parameters()).numpy()
        assert hashlib.sha256(ref_params.tobytes()).hexdigest() == expected["ref_parameters_sha256"]
        assert not any(p.requires_grad for p in model.ref_policy.parameters())
    observations = np.array(expected["observations"], dtype=np.float32)
    actions, _ = model.predict(observations, deterministic=True)
    np.testing.assert_allclose(np.asarray(actions, dtype=np.float64), np.array(expected["actions"]), rtol=0, atol=1e-6)
    with th.no_grad():
        values = model.policy.predict_values(model.policy.obs_to_tensor(observations)[0]).flatten().numpy()
    np.testing.assert_allclose(values, expected["values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_fixture_trains_on(stem: str) -> None:
    expected = EXPECTED[stem]
    env = make_vec_env(expected["env_id"], n_envs=2)
    model = ALGO_BY_NAME[expected["algo"]].load(FIXTURES_DIR / f"{stem}.zip", env=env, device="cpu")
    n_before = len(model.kl_controller.kl_coef_history)
    model.learn(64, reset_num_timesteps=False)
    assert model.num_timesteps == expected["num_timesteps"] + 64
    assert np.isfinite(model.logger.name_to_value["train/kl"])
    if n_before:
        assert len(model.kl_controller.kl_coef_history) == n_before + 1


@pytest.mark.parametrize("algo", ALGOS)
def test_load_with_a_different_number_of_envs(algo: type, tmp_path: Any) -> None:
    """The rollout buffer is not saved: it is rebuilt for the new env count, and beta continues."""
    model = make_model(algo, make_env())
    model.learn(ROLLOUT)
    model.save(tmp_path / "model.zip")
    loaded = algo.load(tmp_path / "model.zip", env=make_vec_env("CartPole-v1", n_envs=3, seed=1), device="cpu")
    assert loaded.n_envs == 3 and loaded.rollout_buffer.n_envs == 3
    loaded.learn(3 * N_STEPS, reset_num_timesteps=False)
    assert loaded.num_timesteps == ROLLOUT + 3 * N_STEPS
    assert loaded.kl_controller.kl_coef_history[:1] == model.kl_controller.kl_coef_history
    assert np.isfinite(loaded.logger.name_to_value["train/kl"])


_RESUME_CHILD = """
import pickle, random, sys
import cloudpickle, numpy as np, torch as th
th.set_num_threads(1)
from sb3_kl import {algo}
state_path, model_path, out_path, timesteps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(state_path, "rb") as file:
    env, rng = cloudpickle.load(file)
model = {algo}.load(model_path, env=env, force_reset=False, device="cpu")
random.setstate(rng[0]); np.random.set_state(rng[1]); th.set_rng_state(rng[2])
model.learn(timesteps, reset_num_timesteps=False)
params = th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().numpy()
with open(out_path, "wb") as file:
    pickle.dump((params, model.kl_controller.kl_coef_history, model.logger.name_to_value["train/kl"]), file)
"""


@pytest.mark.slow  # a child interpreter: ~15 s of imports on a loaded 2-core machine
def test_resume_in_a_new_process_is_bit_exact(tmp_path: Any) -> None:
    """The documented recipe across processes: zip + RNG states + the pickled VecEnv, then load(force_reset=False)."""
    import pickle
    import subprocess
    import sys

    import cloudpickle

    uninterrupted = make_model(KLPPO, make_env())
    uninterrupted.learn((N + M) * ROLLOUT)

    env = make_env()
    first = make_model(KLPPO, env)
    first.learn(N * ROLLOUT)
    first.save(tmp_path / "model.zip")
    with open(tmp_path / "state.pkl", "wb") as file:
        cloudpickle.dump((env, (random.getstate(), np.random.get_state(), th.get_rng_state())), file)
    script = tmp_path / "child.py"
    script.write_text(_RESUME_CHILD.format(algo="KLPPO"))
    args = [str(tmp_path / "state.pkl"), str(tmp_path / "model.zip"), str(tmp_path / "out.pkl"), str(M * ROLLOUT)]
    subprocess.run([sys.executable, str(script), *args], check=True, timeout=300)
    with open(tmp_path / "out.pkl", "rb") as file:
        params, history, kl = pickle.load(file)
    np.testing.assert_array_equal(params, parameters(uninterrupted))
    assert history == uninterrupted.kl_controller.kl_coef_history
    assert kl == uninterrupted.logger.name_to_value["train/kl"]
