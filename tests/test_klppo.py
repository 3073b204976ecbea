import copy
import inspect
import re

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.envs import (
    FakeImageEnv,
    IdentityEnv,
    IdentityEnvBox,
    IdentityEnvMultiBinary,
    IdentityEnvMultiDiscrete,
    SimpleMultiObsEnv,
)
from stable_baselines3.common.utils import LinearSchedule

from sb3_kl import ClipKLPPO, KLPPO, KLTRPO
from sb3_kl.common.buffers import StalePolicyError
from sb3_kl.common.on_policy_algorithm import NonFiniteUpdateError

SMALL = dict(n_steps=64, batch_size=32, n_epochs=3, policy_kwargs=dict(net_arch=[16]), seed=0)


class SnapshotCallback(BaseCallback):
    """Keeps a deep copy of the rollout policy and the rollout's observations at the end of every rollout."""

    def __init__(self):
        super().__init__()
        self.snapshots = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        if isinstance(buffer.observations, dict):
            obs = {k: v.reshape(-1, *v.shape[2:]).copy() for k, v in buffer.observations.items()}
        else:
            obs = buffer.observations.reshape(-1, *buffer.observations.shape[2:]).copy()
        self.snapshots.append((snapshot_policy(self.model), obs))


def snapshot_policy(model):
    """An independent copy of the model's policy (deepcopy fails on gSDE's non-leaf exploration matrices)."""
    policy = model.policy_class(
        model.observation_space, model.action_space, model.lr_schedule, use_sde=model.use_sde, **model.policy_kwargs
    )
    policy.load_state_dict(model.policy.state_dict())
    return policy.set_training_mode(False) or policy


def in_float64(distribution):
    """The same torch distribution (or list of them: MultiCategorical) with its float32 parameters cast to float64."""
    if isinstance(distribution, list):
        return [in_float64(d) for d in distribution]
    if isinstance(distribution, th.distributions.Normal):
        return th.distributions.Normal(distribution.loc.double(), distribution.scale.double())
    return type(distribution)(logits=distribution.logits.double())  # Categorical, Bernoulli


def independent_kl(old_policy, new_policy, obs, float64: bool = False) -> np.ndarray:
    """
    Per-state KL(old || new) from PyTorch's kl_divergence on the two policies' own distributions (``float64``: their
    float32 parameters cast to float64 first).
    """
    with th.no_grad():
        if isinstance(obs, dict):
            obs_tensor = {key: th.as_tensor(value) for key, value in obs.items()}
        else:
            obs_tensor = th.as_tensor(obs)
        old = copy.copy(old_policy.get_distribution(obs_tensor))
        new = new_policy.get_distribution(obs_tensor)
        old_d, new_d = old.distribution, new.distribution
        if float64:
            old_d, new_d = in_float64(old_d), in_float64(new_d)
        if isinstance(old_d, list):  # MultiCategorical
            kl = sum(th.distributions.kl_divergence(p, q) for p, q in zip(old_d, new_d, strict=True))
        else:
            kl = th.distributions.kl_divergence(old_d, new_d)
            if kl.dim() > 1:
                kl = kl.sum(dim=-1)
    return kl.numpy()


ENVS = {
    "discrete": lambda: IdentityEnv(4),
    "box": lambda: IdentityEnvBox(eps=0.5),
    "multidiscrete": lambda: IdentityEnvMultiDiscrete(3),
    "multibinary": lambda: IdentityEnvMultiBinary(3),
    "pendulum": lambda: gym.make("Pendulum-v1"),
    "cartpole": lambda: gym.make("CartPole-v1"),
}


@pytest.mark.parametrize("env_name", list(ENVS))
def test_logged_kl_equals_independent_kl(env_name):
    """train/kl and its quantiles equal torch.distributions.kl_divergence between snapshots of the policy."""
    snapshots = SnapshotCallback()
    model = KLPPO("MlpPolicy", ENVS[env_name](), learning_rate=3e-3, **SMALL)
    model.learn(2 * SMALL["n_steps"], callback=snapshots)
    old_policy, obs = snapshots.snapshots[-1]
    reference = independent_kl(old_policy, model.policy, obs)
    logged = model.logger.name_to_value
    assert logged["train/kl"] > 1e-6, "the update must move the policy"
    assert logged["train/kl"] == pytest.approx(reference.mean(), rel=1e-4, abs=1e-8)
    assert logged["train/kl_p50"] == pytest.approx(np.quantile(reference, 0.5), rel=1e-3, abs=1e-8)
    assert logged["train/kl_p99"] == pytest.approx(np.quantile(reference, 0.99), rel=1e-3, abs=1e-8)
    assert logged["train/kl_max"] == pytest.approx(reference.max(), rel=1e-3, abs=1e-8)
    assert logged["train/kl_convention"] == "forward/analytic/sum"


def test_reverse_direction_and_mean_reduction_are_what_they_say():
    snapshots = SnapshotCallback()
    model = KLPPO(
        "MlpPolicy", IdentityEnvBox(eps=0.5), learning_rate=3e-3, kl_direction="reverse", kl_reduction="mean", **SMALL
    )
    model.learn(2 * SMALL["n_steps"], callback=snapshots)
    old_policy, obs = snapshots.snapshots[-1]
    # KL(new || old): swap the arguments of the independent computation; mean over the 1 action dim
    reference = independent_kl(model.policy, old_policy, obs)
    assert model.logger.name_to_value["train/kl"] == pytest.approx(reference.mean(), rel=1e-4)
    assert model.logger.name_to_value["train/kl_convention"] == "reverse/analytic/mean"


def test_gsde_kl():
    snapshots = SnapshotCallback()
    model = KLPPO("MlpPolicy", "Pendulum-v1", use_sde=True, sde_sample_freq=4, learning_rate=3e-3, **SMALL)
    model.learn(2 * SMALL["n_steps"], callback=snapshots)
    old_policy, obs = snapshots.snapshots[-1]
    reference = independent_kl(old_policy, model.policy, obs)
    assert model.logger.name_to_value["train/kl"] == pytest.approx(reference.mean(), rel=1e-4)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sample_estimators_run_and_are_labelled(estimator):
    model = KLPPO("MlpPolicy", "CartPole-v1", kl_estimator=estimator, **SMALL)
    model.learn(2 * SMALL["n_steps"])
    assert np.isfinite(model.logger.name_to_value["train/kl"])
    assert model.logger.name_to_value["train/kl_convention"] == f"forward/{estimator}/sum"


def test_logged_forward_k1_is_not_clamped_by_log_ratio_clip():
    # a small log_ratio_clip and a large step: log-ratios well past the clamp, and train/kl still the k1 estimate,
    # -log r averaged over the rollout's stored actions, from independent copies of the old and new policy
    snapshots = SnapshotCallback()
    model = KLPPO(
        "MlpPolicy", "CartPole-v1", kl_estimator="k1", log_ratio_clip=0.05, learning_rate=3e-2,
        kl_coef=1e-3, kl_coef_bounds=(1e-4, 1e-3), kl_hinge_coef=0.0, **{**SMALL, "n_epochs": 10},
    )  # fmt: skip
    model.learn(2 * SMALL["n_steps"], callback=snapshots)
    old_policy, obs = snapshots.snapshots[-1]
    actions = th.as_tensor(model.rollout_buffer.actions.reshape(-1)).long()
    with th.no_grad():
        old_log_prob = old_policy.get_distribution(th.as_tensor(obs)).log_prob(actions)
        new_log_prob = model.policy.get_distribution(th.as_tensor(obs)).log_prob(actions)
    log_ratio = (new_log_prob - old_log_prob).numpy()
    assert np.abs(log_ratio).max() > 0.05  # the clamp would have bound
    assert model.logger.name_to_value["train/kl"] == pytest.approx(float(np.mean(-log_ratio)), rel=1e-4, abs=1e-7)
    assert model.logger.name_to_value["train/kl_convention"] == "forward/k1/sum"


@pytest.mark.parametrize(
    "policy,env_fn",
    [
        ("MultiInputPolicy", lambda: SimpleMultiObsEnv(random_start=False)),
        ("CnnPolicy", lambda: FakeImageEnv(screen_height=36, screen_width=36, n_channels=1, discrete=True)),
    ],
)
def test_other_observation_spaces(policy, env_fn):
    kwargs = dict(SMALL)
    kwargs["policy_kwargs"] = (
        dict(net_arch=[16]) if policy == "MultiInputPolicy" else dict(features_extractor_kwargs=dict(features_dim=16))
    )
    model = KLPPO(policy, env_fn(), **kwargs)
    model.learn(2 * SMALL["n_steps"])
    assert model.logger.name_to_value["train/kl"] >= 0


def test_clipping_is_off_by_default_and_on_when_set():
    model = KLPPO("MlpPolicy", "CartPole-v1", **SMALL)
    model.learn(2 * SMALL["n_steps"])
    assert model.clip_range is None
    assert "train/clip_fraction" not in model.logger.name_to_value
    clipped = KLPPO("MlpPolicy", "CartPole-v1", clip_range=0.2, **SMALL)
    clipped.learn(2 * SMALL["n_steps"])
    assert "train/clip_fraction" in clipped.logger.name_to_value
    assert clipped.logger.name_to_value["train/clip_range"] == 0.2


def test_default_target_depends_on_action_space():
    assert KLPPO("MlpPolicy", "CartPole-v1", **SMALL).target_kl(1.0) == 0.02
    assert KLPPO("MlpPolicy", "Pendulum-v1", **SMALL).target_kl(1.0) == 0.03


def test_target_schedule_and_logged_keys():
    model = KLPPO("MlpPolicy", "CartPole-v1", target_kl=LinearSchedule(0.05, 0.01, 1.0), **SMALL)
    model.learn(4 * SMALL["n_steps"])
    values = model.logger.name_to_value
    assert values["train/target_kl"] == pytest.approx(0.01 + 0.04 * model._current_progress_remaining)
    for key in (
        "train/kl_coef",
        "train/kl_grad_ratio",
        "train/approx_kl",
        "train/policy_gradient_loss",
        "train/value_loss",
        "train/entropy_loss",
        "train/explained_variance",
        "train/nonfinite_steps",
        "train/early_stop_epoch",
    ):
        assert key in values, key
    assert values["train/kl_coef"] == model.kl_coef
    assert np.isfinite(values["train/kl_grad_ratio"]) and values["train/kl_grad_ratio"] > 0


def test_coefficient_adapts_toward_target():
    """With a tiny target the penalty grows; with a huge target it shrinks."""
    tight = KLPPO("MlpPolicy", "CartPole-v1", learning_rate=3e-3, target_kl=1e-5, **SMALL).learn(4 * SMALL["n_steps"])
    loose = KLPPO("MlpPolicy", "CartPole-v1", learning_rate=3e-3, target_kl=10.0, **SMALL).learn(4 * SMALL["n_steps"])
    assert tight.kl_coef > 1.0 > loose.kl_coef
    assert tight.kl_controller.n_updates == 4


def test_save_load_continue_keeps_coefficient_and_controller(tmp_path):
    model = KLPPO("MlpPolicy", "CartPole-v1", target_kl=1e-4, kl_window=3, **SMALL).learn(3 * SMALL["n_steps"])
    beta, history, recent = model.kl_coef, list(model.kl_controller.kl_history), list(model.kl_controller.recent_kls)
    assert beta != 1.0
    model.save(tmp_path / "model.zip")
    loaded = KLPPO.load(tmp_path / "model.zip", env=gym.make("CartPole-v1"))
    assert loaded.kl_coef == beta
    assert loaded.kl_controller.kl_history == history
    assert list(loaded.kl_controller.recent_kls) == recent
    assert loaded.target_kl(0.5) == 1e-4
    loaded.learn(SMALL["n_steps"], reset_num_timesteps=False)
    assert loaded.kl_controller.n_updates == 4
    assert loaded.kl_controller.kl_history[:3] == history
    # loading without an env, and overriding beta at load time as SB3 allows for any attribute
    no_env = KLPPO.load(tmp_path / "model.zip", kl_coef=0.123)
    assert no_env.kl_coef == 0.123
    assert no_env.predict(np.zeros(4, dtype=np.float32))[0] in (0, 1)


class StdRecorder(BaseCallback):
    def __init__(self):
        super().__init__()
        self.stds = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        self.stds.append(th.exp(self.model.policy.log_std).min().item())


@pytest.mark.parametrize("use_sde", [False, True])
def test_variance_floor_holds_under_a_loss_that_pushes_std_down(use_sde):
    # a strongly negative entropy coefficient drives the std down (the KL hinge and early stop, which would hold it
    # back, are off)
    kwargs = dict(SMALL, learning_rate=5e-2, ent_coef=-5.0, use_sde=use_sde, kl_hinge_coef=0.0, kl_stop_factor=None)
    unfloored, recorder = KLPPO("MlpPolicy", "Pendulum-v1", **kwargs), StdRecorder()
    unfloored.learn(6 * SMALL["n_steps"], callback=recorder)
    floor = 0.6
    assert min(recorder.stds) < floor, "the test loss must push the std below the floor"
    floored, recorder = KLPPO("MlpPolicy", "Pendulum-v1", min_std=floor, **kwargs), StdRecorder()
    floored.learn(6 * SMALL["n_steps"], callback=recorder)
    assert min(recorder.stds) >= floor * (1 - 1e-6)
    assert th.exp(floored.policy.log_std).min().item() >= floor * (1 - 1e-6)
    if not use_sde:
        assert floored.logger.name_to_value["train/action_std_min"] >= floor * (1 - 1e-5)


def test_stale_buffer_is_refused():
    model = KLPPO("MlpPolicy", "CartPole-v1", **SMALL).learn(SMALL["n_steps"])
    with pytest.raises(StalePolicyError, match="Collect a new rollout"):
        model.train()


def test_nonfinite_steps_are_skipped_and_counted(monkeypatch):
    model = KLPPO("MlpPolicy", "CartPole-v1", **SMALL)
    original = model._surrogate_loss
    calls = {"n": 0}

    def sometimes_nan(*args, **kwargs):
        loss, clip_fraction = original(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 1 else loss), clip_fraction

    monkeypatch.setattr(model, "_surrogate_loss", sometimes_nan)
    model.learn(SMALL["n_steps"] * 2)
    assert model.logger.name_to_value["train/nonfinite_steps"] == 0  # second update
    assert model.nonfinite_steps_total == 1
    assert all(th.isfinite(p).all() for p in model.policy.parameters())


class NaNRewardWrapper(gym.Wrapper):
    def step(self, action):
        obs, _reward, terminated, truncated, info = self.env.step(action)
        return obs, float("nan"), terminated, truncated, info


def test_update_with_only_nonfinite_steps_raises():
    model = KLPPO("MlpPolicy", NaNRewardWrapper(gym.make("CartPole-v1")), **SMALL)
    with pytest.raises(NonFiniteUpdateError, match="VecCheckNan"):
        model.learn(SMALL["n_steps"])
    assert all(th.isfinite(p).all() for p in model.policy.parameters())


def test_kl_stop_factor_stops_early():
    model = KLPPO(
        "MlpPolicy",
        "CartPole-v1",
        learning_rate=0.05,
        n_epochs=10,
        target_kl=1e-4,
        kl_stop_factor=1.0,
        n_steps=64,
        batch_size=32,
        policy_kwargs=dict(net_arch=[16]),
        seed=0,
    )
    model.learn(128)
    assert model.logger.name_to_value["train/early_stop_epoch"] < 10
    assert np.isfinite(model.logger.name_to_value["train/kl_grad_ratio"])


STOP_AT_BOUND = dict(
    learning_rate=0.05, n_epochs=10, target_kl=1e-3, n_steps=64, batch_size=16, policy_kwargs=dict(net_arch=[16]), seed=0
)


class MinibatchKLSpy:
    """Wraps ``_minibatch_kl_ran_away`` to keep every (minibatch KL, threshold, verdict) it judged."""

    def __init__(self, model):
        self.calls = []
        judge = model._minibatch_kl_ran_away

        def spy(kl, stop_kl, epoch):
            verdict = judge(kl, stop_kl, epoch)
            self.calls.append((kl.item(), stop_kl, verdict))
            return verdict

        model._minibatch_kl_ran_away = spy


@pytest.mark.parametrize("algo", [KLPPO, ClipKLPPO])
def test_saturation_stop_ends_the_update_when_beta_is_at_its_bound(algo):
    """
    With beta at the upper end of its bounds, the update ends before the first minibatch step whose minibatch KL
    exceeds kl_saturation_stop_factor * target_kl; the same run without the stop takes every epoch.
    """
    for factor in (1.5, None):
        model = algo(
            "MlpPolicy",
            "CartPole-v1",
            kl_coef=1.0,
            kl_coef_bounds=(1e-4, 1.0),
            kl_stop_factor=None,
            kl_saturation_stop_factor=factor,
            **STOP_AT_BOUND,
        )
        spy = MinibatchKLSpy(model)
        model.learn(64)
        logged = model.logger.name_to_value
        if factor is None:
            assert logged["train/early_stop_at_kl_coef_bound"] == 0.0 and logged["train/early_stop_epoch"] == 10
            assert spy.calls == [] and model.kl_controller.n_updates == 1
            continue
        assert logged["train/early_stop_at_kl_coef_bound"] == 1.0 and logged["train/early_stop_epoch"] < 10
        # every judged minibatch but the last was under the threshold; the last one, over it, took no step
        assert all(stop_kl == pytest.approx(1.5e-3) for _, stop_kl, _ in spy.calls)
        assert [verdict for _, _, verdict in spy.calls] == [False] * (len(spy.calls) - 1) + [True]
        assert all(kl <= stop_kl for kl, stop_kl, _ in spy.calls[:-1]) and spy.calls[-1][0] > spy.calls[-1][1]
        assert np.isfinite(logged["train/kl_grad_ratio"])
        # the stop, not beta, set that update's KL: beta stays at its bound (the controller records the KL)
        assert model.kl_controller.n_updates == 1 and model.kl_coef == 1.0 and logged["train/kl_coef"] == 1.0


@pytest.mark.parametrize("algo", [KLPPO, ClipKLPPO])
def test_a_stopped_update_raises_beta_to_its_bound_and_never_lowers_it(algo):
    # One adaptation step below the bound (1.5**5 on the adaptive path from 1 to 10) arms the stop already: the
    # update's KL far over the band must still take beta to its bound, or it would sit below it for good
    model = algo("MlpPolicy", "CartPole-v1", kl_coef=1.5**5, kl_coef_bounds=(1e-4, 10.0), kl_stop_factor=None, **STOP_AT_BOUND)
    assert model.kl_controller.near_upper_bound and not model.kl_controller.at_upper_bound
    model.learn(64)
    logged = model.logger.name_to_value
    assert logged["train/early_stop_at_kl_coef_bound"] == 1.0 and logged["train/kl"] > 1.25 * 1e-3
    assert model.kl_coef == 10.0 and logged["train/kl_coef"] == 10.0 and model.kl_controller.n_updates == 1
    assert model.kl_controller.kl_coef_history == [10.0]
    # a stopped update whose KL reads under the band does not lower beta: the stop, not beta, made it small
    n_params = model.dist_params.n_params
    model._record_update_kl(np.full(8, 1e-6), np.zeros((8, n_params)), 1e-3, hold_kl_coef=True)
    assert model.kl_coef == 10.0 and model.kl_controller.n_updates == 2 and model.kl_controller.kl_coef_history[-1] == 10.0
    model._record_update_kl(np.full(8, 1e-6), np.zeros((8, n_params)), 1e-3)
    assert model.kl_coef == pytest.approx(10.0 / 1.5)  # an update the stop did not end lowers it as usual


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kl_coef=0.5, kl_coef_bounds=(1e-4, 10.0)),  # beta inside its bounds
        dict(kl_coef=1.0, kl_coef_bounds=(1e-4, 1.0), kl_controller="fixed"),  # a fixed beta is the user's choice
    ],
)
def test_saturation_stop_changes_nothing_while_beta_can_rise(kwargs):
    """Unless an adapting controller has beta at its upper bound, the updates are those without the stop, bit for bit."""
    params = []
    for factor in (1.5, None):
        model = KLPPO(
            "MlpPolicy", "CartPole-v1", kl_stop_factor=None, kl_saturation_stop_factor=factor, **kwargs, **STOP_AT_BOUND
        )
        model.learn(64)
        assert model.logger.name_to_value["train/early_stop_at_kl_coef_bound"] == 0.0
        params.append(th.nn.utils.parameters_to_vector(model.policy.parameters()).detach().clone())
    assert th.equal(params[0], params[1])


def test_saturation_stop_factor_is_saved(tmp_path):
    model = KLPPO("MlpPolicy", "CartPole-v1", kl_saturation_stop_factor=1.2, **SMALL)
    model.save(tmp_path / "model")
    assert KLPPO.load(tmp_path / "model").kl_saturation_stop_factor == 1.2
    assert KLPPO("MlpPolicy", "CartPole-v1", **SMALL).kl_saturation_stop_factor == 1.5


def test_hinge_adds_to_the_penalty():
    model = KLPPO("MlpPolicy", "CartPole-v1", kl_hinge_coef=1000.0, kl_hinge_factor=2.0, **SMALL)
    kl = th.tensor(0.05)
    assert model._kl_penalty(kl, 1.0, 0.02).item() == pytest.approx(0.05 + 1000 * 0.01**2)
    assert model._kl_penalty(th.tensor(0.01), 1.0, 0.02).item() == pytest.approx(0.01)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"target_kl": -0.01}, ValueError, "target_kl"),
        ({"target_kl": 0.0}, ValueError, "target_kl"),
        ({"target_kl": float("inf")}, ValueError, "target_kl"),
        ({"target_kl": LinearSchedule(0.02, -0.01, 1.0)}, ValueError, "target_kl"),
        ({"target_kl": "0.01"}, TypeError, "target_kl"),
        ({"kl_coef_bounds": (10.0, 1e-4)}, ValueError, "kl_coef_bounds"),
        ({"kl_coef_bounds": (0.0, 1.0)}, ValueError, "kl_coef_bounds"),
        ({"kl_band": (2.0, 0.5)}, ValueError, "kl_band"),
        ({"kl_adapt_factor": 1.0}, ValueError, "kl_adapt_factor"),
        ({"kl_estimator": "k2"}, ValueError, "kl_estimator"),
        ({"kl_direction": "sideways"}, ValueError, "kl_direction"),
        ({"kl_reduction": "max"}, ValueError, "kl_reduction"),
        ({"kl_controller": "pid"}, ValueError, "kl_controller"),
        ({"kl_window": 0}, ValueError, "kl_window"),
        ({"kl_coef": float("nan")}, ValueError, "kl_coef"),
        ({"min_std": -0.1}, ValueError, "min_std"),
        ({"min_std": 0.1}, ValueError, "min_std"),  # CartPole is discrete: no variance to floor
        ({"kl_stop_factor": 0.0}, ValueError, "kl_stop_factor"),
        ({"kl_saturation_stop_factor": -1.5}, ValueError, "kl_saturation_stop_factor"),
        ({"kl_hinge_coef": -1.0}, ValueError, "kl_hinge_coef"),
        ({"log_ratio_clip": 0.0}, ValueError, "log_ratio_clip"),
        ({"clip_range": -0.2}, ValueError, "clip_range"),
        ({"kl_quantiles": (0.5, 1.5)}, ValueError, "kl_quantiles"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        KLPPO("MlpPolicy", "CartPole-v1", **kwargs)


def test_ppo_checks_are_kept():
    with pytest.raises(AssertionError):
        KLPPO("MlpPolicy", "CartPole-v1", batch_size=1)
    with pytest.warns(UserWarning, match="mini-batch size"):
        KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=60)


def test_target_schedule_may_decay_to_zero_like_the_zoo_lin_syntax():
    """rl-zoo's `lin_0.02` decays to 0 at the end of training: accepted, the very last update uses a tiny floor."""
    from sb3_kl.common.validation import MIN_TARGET_KL

    model = KLPPO("MlpPolicy", "CartPole-v1", target_kl=LinearSchedule(0.02, 0.0, 1.0), **SMALL)
    model.learn(2 * SMALL["n_steps"])
    assert model._current_progress_remaining == 0.0
    assert model.logger.name_to_value["train/target_kl"] == MIN_TARGET_KL
    with pytest.raises(ValueError, match="target_kl"):
        KLPPO("MlpPolicy", "CartPole-v1", target_kl=LinearSchedule(0.02, -0.01, 1.0))


@pytest.mark.parametrize("algo", [KLPPO, KLTRPO])
def test_target_schedule_past_the_budget_is_read_at_its_end(algo):
    """
    A linear schedule written as SB3 users write one, `lambda progress: 0.02 * progress` (rl-zoo's own
    `linear_schedule` too), goes below 0 when the last rollout overshoots the budget, and SB3 trains on that rollout at
    progress_remaining < 0: the target is read at the schedule's end there (0, so the floor), instead of stopping
    `learn()` at its very end; the KL callbacks read their targets the same way, and a target that has decayed to 0
    sets no size (no spike alarm, the adaptive learning rate kept).
    """
    from sb3_kl import KLAdaptiveLRCallback, KLAlarmCallback
    from sb3_kl.common.validation import MIN_TARGET_KL

    kwargs = SMALL if algo is KLPPO else dict(n_steps=64, batch_size=32, policy_kwargs=dict(net_arch=[16]), seed=0)
    model = algo("MlpPolicy", "CartPole-v1", target_kl=lambda progress: 0.02 * progress, **kwargs)
    alarm = KLAlarmCallback()  # holds the KL to the algorithm's target
    model.learn(96, callback=[alarm])
    assert model._current_progress_remaining < 0
    assert model.logger.name_to_value["train/target_kl"] == MIN_TARGET_KL
    # one rollout for half its steps: its only update runs past the budget; the callbacks' own schedules decay to 0
    own_alarm = KLAlarmCallback(target_kl=lambda progress: 0.02 * progress)
    adaptive = KLAdaptiveLRCallback(target_kl=lambda progress: 0.02 * progress)
    model.learn(32, callback=[alarm, own_alarm, adaptive] if algo is KLPPO else [alarm, own_alarm])
    assert model.logger.name_to_value["train/target_kl"] == MIN_TARGET_KL
    assert not [a for a in alarm.alarms + own_alarm.alarms if a.kind == "kl_spike"], alarm.alarms + own_alarm.alarms
    if algo is KLPPO:
        assert adaptive.learning_rate == model.learning_rate
    # a schedule that is NaN past the budget (a square root) is read at its end too
    model.target_kl = lambda progress: 0.02 * np.sqrt(progress) + 0.001
    model._current_progress_remaining = -0.5
    assert model._current_target_kl() == pytest.approx(0.001)
    with pytest.raises(ValueError, match="target_kl"):  # inside the budget, a negative target is still refused
        model.target_kl = lambda progress: 0.02 * progress - 0.01
        model._current_progress_remaining = 0.25
        model._current_target_kl()


def test_adam_uses_the_fused_kernel_unless_the_user_chooses(tmp_path):
    """Fused Adam by default (same update as SB3's Adam), kept after load; optimizer_kwargs choices are respected."""
    model = KLPPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, device="cpu")
    group = model.policy.optimizer.param_groups[0]
    assert group["fused"] is True and group["eps"] == 1e-5
    model.learn(128)
    stock = KLPPO(
        "MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, n_epochs=2, seed=0, device="cpu",
        policy_kwargs=dict(optimizer_kwargs=dict(eps=1e-5, foreach=False)),
    )  # fmt: skip
    assert not stock.policy.optimizer.param_groups[0]["fused"]
    stock.learn(128)  # construction seeds the global RNGs: each model learns right after its own construction
    for ours, theirs in zip(model.policy.parameters(), stock.policy.parameters(), strict=True):
        th.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    model.save(tmp_path / "model")
    loaded = KLPPO.load(tmp_path / "model", env=model.get_env(), device="cpu")
    assert loaded.policy.optimizer.param_groups[0]["fused"] is True
    assert all(state["step"].dtype == th.float32 for state in loaded.policy.optimizer.state.values())
    loaded.learn(128, reset_num_timesteps=False)


@pytest.mark.parametrize(
    "env_id,kwargs",
    [("CartPole-v1", {}), ("Pendulum-v1", dict(use_sde=True, sde_sample_freq=4))],
)
def test_negligible_fixed_penalty_with_clip_is_ppo(env_id, kwargs):
    """
    With PPO's clip and a fixed, negligible KL coefficient, KLPPO is SB3's PPO: on the same seed it draws the same
    minibatches and reaches the same parameters after several updates (the KL bookkeeping changes nothing else, and
    the after-update KL pass draws nothing from numpy's generator). Adam as PPO's: single-tensor kernel, eps=1e-5.
    """
    common = dict(n_steps=128, batch_size=32, n_epochs=3, seed=3, clip_range=0.2, **kwargs)
    ppo = PPO("MlpPolicy", gym.make(env_id), **common).learn(3 * 128)
    klppo = KLPPO(
        "MlpPolicy",
        gym.make(env_id),
        kl_coef=1e-12,
        kl_controller="fixed",
        kl_coef_bounds=(1e-12, 1.0),
        policy_kwargs=dict(optimizer_kwargs=dict(foreach=False, eps=1e-5)),
        **common,
    ).learn(3 * 128)
    initial = PPO("MlpPolicy", gym.make(env_id), **common).policy.state_dict()
    for key, value in ppo.policy.state_dict().items():
        assert th.allclose(value, klppo.policy.state_dict()[key], rtol=0, atol=1e-6), key
    assert max(float((ppo.policy.state_dict()[k] - initial[k]).abs().max()) for k in initial) > 1e-3
    assert klppo.logger.name_to_value["train/kl"] > 0


@pytest.mark.parametrize("algo_name", ["KLPPO", "ClipKLPPO"])  # KLTRPO has no penalty coefficient
def test_kl_coef_keeps_its_bounds_after_construction(algo_name, tmp_path):
    """
    ``kl_coef`` set after construction (the property, ``load(path, kl_coef=...)`` and ``custom_objects``) gets the
    constructor's checks, bounds included; values within the bounds are applied.
    """
    import sb3_kl
    from sb3_kl.common.controllers import AdaptiveKLController

    algo = getattr(sb3_kl, algo_name)
    model = algo(
        "MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, kl_coef_bounds=(1e-4, 10.0), policy_kwargs=dict(net_arch=[16])
    )
    for value in (1e-9, 100.0, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kl_coef"):
            model.kl_coef = value
        assert model.kl_coef == 1.0
    model.kl_coef = 10.0
    assert model.kl_controller.kl_coef == 10.0
    model.kl_coef = 1e-4
    model.save(tmp_path / "model.zip")
    with pytest.raises(ValueError, match="kl_coef_bounds"):
        algo.load(tmp_path / "model.zip", kl_coef=100.0)
    with pytest.raises(ValueError, match="kl_coef_bounds"):
        algo.load(tmp_path / "model.zip", custom_objects={"kl_coef": 100.0})
    assert algo.load(tmp_path / "model.zip", custom_objects={"kl_coef": 0.5}).kl_coef == 0.5
    assert algo.load(tmp_path / "model.zip", kl_coef=2.0).kl_coef == 2.0
    # wider bounds: a new controller given at load time, then the coefficient within them
    wide = AdaptiveKLController(kl_coef=1.0, kl_coef_bounds=(1e-4, 1000.0))
    assert algo.load(tmp_path / "model.zip", kl_controller=wide, kl_coef=100.0).kl_coef == 100.0


@pytest.mark.parametrize("algo_name", ["KLPPO", "KLTRPO"])
def test_load_refuses_kl_options_it_cannot_apply(algo_name, tmp_path):
    """
    The KL convention and the controllers' options are folded into objects when the model is built: given to
    ``load()`` (keyword or ``custom_objects``) with a value other than the saved one they would be stored where nothing
    reads them, and the saved convention would go on being measured under a name the user thinks changed. They raise,
    naming the option. The saved value (an rl-zoo config given again with ``--trained-agent``) is accepted, and a
    controller object replaces the saved one.
    """
    import sb3_kl
    from sb3_kl.common.controllers import FixedKLController
    from sb3_kl.common.on_policy_algorithm import FIXED_AT_CONSTRUCTION

    algo = getattr(sb3_kl, algo_name)
    saved = dict(
        kl_direction="reverse", kl_estimator="analytic", kl_reduction="sum", log_ratio_clip=20.0, kl_controller="adaptive",
        kl_adapt_factor=1.5, kl_band=(0.8, 1.25), kl_coef_bounds=(1e-4, 10.0), kl_window=1, kl_horizon=10_000,
        ref_kl_direction="reverse", ref_kl_estimator="analytic", ref_kl_controller="adaptive", ref_kl_coef_bounds=(1e-4, 10.0),
    )  # fmt: skip
    # KLTRPO has no penalty coefficient, hence no controller options, and no log-ratio clamp
    parameters = inspect.signature(algo.__init__).parameters
    saved = {name: value for name, value in saved.items() if name in parameters}
    model = algo("MlpPolicy", "Pendulum-v1", n_steps=64, policy_kwargs=dict(net_arch=[16]), **saved)
    model.save(tmp_path / "model.zip")
    other = dict(
        kl_direction="forward", kl_estimator="k3", kl_reduction="mean", log_ratio_clip=5.0, kl_controller="fixed",
        kl_adapt_factor=2.0, kl_band=(0.5, 2.0), kl_coef_bounds=(1e-3, 1.0), kl_window=3, kl_horizon=500,
        ref_kl_direction="forward", ref_kl_estimator="k1", ref_kl_controller="fixed", ref_kl_coef_bounds=(1e-3, 1.0),
    )  # fmt: skip
    assert set(other) == set(FIXED_AT_CONSTRUCTION)
    # options the saved controllers do not use, as the constructor ignores them: without ref_target_kl the reference
    # coefficient is fixed whatever ref_kl_controller names, and the adaptive controller has no horizon
    unused = {"ref_kl_controller": "fixed", "kl_horizon": 500} if "kl_horizon" in saved else {"ref_kl_controller": "fixed"}
    algo.load(tmp_path / "model.zip", **unused)
    for name in set(saved) - set(unused):
        with pytest.raises(ValueError, match=re.escape(f"`{name}`={other[name]!r} cannot be applied by load")):
            algo.load(tmp_path / "model.zip", **{name: other[name]})
        with pytest.raises(ValueError, match=f"`{name}`"):
            algo.load(tmp_path / "model.zip", custom_objects={name: other[name]})
    # the saved values, as a zoo config would give them again: accepted, nothing changes
    loaded = algo.load(tmp_path / "model.zip", **saved)
    assert loaded.kl_settings == model.kl_settings and type(loaded.kl_controller) is type(model.kl_controller)
    assert not (set(saved) - {"kl_controller", "ref_kl_controller"}) & set(vars(loaded)), "no stray attributes"
    assert type(loaded.ref_kl_controller) is type(model.ref_kl_controller)
    if algo.has_kl_coef:
        loaded = algo.load(tmp_path / "model.zip", kl_controller=FixedKLController(kl_coef=0.5))
        assert isinstance(loaded.kl_controller, FixedKLController) and loaded.kl_coef == 0.5
    else:  # no penalty: a controller would be one nothing uses
        with pytest.raises(ValueError, match="`kl_controller`: KLTRPO has no KL penalty"):
            algo.load(tmp_path / "model.zip", kl_controller=FixedKLController(kl_coef=0.5))
    if algo_name == "KLTRPO":
        # kl_reduction="sb3_contrib" is resolved for the action space when the model is built
        model = algo("MlpPolicy", "Pendulum-v1", n_steps=64, policy_kwargs=dict(net_arch=[16]), kl_reduction="sb3_contrib")
        model.save(tmp_path / "sb3_contrib.zip")
        assert algo.load(tmp_path / "sb3_contrib.zip", kl_reduction="sb3_contrib").kl_settings == model.kl_settings
        with pytest.raises(ValueError, match="`kl_reduction`='sum'"):
            algo.load(tmp_path / "sb3_contrib.zip", kl_reduction="sum")


def _recording_klppo(judge: str, judged: list, snapshots: list) -> type:
    """KLPPO judging with ``judge``, recording the judged KL and a snapshot of the policy after every epoch."""

    class Recording(KLPPO):
        _kl_stop_judge = judge

        def _kl_ran_away(self, epoch_kl_sum, epoch_states, *args, **kwargs):
            stop = super()._kl_ran_away(epoch_kl_sum, epoch_states, *args, **kwargs)
            if judge == "epoch_end":
                judged.append(float(np.mean(self._epoch_end_kl[0])))
            else:
                judged.append(epoch_kl_sum.item() / epoch_states)
            snapshots.append({name: tensor.detach().clone() for name, tensor in self.policy.state_dict().items()})
            return stop

    return Recording


def _torch_kl_after_each_epoch(model, snapshots) -> list:
    """KL(rollout policy || policy left by each epoch) over the buffer, with ``torch.distributions``."""
    obs = th.as_tensor(model.rollout_buffer.observations.reshape(64, -1))
    old = th.distributions.Categorical(logits=th.as_tensor(model.rollout_buffer.old_dist_params.reshape(64, -1)))
    kls = []
    policy = model.policy  # the test is over: its parameters are replaced by each snapshot in turn
    for state_dict in snapshots:
        policy.load_state_dict(state_dict)
        with th.no_grad():
            new = th.distributions.Categorical(logits=policy.get_distribution(obs).distribution.logits)
        kls.append(th.distributions.kl_divergence(old, new).mean().item())
    return kls


EARLY_STOP_KWARGS = dict(n_steps=64, batch_size=64, n_epochs=5, policy_kwargs=dict(net_arch=[16]), seed=0)


def test_early_stop_judges_the_documented_lagging_kl():
    """
    The early stop judges the mean of the epoch's per-minibatch KLs, each taken before that minibatch's step. With one
    minibatch per epoch that is 0 after the first epoch and, after epoch k, the KL (recomputed with
    ``torch.distributions``) of the policy epoch k - 1 left: it lags by one epoch.
    """
    judged, snapshots = [], []
    model = _recording_klppo("minibatch_mean", judged, snapshots)(
        "MlpPolicy", "CartPole-v1", learning_rate=1e-3, target_kl=0.02, kl_stop_factor=2.0, **EARLY_STOP_KWARGS
    )
    assert model._kl_stop_judge == KLPPO._kl_stop_judge == ClipKLPPO._kl_stop_judge == "minibatch_mean"  # the default
    model.learn(64)
    actual = _torch_kl_after_each_epoch(model, snapshots)
    assert len(judged) == EARLY_STOP_KWARGS["n_epochs"] and actual[0] > 0
    assert abs(judged[0]) < 1e-6
    # KLs of ~1e-5 from float32 log-probabilities: rounding leaves ~1e-9 whose share depends on the CPU's kernels
    np.testing.assert_allclose(judged[1:], actual[:-1], rtol=1e-4, atol=1e-8)


def test_epoch_end_judge_measures_the_policy_the_epoch_leaves():
    """
    The alternative rule compared in ``benchmarks/studies/epoch_kl_stop.py``: the KL of the policy each epoch leaves over the
    whole buffer (recomputed with ``torch.distributions``); it stops after the first step that crosses
    ``kl_stop_factor * target_kl``, and its last pass is the logged ``train/kl``.
    """
    judged, snapshots = [], []
    model = _recording_klppo("epoch_end", judged, snapshots)(
        "MlpPolicy", "CartPole-v1", learning_rate=0.05, target_kl=1e-3, kl_stop_factor=2.0, **EARLY_STOP_KWARGS
    )
    model.learn(64)
    logs = model.logger.name_to_value
    assert logs["train/early_stop_epoch"] == len(judged) == 1 < EARLY_STOP_KWARGS["n_epochs"]
    np.testing.assert_allclose(judged, _torch_kl_after_each_epoch(model, snapshots), rtol=1e-5)
    assert judged[-1] > 2.0 * 1e-3
    assert logs["train/kl"] == pytest.approx(judged[-1], rel=1e-6)


def test_epoch_end_judge_logs_the_final_policy_after_a_stop_at_the_coefficient_bound():
    """
    With the epoch-end judge, a stop at beta's upper bound in a later epoch ends the update after the judge measured
    the policy an earlier epoch left: the logged ``train/kl`` must still be that of the policy the update leaves
    (recomputed with ``torch.distributions``), not the earlier epoch's measurement.
    """
    judged, snapshots = [], []
    model = _recording_klppo("epoch_end", judged, snapshots)(
        "MlpPolicy",
        "CartPole-v1",
        learning_rate=3e-2,
        target_kl=1.5e-3,
        kl_coef=10.0,  # at the upper bound: the stop at the bound is armed from the first update
        kl_stop_factor=1e6,  # the per-epoch rule runs (and measures) but never stops
        kl_hinge_coef=0.0,
        # two minibatches per epoch: the stop can come after a step of the epoch it ends
        **{**EARLY_STOP_KWARGS, "batch_size": 32},
    )
    model.learn(64)
    logs = model.logger.name_to_value
    assert logs["train/early_stop_at_kl_coef_bound"] == 1.0
    stop_epoch = int(logs["train/early_stop_epoch"])
    # the bound stopped the update in a later epoch than the first, after the judge measured at least one epoch
    assert 1 < stop_epoch < EARLY_STOP_KWARGS["n_epochs"] and len(judged) == stop_epoch - 1
    snapshots.append({name: tensor.detach().clone() for name, tensor in model.policy.state_dict().items()})
    final = _torch_kl_after_each_epoch(model, snapshots)[-1]
    assert final != pytest.approx(judged[-1], rel=1e-3)  # the stopped epoch moved the policy after the last judgement
    assert logs["train/kl"] == pytest.approx(final, rel=1e-5)


class RolloutDistributionSnapshot(BaseCallback):
    """
    Keeps the rollout policy's action logits on the buffer's observations (CartPole). Logits, not probabilities:
    ``Categorical(probs=...)`` clamps them to float32's eps, which under-states a large KL.
    """

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self.observations = th.as_tensor(self.model.rollout_buffer.observations.reshape(-1, 4))
        with th.no_grad():
            self.logits = self.model.policy.get_distribution(self.observations).distribution.logits.clone()


def exact_categorical_kl(old_logits: th.Tensor, new_logits: th.Tensor) -> float:
    """Mean KL(old || new) over the states, from the logits in float64 (no clamping of small probabilities)."""
    old, new = (th.distributions.Categorical(logits=logits.double()) for logits in (old_logits, new_logits))
    return th.distributions.kl_divergence(old, new).mean().item()


@pytest.mark.parametrize("learning_rate", [1e-2, 3e-2])
@pytest.mark.parametrize("kl_hinge_coef", [0.0, None])
def test_default_hinge_holds_the_update_kl_with_beta_at_its_floor(kl_hinge_coef, learning_rate):
    """
    beta at its floor (where it sinks after many low-KL updates) and a learning rate that moves the policy far in
    one update: without the hinge the update overshoots the target 20 times over or more (about 75 and 235 times at
    these rates); the default hinge keeps it under twice the target (the early stop is off, so the hinge alone is
    tested). The KL is checked against torch.distributions on snapshots of both policies' logits, in float64.
    """
    hinge = {} if kl_hinge_coef is None else dict(kl_hinge_coef=kl_hinge_coef)
    model = KLPPO(
        "MlpPolicy", "CartPole-v1", n_steps=256, batch_size=64, n_epochs=10, learning_rate=learning_rate,
        kl_controller="fixed", kl_coef=1e-4, target_kl=0.02, policy_kwargs=dict(net_arch=[32]), seed=0,
        kl_stop_factor=None, **hinge,
    )  # fmt: skip
    snapshot = RolloutDistributionSnapshot()
    model.learn(256, callback=snapshot)
    with th.no_grad():
        new_logits = model.policy.get_distribution(snapshot.observations).distribution.logits
    kl = model.logger.name_to_value["train/kl"]
    assert kl == pytest.approx(exact_categorical_kl(snapshot.logits, new_logits), rel=1e-4)
    if kl_hinge_coef is None:
        assert model.kl_hinge_coef == 1000.0 and kl < 2 * 0.02
    else:
        assert kl > 20 * 0.02


@pytest.mark.parametrize("env_name", ["cartpole", "pendulum", "multidiscrete"])
def test_logged_kl_equals_independent_kl_far_outside_the_band(env_name):
    """At a KL tens of times the target (huge learning rate, no hinge) train/kl is still the exact KL, not a clipped
    or saturated value: the numbers a user reads when training blows up are the true ones."""
    snapshots = SnapshotCallback()
    model = KLPPO("MlpPolicy", ENVS[env_name](), learning_rate=0.5, kl_hinge_coef=0.0, **SMALL)
    model.learn(SMALL["n_steps"], callback=snapshots)
    old_policy, obs = snapshots.snapshots[-1]
    reference = independent_kl(old_policy, model.policy, obs)
    logged = model.logger.name_to_value
    assert logged["train/kl"] > 20 * logged["train/target_kl"], "the update must leave the band far behind"
    assert logged["train/kl"] == pytest.approx(reference.mean(), rel=1e-4)
    assert logged["train/kl_max"] == pytest.approx(reference.max(), rel=1e-3)


@pytest.mark.parametrize("env_name", ["discrete", "box"])
def test_logged_kl_of_a_tiny_update_is_exact(env_name):
    """
    An update so small that its KL (~1e-10) is far below float32's rounding of the log-probabilities (~1e-7 of their
    size): the logged KL and its quantiles, which drive beta, are still the exact KL, because the update's KL is
    computed in float64 from the two policies' parameters (in float32 the logged mean came out negative).
    """
    snapshots = SnapshotCallback()
    model = KLPPO("MlpPolicy", ENVS[env_name](), learning_rate=1e-6, **SMALL)
    model.learn(2 * SMALL["n_steps"], callback=snapshots)
    old_policy, obs = snapshots.snapshots[-1]
    reference = independent_kl(old_policy, model.policy, obs, float64=True)
    logged = model.logger.name_to_value
    assert 0 < reference.mean() < 1e-7, "the update must be tiny"
    assert logged["train/kl"] == pytest.approx(reference.mean(), rel=1e-3)
    assert logged["train/kl_p50"] == pytest.approx(np.quantile(reference, 0.5), rel=1e-2)
    assert logged["train/kl_max"] == pytest.approx(reference.max(), rel=1e-3)


def test_gsde_kl_gradient_reaches_the_features():
    """
    gSDE builds the std from the latent features but SB3 detaches them from the distribution (learn_features=False):
    the KL in KLPPO's loss must still be differentiated through them. Checked against a copy of the policy whose
    distribution keeps them attached (learn_features=True) and torch.distributions' KL.
    """
    model = KLPPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, n_epochs=2, use_sde=True, learning_rate=1e-2, seed=0)
    model.learn(64)
    data = next(iter(model.rollout_buffer.get(32)))
    _, distribution = model._forward_samples(data)
    kl = model._per_state_kl(data.old_dist_params, distribution, None).mean()

    independent = type(model.policy)(**model.policy._get_constructor_parameters())
    independent.load_state_dict(model.policy.state_dict())
    independent.action_dist.learn_features = True
    d = model.action_space.shape[0]
    old = th.distributions.Normal(data.old_dist_params[:, :d], data.old_dist_params[:, d:].exp())
    expected = th.distributions.kl_divergence(old, independent.get_distribution(data.observations).distribution).sum(-1).mean()
    assert kl.item() == pytest.approx(expected.item(), rel=1e-5)
    assert expected.item() > 1e-4

    def gradients(value, policy):
        named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        grads = th.autograd.grad(value, [p for _, p in named], allow_unused=True)
        return {n: th.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads, strict=True)}

    got, want = gradients(kl, model.policy), gradients(expected, independent)
    for name in ("mlp_extractor.policy_net.0.weight", "log_std", "action_net.weight"):
        assert want[name].abs().max() > 1e-6, name
        assert th.allclose(got[name], want[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("squash_output", [False, True])
@pytest.mark.parametrize(
    ("estimator", "ref_estimator", "direction"),
    [
        ("k1", "k1", "forward"),
        ("k3", "k3", "forward"),
        ("k3", "k3", "reverse"),
        # one of the two KL terms analytic: the other's sample estimate still reaches the features
        ("analytic", "k3", "forward"),
        ("k3", "analytic", "forward"),
    ],
)
def test_gsde_sample_kl_estimates_reach_the_features(estimator, ref_estimator, direction, squash_output):
    """
    The sample estimates of the update KL and of the reference KL are built on the log-probabilities of the stored
    actions, which SB3's gSDE distribution computes with the features detached: in the loss they must be
    differentiated through the features as the analytic KL is. Checked against a copy of the policy whose distribution
    keeps them attached (learn_features=True), on which SB3's own log_prob carries that gradient.
    """
    kwargs = dict(n_steps=64, batch_size=32, n_epochs=2, use_sde=True, learning_rate=1e-2, seed=0, device="cpu")
    kwargs.update(kl_estimator=estimator, kl_direction=direction, policy_kwargs=dict(squash_output=squash_output))
    reference = KLPPO("MlpPolicy", "Pendulum-v1", **{**kwargs, "seed": 1})
    kwargs.update(ref_policy=reference, ref_kl_coef=0.1, ref_kl_estimator=ref_estimator, ref_kl_direction=direction)
    model = KLPPO("MlpPolicy", "Pendulum-v1", **kwargs)
    model.learn(64)
    data = next(iter(model.rollout_buffer.get(32)))
    actions = model._actions_for_log_prob(data.actions)
    _, distribution = model._forward_samples(data)
    log_prob, log_ratio = model._log_probs_for_kl(distribution, actions, distribution.log_prob(actions), data.old_log_prob)
    ref_params, ref_log_prob = model._reference_distribution(data.observations, actions)

    independent = type(model.policy)(**model.policy._get_constructor_parameters())
    independent.load_state_dict(model.policy.state_dict())
    independent.action_dist.learn_features = True
    attached = independent.get_distribution(data.observations)
    attached_log_prob = attached.log_prob(actions)
    assert th.allclose(log_prob, attached_log_prob, rtol=1e-5, atol=1e-5)

    def terms(policy_distribution, policy_log_prob, policy_log_ratio):
        kl = model._per_state_kl(data.old_dist_params, policy_distribution, policy_log_ratio).mean()
        ref_kl = model._reference_kl(ref_params, policy_distribution, policy_log_prob, ref_log_prob, data.old_log_prob)
        return kl, ref_kl.mean()

    def gradient(value, policy):
        weight = policy.mlp_extractor.policy_net[0].weight
        (grad,) = th.autograd.grad(value, [weight], retain_graph=True)
        return grad

    got = terms(distribution, log_prob, log_ratio)
    want = terms(attached, attached_log_prob, attached_log_prob - data.old_log_prob)
    for name, g, w in zip(("update KL", "reference KL"), got, want, strict=True):
        assert g.item() == pytest.approx(w.item(), rel=1e-4, abs=1e-7), name
        expected = gradient(w, independent)
        assert expected.abs().max() > 1e-6, name
        assert th.allclose(gradient(g, model.policy), expected, rtol=1e-3, atol=1e-7), name


@pytest.mark.parametrize("log_ratio_clip", [0.1, 20.0])
def test_the_clipped_surrogate_is_ppos_whatever_log_ratio_clip(log_ratio_clip):
    """
    With ratio clipping the surrogate, its clip fraction and its gradient are SB3's PPO's: log_ratio_clip clamps only
    the sample KL estimates, and the unclipped surrogate (clip_range=None), where nothing else bounds the ratio.
    """
    model = ClipKLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, log_ratio_clip=log_ratio_clip, device="cpu")
    generator = th.Generator().manual_seed(0)
    log_ratio = (th.randn(256, generator=generator) * 2.0).requires_grad_()
    advantages = th.randn(256, generator=generator)
    loss, clip_fraction = model._surrogate_loss(log_ratio, advantages, 0.2)
    ratio = th.exp(log_ratio)  # SB3's PPO
    expected = -th.min(advantages * ratio, advantages * th.clamp(ratio, 0.8, 1.2)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert clip_fraction == pytest.approx(float((th.abs(ratio - 1) > 0.2).float().mean()))
    assert clip_fraction > 0.5
    (got,) = th.autograd.grad(loss, [log_ratio], retain_graph=True)
    (want,) = th.autograd.grad(expected, [log_ratio])
    assert th.allclose(got, want, rtol=1e-6, atol=1e-9)
    # without clipping the ratio is clamped
    loss, clip_fraction = model._surrogate_loss(log_ratio, advantages, None)
    clamped = th.exp(th.clamp(log_ratio, -log_ratio_clip, log_ratio_clip))
    assert clip_fraction is None and loss.item() == pytest.approx(-(advantages * clamped).mean().item(), rel=1e-6)


@pytest.mark.parametrize("algo", ["KLPPO", "ClipKLPPO", "KLTRPO", "RecurrentKLPPO"])
def test_kl_quantiles_come_back_as_the_constructor_stores_them(algo, tmp_path):
    import sb3_kl

    cls = getattr(sb3_kl, algo)
    policy = "MlpLstmPolicy" if algo == "RecurrentKLPPO" else "MlpPolicy"
    model = cls(policy, "CartPole-v1", n_steps=64, batch_size=64, kl_quantiles=(0.25, 0.75), device="cpu")
    model.save(tmp_path / "model")
    loaded = cls.load(tmp_path / "model", device="cpu")
    assert loaded.kl_quantiles == (0.25, 0.75) and isinstance(loaded.kl_quantiles, tuple)


def test_target_kl_set_after_construction_is_used(tmp_path):
    # SB3's PPO keeps target_kl as a number that a user may set between two learn() calls
    model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.learn(64)
    model.target_kl = 0.05
    assert model.target_kl(1.0) == 0.05  # read as right after construction
    model.learn(64, reset_num_timesteps=False)
    assert model.logger.name_to_value["train/target_kl"] == 0.05
    model.save(tmp_path / "model")
    assert KLPPO.load(tmp_path / "model").target_kl(1.0) == 0.05
    with pytest.raises(ValueError, match="target_kl"):
        model.target_kl = -1.0
    model.target_kl = None  # the action space's default, as in the constructor
    assert model.target_kl(1.0) == 0.02
