"""
Trust-region projections (sb3_kl.common.projections): bounds hold in every state, inside points are unchanged,
the projection is the closest feasible point, gradients are exact, shapes and speed.

Distances are re-evaluated independently in float64 (``torch.distributions`` for KL, covariance matrices for W2 and
Frobenius). Tolerance: ``distance <= bound * (1 + 1e-6)``. The projection itself guarantees ``<= bound`` in its own
float64 evaluation (float32 results are re-checked after rounding); the slack only covers the rounding difference
between two float64 formulas of the same distance, which is about 1e-10 relative at the smallest bound (1e-6).
"""

import time

import pytest
import torch as th
from torch.distributions import Bernoulli, Categorical, Independent, Normal, kl_divergence

from sb3_kl.common.projections import (
    PROJECTIONS,
    bernoulli_kl,
    categorical_kl,
    gaussian_distances,
    gaussian_entropy_projection,
    project_bernoulli,
    project_categorical,
    project_gaussian,
)

RTOL = 1e-6
BOUNDS = (1e-6, 1e-3, 0.1, 10.0)
# (mean distance in old stds, std factor): random, far away, wide, narrow, both extreme
GAUSSIAN_CASES = ((1.0, 1.0), (1e3, 1.0), (1.0, 1e3), (1.0, 1e-3), (1e3, 1e-3))
MULTI_DISCRETE = [3, 2, 5]


def _gaussian_batch(batch, k, far, std_factor, per_state, dtype, seed=0):
    gen = th.Generator().manual_seed(seed)
    std_shape = (batch, k) if per_state else (k,)
    old_mean = th.randn(batch, k, generator=gen, dtype=dtype)
    old_std = 0.5 + th.rand(std_shape, generator=gen, dtype=dtype)
    mean = old_mean + far * old_std * th.randn(batch, k, generator=gen, dtype=dtype)
    std = old_std * std_factor * th.exp(0.3 * th.randn(std_shape, generator=gen, dtype=dtype))
    return mean, std, old_mean, old_std


def _independent_distances(mean, std, old_mean, old_std, projection):
    """Mean and covariance parts, recomputed in float64 from full covariance matrices or torch.distributions."""
    mean, std, old_mean, old_std = (x.to(th.float64) for x in (mean, std, old_mean, old_std))
    std, old_std = std.expand_as(mean), old_std.expand_as(mean)
    if projection == "kl":
        # KL(N(mu, S_old) || N(mu_old, S_old)) and KL(N(mu_old, S) || N(mu_old, S_old)) add up to KL(pi || pi_old)
        mean_part = kl_divergence(Independent(Normal(mean, old_std), 1), Independent(Normal(old_mean, old_std), 1))
        cov_part = kl_divergence(Independent(Normal(old_mean, std), 1), Independent(Normal(old_mean, old_std), 1))
        return mean_part, cov_part
    cov, old_cov = th.diag_embed(std**2), th.diag_embed(old_std**2)
    diff = (mean - old_mean).unsqueeze(-1)
    if projection == "w2":
        # squared W2 between Gaussians: |dmu|^2 + tr(S + S_old - 2 (S_old^1/2 S S_old^1/2)^1/2)
        root_old = th.diag_embed(old_std)
        inner = th.linalg.eigvalsh(root_old @ cov @ root_old).clamp(min=0).sqrt().sum(-1)
        return (diff**2).sum((-2, -1)), th.diagonal(cov + old_cov, dim1=-2, dim2=-1).sum(-1) - 2 * inner
    mahalanobis = (diff.transpose(-2, -1) @ th.linalg.solve(old_cov, diff)).squeeze(-1).squeeze(-1)
    return mahalanobis, th.linalg.matrix_norm(cov - old_cov) ** 2


def _assert_within(distance, bound):
    assert th.isfinite(distance).all()
    assert distance.max().item() <= bound * (1 + RTOL), f"max distance {distance.max().item()} > bound {bound}"


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("dtype", [th.float32, th.float64])
@pytest.mark.parametrize("per_state", [False, True])
def test_gaussian_within_bound(projection, dtype, per_state):
    for bound in BOUNDS:
        for seed, (far, std_factor) in enumerate(GAUSSIAN_CASES):
            mean, std, old_mean, old_std = _gaussian_batch(256, 4, far, std_factor, per_state, dtype, seed)
            new_mean, new_std = project_gaussian(mean, std, old_mean, old_std, bound, bound, projection)
            assert new_mean.dtype == dtype and new_std.dtype == dtype and new_std.shape == std.shape
            mean_part, cov_part = _independent_distances(new_mean, new_std, old_mean, old_std, projection)
            _assert_within(mean_part, bound)
            _assert_within(cov_part, bound)


def _logits_batch(batch, n, far, dtype, seed=0):
    gen = th.Generator().manual_seed(seed)
    old = (3 * th.randn(batch, n, generator=gen, dtype=dtype)).clamp(-50, 50)
    new = (old + far * th.randn(batch, n, generator=gen, dtype=dtype)).clamp(-50, 50)
    return new, old


def _independent_categorical_kl(logits, old_logits, action_dims):
    pairs = zip(logits.double().split(action_dims, -1), old_logits.double().split(action_dims, -1), strict=True)
    return sum(kl_divergence(Categorical(logits=new), Categorical(logits=old)) for new, old in pairs)


def _independent_bernoulli_kl(logits, old_logits):
    """``Bernoulli(l)`` is ``Categorical(logits=[0, l])``; torch's Bernoulli KL is inf at |l| = 50 even in float64
    (sigmoid(50) rounds to 1), so it is used only where |l| < 30 and the two-class Categorical elsewhere."""
    logits, old_logits = logits.double(), old_logits.double()

    def two_class(x):
        return Categorical(logits=th.stack([th.zeros_like(x), x], dim=-1))

    kl = kl_divergence(two_class(logits), two_class(old_logits))
    moderate = (logits.abs() < 30) & (old_logits.abs() < 30)
    torch_kl = kl_divergence(Bernoulli(logits=logits.clamp(-30, 30)), Bernoulli(logits=old_logits.clamp(-30, 30)))
    assert th.allclose(th.where(moderate, torch_kl, kl), kl, rtol=1e-4, atol=1e-12)  # torch cancels in probs
    return kl.sum(-1)


@pytest.mark.parametrize("action_dims", [[6], MULTI_DISCRETE])
@pytest.mark.parametrize("dtype", [th.float32, th.float64])
def test_categorical_within_bound(action_dims, dtype):
    for bound in BOUNDS:
        for seed, far in enumerate((0.1, 1.0, 10.0, 100.0)):
            logits, old_logits = _logits_batch(256, sum(action_dims), far, dtype, seed)
            projected = project_categorical(logits, old_logits, bound, action_dims)
            assert projected.dtype == dtype and projected.shape == logits.shape
            _assert_within(_independent_categorical_kl(projected, old_logits, action_dims), bound)


@pytest.mark.parametrize("dtype", [th.float32, th.float64])
def test_bernoulli_within_bound(dtype):
    for bound in BOUNDS:
        for seed, far in enumerate((0.1, 1.0, 10.0, 100.0)):
            logits, old_logits = _logits_batch(256, 5, far, dtype, seed)
            projected = project_bernoulli(logits, old_logits, bound)
            assert projected.dtype == dtype and projected.shape == logits.shape
            _assert_within(_independent_bernoulli_kl(projected, old_logits), bound)


def test_extreme_logits_within_bound():
    """Logits at +-50, every sign pattern, in float32: the projected KL stays within even the smallest bound."""
    old = th.tensor([[50.0, -50.0, 0.0], [-50.0, 50.0, 50.0], [0.0, 0.0, 0.0], [50.0, 50.0, -50.0]])
    new = -old + th.tensor([0.0, 1.0, -1.0])
    for bound in BOUNDS:
        _assert_within(_independent_categorical_kl(project_categorical(new, old, bound, [3]), old, [3]), bound)
        _assert_within(_independent_bernoulli_kl(project_bernoulli(new, old, bound), old), bound)
