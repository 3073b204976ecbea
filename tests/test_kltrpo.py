import math

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from sb3_contrib import TRPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import IdentityEnvBox, IdentityEnvMultiBinary, IdentityEnvMultiDiscrete

from sb3_kl import KLTRPO
from sb3_kl.common.controllers import FixedKLController

TINY = dict(policy_kwargs=dict(net_arch=[16]), batch_size=64, n_critic_updates=2)


def snapshot(model) -> th.nn.Module:
    """An independent copy of the model's policy, in eval mode (deepcopy fails on gSDE's exploration matrices)."""
    policy = model.policy_class(
        model.observation_space, model.action_space, model.lr_schedule, use_sde=model.use_sde, **model.policy_kwargs
    )
    policy.load_state_dict(model.policy.state_dict())
    policy.set_training_mode(False)
    return policy


def reference_kl(old_policy, new_policy, obs: np.ndarray, direction: str = "forward") -> np.ndarray:
    """Per-state joint KL between two policies from torch.distributions.kl_divergence (independent of sb3_kl)."""
    with th.no_grad():
        obs_tensor = th.as_tensor(obs)
        old = old_policy.get_distribution(obs_tensor).distribution
        new = new_policy.get_distribution(obs_tensor).distribution
        if not isinstance(old, list):
            old, new = [old], [new]
        if direction == "reverse":
            old, new = new, old
        total = 0
        for p, q in zip(old, new, strict=True):
            kl = th.distributions.kl_divergence(p, q)
            total = total + (kl.sum(dim=-1) if kl.dim() > 1 else kl)
    return total.numpy()


class UpdateKLCallback(BaseCallback):
    """
    Measures every update from outside: snapshot of the policy and the rollout's states before ``train()``
    (at ``_on_rollout_end``), comparison with the policy after it (at the next ``_on_rollout_start``, or at the end).
    """

    def __init__(self, direction: str = "forward"):
        super().__init__()
        self.direction = direction
        self.pending = None
        self.updates: list[np.ndarray] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        observations = self.model.rollout_buffer.observations
        self.pending = (snapshot(self.model), observations.reshape(-1, *observations.shape[2:]).copy())

    def _measure(self) -> None:
        if self.pending is not None:
            old_policy, obs = self.pending
            self.updates.append(reference_kl(old_policy, self.model.policy, obs, self.direction))
            self.pending = None

    def _on_rollout_start(self) -> None:
        self._measure()

    def _on_training_end(self) -> None:
        self._measure()


# Tolerance for float32 round-off between the line search's forward pass and the reference's
REL_TOL = 1e-4


@pytest.mark.parametrize(
    "env_id,kwargs",
    [
        ("CartPole-v1", dict(n_steps=256)),
        ("Pendulum-v1", dict(n_steps=256)),
        ("Pendulum-v1", dict(n_steps=256, use_sde=True, sde_sample_freq=4)),
    ],
)
def test_mean_kl_within_target_on_every_update(env_id, kwargs):
    """Measured from outside, every update's mean KL(old||new) is <= target_kl, and the steps are real."""
    target_kl = 0.01
    callback = UpdateKLCallback()
    model = KLTRPO("MlpPolicy", gym.make(env_id), target_kl=target_kl, seed=1, **kwargs, **TINY)
    model.learn(8 * kwargs["n_steps"], callback=callback)
    means = np.array([kl.mean() for kl in callback.updates])
    assert len(means) == 8
    assert np.all(means <= target_kl * (1 + REL_TOL)), means
    # The line search grows the step to the measured bound: the updates use most of the trust region
    assert np.median(means) >= 0.85 * target_kl, means
    # The logged KL is the one measured from outside (last update)
    assert model.logger.name_to_value["train/kl"] == pytest.approx(means[-1], rel=1e-3, abs=1e-8)
    assert model.logger.name_to_value["train/kl_convention"] == "forward/analytic/sum"


def test_tail_bound_holds_and_binds():
    """With tail_kl set, the 0.99 quantile of the per-state KL stays under it; without, the same run exceeds it."""
    target_kl, tail_kl = 0.05, 0.05
    results = {}
    for tail in (None, tail_kl):
        callback = UpdateKLCallback()
        model = KLTRPO("MlpPolicy", "CartPole-v1", n_steps=256, target_kl=target_kl, tail_kl=tail, seed=0, **TINY)
        model.learn(6 * 256, callback=callback)
        results[tail] = (callback.updates, model.logger.name_to_value)
    free, _ = results[None]
    bounded, logs = results[tail_kl]
    assert max(np.quantile(kl, 0.99) for kl in free) > tail_kl, "the test needs a run whose tail exceeds the bound"
    tails = np.array([np.quantile(kl, 0.99) for kl in bounded])
    assert np.all(tails <= tail_kl * (1 + REL_TOL)), tails
    assert np.all([kl.mean() <= target_kl * (1 + REL_TOL) for kl in bounded])
    assert np.median([kl.mean() for kl in bounded]) > 1e-3, "steps must still be taken"
    assert logs["train/kl_tail"] == pytest.approx(tails[-1], rel=1e-3, abs=1e-8)
    assert logs["train/tail_kl"] == tail_kl


def test_reverse_mean_convention_is_the_constrained_one():
    """kl_direction='reverse', kl_reduction='mean' constrains KL(new||old) / action_dim (sb3-contrib TRPO's KL)."""
    target_kl = 0.01
    callback = UpdateKLCallback(direction="reverse")
    env = IdentityEnvMultiDiscrete(3)
    model = KLTRPO(
        "MlpPolicy", env, n_steps=128, target_kl=target_kl, kl_direction="reverse", kl_reduction="mean", seed=0, **TINY
    )
    model.learn(4 * 128, callback=callback)
    means = np.array([kl.mean() / 2 for kl in callback.updates])  # MultiDiscrete([3, 3]): 2 action dimensions
    assert np.all(means <= target_kl * (1 + REL_TOL)), means
    assert means.max() > 0.2 * target_kl
    assert model.logger.name_to_value["train/kl_convention"] == "reverse/analytic/mean"


class TargetReachEnv(gym.Env):
    """
    A MuJoCo-free task with a ``Box(dim)`` action: the reward is ``-||a - x||^2`` for the observed point ``x``
    (drawn uniformly in [-1, 1]^dim at every step); episodes of ``ep_length`` steps.
    """

    def __init__(self, dim: int = 4, ep_length: int = 32):
        super().__init__()
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.ep_length = ep_length

    def _draw(self) -> np.ndarray:
        self.obs = self.np_random.uniform(-1.0, 1.0, self.observation_space.shape).astype(np.float32)
        return self.obs

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._draw(), {}

    def step(self, action):
        reward = -float(np.sum((np.clip(action, -1.0, 1.0) - self.obs) ** 2))
        self.t += 1
        return self._draw(), reward, False, self.t >= self.ep_length, {}


# sb3-contrib's TRPO steps Adam with its single-tensor kernel and eps=1e-5 (SB3's policy default)
TRPO_ADAM = dict(optimizer_kwargs=dict(foreach=False, eps=1e-5))


def _final_parameters(model, n_updates: int, n_steps: int) -> dict[str, th.Tensor]:
    model.learn(n_updates * n_steps)
    assert model.logger.name_to_value["train/is_line_search_success"] == 1.0
    return {key: value.detach().clone() for key, value in model.policy.state_dict().items()}


def _max_difference(params: dict[str, th.Tensor], other: dict[str, th.Tensor]) -> float:
    return max(float((value - other[key]).abs().max()) for key, value in params.items())


@pytest.mark.parametrize(
    "make_env,kwargs,n_updates,reduction",
    [
        (lambda: gym.make("CartPole-v1"), dict(n_steps=256), 3, "sum"),  # Discrete: one dimension
        (lambda: IdentityEnvMultiDiscrete(3), dict(n_steps=128), 3, "sum"),  # SB3 sums the sub-actions' KL
        (lambda: IdentityEnvMultiBinary(3), dict(n_steps=128), 3, "mean"),  # torch's per-dimension KL, .mean()
        # Pendulum amplifies float32 round-off: from the third update on the rollouts differ by more than it
        (lambda: gym.make("Pendulum-v1"), dict(n_steps=256), 2, "mean"),
        (lambda: TargetReachEnv(dim=4), dict(n_steps=256), 2, "mean"),  # Box(4): mean over the 4 dimensions
        # gSDE: the rollouts after the first update differ by the step's float32 round-off, which Pendulum amplifies
        (lambda: gym.make("Pendulum-v1"), dict(n_steps=256, use_sde=True, sde_sample_freq=4), 1, "mean"),
        (lambda: TargetReachEnv(dim=3), dict(n_steps=256, use_sde=True, sde_sample_freq=4), 1, "mean"),
    ],
)
def test_sb3_contrib_convention_reproduces_sb3_contrib_trpo(make_env, kwargs, n_updates, reduction):
    """
    On every action space sb3-contrib's TRPO supports, KLTRPO with ``kl_reduction="sb3_contrib"`` (and TRPO's
    backtracking only: ``line_search_grow_iter=0``) is TRPO: same seed, same actor step, same critic minibatches (the
    same permutations are drawn: measuring the update draws nothing from numpy's generator), so the same parameters
    up to float32 round-off, update after update. The explicit convention it resolves to (KL(new||old), summed for
    Discrete/MultiDiscrete, averaged over dimensions for Box/MultiBinary/gSDE) does the same; where the action has
    several dimensions, the other reduction does not.
    """
    common = dict(seed=3, n_critic_updates=3, batch_size=64, **kwargs)
    ours = dict(line_search_grow_iter=0, policy_kwargs=TRPO_ADAM, **common)
    trpo = _final_parameters(TRPO("MlpPolicy", make_env(), **common), n_updates, kwargs["n_steps"])
    # each model is built right before it learns: construction seeds (and then draws from) the global generators
    for convention in (dict(kl_reduction="sb3_contrib"), dict(kl_direction="reverse", kl_reduction=reduction)):
        model = KLTRPO("MlpPolicy", make_env(), **convention, **ours)
        assert model.kl_settings.convention == f"reverse/analytic/{reduction}"
        params = _final_parameters(model, n_updates, kwargs["n_steps"])
        for key, value in trpo.items():
            assert th.allclose(value, params[key], rtol=0, atol=2e-5), key
        assert model.logger.name_to_value["train/kl_convention"] == f"reverse/analytic/{reduction}"
    initial = TRPO("MlpPolicy", make_env(), **common).policy.state_dict()
    assert _max_difference(trpo, initial) > 1e-3, "no real step taken"
    if model.dist_params.n_dims > 1:
        other = "sum" if reduction == "mean" else "mean"
        wrong = KLTRPO("MlpPolicy", make_env(), kl_direction="reverse", kl_reduction=other, **ours)
        assert _max_difference(_final_parameters(wrong, n_updates, kwargs["n_steps"]), trpo) > 1e-3


@pytest.mark.parametrize(
    "make_env,n_steps,reduction,n_dims",
    [
        (lambda: TargetReachEnv(dim=4), 256, "sum", 4),  # TRPO averages over the 4 dimensions; summed here
        (lambda: IdentityEnvMultiBinary(3), 128, "sum", 3),
        (lambda: IdentityEnvMultiDiscrete(3), 128, "mean", 2),  # two sub-actions: TRPO sums them, averaged here
    ],
)
def test_kl_reduction_rescales_the_bound_not_the_search_direction(make_env, n_steps, reduction, n_dims):
    """
    With the other reduction than sb3-contrib's TRPO, KLTRPO's KL and its Hessian are ``n_dims`` times TRPO's (or
    ``1 / n_dims``), and ``cg_damping`` is scaled with them: at the correspondingly scaled ``target_kl`` (and TRPO's
    backtracking) it takes TRPO's very updates, with a damping large enough to bend the direction if it were not
    scaled. Unscaled, the same damping gives other parameters.
    """
    delta, damping = 0.01, 0.5
    common = dict(seed=3, n_critic_updates=3, batch_size=64, n_steps=n_steps, cg_damping=damping)
    trpo = _final_parameters(TRPO("MlpPolicy", make_env(), target_kl=delta, **common), 2, n_steps)
    factor = n_dims if reduction == "sum" else 1.0 / n_dims
    model = KLTRPO(
        "MlpPolicy", make_env(), kl_direction="reverse", kl_reduction=reduction, target_kl=delta * factor,
        line_search_grow_iter=0, policy_kwargs=TRPO_ADAM, **common,
    )  # fmt: skip
    assert model.cg_damping_scale() == pytest.approx(factor)
    params = _final_parameters(model, 2, n_steps)
    for key, value in trpo.items():
        assert th.allclose(value, params[key], rtol=0, atol=2e-5), key
    unscaled = KLTRPO(
        "MlpPolicy", make_env(), kl_direction="reverse", kl_reduction=reduction, target_kl=delta * factor,
        line_search_grow_iter=0, policy_kwargs=TRPO_ADAM, **common,
    )  # fmt: skip
    unscaled.cg_damping_scale = lambda: 1.0  # type: ignore[method-assign]
    assert _max_difference(_final_parameters(unscaled, 2, n_steps), trpo) > 1e-3
    # the sb3-contrib convention itself is never rescaled
    assert KLTRPO("MlpPolicy", make_env(), kl_reduction="sb3_contrib", n_steps=n_steps).cg_damping_scale() == 1.0


def test_sb3_contrib_convention_survives_save_load(tmp_path):
    model = KLTRPO("MlpPolicy", IdentityEnvMultiBinary(3), kl_reduction="sb3_contrib", n_steps=64, **TINY)
    assert model.kl_settings.convention == "reverse/analytic/mean"
    model.save(tmp_path / "model.zip")
    loaded = KLTRPO.load(tmp_path / "model.zip", env=IdentityEnvMultiBinary(3))
    assert loaded.kl_settings.convention == "reverse/analytic/mean" and loaded.sb3_contrib_kl


def test_sb3_contrib_convention_rejects_forward_direction():
    with pytest.raises(ValueError, match="kl_direction"):
        KLTRPO("MlpPolicy", "CartPole-v1", n_steps=64, kl_reduction="sb3_contrib", kl_direction="forward")


def test_measuring_the_update_draws_no_random_numbers():
    """The after-update KL pass reads the buffer in order: numpy's global generator is left where it was."""
    model = KLTRPO("MlpPolicy", "CartPole-v1", n_steps=64, seed=0, **TINY)
    model.learn(64)
    state = np.random.get_state()
    model._measure_update_kl()
    assert np.array_equal(np.random.get_state()[1], state[1]) and np.random.get_state()[2] == state[2]


def test_failed_line_search_leaves_policy_unchanged():
    """An unreachable tail bound rejects every step: the actor is exactly restored; the critic still learns."""
    model = KLTRPO("MlpPolicy", "Pendulum-v1", n_steps=128, tail_kl=1e-12, seed=0, **TINY)
    actor_before = [p.detach().clone() for n, p in model.policy.named_parameters() if "value" not in n]
    critic_before = [p.detach().clone() for n, p in model.policy.named_parameters() if "value" in n]
    model.learn(128)
    actor_after = [p.detach() for n, p in model.policy.named_parameters() if "value" not in n]
    critic_after = [p.detach() for n, p in model.policy.named_parameters() if "value" in n]
    assert all(th.equal(a, b) for a, b in zip(actor_before, actor_after, strict=True))
    assert not all(th.equal(a, b) for a, b in zip(critic_before, critic_after, strict=True))
    logs = model.logger.name_to_value
    assert logs["train/line_search_success"] == 0.0
    assert logs["train/is_line_search_success"] == 0.0
    assert logs["train/line_search_steps"] == model.line_search_max_iter
    assert logs["train/step_size"] == 0.0
    assert logs["train/kl"] == 0.0


def test_logged_keys_and_no_penalty_coefficient():
    model = KLTRPO("MlpPolicy", IdentityEnvMultiBinary(3), n_steps=64, seed=0, **TINY)
    model.learn(128)
    logs = model.logger.name_to_value
    for key in (
        "train/policy_objective",
        "train/value_loss",
        "train/kl_divergence_loss",
        "train/explained_variance",
        "train/is_line_search_success",
        "train/n_updates",
        "train/line_search_success",
        "train/line_search_steps",
        "train/step_size",
        "train/kl",
        "train/kl_p99",
        "train/kl_max",
        "train/target_kl",
    ):
        assert key in logs, key
    assert "train/kl_coef" not in logs, "KLTRPO has no KL penalty coefficient"
    assert "train/kl_tail" not in logs
    assert logs["train/line_search_success"] == 1.0 and logs["train/step_size"] > 0
    assert 1 <= logs["train/line_search_steps"] <= model.line_search_max_iter


class StdCallback(BaseCallback):
    """Records the Gaussian's std after every update."""

    def __init__(self):
        super().__init__()
        self.stds: list[float] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        if self.model.num_timesteps > 0:
            self.stds.append(th.exp(self.model.policy.log_std).min().item())

    def _on_training_end(self) -> None:
        self._on_rollout_start()


@pytest.mark.parametrize("log_std_init,min_std", [(0.0, 0.9), (math.log(0.5), 0.8)])
def test_variance_floor_after_accepted_step(log_std_init, min_std):
    """
    On an env that rewards precision the std shrinks; with min_std it stops at the floor, and the KL constraint
    holds for the floored policy. A std that starts under the floor is never lowered and steps are still taken.
    """
    kwargs = dict(n_steps=128, target_kl=0.1, seed=0, batch_size=64, n_critic_updates=2)
    policy_kwargs = dict(net_arch=[16], log_std_init=log_std_init)
    free = StdCallback()
    KLTRPO("MlpPolicy", IdentityEnvBox(eps=0.5), policy_kwargs=policy_kwargs, **kwargs).learn(8 * 128, callback=free)
    std_cb, kl_cb = StdCallback(), UpdateKLCallback()
    model = KLTRPO("MlpPolicy", IdentityEnvBox(eps=0.5), min_std=min_std, policy_kwargs=policy_kwargs, **kwargs)
    model.learn(8 * 128, callback=CallbackList([std_cb, kl_cb]))
    initial_std = math.exp(log_std_init)
    assert min(free.stds) < min(min_std, initial_std), "the test needs a run whose std falls under the floor"
    assert all(std >= min(min_std, initial_std) * (1 - 1e-6) for std in std_cb.stds), std_cb.stds
    assert all(kl.mean() <= 0.1 * (1 + REL_TOL) for kl in kl_cb.updates)
    assert np.median([kl.mean() for kl in kl_cb.updates]) > 0.01


def test_same_signature_as_sb3_contrib_trpo():
    """A TRPO user can swap the class name: every TRPO argument is accepted, and the defaults agree."""
    import inspect

    trpo = inspect.signature(TRPO.__init__).parameters
    ours = inspect.signature(KLTRPO.__init__).parameters
    for name, parameter in trpo.items():
        assert name in ours, name
        assert ours[name].default == parameter.default, name


def test_save_load_round_trip(tmp_path):
    model = KLTRPO("MlpPolicy", "Pendulum-v1", n_steps=128, target_kl=0.02, tail_kl=0.2, tail_quantile=0.9, seed=0, **TINY)
    model.learn(256)
    obs = np.stack([model.observation_space.sample() for _ in range(8)])
    actions, _ = model.predict(obs, deterministic=True)
    model.save(tmp_path / "kltrpo.zip")
    loaded = KLTRPO.load(tmp_path / "kltrpo.zip", env=gym.make("Pendulum-v1"))
    np.testing.assert_allclose(loaded.predict(obs, deterministic=True)[0], actions)
    assert loaded.tail_kl == 0.2 and loaded.tail_quantile == 0.9
    assert loaded.target_kl(1.0) == 0.02
    assert loaded.kl_settings.convention == "forward/analytic/sum"
    assert loaded.cg_max_steps == model.cg_max_steps and loaded.n_critic_updates == 2
    callback = UpdateKLCallback()
    loaded.learn(256, reset_num_timesteps=False, callback=callback)
    assert all(np.quantile(kl, 0.9) <= 0.2 * (1 + REL_TOL) for kl in callback.updates)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_kl=0.0), "target_kl"),
        (dict(target_kl=-0.01), "target_kl"),
        (dict(target_kl=float("nan")), "target_kl"),
        (dict(target_kl=None), "target_kl"),
        (dict(tail_kl=0.0), "tail_kl"),
        (dict(tail_kl=-1.0), "tail_kl"),
        (dict(tail_kl=float("inf")), "tail_kl"),
        (dict(tail_quantile=0.0), "tail_quantile"),
        (dict(tail_quantile=1.0), "tail_quantile"),
        (dict(tail_quantile=1.5), "tail_quantile"),
        (dict(cg_max_steps=0), "cg_max_steps"),
        (dict(cg_max_steps=2.5), "cg_max_steps"),
        (dict(cg_damping=-0.1), "cg_damping"),
        (dict(line_search_shrinking_factor=0.0), "line_search_shrinking_factor"),
        (dict(line_search_shrinking_factor=1.0), "line_search_shrinking_factor"),
        (dict(line_search_shrinking_factor=1.5), "line_search_shrinking_factor"),
        (dict(line_search_max_iter=0), "line_search_max_iter"),
        (dict(n_critic_updates=-1), "n_critic_updates"),
        (dict(sub_sampling_factor=0), "sub_sampling_factor"),
        (dict(batch_size=0), "batch_size"),
        (dict(kl_estimator="k3"), "kl_estimator"),
        (dict(kl_estimator="k1"), "kl_estimator"),
        (dict(kl_direction="sideways"), "kl_direction"),
        (dict(kl_reduction="max"), "kl_reduction"),
        (dict(min_std=-1.0), "min_std"),
        (dict(kl_quantiles=(0.5, 1.0)), "kl_quantiles"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    # ValueError for a value out of range, TypeError for a value of the wrong type; the message names the argument
    with pytest.raises((ValueError, TypeError), match=match):
        KLTRPO("MlpPolicy", "Pendulum-v1", n_steps=64, **kwargs)


def test_min_std_needs_box_actions():
    with pytest.raises(ValueError, match="min_std"):
        KLTRPO("MlpPolicy", "CartPole-v1", n_steps=64, min_std=0.1)


class LoggedValues(BaseCallback):
    """Records the named ``train/...`` values of every update (read at the next rollout's start, or at the end)."""

    def __init__(self, *keys: str):
        super().__init__()
        self.keys = keys
        self.updates: list[dict[str, float]] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        if self.model._n_updates > len(self.updates):
            self.updates.append({key: self.model.logger.name_to_value[key] for key in self.keys})

    def _on_training_end(self) -> None:
        self._on_rollout_start()


def budget_used(kl: np.ndarray, target_kl: float, tail_kl: float | None, tail_quantile: float = 0.99) -> float:
    """Fraction of the trust region an update used, measured from outside: the tighter of mean/target and tail/bound."""
    used = kl.mean() / target_kl
    return max(used, np.quantile(kl, tail_quantile) / tail_kl) if tail_kl is not None else used


@pytest.mark.parametrize("tail_kl", [None, 0.025])
def test_line_search_uses_the_trust_region_the_quadratic_model_leaves(tail_kl):
    """
    A large ``cg_damping`` makes the quadratic model overestimate the KL (it uses ``d^T (F + damping) d``), so the
    model's step uses a fraction of the trust region: with ``line_search_grow_iter=0`` (TRPO's backtracking) under half
    of it. The growing line search takes a step past the model's and uses >= 85% of the budget on every update,
    and, measured from outside, never goes over ``target_kl`` nor ``tail_kl``.
    """
    target_kl = 0.01
    kwargs = dict(n_steps=256, target_kl=target_kl, tail_kl=tail_kl, cg_damping=2.0, seed=0, **TINY)
    used, ratios = {}, {}
    for grow_iter in (0, 5):
        kl_cb, logs = UpdateKLCallback(), LoggedValues("train/step_size_ratio", "train/line_search_steps")
        model = KLTRPO("MlpPolicy", "CartPole-v1", line_search_grow_iter=grow_iter, **kwargs)
        model.learn(6 * 256, callback=CallbackList([kl_cb, logs]))
        assert len(kl_cb.updates) == 6
        for kl in kl_cb.updates:
            assert kl.mean() <= target_kl * (1 + REL_TOL), kl.mean()
            if tail_kl is not None:
                assert np.quantile(kl, 0.99) <= tail_kl * (1 + REL_TOL), np.quantile(kl, 0.99)
        used[grow_iter] = np.array([budget_used(kl, target_kl, tail_kl) for kl in kl_cb.updates])
        ratios[grow_iter] = np.array([entry["train/step_size_ratio"] for entry in logs.updates])
        assert all(entry["train/line_search_steps"] <= model.line_search_max_iter + grow_iter for entry in logs.updates)
    assert np.all(used[0] < 0.5), used[0]
    assert np.all(ratios[0] == 1.0), "the quadratic model's step is accepted as it is"
    assert np.all(used[5] >= 0.85), used[5]
    assert np.all(ratios[5] > 1.0), ratios[5]


@pytest.mark.parametrize(
    "make_env,n_steps",
    [(lambda: gym.make("Pendulum-v1"), 512), (lambda: TargetReachEnv(dim=4), 512)],
)
def test_sub_sampled_step_holds_on_the_whole_buffer(make_env, n_steps):
    """
    With ``sub_sampling_factor=8`` the gradient and the Fisher products use one state in 8, but the constraints are
    checked on every state: measured from outside on the whole buffer, no update goes over ``target_kl`` nor
    ``tail_kl``, while the steps use most of the budget (so a check on the subset alone would not hold).
    """
    target_kl, tail_kl = 0.01, 0.03
    callback = UpdateKLCallback()
    model = KLTRPO(
        "MlpPolicy", make_env(), n_steps=n_steps, sub_sampling_factor=8, target_kl=target_kl, tail_kl=tail_kl, seed=0, **TINY
    )
    model.learn(8 * n_steps, callback=callback)
    assert len(callback.updates) == 8
    means = np.array([kl.mean() for kl in callback.updates])
    tails = np.array([np.quantile(kl, 0.99) for kl in callback.updates])
    assert np.all(means <= target_kl * (1 + REL_TOL)), means
    assert np.all(tails <= tail_kl * (1 + REL_TOL)), tails
    assert np.median([budget_used(kl, target_kl, tail_kl) for kl in callback.updates]) > 0.8
    assert model.logger.name_to_value["train/kl_divergence_loss"] == pytest.approx(means[-1], rel=1e-3)


def test_line_search_takes_a_negative_rounded_kl_as_zero():
    """
    Near ``target_kl``'s 1e-8 floor (the last update of a schedule that decays to 0) a small step's float32 mean KL
    can come out below 0. The search counts it as 0 budget used: it goes on to the growth candidates (here one over
    the bound, so the secant between the two) instead of taking the square root of a negative number.
    """
    target_kl = 1e-8
    model = KLTRPO("MlpPolicy", TargetReachEnv(dim=2), n_steps=64, target_kl=target_kl, seed=0, **TINY)
    measured = {1.0: -5.9e-10, 4.0: 8.6 * target_kl}  # the model's step, then its 4x growth over the bound

    def evaluate(step_size: float) -> tuple[float, float, None]:
        kl = measured.get(step_size, 0.5 * target_kl * step_size**2 / 4.0)
        return 1.0, kl, None

    step_size, objective, mean_kl, n_tried = model._search_step_size(evaluate, 1.0, 0.0, target_kl)
    assert n_tried >= 3, "the growth went on past the rejected candidate"
    assert 1.0 < step_size < 4.0
    assert mean_kl <= target_kl and objective == 1.0


def test_line_search_does_not_grow_past_the_surrogates_maximum():
    """
    Growing the accepted step toward the KL bound takes a larger step only if its objective is at least the accepted
    one's: where the surrogate peaks inside the trust region, a larger step would move the policy further for a worse
    objective. Here the objective peaks at 1.5 x the model's step and the KL bound lies at 2.5 x: the search ends
    near the peak (it narrows the interval above the accepted step), with the best objective of the feasible
    candidates it tried, not at the bound.
    """
    target_kl = 0.01
    model = KLTRPO("MlpPolicy", TargetReachEnv(dim=2), n_steps=64, target_kl=target_kl, seed=0, **TINY)
    tried = []

    def evaluate(step_size: float) -> tuple[float, float, None]:
        objective, kl = 1.0 - (step_size - 1.5) ** 2, target_kl * (step_size / 2.5) ** 2
        tried.append((step_size, objective, kl))
        return objective, kl, None

    step_size, objective, mean_kl, _ = model._search_step_size(evaluate, 1.0, 0.0, target_kl)
    feasible = [candidate for candidate in tried if candidate[2] <= target_kl]
    assert any(candidate[0] > step_size for candidate in feasible), "a larger feasible step was tried and refused"
    assert objective == max(candidate[1] for candidate in feasible)
    assert objective > 0.9 and step_size < 2.0, (step_size, objective)  # near the peak, well inside the bound
    assert mean_kl < 0.65 * target_kl
    # the same search on an objective that keeps improving grows to the bound
    step_size, _, mean_kl, _ = model._search_step_size(lambda s: (s, target_kl * (s / 2.5) ** 2, None), 1.0, 0.0, target_kl)
    assert 0.95 * target_kl <= mean_kl <= target_kl


def test_target_kl_decaying_to_zero_trains_to_the_end():
    """rl-zoo's ``lin_0.01`` for ``target_kl``: the last update runs at the 1e-8 floor (docs/zoo.md)."""
    env = make_vec_env(lambda: TargetReachEnv(dim=2, ep_length=50), n_envs=2, seed=0)
    model = KLTRPO("MlpPolicy", env, n_steps=64, target_kl=lambda progress: 0.01 * progress, seed=0, **TINY)
    model.learn(1280)
    assert model._n_updates == 10
    assert model.logger.name_to_value["train/target_kl"] == pytest.approx(1e-8)


class Float64UpdateKL(UpdateKLCallback):
    """The update's exact KL(old||new) of a Gaussian policy, in float64 on the float32 parameters."""

    def _measure(self) -> None:
        if self.pending is not None:
            old_policy, obs = self.pending
            with th.no_grad():
                obs_tensor = th.as_tensor(obs)
                old, new = (policy.get_distribution(obs_tensor).distribution for policy in (old_policy, self.model.policy))
                old = th.distributions.Normal(old.loc.double(), old.scale.double())
                new = th.distributions.Normal(new.loc.double(), new.scale.double())
                self.updates.append(th.distributions.kl_divergence(old, new).sum(dim=-1).numpy())
            self.pending = None


@pytest.mark.parametrize("target_kl", [1e-7, 1e-8])
def test_the_bound_holds_at_targets_near_zero(target_kl):
    """
    A schedule's last update runs at the 1e-8 floor: there a float32 KL loses its digits to cancellation and the
    line search accepted steps of 2-4 x the target (found by an independent review). Measured in float64.
    """
    env = make_vec_env(lambda: TargetReachEnv(dim=3, ep_length=50), n_envs=2, seed=0)
    kwargs = dict(n_steps=256, n_critic_updates=1, seed=0, policy_kwargs=dict(net_arch=[64, 64]))
    model = KLTRPO("MlpPolicy", env, target_kl=target_kl, **kwargs)
    callback = Float64UpdateKL()
    model.learn(3 * 512, callback=callback)
    means = np.array([kl.mean() for kl in callback.updates])
    assert len(means) == 3 and np.all(means > 0.5 * target_kl), means
    assert np.all(means <= target_kl * (1 + 1e-6)), means / target_kl
    assert model.logger.name_to_value["train/kl"] == pytest.approx(means[-1], rel=1e-6)


def test_has_no_kl_coef_to_read_or_set():
    # a hard constraint has no penalty: the unused controller's beta is not a number KLTRPO offers
    model = KLTRPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=64, seed=0)
    assert not model.has_kl_coef and not hasattr(model, "kl_coef")
    for access in (lambda: model.kl_coef, lambda: setattr(model, "kl_coef", 0.5)):
        with pytest.raises(AttributeError, match=r"KLTRPO has no KL penalty, so no `kl_coef`.*set `target_kl`"):
            access()


@pytest.mark.parametrize(
    "option",
    [
        dict(kl_coef=0.5),
        dict(custom_objects={"kl_coef": 0.5}),
        dict(kl_controller=FixedKLController(kl_coef=0.5)),
        dict(kl_coef_bounds=(1e-3, 5.0)),
        dict(kl_adapt_factor=3.0),
    ],
)
def test_load_refuses_the_options_of_a_kl_penalty(tmp_path, option):
    model = KLTRPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=64, seed=0)
    model.save(tmp_path / "model.zip")
    name = next(iter(option.get("custom_objects", option)))
    with pytest.raises(ValueError, match=rf"KLTRPO.load\(\) got `{name}`: KLTRPO has no KL penalty.*Drop it"):
        KLTRPO.load(tmp_path / "model.zip", **option)
    assert KLTRPO.load(tmp_path / "model.zip", target_kl=0.02).target_kl(1.0) == 0.02
