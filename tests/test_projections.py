"""
Trust-region projections (sb3_kl.common.projections): bounds hold in every state, inside points are unchanged,
the projection is the closest feasible point, gradients are exact, shapes and speed.

Distances are re-evaluated independently in float64 (``torch.distributions`` for KL, covariance matrices for W2 and
Frobenius). Tolerance: ``distance <= bound * (1 + 1e-6)``. The projections guarantee ``<= bound`` in their own
float64 evaluation, after rounding to the input dtype; the slack only covers the difference between two float64
formulas of the same distance (cancellation in ``r - 1 - log r`` and in ``(s^2 - s_old^2)^2``), about 1e-9 relative
at worst at the smallest bound, 1e-6.
"""

import math

import pytest
import torch as th
from torch.distributions import Bernoulli, Categorical, Independent, Normal, kl_divergence

from sb3_kl.common.projections import (
    PROJECTIONS,
    bernoulli_kl,
    categorical_kl,
    gaussian_distance_to_fixed,
    gaussian_distances,
    gaussian_entropy_projection,
    project_bernoulli,
    project_bernoulli_with_distances,
    project_categorical,
    project_categorical_with_distances,
    project_gaussian,
    project_gaussian_with_distances,
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


def test_fast_newton_steps_and_the_safeguarded_search_find_the_same_projections(monkeypatch):
    """The root search's unguarded Newton steps give what the safeguarded search alone gives, on extreme batches too."""
    import sb3_kl.common.projections as projections

    def project_all():
        out = []
        for bound in BOUNDS:
            for seed, (far, std_factor) in enumerate(GAUSSIAN_CASES):
                out += project_gaussian(*_gaussian_batch(256, 4, far, std_factor, True, th.float64, seed), bound, bound)
            for seed, far in enumerate((0.1, 1.0, 10.0, 100.0)):
                logits, old_logits = _logits_batch(256, sum(MULTI_DISCRETE), far, th.float64, seed)
                out.append(project_categorical(logits, old_logits, bound, MULTI_DISCRETE))
                out.append(project_bernoulli(logits, old_logits, bound))
        return out

    fast = project_all()
    monkeypatch.setattr(projections, "_FAST_NEWTON_STEPS", 0)
    for with_fast_steps, safeguarded in zip(fast, project_all(), strict=True):
        th.testing.assert_close(with_fast_steps, safeguarded, rtol=1e-7, atol=1e-12)


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


def test_inside_bound_is_unchanged_with_identity_gradient():
    """States already inside the bound come back bit for bit, and the gradient through them is the identity."""
    old_mean, old_std = th.randn(5, 3), 0.5 + th.rand(5, 3)
    mean = (old_mean + 1e-3).requires_grad_()
    std = (old_std * 1.001).requires_grad_()
    for projection in PROJECTIONS:
        new_mean, new_std = project_gaussian(mean, std, old_mean, old_std, 0.1, 0.1, projection)
        assert th.equal(new_mean, mean) and th.equal(new_std, std)
        mean_grad, std_grad = th.autograd.grad((new_mean * 2).sum() + (new_std * 3).sum(), (mean, std))
        assert th.equal(mean_grad, th.full_like(mean, 2.0)) and th.equal(std_grad, th.full_like(std, 3.0))
    old_logits = 3 * th.randn(5, 10)
    logits = (old_logits + 1e-3 * th.randn(5, 10)).requires_grad_()
    for projected in (
        project_categorical(logits, old_logits, 0.1, MULTI_DISCRETE),
        project_bernoulli(logits, old_logits, 0.1),
    ):
        assert th.equal(projected, logits)
        (grad,) = th.autograd.grad((projected * 2).sum(), logits)
        assert th.equal(grad, th.full_like(logits, 2.0))


def test_all_inside_batch_returns_the_inputs_themselves():
    """
    With no state outside a bound, the projection is the identity and skips its work: the input tensors themselves
    come back (gradient the identity), and the distances it reports are the inputs' own, before and after.
    """
    for per_state in (False, True):
        mean, std, old_mean, old_std = _gaussian_batch(6, 3, 1e-3, 1.0, per_state, th.float32, seed=3)
        std = (old_std * 1.001).requires_grad_()
        mean.requires_grad_()
        for projection in PROJECTIONS:
            result = project_gaussian_with_distances(mean, std, old_mean, old_std, 0.1, 0.1, projection)
            assert result.mean is mean and result.std is std
            mean_grad, std_grad = th.autograd.grad((result.mean * 2).sum() + (result.std * 3).sum(), (mean, std))
            assert th.equal(mean_grad, th.full_like(mean, 2.0)) and th.equal(std_grad, th.full_like(std, 3.0))
            mean_part, cov_part = gaussian_distances(*(x.double() for x in (mean, std, old_mean, old_std)), projection)
            assert th.equal(result.mean_before, mean_part.detach()) and th.equal(result.mean_after, result.mean_before)
            assert th.equal(result.cov_before, cov_part.detach()) and th.equal(result.cov_after, result.cov_before)
    # only the means outside: the stds come back themselves, the means are projected
    mean, std, old_mean, old_std = _gaussian_batch(6, 3, 10.0, 1.0, True, th.float32, seed=3)
    std = old_std * 1.001
    result = project_gaussian_with_distances(mean, std, old_mean, old_std, 0.1, 0.1)
    assert result.std is std and result.mean is not mean and not th.equal(result.mean, mean)
    # a state-independent std against per-state old stds is broadcast per state, as a projection would be
    result = project_gaussian_with_distances(mean, old_std[0] * 1.001, old_mean, old_std, 1e3, 1e3)
    assert result.std.shape == mean.shape
    old_logits = 3 * th.randn(5, 10, generator=th.Generator().manual_seed(3))
    logits = (old_logits + 1e-3 * th.randn(5, 10, generator=th.Generator().manual_seed(4))).requires_grad_()
    for result in (
        project_categorical_with_distances(logits, old_logits, 0.1, MULTI_DISCRETE),
        project_bernoulli_with_distances(logits, old_logits, 0.1),
    ):
        assert result.logits is logits
        (grad,) = th.autograd.grad((result.logits * 2).sum(), logits)
        assert th.equal(grad, th.full_like(logits, 2.0))
        assert th.equal(result.after, result.before) and (result.before <= 0.1).all()
    assert th.allclose(
        project_categorical_with_distances(logits, old_logits, 0.1, MULTI_DISCRETE).before,
        categorical_kl(logits.detach().double(), old_logits.double(), MULTI_DISCRETE),
        rtol=1e-9,
        atol=1e-15,
    )
    assert th.allclose(
        project_bernoulli_with_distances(logits, old_logits, 0.1).before,
        bernoulli_kl(logits.detach().double(), old_logits.double()),
        rtol=1e-9,
        atol=1e-15,
    )


def test_reported_distances_are_those_of_the_result():
    """The distances after the projection that it reports are the returned parameters' (float64), within the bound."""
    mean, std, old_mean, old_std = _gaussian_batch(32, 3, 3.0, 2.0, True, th.float32, seed=4)
    for projection in PROJECTIONS:
        result = project_gaussian_with_distances(mean, std, old_mean, old_std, 0.01, 0.001, projection)
        mean_part, cov_part = gaussian_distances(
            *(x.double() for x in (result.mean, result.std, old_mean, old_std)), projection
        )
        assert th.allclose(result.mean_after, mean_part, rtol=1e-12) and th.allclose(result.cov_after, cov_part, rtol=1e-12)
        assert result.mean_after.max() <= 0.01 and result.cov_after.max() <= 0.001
        before_mean, before_cov = gaussian_distances(*(x.double() for x in (mean, std, old_mean, old_std)), projection)
        assert th.equal(result.mean_before, before_mean) and th.equal(result.cov_before, before_cov)
    logits, old_logits = _logits_batch(32, 10, 3.0, th.float32, seed=4)
    result = project_categorical_with_distances(logits, old_logits, 0.01, MULTI_DISCRETE)
    after = categorical_kl(result.logits.double(), old_logits.double(), MULTI_DISCRETE)
    assert th.allclose(result.after, after, rtol=1e-9) and result.after.max() <= 0.01
    result = project_bernoulli_with_distances(logits, old_logits, 0.01)
    after = bernoulli_kl(result.logits.double(), old_logits.double())
    assert th.allclose(result.after, after, rtol=1e-9) and result.after.max() <= 0.01


def test_mixed_batch_changes_only_outside_states():
    """In one batch, states inside the bound are untouched and the others are moved onto the boundary."""
    mean, std, old_mean, old_std = _gaussian_batch(64, 3, 1.0, 1.0, True, th.float64)
    for projection in PROJECTIONS:
        mean_part, cov_part = gaussian_distances(mean, std, old_mean, old_std, projection)
        bound = mean_part.median().item()
        new_mean, new_std = project_gaussian(mean, std, old_mean, old_std, bound, cov_part.median().item(), projection)
        inside = mean_part <= bound
        assert th.equal(new_mean[inside], mean[inside]) and not th.equal(new_mean[~inside], mean[~inside])
        new_part, _ = _independent_distances(new_mean, new_std, old_mean, old_std, projection)
        assert th.allclose(new_part[~inside], th.full_like(new_part[~inside], bound), rtol=1e-6)


@pytest.mark.parametrize("per_state", [False, True])
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_distance_to_a_fixed_gaussian_has_autograd_values_and_gradients_bit_for_bit(projection, per_state):
    # TRPL's trust-region term: the fused KL gradient must be the one autograd computes from gaussian_distances
    mean, std, fixed_mean, fixed_std = _gaussian_batch(64, 3, 1.0, 1.3, per_state, th.float32)
    weights = th.rand(64, generator=th.Generator().manual_seed(1))
    results = []
    for fused in (True, False):
        leaf_mean, leaf_std = mean.clone().requires_grad_(), std.clone().requires_grad_()
        if fused:
            distance = gaussian_distance_to_fixed(leaf_mean, leaf_std, fixed_mean, fixed_std, projection)
        else:
            mean_part, cov_part = gaussian_distances(leaf_mean, leaf_std, fixed_mean, fixed_std, projection)
            distance = mean_part + cov_part
        (weights * distance).mean().backward()
        results.append((distance.detach(), leaf_mean.grad, leaf_std.grad))
    for fused_value, autograd_value in zip(*results, strict=True):
        assert th.equal(fused_value, autograd_value)


def test_distance_functions_match_torch_distributions():
    """The public distance helpers agree with the independent float64 evaluations."""
    for projection in PROJECTIONS:
        for per_state in (False, True):
            args = _gaussian_batch(32, 4, 2.0, 1.7, per_state, th.float64)
            mean_part, cov_part = gaussian_distances(*args, projection=projection)
            assert mean_part.shape == (32,) and cov_part.shape == ((32,) if per_state else ())
            reference = _independent_distances(*args, projection)
            assert th.allclose(mean_part, reference[0], rtol=1e-9)
            assert th.allclose(cov_part.expand(32), reference[1], rtol=1e-9)
    logits, old_logits = _logits_batch(32, 10, 3.0, th.float64)
    assert th.allclose(
        categorical_kl(logits, old_logits, MULTI_DISCRETE), _independent_categorical_kl(logits, old_logits, MULTI_DISCRETE)
    )
    assert th.allclose(bernoulli_kl(logits, old_logits), _independent_bernoulli_kl(logits, old_logits))


def _boundary_points(old, directions, constraint, bound):
    """Points ``old + s * direction`` with ``constraint == bound`` (bisection on ``s``, float64), one per direction."""
    low = th.zeros(directions.shape[0], dtype=th.float64)
    high = th.ones_like(low)
    for _ in range(80):
        outside = constraint(old + high.unsqueeze(-1) * directions) > bound
        if outside.all():
            break
        high = th.where(outside, high, 2 * high)
    for _ in range(80):
        middle = 0.5 * (low + high)
        outside = constraint(old + middle.unsqueeze(-1) * directions) > bound
        low, high = th.where(outside, low, middle), th.where(outside, middle, high)
    return old + low.unsqueeze(-1) * directions


def _closeness(projection, part, candidate, mean, std, old_std):
    """
    What each projection minimises: the same distance, measured from the candidate to the new (unprojected)
    distribution. Means: under the old covariance for KL and Frobenius, plain Euclidean for W2. Covariances:
    KL(Sigma~ || Sigma), |sigma~ - sigma|^2, |Sigma~ - Sigma|_F^2.
    """
    if part == "mean":
        return gaussian_distances(candidate, old_std, mean, old_std, projection)[0]
    return gaussian_distances(mean, candidate, mean, std, projection)[1]


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("part", ["mean", "cov"])
def test_gaussian_projection_is_the_closest_point(projection, part):
    """No random point on the boundary of the trust region is closer to the new distribution than the projection."""
    gen = th.Generator().manual_seed(3)
    k, bound = 4, 0.05
    old_mean, old_std = th.randn(1, k, generator=gen, dtype=th.float64), 0.5 + th.rand(1, k, generator=gen, dtype=th.float64)
    mean = old_mean + 2 * th.randn(1, k, generator=gen, dtype=th.float64)
    std = old_std * th.exp(th.randn(1, k, generator=gen, dtype=th.float64))
    new_mean, new_std = project_gaussian(mean, std, old_mean, old_std, bound, bound, projection)
    directions = th.randn(4000, k, generator=gen, dtype=th.float64)
    if part == "mean":
        alternatives = _boundary_points(
            old_mean, directions, lambda x: gaussian_distances(x, old_std, old_mean, old_std, projection)[0], bound
        )
        best = _closeness(projection, part, new_mean, mean, std, old_std)
        others = _closeness(projection, part, alternatives, mean, std, old_std)
    else:
        # random directions in log-std space
        log_alternatives = _boundary_points(
            old_std.log(), directions, lambda x: gaussian_distances(old_mean, x.exp(), old_mean, old_std, projection)[1], bound
        )
        best = _closeness(projection, part, new_std, mean, std, old_std)
        others = _closeness(projection, part, log_alternatives.exp(), mean, std, old_std)
    assert best.item() <= others.min().item() * (1 + 1e-9)
    assert best.item() >= others.min().item() * 0.5  # the sampled boundary comes close: the comparison is not vacuous


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_one_dimensional_projection_matches_brute_force(projection):
    """In one dimension, a fine grid over the feasible interval finds the same closest mean and std."""
    old_mean, old_std = th.tensor([[0.3]], dtype=th.float64), th.tensor([[0.7]], dtype=th.float64)
    bound = 0.02
    for mean, std in ((2.0, 2.5), (-1.0, 0.1)):
        mean, std = th.tensor([[mean]], dtype=th.float64), th.tensor([[std]], dtype=th.float64)
        new_mean, new_std = project_gaussian(mean, std, old_mean, old_std, bound, bound, projection)
        means = th.linspace(-1.0, 2.0, 300001, dtype=th.float64).unsqueeze(-1)
        stds = th.exp(th.linspace(-3.0, 3.0, 300001, dtype=th.float64)).unsqueeze(-1)
        mean_part, _ = gaussian_distances(means, old_std, old_mean, old_std, projection)
        _, cov_part = gaussian_distances(old_mean, stds, old_mean, old_std, projection)
        mean_objective = _closeness(projection, "mean", means, mean, std, old_std)
        std_objective = _closeness(projection, "cov", stds, mean, std, old_std)
        best_mean = means[th.where(mean_part <= bound, mean_objective, th.inf).argmin()]
        best_std = stds[th.where(cov_part <= bound, std_objective, th.inf).argmin()]
        assert abs(best_mean.item() - new_mean.item()) < 2e-5
        assert abs(best_std.item() / new_std.item() - 1) < 5e-5


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("per_state", [False, True])
def test_one_dimensional_kl_covariance_closed_form_matches_the_root_search(bound, per_state):
    """
    With one action dimension the KL covariance projection is closed form; the root search (reached here with a
    per-state target, which the closed form does not take) finds the same stds, and gradcheck passes through both.
    """
    from sb3_kl.common.projections import _cov_distance, _project_kl_cov

    _, std, _, old_std = _gaussian_batch(64, 1, 1.0, 1.0, per_state, th.float64, seed=11)
    if per_state:  # both sides, far and near
        std = std * th.exp(th.linspace(-12.0, 4.0, std.numel(), dtype=th.float64)).reshape(std.shape)
    else:  # one std for every state (SB3's log_std), far enough to be outside every bound
        std = old_std * math.exp(-12.0)
    cov_part = _cov_distance(std, old_std, "kl")
    active = cov_part > bound
    target = bound * (1 - 1e-9)
    closed = _project_kl_cov(std, old_std, cov_part, active, bound, target)
    searched = _project_kl_cov(std, old_std, cov_part, active, bound, th.full_like(cov_part, target))
    assert active.any() and closed.shape == searched.shape
    th.testing.assert_close(closed, searched, rtol=1e-8, atol=0)  # the search stops at |KL - target| <= 1e-10 bound
    assert _cov_distance(closed, old_std, "kl").max().item() <= bound
    assert th.autograd.gradcheck(
        lambda s: _project_kl_cov(s, old_std, _cov_distance(s, old_std, "kl"), active, bound, target),
        (std.clone().requires_grad_(),),
    )


@pytest.mark.parametrize("space", ["discrete", "multi_discrete", "multi_binary"])
def test_categorical_projection_is_the_closest_point(space):
    """No random distribution on the boundary KL(q || p_old) = bound has a smaller KL(q || p) than the projection."""
    gen = th.Generator().manual_seed(4)
    action_dims = {"discrete": [6], "multi_discrete": MULTI_DISCRETE}.get(space)
    n, bound = (sum(action_dims) if action_dims else 5), 0.05
    old_logits = 2 * th.randn(1, n, generator=gen, dtype=th.float64)
    logits = old_logits + 3 * th.randn(1, n, generator=gen, dtype=th.float64)
    if action_dims is None:
        projected = project_bernoulli(logits, old_logits, bound)

        def kl(x, y):
            return bernoulli_kl(x, y.expand_as(x))

    else:
        projected = project_categorical(logits, old_logits, bound, action_dims)

        def kl(x, y):
            return categorical_kl(x, y.expand_as(x), action_dims)

    assert kl(logits, old_logits).item() > 2 * bound  # outside: the projection is active
    alternatives = _boundary_points(
        old_logits, th.randn(4000, n, generator=gen, dtype=th.float64), lambda x: kl(x, old_logits), bound
    )
    best, others = kl(projected, logits), kl(alternatives, logits)
    assert best.item() <= others.min().item() * (1 + 1e-9)
    assert best.item() >= others.min().item() * 0.5


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("per_state", [False, True])
def test_gaussian_gradcheck(projection, per_state):
    """Gradients through the projection (and, for KL, the implicit multiplier) match finite differences."""
    mean, std, old_mean, old_std = _gaussian_batch(3, 3, 3.0, 2.5, per_state, th.float64, seed=5)
    mean[0] = old_mean[0] + 1e-3  # one state inside the mean bound: identity there
    assert th.autograd.gradcheck(
        lambda m, s: project_gaussian(m, s, old_mean, old_std, 0.05, 0.05, projection),
        (mean.requires_grad_(), std.requires_grad_()),
    )


def test_categorical_and_bernoulli_gradcheck():
    """Gradients through the categorical and Bernoulli projections (implicit multiplier) match finite differences."""
    logits, old_logits = _logits_batch(3, 10, 2.0, th.float64, seed=6)
    logits[0] = old_logits[0] + 1e-3  # one state inside the bound: identity there
    logits.requires_grad_()
    assert th.autograd.gradcheck(lambda x: project_categorical(x, old_logits, 0.05, MULTI_DISCRETE), (logits,))
    assert th.autograd.gradcheck(lambda x: project_bernoulli(x, old_logits, 0.05), (logits,))


def test_old_tensors_may_require_grad():
    """Old parameters are constants: passing ones that require grad neither fails nor receives a gradient."""
    mean, std, old_mean, old_std = (x.requires_grad_() for x in _gaussian_batch(8, 3, 5.0, 3.0, True, th.float32))
    new_mean, new_std = project_gaussian(mean, std, old_mean, old_std, 0.01, 0.01)
    (new_mean.sum() + new_std.sum()).backward()
    assert old_mean.grad is None and old_std.grad is None and mean.grad is not None
    logits, old_logits = (x.requires_grad_() for x in _logits_batch(8, 10, 5.0, th.float32))
    (
        project_categorical(logits, old_logits, 0.01, MULTI_DISCRETE).sum() + project_bernoulli(logits, old_logits, 0.01).sum()
    ).backward()
    assert old_logits.grad is None and logits.grad is not None


def _project_all(gaussians, logits, old_logits):
    """Every projection on one batch: the Gaussian with a shared and a per-state std, the categorical, the Bernoulli."""
    out = [project_gaussian(*gaussian, 0.01, 0.001) for gaussian in gaussians]
    out.append(project_categorical(logits, old_logits, 0.01, MULTI_DISCRETE))
    out.append(project_bernoulli(logits, old_logits, 0.01))
    return out


@pytest.mark.parametrize("batch", [1, 4096])
def test_shapes(batch):
    """A batch of one and a large batch (4096 x 6) keep their shapes."""
    gaussians = [_gaussian_batch(batch, 6, 10.0, 3.0, per_state, th.float32) for per_state in (False, True)]
    logits, old_logits = _logits_batch(batch, 10, 3.0, th.float32)
    (shared_mean, shared_std), (mean, std), categorical, bernoulli = _project_all(gaussians, logits, old_logits)
    assert shared_mean.shape == mean.shape == (batch, 6) and shared_std.shape == (6,) and std.shape == (batch, 6)
    assert categorical.shape == bernoulli.shape == (batch, 10)


def test_state_independent_std_is_projected_once():
    """With SB3's state-independent std, the projected std is one (k,) vector, equal to the per-state result."""
    mean, std, old_mean, old_std = _gaussian_batch(16, 3, 1.0, 4.0, False, th.float64)
    _, shared = project_gaussian(mean, std, old_mean, old_std, 0.1, 0.01)
    _, per_state = project_gaussian(mean, std.expand(16, 3), old_mean, old_std.expand(16, 3), 0.1, 0.01)
    assert shared.shape == (3,) and th.allclose(per_state, shared.expand(16, 3), rtol=1e-12)


def test_bad_arguments_fail_early():
    mean, std, old_mean, old_std = _gaussian_batch(4, 2, 1.0, 1.0, False, th.float32)
    with pytest.raises(ValueError, match="projection"):
        project_gaussian(mean, std, old_mean, old_std, 0.1, 0.1, projection="l2")
    with pytest.raises(ValueError, match="cov_bound"):
        project_gaussian(mean, std, old_mean, old_std, 0.1, 0.0)
    with pytest.raises(ValueError, match="old_mean"):
        project_gaussian(mean, std, old_mean[:2], old_std, 0.1, 0.1)
    with pytest.raises(ValueError, match="action size"):
        project_gaussian(mean, std[:1], old_mean, old_std, 0.1, 0.1)
    logits, old_logits = _logits_batch(4, 5, 1.0, th.float32)
    with pytest.raises(ValueError, match="action_dims"):
        project_categorical(logits, old_logits, 0.1, [2, 2])
    with pytest.raises(ValueError, match="bound"):
        project_bernoulli(logits, old_logits, -1.0)
    with pytest.raises(ValueError, match="old_logits"):
        project_bernoulli(logits, old_logits[:, :3], 0.1)


def test_entropy_projection_raises_low_entropy_only():
    std = th.tensor([[1e-3, 1e-2], [1.0, 2.0]], requires_grad=True)
    min_entropy = 0.0
    new_std = gaussian_entropy_projection(std, min_entropy)
    entropy = Independent(Normal(th.zeros(2, 2), new_std), 1).entropy()
    assert entropy[0].item() == pytest.approx(min_entropy, abs=1e-5)
    assert th.equal(new_std[1], std[1]) and entropy[1].item() > min_entropy
    assert gaussian_entropy_projection(std[1].detach(), min_entropy).shape == (2,)


def test_move_below_float32_resolution_rounds_to_the_old_mean():
    """A mean 1000 with std 1e-3 cannot move by 1.4e-6 in float32: rounded toward the old mean, it stays inside."""
    old_mean, old_std = th.full((2, 1), 1000.0), th.full((1,), 1e-3)
    mean = old_mean + th.tensor([[1.0], [-1.0]])
    new_mean, _ = project_gaussian(mean, old_std, old_mean, old_std, 1e-6, 1e-6)
    assert th.equal(new_mean, old_mean)
    new_mean, _ = project_gaussian(mean.double(), old_std.double(), old_mean.double(), old_std.double(), 1e-6, 1e-6)
    mean_part, _ = _independent_distances(new_mean, old_std, old_mean, old_std, "kl")
    assert th.allclose(mean_part, th.full_like(mean_part, 1e-6), rtol=1e-6)  # float64 reaches the boundary


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_gradcheck_far_outside_a_small_bound(projection):
    """Far outside a small bound (means 30 stds away, stds x0.01, logits 10 apart, bound 1e-4) gradients still match."""
    mean, std, old_mean, old_std = _gaussian_batch(3, 3, 30.0, 1e-2, True, th.float64, seed=7)
    assert th.autograd.gradcheck(
        lambda m, s: project_gaussian(m, s, old_mean, old_std, 1e-4, 1e-4, projection),
        (mean.requires_grad_(), std.requires_grad_()),
    )
    if projection == "kl":
        logits, old_logits = _logits_batch(3, 10, 10.0, th.float64, seed=7)
        logits.requires_grad_()
        assert th.autograd.gradcheck(lambda x: project_categorical(x, old_logits, 1e-4, MULTI_DISCRETE), (logits,))
        assert th.autograd.gradcheck(lambda x: project_bernoulli(x, old_logits, 1e-4), (logits,))


def test_multi_discrete_factors_share_one_multiplier():
    """Every factor is interpolated with the same weight t = 1 / (1 + eta), so that the joint KL is what is bounded."""
    logits, old_logits = _logits_batch(16, 10, 3.0, th.float64, seed=8)
    projected = project_categorical(logits, old_logits, 0.01, MULTI_DISCRETE)
    weights = []
    for new, old, proj in zip(*(x.split(MULTI_DISCRETE, -1) for x in (logits, old_logits, projected)), strict=True):
        # up to a constant per factor, proj - old = t (new - old): remove the constants, then solve for t
        step, full = proj - old, new - old
        step, full = step - step.mean(-1, keepdim=True), full - full.mean(-1, keepdim=True)
        weights.append((step * full).sum(-1) / (full * full).sum(-1))
        assert th.allclose(step, weights[-1].unsqueeze(-1) * full, atol=1e-9)
    assert th.allclose(weights[0], weights[1], rtol=1e-9) and th.allclose(weights[0], weights[2], rtol=1e-9)
    assert (weights[0] < 1).all()  # every state was outside the bound and moved


def test_float32_gradients_match_float64():
    """The float32 path (rounded toward the old parameters, or re-solved) has the gradient of the float64 projection."""
    mean, std, old_mean, old_std = _gaussian_batch(8, 3, 5.0, 3.0, True, th.float32, seed=9)
    logits, old_logits = _logits_batch(8, 10, 5.0, th.float32, seed=9)
    weights = th.randn(8, 10, generator=th.Generator().manual_seed(9))

    def gradients(dtype):
        inputs = [x.detach().to(dtype).clone().requires_grad_() for x in (mean, std, logits)]
        for projection in PROJECTIONS:
            new_mean, new_std = project_gaussian(
                inputs[0], inputs[1], old_mean.to(dtype), old_std.to(dtype), 0.01, 0.01, projection
            )
            (new_mean * weights[:, :3] + new_std.log() * weights[:, 3:6]).sum().backward()
        projected = project_categorical(inputs[2], old_logits.to(dtype), 0.01, MULTI_DISCRETE)
        (projected.log_softmax(-1) * weights).sum().backward()
        (project_bernoulli(inputs[2], old_logits.to(dtype), 0.01) * weights).sum().backward()
        return [x.grad.double() for x in inputs]

    for low, high in zip(gradients(th.float32), gradients(th.float64), strict=True):
        assert th.allclose(low, high, rtol=1e-3, atol=1e-4)
