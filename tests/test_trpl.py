import math

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.envs import IdentityEnvMultiBinary, IdentityEnvMultiDiscrete, SimpleMultiObsEnv

from sb3_kl import TRPL, KLAdaptiveLRCallback, KLAlarmCallback, KLMonitorCallback, VarianceFloorCallback
from sb3_kl.callbacks import model_target_kl

TINY = dict(policy_kwargs=dict(net_arch=[16]), batch_size=32, n_epochs=2)

#: Every key TRPL logs after an update, beside SB3's own
LOGGED_KEYS = (
    "train/kl",
    "train/kl_max",
    "train/target_kl",
    "train/policy_gradient_loss",
    "train/value_loss",
    "train/entropy_loss",
    "train/trust_region_loss",
    "train/explained_variance",
    "train/projected_fraction",
    "train/projected_max",
    "train/distance_max_before_enforcement",
    "train/distance_max",
    "train/enforcement_steps",
    "train/enforcement_rejected_tries",
    "train/enforcement_step_fraction",
    "train/update_kept_fraction",
    "train/bound_met",
)


class TrainLogs(BaseCallback):
    """Keeps the logged ``train/`` values of every update (read before the next dump clears them)."""

    def __init__(self):
        super().__init__()
        self.updates: list[dict[str, float]] = []

    def _on_step(self) -> bool:
        return True

    def _keep(self) -> None:
        values = self.model.logger.name_to_value
        if "train/distance_max" in values:
            self.updates.append({k: v for k, v in values.items() if k.startswith("train/")})

    def _on_rollout_start(self) -> None:
        self._keep()

    def _on_training_end(self) -> None:
        self._keep()


def snapshot(model) -> th.nn.Module:
    """An independent copy of the acting policy, in eval mode."""
    policy = model.policy_class(
        model.observation_space, model.action_space, model.lr_schedule, use_sde=model.use_sde, **model.policy_kwargs
    )
    policy.load_state_dict(model.policy.state_dict())
    policy.set_training_mode(False)
    return policy


def as_float64(distribution: th.distributions.Distribution) -> th.distributions.Distribution:
    """The same torch distribution with float64 parameters."""
    if isinstance(distribution, th.distributions.Normal):
        return th.distributions.Normal(distribution.loc.double(), distribution.scale.double())
    return type(distribution)(logits=distribution.logits.double())


def reverse_kl(old_policy, new_policy, obs: np.ndarray) -> np.ndarray:
    """Per-state joint KL(new || old) from torch.distributions.kl_divergence, in float64 (independent of sb3_kl)."""
    with th.no_grad():
        obs_tensor = th.as_tensor(obs)
        old = old_policy.get_distribution(obs_tensor).distribution
        new = new_policy.get_distribution(obs_tensor).distribution
        if not isinstance(old, list):
            old, new = [old], [new]
        total = 0
        for p, q in zip(map(as_float64, new), map(as_float64, old), strict=True):
            kl = th.distributions.kl_divergence(p, q)
            total = total + (kl.sum(dim=-1) if kl.dim() > 1 else kl)
    return total.numpy()


def gaussian_kl_parts(old_policy, new_policy, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """
    Per state, the mean part ``0.5 sum((mu_old - mu_new)^2 / sigma_old^2)`` of KL(new || old) between two Gaussian
    policies and its covariance part (the rest of the KL, from torch.distributions), in float64 (independent of sb3_kl).
    """
    with th.no_grad():
        obs_tensor = th.as_tensor(obs)
        old = as_float64(old_policy.get_distribution(obs_tensor).distribution)
        new = as_float64(new_policy.get_distribution(obs_tensor).distribution)
        mean_part = 0.5 * (((old.loc - new.loc) / old.scale) ** 2).sum(dim=-1)
        kl = th.distributions.kl_divergence(new, old).sum(dim=-1)
    return mean_part.numpy(), (kl - mean_part).numpy()


class UpdateProbe(TrainLogs):
    """
    The acting policy and the rollout's states are snapshot before each ``train()`` (at the end of the rollout) and
    the per-state KL(new || old) is measured after it from outside (and, for a Gaussian policy, its mean and covariance
    parts), plus the update's logged values.
    """

    def __init__(self):
        super().__init__()
        self.pending = None
        self.kls: list[np.ndarray] = []
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []

    def _on_rollout_end(self) -> None:
        obs = self.model.rollout_buffer.observations
        self.pending = (snapshot(self.model), obs.reshape(-1, *obs.shape[2:]).copy())

    def _measure(self) -> None:
        if self.pending is not None:
            old_policy, obs = self.pending
            new_policy = snapshot(self.model)
            self.kls.append(reverse_kl(old_policy, new_policy, obs))
            if isinstance(self.model.action_space, gym.spaces.Box):
                self.parts.append(gaussian_kl_parts(old_policy, new_policy, obs))
            self.pending = None

    def _on_rollout_start(self) -> None:
        self._measure()
        super()._on_rollout_start()

    def _on_training_end(self) -> None:
        self._measure()
        super()._on_training_end()


@pytest.mark.parametrize(
    "make_env, kwargs",
    [
        ("CartPole-v1", {}),
        ("Pendulum-v1", {}),
        ("Pendulum-v1", dict(use_sde=True)),
        (lambda: IdentityEnvMultiDiscrete(3), {}),
        (lambda: IdentityEnvMultiBinary(3), {}),
    ],
)
def test_runs_and_logs(make_env, kwargs):
    env = make_env if isinstance(make_env, str) else make_env()
    logs = TrainLogs()
    model = TRPL("MlpPolicy", env, n_steps=64, seed=0, **TINY, **kwargs)
    model.learn(2 * 64, callback=logs)
    assert len(logs.updates) == 2
    for values in logs.updates:
        for key in LOGGED_KEYS:
            assert math.isfinite(values[key]), key
        assert values["train/bound_met"] == 1.0
        assert values["train/target_kl"] == pytest.approx(model.joint_bound)
        assert values["train/kl_convention"] == "reverse/analytic/sum"
    is_box = isinstance(model.action_space, gym.spaces.Box)
    assert ("train/std" in logs.updates[0]) == is_box
    for key in ("train/mean_part_max_ratio", "train/cov_part_max_ratio"):
        assert all((key in values) == is_box for values in logs.updates), key


def test_dict_observations():
    logs = TrainLogs()
    model = TRPL("MultiInputPolicy", SimpleMultiObsEnv(random_start=False), n_steps=32, seed=0, **TINY)
    model.learn(2 * 32, callback=logs)
    assert len(logs.updates) == 2 and all(v["train/bound_met"] == 1.0 for v in logs.updates)


@pytest.mark.parametrize(
    "env_id, kwargs",
    [
        ("CartPole-v1", dict(learning_rate=3e-3)),
        (lambda: IdentityEnvMultiDiscrete(3), dict(learning_rate=1e-2)),
        (lambda: IdentityEnvMultiBinary(3), dict(learning_rate=1e-2)),
        ("Pendulum-v1", dict(learning_rate=3e-3, mean_bound=0.01, cov_bound=0.0005)),
        ("Pendulum-v1", dict(learning_rate=1e-2, use_sde=True, mean_bound=0.01, cov_bound=0.0005)),
    ],
)
def test_bound_holds_in_every_state_measured_from_outside(env_id, kwargs):
    """
    A large learning rate pushes the network out of the trust region during the epochs; after each update the
    acting policy's largest per-state KL(new || old) over the rollout's states, measured independently in float64,
    is within 1.05 x (mean_bound + cov_bound), for a Gaussian each part within 1.05 x its own bound, and every
    minibatch's projected distribution was inside its bounds.
    """
    probe = UpdateProbe()
    env = env_id if isinstance(env_id, str) else env_id()
    model = TRPL(
        "MlpPolicy", env, n_steps=256, batch_size=64, n_epochs=4, seed=1, policy_kwargs=dict(net_arch=[32]), **kwargs
    )
    model.learn(6 * 256, callback=probe)
    assert len(probe.kls) == len(probe.updates) == 6
    bound = model.joint_bound
    for kl, values in zip(probe.kls, probe.updates, strict=True):
        assert kl.max() <= 1.05 * bound
        assert kl.max() == pytest.approx(values["train/kl_max"], rel=1e-4, abs=1e-9)
        assert values["train/projected_max"] <= bound * (1 + 1e-4)
        if isinstance(model.action_space, gym.spaces.Box):
            assert values["train/projected_mean_part_max"] <= model.mean_bound * (1 + 1e-4)
            assert values["train/projected_cov_part_max"] <= model.cov_bound * (1 + 1e-4)
    for mean_part, cov_part in probe.parts:
        assert mean_part.max() <= 1.05 * model.mean_bound and cov_part.max() <= 1.05 * model.cov_bound
    # the bound binds: the projection moved states, and the network left the trust region at least once
    assert max(v["train/projected_fraction"] for v in probe.updates) > 0
    assert max(v["train/distance_max_before_enforcement"] for v in probe.updates) > bound


@pytest.mark.parametrize("use_sde", [False, True])
@pytest.mark.parametrize("learning_rate", [3e-3, 3e-2])
def test_each_part_holds_its_own_bound_in_every_state(use_sde, learning_rate):
    """
    The mean part and the covariance part of KL(new || old) are each held by their own bound, not only their sum by
    the joint bound: after every update, measured from outside in float64 on the rollout's states, the acting
    policy's largest per-state mean part is within 1.05 x mean_bound and its largest covariance part within
    1.05 x cov_bound (with gSDE the std, and so the covariance part, differs per state). The logged ratios are these
    and ``train/bound_met`` says they hold.
    """
    probe = UpdateProbe()
    model = TRPL(
        "MlpPolicy",
        "Pendulum-v1",
        learning_rate=learning_rate,
        use_sde=use_sde,
        n_steps=256,
        batch_size=64,
        n_epochs=4,
        seed=4,
        policy_kwargs=dict(net_arch=[32]),
    )
    before = []  # the largest ratio of each part to its bound after the epochs, before the enforcement
    enforce = model._enforce_bound

    def recording(*args):
        before.append(model._acting_ratios()[0].max(dim=0).values.tolist())
        return enforce(*args)

    model._enforce_bound = recording
    model.learn(6 * 256, callback=probe)
    assert len(probe.parts) == len(probe.updates) == 6
    for (mean_part, cov_part), values in zip(probe.parts, probe.updates, strict=True):
        assert mean_part.max() <= 1.05 * model.mean_bound
        assert cov_part.max() <= 1.05 * model.cov_bound
        assert values["train/mean_part_max_ratio"] == pytest.approx(mean_part.max() / model.mean_bound, rel=1e-3, abs=1e-6)
        assert values["train/cov_part_max_ratio"] == pytest.approx(cov_part.max() / model.cov_bound, rel=1e-3, abs=1e-6)
        assert values["train/bound_met"] == 1.0
    # not vacuous: after the epochs of some update a part was above its bound, for gSDE the covariance part
    assert max(max(ratios) for ratios in before) > 1.05
    if use_sde:
        assert max(cov for _, cov in before) > 1.05


def test_move_back_toward_the_rollout_policy_when_regression_is_not_allowed():
    """With no regression steps the enforcement falls back to shrinking the actor's step; the bound still holds."""
    probe = UpdateProbe()
    model = TRPL("MlpPolicy", "CartPole-v1", learning_rate=1e-2, max_enforce_steps=0, n_steps=256, seed=0, **TINY)
    model.learn(3 * 256, callback=probe)
    assert any(v["train/enforcement_step_fraction"] < 1 for v in probe.updates)
    assert all(v["train/enforcement_steps"] == 0 for v in probe.updates)
    assert all(kl.max() <= 1.05 * model.joint_bound for kl in probe.kls)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_warns_once_when_the_enforcement_keeps_undoing_the_updates(env_id, capsys):
    """
    At a learning rate far too large for the bounds the enforcement undoes nearly all of every update (the bound
    holds, the KL is small, the actor hardly moves): TRPL warns once, at the user's line, naming ``learning_rate`` and
    the bounds, prints it with ``verbose=1``, and logs each update's kept fraction.
    """
    logs = TrainLogs()
    model = TRPL("MlpPolicy", env_id, learning_rate=10.0, n_steps=64, seed=0, verbose=1, **TINY)
    with pytest.warns(UserWarning, match="undone most of the actor's update") as record:
        model.learn(8 * 64, callback=logs)
    undone = [w for w in record if "undone most" in str(w.message)]
    assert len(undone) == 1 and undone[0].filename == __file__
    message = str(undone[0].message)
    assert "`learning_rate`" in message and "mean_bound=0.03" in message
    assert ("cov_bound=0.001" in message) == (env_id == "Pendulum-v1")
    assert "undone most of the actor's update" in capsys.readouterr().out
    kept = [v["train/update_kept_fraction"] for v in logs.updates]
    assert sum(k < 0.1 for k in kept) >= 5
    assert all(v["train/bound_met"] == 1.0 for v in logs.updates)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_no_undone_update_warning_at_the_default_learning_rate(env_id, recwarn):
    """At the default learning rate the enforcement keeps the updates: no warning."""
    logs = TrainLogs()
    model = TRPL("MlpPolicy", env_id, n_steps=64, seed=0, **TINY)
    model.learn(8 * 64, callback=logs)
    assert not [w for w in recwarn if "undone most" in str(w.message)]
    assert model.mostly_undone_updates == 0 and not model.mostly_undone_warned
    assert min(v["train/update_kept_fraction"] for v in logs.updates) >= 0.1


def test_kept_fraction_is_the_component_along_the_epochs_step():
    rollout = th.zeros(3)
    epochs = th.tensor([2.0, 0.0, 0.0])
    assert TRPL._kept_fraction(rollout, epochs, epochs) == 1.0
    assert TRPL._kept_fraction(rollout, epochs, rollout) == 0.0
    assert TRPL._kept_fraction(rollout, epochs, th.tensor([0.5, 3.0, 0.0])) == pytest.approx(0.25)
    assert TRPL._kept_fraction(rollout, rollout, th.ones(3)) == 1.0  # the epochs did not move the actor


def test_acting_policy_is_the_network():
    """
    predict() acts with the network's raw output, as in SB3, not with its projection: with the network moved outside
    the trust region around the rollout policy, the acting mean is the network's and differs from the projected one.
    """
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, seed=0, **TINY)
    model.learn(64)
    data = model.rollout_buffer._get_samples(np.arange(64))  # the rollout policy's distribution on its states
    with th.no_grad():
        model.policy.action_net.bias += 0.5  # mean part of KL(new || old) 0.125 / std^2, far above mean_bound
        policy = model.policy
        raw_mean = policy.action_net(policy.mlp_extractor.forward_actor(policy.extract_features(data.observations)))
        distribution = policy.get_distribution(data.observations)
        projected = model._project(distribution, data.old_dist_params, None)
    assert projected["moved"].all()
    action, _ = model.predict(data.observations.numpy(), deterministic=True)
    np.testing.assert_allclose(action, np.clip(raw_mean.numpy(), -2, 2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(distribution.distribution.mean.numpy(), raw_mean.numpy(), rtol=1e-6)
    projected_mean = projected["distribution"].distribution.mean
    assert (raw_mean - projected_mean).abs().min() > 0.1


def _entropy(std: th.Tensor) -> th.Tensor:
    return th.log(std).sum(-1) + 0.5 * std.shape[-1] * (1 + math.log(2 * math.pi))


@pytest.mark.parametrize("projection", ["kl", "w2", "frobenius"])
def test_entropy_floor_yields_to_the_trust_region(projection):
    """
    The entropy control raises the network's std to the floor before the projection, and the trust region wins:
    a floor within ``cov_bound`` of the rollout policy is met exactly, a floor far above it is not (the projected
    covariance part stays within ``cov_bound``), but the projected entropy still moves from the rollout policy's toward it.
    """
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, projection=projection, target_entropy=0.0, seed=0, **TINY)
    obs = th.as_tensor(model.env.reset())
    distribution = model.policy.get_distribution(obs)
    old_params = model.dist_params.extract(distribution).detach()  # the network is the rollout policy
    std = th.exp(model.policy.log_std.detach())
    near = float(_entropy(std * 1.01))  # KL part 1e-4, W2 part 1e-4 std^2, Frobenius ~4e-4 std^4: all within 1e-3
    far = float(_entropy(std * 2.0))
    with th.no_grad():
        reached = model._project(distribution, old_params, near)
        limited = model._project(distribution, old_params, far)
    assert float(reached["distribution"].entropy().min()) == pytest.approx(near, abs=1e-5)
    limited_entropy = limited["distribution"].entropy()
    assert limited["parts"][1].max() <= model.cov_bound * (1 + 1e-4)
    assert (limited_entropy < far - 0.1).all()
    assert (limited_entropy > float(_entropy(std)) + 1e-3).all()


def test_entropy_floor_is_approached_over_updates():
    """A floor far above the rollout policy's entropy: every update keeps the bound and the acting entropy rises."""
    logs = TrainLogs()
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, target_entropy=3.0, seed=0, **TINY)
    model.learn(4 * 64, callback=logs)
    # Pendulum's one action dimension, a state-independent std: the acting entropy is log(std) + 0.5 log(2 pi e)
    after = [math.log(v["train/action_std_mean"]) + 0.5 * (1 + math.log(2 * math.pi)) for v in logs.updates]
    entropies = [model.initial_entropy, *after]
    assert all(v["train/bound_met"] == 1.0 for v in logs.updates)
    assert (np.diff(entropies) > 0).all()
    assert entropies[-1] < logs.updates[-1]["train/min_entropy"]


@pytest.mark.parametrize("projection", ["w2", "frobenius"])
def test_distance_bound_is_no_kl_target(projection):
    """
    A W2 or Frobenius bound is logged as ``train/distance_bound``, never as ``train/target_kl`` (``train/kl`` is a KL),
    and callbacks see no KL target; with ``projection="kl"`` the bound is the KL target.
    """
    monitor = KLMonitorCallback(direction="reverse")
    logs = TrainLogs()
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, projection=projection, seed=0, **TINY)
    model.learn(2 * 64, callback=[monitor, logs])
    for values in logs.updates:
        assert "train/target_kl" not in values
        assert values["train/distance_bound"] == pytest.approx(model.joint_bound)
    assert model_target_kl(model) is None
    assert all("target" not in record for record in monitor.history)
    kl_model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, seed=0, **TINY)
    assert model_target_kl(kl_model) == pytest.approx(kl_model.joint_bound)


def test_entropy_control_decays_and_persists(tmp_path):
    logs = TrainLogs()
    model = TRPL("MlpPolicy", "Pendulum-v1", target_entropy=-1.0, n_steps=64, seed=0, **TINY)
    model.learn(3 * 64, callback=logs)
    initial = model.initial_entropy
    assert initial is not None and math.isfinite(initial)
    bounds = [v["train/min_entropy"] for v in logs.updates]
    assert bounds[0] == pytest.approx(-1.0 + (initial + 1.0) * (1 - 64 / 192), rel=1e-6)
    assert bounds == sorted(bounds, reverse=True)
    model.save(tmp_path / "model.zip")
    loaded = TRPL.load(tmp_path / "model.zip")
    assert loaded.initial_entropy == initial and loaded.target_entropy == -1.0


def test_save_load_round_trip(tmp_path):
    kwargs = dict(projection="w2", mean_bound=0.02, cov_bound=0.002, trust_region_coef=4.0, max_enforce_steps=7)
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, seed=0, **TINY, **kwargs)
    model.learn(64)
    model.save(tmp_path / "model.zip")
    loaded = TRPL.load(tmp_path / "model.zip", env=model.env)
    for name, value in kwargs.items():
        assert getattr(loaded, name) == value
    assert loaded.joint_bound == pytest.approx(0.022)
    for key, tensor in model.policy.state_dict().items():
        assert th.equal(tensor, loaded.policy.state_dict()[key]), key
    loaded.learn(64, reset_num_timesteps=False)
    # a bound given to load() is the one in force and the one logged (a W2 bound, no KL target); with
    # projection="kl" it is the KL target the logs and callbacks compare with
    tighter = TRPL.load(tmp_path / "model.zip", env=model.env, mean_bound=0.01)
    assert tighter.joint_bound == pytest.approx(0.012) and tighter._current_target_kl() is None
    tighter.learn(64, reset_num_timesteps=False)
    assert tighter.logger.name_to_value["train/distance_bound"] == pytest.approx(0.012)
    in_kl = TRPL.load(tmp_path / "model.zip", env=model.env, mean_bound=0.01, projection="kl")
    assert in_kl._current_target_kl() == pytest.approx(0.012)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(projection="l2"), ValueError, "projection"),
        (dict(mean_bound=0.0), ValueError, "pass e.g. mean_bound=0.03"),
        (dict(mean_bound=-0.1), ValueError, "mean_bound"),
        (dict(mean_bound=math.inf), ValueError, "mean_bound"),
        (dict(mean_bound=math.nan), ValueError, "mean_bound"),
        (dict(cov_bound=0.0), ValueError, "pass e.g. cov_bound=0.001"),
        (dict(cov_bound=math.inf), ValueError, "cov_bound"),
        (dict(mean_bound="0.1"), TypeError, "mean_bound"),
        (dict(trust_region_coef=-1.0), ValueError, "trust_region_coef"),
        (dict(trust_region_coef=math.nan), ValueError, "trust_region_coef"),
        (dict(target_entropy=math.inf), ValueError, "target_entropy"),
        (dict(max_enforce_steps=-1), ValueError, "max_enforce_steps"),
        (dict(bound_tolerance=0.9), ValueError, "bound_tolerance=1.05"),
        (dict(batch_size=1), ValueError, "batch_size"),
        (dict(n_epochs=0), ValueError, "n_epochs"),
        (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
        (dict(ent_coef=-0.1), ValueError, "ent_coef"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, **kwargs)


def test_truncated_minibatch_warns_as_in_ppo():
    with pytest.warns(UserWarning, match="truncated mini-batch of size 36"):
        TRPL("MlpPolicy", "Pendulum-v1", n_steps=100, batch_size=64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(projection="w2"), "projection='kl'"),
        (dict(projection="frobenius"), "projection='kl'"),
        (dict(target_entropy=0.5), "target_entropy=None"),
    ],
)
def test_gaussian_options_refused_for_discrete_actions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TRPL("MlpPolicy", "CartPole-v1", n_steps=64, **kwargs)
    # also when the env comes later (load, or _init_setup_model with env=None then set up)
    model = TRPL("MlpPolicy", None, n_steps=64, _init_setup_model=False, **kwargs)
    model.action_space, model.observation_space = gym.spaces.Discrete(2), gym.spaces.Box(-1, 1, (4,))
    with pytest.raises(ValueError, match=match):
        model._setup_model()


@pytest.mark.parametrize("std_kwargs", [{}, dict(full_std=False, use_expln=True)])
@pytest.mark.parametrize("learn_features", [False, True])
def test_gsde_std_trains_the_features_only_with_learn_features(std_kwargs, learn_features):
    """
    As SB3's gSDE: the std the losses of the epochs use is built on the actor's features detached, so its gradient
    with respect to them is 0, unless the distribution has ``learn_features=True`` (SB3's actor-critic policies fix
    it to False; a custom policy may set it); its values are SB3's, bit for bit. Only the bound enforcement's
    regression differentiates the std in the features (the same values), to bring each state's std back.
    """
    policy_kwargs = dict(TINY["policy_kwargs"], **std_kwargs)
    model = TRPL("MlpPolicy", "Pendulum-v1", use_sde=True, n_steps=64, **{**TINY, "policy_kwargs": policy_kwargs})
    model.policy.action_dist.learn_features = learn_features
    obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(8)]))
    stock = model.policy.get_distribution(obs).distribution
    stock_loc, stock_scale = stock.loc.detach().clone(), stock.scale.detach().clone()
    _, distribution = model._forward(obs)
    assert th.equal(distribution.distribution.loc, stock_loc) and th.equal(distribution.distribution.scale, stock_scale)
    assert distribution.get_actions().shape == (8, 1)  # sampling works on the distribution as SB3 keeps it
    features = model.policy.mlp_extractor.forward_actor(model.policy.extract_features(obs)).detach().requires_grad_()
    mean, std = model._gaussian_parts(model._distribution_from_latent(features))
    (grad,) = th.autograd.grad(std.sum(), features, allow_unused=True)
    assert (grad is not None and grad.abs().sum() > 0) == learn_features
    (mean_grad,) = th.autograd.grad(mean.sum(), features)
    assert mean_grad.abs().sum() > 0  # the mean trains them either way
    model.learn(64)  # a buffer of states
    data = model.rollout_buffer._get_samples(np.arange(8))
    _, enforced_std = model._gaussian_parts(model._enforcement_distribution(data))
    _, stock_std = model._gaussian_parts(model.policy.get_distribution(data.observations))
    th.testing.assert_close(enforced_std, stock_std, rtol=1e-6, atol=0)
    model.policy.zero_grad()
    enforced_std.sum().backward()
    first_layer = model.policy.mlp_extractor.policy_net[0].weight
    assert first_layer.grad is not None and first_layer.grad.abs().sum() > 0


def test_enforcement_regression_runs_the_actor_only():
    """The enforcement's regression loss runs no value head and gives the critic no gradient."""
    model, ratios, _ = pushed_outside_the_bound("Pendulum-v1", {})
    calls = []
    hooks = [
        module.register_forward_hook(lambda *_: calls.append(1))
        for module in (model.policy.value_net, model.policy.mlp_extractor.value_net)
    ]
    model.policy.zero_grad()
    for toward_rollout in (False, True):
        model._regression_loss(ratios, None, toward_rollout).backward()
    for hook in hooks:
        hook.remove()
    assert not calls
    assert all(p.grad is None for p in model.policy.value_net.parameters())
    assert model.policy.action_net.weight.grad.abs().sum() > 0


def test_squashed_gsde_refused():
    with pytest.raises(ValueError, match="squash_output"):
        TRPL("MlpPolicy", "Pendulum-v1", use_sde=True, policy_kwargs=dict(squash_output=True), n_steps=64)


def test_callbacks_work():
    monitor = KLMonitorCallback(direction="reverse")
    callbacks = [
        monitor,
        KLAlarmCallback(monitor=monitor),
        KLAdaptiveLRCallback(target_kl=0.01, monitor=monitor),
        VarianceFloorCallback(min_std=0.1),
    ]
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, seed=0, **TINY)
    model.learn(3 * 64, callback=callbacks)
    assert len(monitor.history) == 3
    # the monitor's exact KL(new || old) is the one TRPL logs as train/kl
    assert monitor.history[-1]["mean"] == pytest.approx(model.logger.name_to_value["train/kl"], rel=1e-3, abs=1e-7)
    assert float(th.exp(model.policy.log_std.detach()).min()) >= 0.1 - 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("env_id, kwargs", [("CartPole-v1", {}), ("Pendulum-v1", {}), ("Pendulum-v1", dict(use_sde=True))])
def test_regression_alone_meets_the_bound_at_default_settings(env_id, kwargs):
    """
    The measurement behind ``max_enforce_steps=30``: 3 seeds x 30 updates of 1024 steps at the default settings. Every
    update meets the bound, measured from outside, and at least 99 % of them by the regression steps alone (no move
    back toward the rollout policy).
    """
    probes = []
    for seed in range(3):
        probe = UpdateProbe()
        model = TRPL("MlpPolicy", env_id, n_steps=1024, seed=seed, **kwargs)
        model.learn(30 * 1024, callback=probe)
        probes.append(probe)
    updates = [values for probe in probes for values in probe.updates]
    assert len(updates) == 90
    assert all(kl.max() <= 1.05 * model.joint_bound for probe in probes for kl in probe.kls)
    regression_only = [v["train/enforcement_step_fraction"] == 1.0 for v in updates]
    assert np.mean(regression_only) >= 0.99


def test_same_seed_same_model():
    params = []
    for _ in range(2):
        model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, seed=3, **TINY)
        model.learn(2 * 64)
        params.append(th.nn.utils.parameters_to_vector(model.policy.parameters()).detach())
    assert th.equal(params[0], params[1])


@pytest.mark.parametrize(
    "env_id, kwargs",
    [("CartPole-v1", {}), ("Pendulum-v1", {}), ("Pendulum-v1", dict(use_sde=True)), ("Pendulum-v1", dict(projection="w2"))],
)
def test_projection_of_the_rollout_policy_is_the_identity(env_id, kwargs):
    """
    On states where the network is the rollout policy, no state is outside the bound: the projected distribution has
    the network's own parameter tensors, the regression term is 0 (and so is its gradient), no state counts as moved,
    and the logged distances are the network's own (0).
    """
    model = TRPL("MlpPolicy", env_id, n_steps=64, seed=0, **kwargs, **TINY)
    obs = th.as_tensor(model.env.reset())
    _, distribution = model._forward(obs)
    old_params = model.dist_params.extract(distribution).detach()
    projection = model._project(distribution, old_params, None)
    assert th.equal(projection["trust_region"], th.zeros(len(obs))) and not projection["moved"].any()
    assert projection["projected"].abs().max() < 1e-12
    projected = projection["distribution"].distribution
    if model._is_gaussian:
        assert th.equal(projected.mean, distribution.distribution.mean)
        assert th.equal(projected.stddev, distribution.distribution.stddev.expand_as(projected.stddev))
    else:
        assert th.equal(projected.logits, distribution.distribution.logits)


@pytest.mark.parametrize("projection", ["kl", "w2"])
def test_logged_update_kl_is_the_measured_one(projection):
    """The update's KL, taken from the bound enforcement's last pass over the buffer, is what a fresh pass measures."""
    logs = TrainLogs()
    model = TRPL("MlpPolicy", "Pendulum-v1", n_steps=64, projection=projection, seed=0, **TINY)
    model.learn(2 * 64, callback=logs)
    per_state, _ = model._measure_update_kl()
    assert logs.updates[-1]["train/kl"] == float(np.mean(per_state))
    assert logs.updates[-1]["train/kl_max"] == float(np.max(per_state))


@pytest.mark.parametrize("variant", ["line_search_capped", "line_search", "line_search_unit", "fresh", "shared", "scaled"])
def test_enforcement_steps_leave_the_policy_optimizer_alone(monkeypatch, variant):
    """
    The regression steps of the bound enforcement leave the policy optimizer alone: the line search (the default)
    steps the parameters itself; "fresh" and "scaled" step an optimizer of their own (the policy optimizer's class and
    hyperparameters, this update's learning rate, new moments). The policy optimizer counts only the minibatch steps.
    With ``_enforcement_optimizer = "shared"`` (kept to compare) it counts the regression steps too.
    """
    monkeypatch.setattr(TRPL, "_enforcement_optimizer", variant)
    probe = UpdateProbe()
    model = TRPL("MlpPolicy", "CartPole-v1", learning_rate=1e-2, n_steps=256, seed=0, **TINY)
    made = []
    make = model._make_enforcement_optimizer

    def recording(actor_params):
        made.append(make(actor_params))
        return made[-1]

    model._make_enforcement_optimizer = recording
    model.learn(3 * 256, callback=probe)
    regression_steps = sum(v["train/enforcement_steps"] for v in probe.updates)
    assert regression_steps > 0  # the test is not vacuous
    if not variant.startswith("line_search"):  # optimizer steps are never undone
        assert all(v["train/enforcement_rejected_tries"] == 0 for v in probe.updates)
    minibatch_steps = 3 * TINY["n_epochs"] * (256 // TINY["batch_size"])
    policy_steps = max(int(state["step"]) for state in model.policy.optimizer.state.values())
    if variant == "shared":
        assert policy_steps == minibatch_steps + regression_steps
        assert all(optimizer is model.policy.optimizer for optimizer in made)
        return
    assert policy_steps == minibatch_steps
    if variant.startswith("line_search"):
        assert not made
        return
    policy_group = model.policy.optimizer.param_groups[0]
    keys = ("lr", "eps", "fused")
    for optimizer in made:
        assert type(optimizer) is type(model.policy.optimizer) and optimizer is not model.policy.optimizer
        group = optimizer.param_groups[0]
        assert {k: group[k] for k in keys} == {k: policy_group[k] for k in keys}
        # "scaled" steps without momentum on the policy's second moments (copied, so their step count goes on)
        assert group["betas"] == ((0.0, policy_group["betas"][1]) if variant == "scaled" else policy_group["betas"])
        assert {id(p) for p in group["params"]} == {id(p) for p in model._actor_parameters()}
    if variant == "fresh":
        assert sum(max(int(s["step"]) for s in optimizer.state.values()) for optimizer in made) == regression_steps


def excess(ratios: th.Tensor) -> float:
    """The summed excess of the per-state parts over their bounds, in units of each bound."""
    return float((ratios - 1).clamp(min=0).sum())


def pushed_outside_the_bound(env_id: str, kwargs: dict) -> tuple[TRPL, th.Tensor, th.Tensor]:
    """A TRPL model after the epochs of a large-learning-rate update, before the enforcement: outside the bound."""
    model = TRPL("MlpPolicy", env_id, learning_rate=3e-2, max_enforce_steps=0, n_steps=256, seed=0, **kwargs, **TINY)
    model.learn(256)  # one update, then collect the next rollout and run the epochs only
    callback = model._init_callback(None)
    callback.on_training_start(locals(), globals())
    model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=model.n_steps)
    model._prepare_rollout_distribution()
    for data in [d for _ in range(5) for d in model.rollout_buffer.get(TINY["batch_size"])]:
        _, distribution = model._forward_samples(data)
        log_prob = distribution.log_prob(model._actions_for_log_prob(data.actions))
        model._optimizer_step(-(data.advantages * log_prob).mean())  # the policy gradient, unprojected
    ratios, params = model._acting_ratios()
    assert ratios.max() > model.bound_tolerance  # the tests are not vacuous
    model.max_enforce_steps = 30
    return model, ratios, params


@pytest.mark.parametrize("variant", ["line_search_capped", "line_search", "line_search_unit"])
@pytest.mark.parametrize("env_id, kwargs", [("CartPole-v1", {}), ("Pendulum-v1", {}), ("Pendulum-v1", dict(use_sde=True))])
def test_line_search_keeps_only_steps_that_lower_the_excess(monkeypatch, env_id, kwargs, variant):
    """
    The line search's regression (from the network after the epochs of a large-learning-rate update, pushed outside
    the bound) ends with a lower summed excess over the bound than it started from, within ``max_enforce_steps``
    tries, and the distances it returns are those of the parameters it leaves in the network. It counts as steps the
    tries that lowered the excess (kept) and as rejected tries the others. Its first try moves the parameters by the
    learning rate in root mean square with ``line_search_unit``, by at most that with the default.
    """
    monkeypatch.setattr(TRPL, "_enforcement_optimizer", variant)
    model, ratios, params = pushed_outside_the_bound(env_id, kwargs)
    actor = model._actor_parameters()
    start = th.nn.utils.parameters_to_vector(actor).detach().clone()
    tried, measured_excess = [], []
    measure = model._acting_ratios

    def recording():
        tried.append(th.nn.utils.parameters_to_vector(actor).detach().clone())
        result = measure()
        measured_excess.append(excess(result[0]))
        return result

    model._acting_ratios = recording
    new_ratios, new_params, accepted, rejected = model._line_search_regression(actor, ratios, params, None)
    model._acting_ratios = measure
    assert 0 < accepted + rejected <= 30 and len(tried) == accepted + rejected
    merit, lowered = excess(ratios), 0
    for value in measured_excess:
        if value < merit:
            merit, lowered = value, lowered + 1
    assert accepted == lowered > 0
    first_step_rms = float((tried[0] - start).pow(2).mean().sqrt())
    lr = model.policy.optimizer.param_groups[0]["lr"]
    if variant == "line_search_unit":
        assert first_step_rms == pytest.approx(lr, rel=1e-4)
    if variant == "line_search_capped":
        assert first_step_rms <= lr * (1 + 1e-4)
    assert excess(new_ratios) < excess(ratios)
    measured, measured_params = model._acting_ratios()
    assert th.equal(measured, new_ratios) and th.equal(measured_params, new_params)


@pytest.mark.parametrize("env_id, kwargs", [("CartPole-v1", {}), ("Pendulum-v1", dict(use_sde=True))])
def test_capped_line_search_leaves_a_direction_that_does_not_lower_the_excess(env_id, kwargs):
    """
    Given a regression whose gradient raises the summed excess (its sign flipped), the default line search fails three
    tries in a row, then steps along the excess's own gradient and ends with a lower excess than it started from.
    """
    model, ratios, params = pushed_outside_the_bound(env_id, kwargs)
    regression, asked = model._regression_loss, []

    def flipped(ratios, min_entropy, toward_rollout=False):
        asked.append(toward_rollout)
        loss = regression(ratios, min_entropy, toward_rollout=True)
        return loss if toward_rollout else -loss

    model._regression_loss = flipped
    new_ratios, _, accepted, rejected = model._line_search_regression(model._actor_parameters(), ratios, params, None)
    assert asked[0] is False and asked[1] is True and rejected >= 3 and accepted > 0
    assert excess(new_ratios) < excess(ratios)
