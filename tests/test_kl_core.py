import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from stable_baselines3.common.distributions import make_proba_distribution

from sb3_kl.common.kl import (
    BernoulliParams,
    CategoricalParams,
    GaussianParams,
    KLSettings,
    MultiCategoricalParams,
    distribution_params_for_space,
    importance_sampled_kl,
    kl_quantiles,
    make_distribution_params,
    per_state_kl,
    per_state_kl_to,
    quantile_name,
    sample_kl,
)

LAYOUTS = [GaussianParams(3), CategoricalParams(4), MultiCategoricalParams([2, 3, 4]), BernoulliParams(3)]


def random_params(layout, batch: int, seed: int, scale: float = 1.0) -> th.Tensor:
    generator = th.Generator().manual_seed(seed)
    params = scale * th.randn(batch, layout.n_params, generator=generator, dtype=th.float64)
    if isinstance(layout, GaussianParams):
        params[:, layout.action_dim :] = params[:, layout.action_dim :].clamp(-2, 1)
    return params


def torch_joint_kl(layout, p: th.Tensor, q: th.Tensor) -> th.Tensor:
    """Independent reference: PyTorch's own kl_divergence, summed over independent factors and dimensions."""
    total = th.zeros(p.shape[0], dtype=p.dtype)
    for dist_p, dist_q in zip(layout.torch_distributions(p), layout.torch_distributions(q), strict=True):
        kl = th.distributions.kl_divergence(dist_p, dist_q)
        total = total + (kl.sum(dim=-1) if kl.dim() > 1 else kl)
    return total


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: type(layout).__name__)
def test_analytic_equals_closed_form(layout):
    p, q = random_params(layout, 64, 0), random_params(layout, 64, 1)
    settings_ = KLSettings()
    ours = per_state_kl(settings_, layout, p, q)
    th.testing.assert_close(ours, torch_joint_kl(layout, p, q))
    reverse = per_state_kl(KLSettings(direction="reverse"), layout, p, q)
    th.testing.assert_close(reverse, torch_joint_kl(layout, q, p))
    # forward != reverse on asymmetric pairs
    assert not th.allclose(ours, reverse)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: type(layout).__name__)
def test_kl_of_distribution_with_itself_is_zero(layout):
    p = random_params(layout, 32, 3)
    for direction in ("forward", "reverse"):
        kl = per_state_kl(KLSettings(direction=direction), layout, p, p.clone())
        assert th.allclose(kl, th.zeros_like(kl), atol=1e-12)
        log_ratio = th.zeros(32, dtype=p.dtype)
        for estimator in ("k1", "k3"):
            assert th.all(per_state_kl(KLSettings(estimator, direction), layout, p, p, log_ratio) == 0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: type(layout).__name__)
def test_mean_reduction_is_sum_over_dims(layout):
    p, q = random_params(layout, 16, 4), random_params(layout, 16, 5)
    total = per_state_kl(KLSettings(reduction="sum"), layout, p, q)
    mean = per_state_kl(KLSettings(reduction="mean"), layout, p, q)
    th.testing.assert_close(mean, total / layout.n_dims)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: type(layout).__name__)
def test_sample_estimators_converge_to_analytic(layout, direction):
    """k1 and k3 from samples of the old policy are unbiased for the chosen direction."""
    th.manual_seed(0)
    old = random_params(layout, 1, 6, scale=0.5).double()
    new = old + 0.3 * random_params(layout, 1, 7).double()
    n_samples = 200_000
    old_dists = layout.torch_distributions(old.expand(n_samples, -1))
    new_dists = layout.torch_distributions(new.expand(n_samples, -1))
    log_ratio = th.zeros(n_samples, dtype=th.float64)
    for dist_old, dist_new in zip(old_dists, new_dists, strict=True):
        actions = dist_old.sample()
        lp_new, lp_old = dist_new.log_prob(actions), dist_old.log_prob(actions)
        if lp_new.dim() > 1:
            lp_new, lp_old = lp_new.sum(-1), lp_old.sum(-1)
        log_ratio += lp_new - lp_old
    exact = per_state_kl(KLSettings(direction=direction), layout, old, new).item()
    for estimator in ("k1", "k3"):
        estimate = per_state_kl(KLSettings(estimator, direction), layout, old, new, log_ratio).mean().item()
        assert estimate == pytest.approx(exact, rel=0.05, abs=2e-3), (estimator, estimate, exact)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=64), st.sampled_from(["forward", "reverse"]))
def test_k3_never_negative_and_finite(log_ratios, direction):
    log_ratio = th.tensor(log_ratios, dtype=th.float32)
    kl = sample_kl(log_ratio, "k3", direction, log_ratio_clip=20.0)
    assert th.all(th.isfinite(kl))
    assert th.all(kl >= -1e-6)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(range(len(LAYOUTS))), st.floats(0.1, 3.0))
def test_analytic_kl_nonnegative_property(seed, layout_index, scale):
    layout = LAYOUTS[layout_index]
    p, q = random_params(layout, 8, seed, scale), random_params(layout, 8, seed + 1, scale)
    kl = per_state_kl(KLSettings(), layout, p, q)
    assert th.all(th.isfinite(kl))
    assert th.all(kl >= -1e-9)


def test_log_ratio_is_clipped():
    log_ratio = th.tensor([1000.0, -1000.0])
    kl = sample_kl(log_ratio, "k3", "reverse", log_ratio_clip=20.0)
    assert th.all(th.isfinite(kl))


def test_log_ratio_clip_only_clamps_what_is_exponentiated():
    # forward k1 is -log r: nothing is exponentiated, so log_ratio_clip leaves it the k1 estimate it is logged as
    log_ratio = th.tensor([0.7, -0.3, 3.0, -2.5], dtype=th.float64)
    assert th.equal(sample_kl(log_ratio, "k1", "forward", log_ratio_clip=0.05), -log_ratio)
    # k3 and the reverse forms exponentiate log r: each sample is the estimate at the clamped log-ratio (k3 stays >= 0)
    clamped = log_ratio.clamp(-0.05, 0.05)
    ratio = clamped.exp()
    assert th.allclose(sample_kl(log_ratio, "k3", "forward", log_ratio_clip=0.05), (ratio - 1) - clamped)
    assert th.allclose(sample_kl(log_ratio, "k1", "reverse", log_ratio_clip=0.05), ratio * clamped)
    assert th.allclose(sample_kl(log_ratio, "k3", "reverse", log_ratio_clip=0.05), ratio * clamped - (ratio - 1))
    assert th.all(sample_kl(log_ratio, "k3", "forward", log_ratio_clip=0.05) >= 0)
    # importance-weighted (reference) k1: the weight is clamped before exp, -log rho is not
    log_prob, ref_log_prob, sampler = log_ratio, th.zeros(4, dtype=th.float64), th.zeros(4, dtype=th.float64)
    weight = (log_prob - sampler).clamp(-0.05, 0.05).exp()
    expected = -weight * (ref_log_prob - log_prob)
    assert th.allclose(importance_sampled_kl(log_prob, ref_log_prob, sampler, "k1", "reverse", log_ratio_clip=0.05), expected)


@pytest.mark.parametrize(
    "action_space,use_sde",
    [
        (spaces.Box(-1, 1, (3,)), False),
        (spaces.Box(-1, 1, (2,)), True),
        (spaces.Discrete(5), False),
        (spaces.MultiDiscrete([2, 3]), False),
        (spaces.MultiBinary(4), False),
    ],
)
def test_extract_matches_sb3_distribution(action_space, use_sde):
    """Parameters extracted from SB3's distributions rebuild the same distribution (and gSDE is Gaussian)."""
    dist = make_proba_distribution(action_space, use_sde=use_sde)
    layout = make_distribution_params(dist)
    assert type(layout) is type(distribution_params_for_space(action_space))
    latent = th.randn(5, 8)
    if use_sde:
        mean_net, log_std = dist.proba_distribution_net(latent_dim=8)
        dist.proba_distribution(mean_net(latent), log_std, latent)
    elif isinstance(action_space, spaces.Box):
        mean_net, log_std = dist.proba_distribution_net(latent_dim=8)
        dist.proba_distribution(mean_net(latent), log_std)
    else:
        net = dist.proba_distribution_net(latent_dim=8)
        dist.proba_distribution(net(latent))
    params = layout.extract(dist)
    assert params.shape == (5, layout.n_params)
    actions = dist.sample()
    rebuilt = layout.torch_distributions(params.detach())
    log_prob = th.zeros(5)
    if isinstance(action_space, spaces.MultiDiscrete):
        for i, d in enumerate(rebuilt):
            log_prob += d.log_prob(actions[:, i])
    else:
        lp = rebuilt[0].log_prob(actions)
        log_prob += lp.sum(-1) if lp.dim() > 1 else lp
    th.testing.assert_close(log_prob, dist.log_prob(actions).detach(), rtol=1e-4, atol=1e-4)
    th.testing.assert_close(layout.entropy(params.detach()), dist.entropy().detach(), rtol=1e-4, atol=1e-4)


def test_quantiles_and_names():
    stats = kl_quantiles(np.arange(101, dtype=float), (0.5, 0.9, 0.99))
    assert stats == {"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert quantile_name(0.999) == "p99.9"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"estimator": "k2"}, "kl_estimator"),
        ({"direction": "backward"}, "kl_direction"),
        ({"reduction": "max"}, "kl_reduction"),
        ({"log_ratio_clip": -1.0}, "log_ratio_clip"),
        ({"log_ratio_clip": float("nan")}, "log_ratio_clip"),
    ],
)
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KLSettings(**kwargs)


def test_convention_labels():
    assert KLSettings().convention == "forward/analytic/sum"
    assert KLSettings("k3", "reverse", "mean").description == "KL(new||old), k3, averaged over action dimensions"


@pytest.mark.parametrize("use_sde", [False, True])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_loss_path_matches_parameter_path_in_value_and_gradient(direction, use_sde):
    """per_state_kl_to (the loss path, straight from the live distribution) equals per_state_kl in value and gradient."""
    action_space = spaces.Box(-1, 1, (3,))
    dist = make_proba_distribution(action_space, use_sde=use_sde)
    layout = make_distribution_params(dist)
    mean_net, log_std = dist.proba_distribution_net(latent_dim=8)
    latent = th.randn(16, 8)
    old = layout.extract(
        dist.proba_distribution(mean_net(latent), log_std, latent)
        if use_sde
        else dist.proba_distribution(mean_net(latent), log_std)
    ).detach()
    with th.no_grad():
        log_std.add_(0.3 * th.randn_like(log_std))
        mean_net.weight.add_(0.3 * th.randn_like(mean_net.weight))
    settings_ = KLSettings(direction=direction)

    def fresh():
        return (
            dist.proba_distribution(mean_net(latent), log_std, latent)
            if use_sde
            else dist.proba_distribution(mean_net(latent), log_std)
        )

    fused = per_state_kl_to(settings_, layout, old, fresh()).mean()
    grads_fused = th.autograd.grad(fused, [mean_net.weight, log_std])
    reference = per_state_kl(settings_, layout, old, layout.extract(fresh())).mean()
    grads_reference = th.autograd.grad(reference, [mean_net.weight, log_std])
    th.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-7)
    for a, b in zip(grads_fused, grads_reference, strict=True):
        th.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reverse", [False, True])
def test_fused_gaussian_kl_gradient_is_exact(reverse):
    """The one-node Gaussian KL of the loss path has the gradient of the closed form (float64 finite differences)."""
    layout = GaussianParams(3)
    dist = make_proba_distribution(spaces.Box(-1, 1, (3,)))
    generator = th.Generator().manual_seed(0)
    mean = th.randn(6, 3, dtype=th.float64, generator=generator, requires_grad=True)
    log_std = th.randn(3, dtype=th.float64, generator=generator, requires_grad=True)
    old = th.randn(6, 6, dtype=th.float64, generator=generator)

    def joint(mean_: th.Tensor, log_std_: th.Tensor) -> th.Tensor:
        return layout.joint_kl_to(old, dist.proba_distribution(mean_, log_std_), reverse=reverse)

    assert type(joint(mean, log_std).grad_fn).__name__ == "_GaussianJointKLBackward"
    assert th.autograd.gradcheck(joint, (mean, log_std))
    # the same value as the per-dimension form and as torch.distributions
    reference = layout.kl_per_dim_to(old, dist.proba_distribution(mean, log_std), reverse=reverse).sum(dim=-1)
    th.testing.assert_close(joint(mean, log_std), reference)
    old_torch = layout.torch_distributions(old)[0]
    new_torch = th.distributions.Normal(mean, th.exp(log_std).expand_as(mean))
    pair = (new_torch, old_torch) if reverse else (old_torch, new_torch)
    th.testing.assert_close(joint(mean, log_std), th.distributions.kl_divergence(*pair).sum(dim=-1))


def test_fused_gaussian_kl_refuses_second_derivatives_and_falls_back_without_grad():
    layout = GaussianParams(2)
    dist = make_proba_distribution(spaces.Box(-1, 1, (2,)))
    mean, log_std = th.randn(4, 2, requires_grad=True), th.zeros(2, requires_grad=True)
    old = th.randn(4, 4)
    kl = layout.joint_kl_to(old, dist.proba_distribution(mean, log_std)).sum()
    (grad,) = th.autograd.grad(kl, mean, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|does not require grad"):
        th.autograd.grad(grad.sum(), mean)
    # Fisher-vector products go through the differentiable per-dimension form
    new = layout.extract(dist.proba_distribution(mean, log_std))
    (grad,) = th.autograd.grad(layout.kl_per_dim(old, new).sum(), mean, create_graph=True)
    assert th.autograd.grad(grad.sum(), mean)[0].shape == mean.shape
    with th.no_grad():
        assert layout.joint_kl_to(old, dist.proba_distribution(mean, log_std)).grad_fn is None
