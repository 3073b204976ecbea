"""
Differentiable per-state trust-region projections of action distributions (the layers of TRPL).

Otto et al., "Differentiable Trust Region Layers for Deep Reinforcement Learning", ICLR 2021
(https://arxiv.org/abs/2101.09207): in every state, the policy's distribution ``pi`` is replaced by the closest
distribution ``pi~`` that lies within a bound of the rollout ("old") policy's distribution ``pi_old`` in that state, and
the loss is differentiated through this projection. A distribution already inside its bound is returned unchanged.

Gaussians (diagonal, as in SB3) are bounded separately in mean and covariance, each with its own bound:

- ``"kl"``: mean part ``0.5 (mu - mu_old)^T Sigma_old^-1 (mu - mu_old)`` (Mahalanobis under the old covariance),
  covariance part ``0.5 [tr(Sigma_old^-1 Sigma) - k + log det Sigma_old - log det Sigma]``; the two add up to
  KL(pi || pi_old). The covariance projection interpolates the precisions,
  ``Sigma~^-1 = (Sigma^-1 + eta Sigma_old^-1) / (1 + eta)``, with the multiplier ``eta >= 0`` found per state by a
  1-D root search (closed form with one action dimension).
- ``"w2"``: the squared 2-Wasserstein distance, unscaled: mean part ``||mu - mu_old||^2`` (plain Euclidean),
  covariance part ``||sigma - sigma_old||^2`` on the standard deviations. The bounds are therefore in squared
  action units. Closed form: both parts interpolate linearly (means, resp. standard deviations).
- ``"frobenius"``: mean part ``(mu - mu_old)^T Sigma_old^-1 (mu - mu_old)`` (Mahalanobis, without the 0.5),
  covariance part ``||Sigma - Sigma_old||_F^2``. Closed form: interpolation of the means, resp. the variances.

Every closed form is ``x~ = (x + omega x_old) / (1 + omega)`` with ``omega = sqrt(d / bound) - 1`` when the
distance ``d`` exceeds the bound. Each projection minimises the same kind of distance to the network's distribution
that it bounds to the old one: for the means, the distance above with the old covariance kept (Mahalanobis under
``Sigma_old`` for KL and Frobenius, Euclidean for W2); for the covariances, ``KL(Sigma~ || Sigma)`` for KL,
``||sigma~ - sigma||^2`` for W2 and ``||Sigma~ - Sigma||_F^2`` for Frobenius.

Categorical, MultiDiscrete and Bernoulli (MultiBinary) distributions are projected with the I-projection
``min KL(q || p) s.t. KL(q || p_old) <= bound``, whose solution is the geometric interpolation of the natural
parameters (logits), ``z~ = (z + eta z_old) / (1 + eta)``. One ``eta`` per state is shared by all factors of a
MultiDiscrete / MultiBinary distribution, so that the *joint* KL is bounded.

All computations run in float64. The root searches work on ``t = 1 / (1 + eta)`` in ``(0, 1]`` (safeguarded
Newton inside a bracket). The gradient of the multiplier is implicit differentiation, implemented as one Newton step
at the converged root whose value is zero and whose derivative of the constraint in ``t`` is detached:
``t = t* - (g(t*, theta) - g(t*, theta).detach()) / g_t(t*)``, so that ``dt/dtheta = -g_theta / g_t``, exact at the
root.

Old tensors are treated as constants (detached). Outputs have the dtype of the inputs. The returned distributions
are within the bound in every state, as evaluated in float64 by the distances of this module, also after rounding to
float32: Gaussian parameters are rounded toward the old ones (each part of each distance grows with every entry's
distance to its old value), while categorical and Bernoulli projections aim at ``bound * (1 - 1e-4)`` in float32
(rounding logits of size ``|z|`` moves the KL by about ``1e-7 |z| sqrt(bound)``). The rounded result is re-evaluated
in float64 and the few states still outside are solved again; a state whose projection cannot be represented within
the bound in float32 (a move below float32 resolution) gets the old distribution.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch as th
from torch.nn import functional as F

from sb3_kl.common.kl import MultiCategoricalParams

PROJECTIONS = ("kl", "w2", "frobenius")

# Relative margins below the bound aimed at, so that the rounded result stays inside
_FLOAT32_MARGIN = 1e-4
_FLOAT64_MARGIN = 1e-9
# Stop the root search when |g| <= _ROOT_RTOL * bound (or the bracket is at machine precision): a tenth of the float64
# margin, so that the root is inside the bound; tighter would chase the rounding noise of the distances (about
# 1e-12 of the bound, from the cancellation in the KL covariance part), which took the search 2-4 evaluations more
_ROOT_RTOL = 1e-10
_MAX_ROOT_ITERATIONS = 100
# Unguarded Newton steps tried before the safeguarded search (three reach the tolerance from the usual start)
_FAST_NEWTON_STEPS = 6


class GaussianProjection(NamedTuple):
    """
    The projected Gaussian, with the distances to the old one that the projection measured (float64, no gradient).
    A part with no state outside its bound is the input tensor itself (the identity, gradient included).
    """

    mean: th.Tensor
    std: th.Tensor
    #: mean part per state before and after the projection, ``(batch,)``
    mean_before: th.Tensor
    mean_after: th.Tensor
    #: covariance part before and after, ``(batch,)``, or ``()`` for state-independent stds
    cov_before: th.Tensor
    cov_after: th.Tensor


class LogitsProjection(NamedTuple):
    """
    Projected logits (categorical or Bernoulli), with the joint KL to the old distribution per state before and after
    the projection (float64, no gradient). With no state outside the bound, ``logits`` is the input tensor itself.
    """

    logits: th.Tensor
    before: th.Tensor
    after: th.Tensor


def _check_bound(bound: float, name: str) -> None:
    """Fail early on a bound that is not a positive finite number (Python, NumPy or 0-d tensor)."""
    try:
        valid = not isinstance(bound, bool) and 0.0 < float(bound) < math.inf
    except (TypeError, ValueError, RuntimeError):
        valid = False
    if not valid:
        raise ValueError(f"`{name}` must be a positive finite number, got {bound!r}: pass e.g. {name}=0.01")


def _check_projection(projection: str) -> None:
    """Fail early on an unknown projection name."""
    if projection not in PROJECTIONS:
        raise ValueError(f"`projection` must be one of {PROJECTIONS}, got {projection!r}")


def _check_same_shape(new: th.Tensor, old: th.Tensor, name: str) -> None:
    """Fail early when a new tensor and its old counterpart differ in shape."""
    if new.shape != old.shape:
        raise ValueError(
            f"`{name}` {tuple(new.shape)} and `old_{name}` {tuple(old.shape)} must have the same shape: pass the "
            "rollout policy's parameters on the same states"
        )


class _RoundToward(th.autograd.Function):
    """
    Cast float64 ``values`` to ``dtype``, rounding each entry toward ``old`` (float64, representable in ``dtype``)
    instead of to the nearest, so that no entry ends farther from its old value than before. The gradient is the
    cast's (one node, where the cast and its correction would record four).
    """

    @staticmethod
    def forward(ctx, values, old, dtype):  # type: ignore[no-untyped-def,override]
        nearest = values.to(dtype)
        farther = (nearest.to(th.float64) - old).abs() > (values - old).abs()
        return th.where(farther, th.nextafter(nearest, old.to(dtype)), nearest)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        return grad.to(th.float64), None, None


def _round_toward(values: th.Tensor, old: th.Tensor, dtype: th.dtype) -> th.Tensor:
    """:class:`_RoundToward`: ``values`` (float64) in ``dtype``, each entry rounded toward ``old``."""
    return _RoundToward.apply(values, old, dtype)


def _round_inside(
    solve: Callable[[float | th.Tensor], th.Tensor],
    distance: Callable[[th.Tensor], th.Tensor],
    old: th.Tensor,
    bound: float,
    dtype: th.dtype,
    separable: bool,
) -> th.Tensor:
    """
    Run a projection in float64 and return it in ``dtype``, inside the bound after rounding.

    A *separable* distance (a sum over entries, each growing with the entry's distance to its old value: every
    Gaussian part here) is kept inside by rounding toward the old parameters. Otherwise (categorical and Bernoulli
    KL) the float32 search aims at ``bound * (1 - 1e-4)``. Either way the rounded result is re-evaluated in float64;
    states still outside are solved again with a target lowered by their excess, up to three times, and a state that
    still fails (a move below float32 resolution) falls back to the old parameters.

    :param solve: maps a target (float or per-state tensor) to the projected parameters in float64
    :param distance: maps parameters (float64) to the constrained distance per state
    :param old: the old parameters, float64
    :param bound: the bound
    :param dtype: the dtype of the result
    :param separable: whether rounding toward ``old`` cannot increase the distance
    :return: the projected parameters in ``dtype``, and their distance per state (float64, the re-check's)
    """
    if dtype == th.float64 or separable:
        margin = _FLOAT64_MARGIN

        def cast(values: th.Tensor) -> th.Tensor:
            return values if dtype == th.float64 else _round_toward(values, old, dtype)

    else:
        margin = _FLOAT32_MARGIN

        def cast(values: th.Tensor) -> th.Tensor:
            return values.to(dtype)

    target: float | th.Tensor = bound * (1.0 - margin)
    result = cast(solve(target))
    for _ in range(3):
        with th.no_grad():
            dist = distance(result.detach().to(th.float64))
        over = dist > bound
        if not bool(over.any()):
            return result, dist
        target = th.where(over, target * (bound / dist) * (1.0 - margin), target)
        result = cast(solve(target))
    with th.no_grad():
        dist = distance(result.detach().to(th.float64))
        over = dist > bound
    return th.where(over.unsqueeze(-1), old.to(dtype), result), th.where(over, th.zeros_like(dist), dist)


def _solve_increasing(
    fn: Callable[[th.Tensor], tuple[th.Tensor, th.Tensor]],
    t0: th.Tensor,
    target: float | th.Tensor,
    bound: float,
    active: th.Tensor,
    rtol: float = _ROOT_RTOL,
) -> th.Tensor:
    """
    Batched root search of ``g(t) = D(t) - target = 0`` for a distance ``D >= 0`` increasing on ``[0, 1]``, with
    ``D(0) = 0 < target < D(1)``.

    Safeguarded Newton on ``sqrt(D) - sqrt(target)``: the distances here grow like ``t^2`` from 0, so their square
    root is close to linear in ``t`` and Newton lands in about half the steps it needs on ``g`` itself (same root,
    same bracket). Plain Newton steps come first, as long as each stays in ``(0, 1]``; if they do not converge, a
    bracket ``[lo, hi]`` is kept, and a Newton step that leaves it is replaced by the secant of the bracket, or else
    by a geometric bisection. Returns, per entry, the final iterate if ``g <= rtol * bound`` there
    (stepped back if not), and otherwise the feasible end of the bracket: callers aim at a target at least
    ``10 rtol * bound`` below the bound, so the root is inside it.

    :param fn: maps ``t`` (float64, no grad) to ``(g(t), g'(t))``
    :param t0: starting point in ``(0, 1]``
    :param target: the distance aimed at (float or per entry)
    :param bound: the bound, to scale the stopping tolerance
    :param active: entries outside the bound; the others are not searched and return ``t = 1``
    :param rtol: stop when ``|g| <= rtol * bound``
    :return: the root, float64, without grad
    """
    tol = rtol * bound
    sqrt_target = math.sqrt(target) if isinstance(target, float) else th.sqrt(target)

    def newton_step(t: th.Tensor, g: th.Tensor, dg: th.Tensor) -> th.Tensor:
        # Newton on sqrt(D): t - (sqrt(D) - sqrt(target)) 2 sqrt(D) / g', the difference of roots without cancellation
        sqrt_d = th.sqrt((g + target).clamp(min=0.0))
        return t - 2.0 * g * sqrt_d / (dg * (sqrt_d + sqrt_target))

    t = t0.clamp(1e-300, 1.0)
    # The usual case first, with no bracket to keep: plain Newton steps while every one stays in (0, 1]
    for _ in range(_FAST_NEWTON_STEPS):
        g, dg = fn(t)
        done = (g.abs() <= tol) | ~active
        newton = newton_step(t, g, dg)
        # one host read for both: whether to stop, and whether every step still searching stays in (0, 1]
        all_done, all_inside = th.stack((done.all(), (done | ((newton > 0) & (newton <= 1))).all())).tolist()
        if all_done:
            return th.where(active, t, th.ones_like(t))
        if not all_inside:
            break
        t = th.where(done, t, newton)
    # Safeguarded search from where the fast steps stopped (the bracket [0, 1] holds every root)
    lo, hi = th.zeros_like(t0), th.ones_like(t0)
    g_lo, g_hi = th.full_like(t0, -th.inf), th.full_like(t0, th.inf)  # g at the bracket ends, once known
    previous = th.zeros_like(t0, dtype=th.bool)
    g_previous = th.full_like(t0, th.inf)
    for _ in range(_MAX_ROOT_ITERATIONS):
        g, dg = fn(t)
        feasible = g <= 0
        # Illinois rule: an end kept twice in a row has its g halved, so that the secant cannot stall on it
        g_lo = th.where(~feasible & ~previous, 0.5 * g_lo, g_lo)
        g_hi = th.where(feasible & previous, 0.5 * g_hi, g_hi)
        lo, g_lo = th.where(feasible, t, lo), th.where(feasible, g, g_lo)
        hi, g_hi = th.where(feasible, hi, t), th.where(feasible, g_hi, g)
        previous = feasible
        g_abs = g.abs()
        done = (g_abs <= tol) | (hi - lo <= 4e-16 * hi) | ~active
        # A Newton step that leaves the bracket falls back to the secant of the bracket; when |g| did not halve in
        # the last step, to a bisection instead (geometric while the bracket spans decades, or a tenfold
        # step down while no feasible point is known)
        newton = newton_step(t, g, dg)
        slow = g_abs > 0.5 * g_previous
        g_previous = g_abs
        take_newton = (newton > lo) & (newton < hi) & ~slow
        # one host read for both: whether to stop, and whether every entry still searching takes its Newton step
        all_done, all_newton = th.stack((done.all(), (done | take_newton).all())).tolist()
        if all_done:
            break
        if all_newton:  # the usual case near the root: the fallbacks would not be used
            t = th.where(done, t, newton)
            continue
        secant = lo - g_lo * (hi - lo) / (g_hi - g_lo)
        bisection = th.where(lo > 0.1 * hi, 0.5 * (lo + hi), th.where(lo > 0, th.sqrt(lo * hi), 0.1 * hi))
        fallback = th.where((secant > lo) & (secant < hi) & ~slow, secant, bisection)
        t = th.where(done, t, th.where(take_newton, newton, fallback))
    # Stopped on the bracket's width beyond the tolerance: step back until within it (else keep the bracket's end)
    for _ in range(4):
        if bool(((g <= tol) | ~active).all()):
            break
        back = th.maximum(2.0 * g / dg, 4e-16 * t)
        t = th.where((g > tol) & active, th.where(th.isfinite(back), t - back, lo), t).clamp(min=0.0)
        g, dg = fn(t)
    return th.where(active, th.where(g <= tol, t, lo), th.ones_like(t))


def _implicit_t(t_root: th.Tensor, fn: Callable[[th.Tensor], tuple[th.Tensor, th.Tensor]], active: th.Tensor) -> th.Tensor:
    """
    Attach the implicit gradient to a root ``t*`` of ``g(t, theta) = 0``: value ``t*``, derivative ``-g_theta / g_t``.

    :param t_root: the root (no grad)
    :param fn: maps ``t`` to ``(g, g_t)``, with ``g`` differentiable in the new parameters
    :param active: entries where the constraint is active (elsewhere ``t = 1`` and no gradient is attached)
    :return: ``t`` with the implicit gradient
    """
    g, dg = fn(t_root)
    dg = th.where(active & (dg > 0), dg.detach(), th.ones_like(dg))
    step = th.where(active, (g - g.detach()) / dg, th.zeros_like(g))
    return t_root - step


def _mean_distance(mean: th.Tensor, old_mean: th.Tensor, old_std: th.Tensor, projection: str) -> th.Tensor:
    """Mean part of the distance per state (any floating dtype)."""
    if projection == "w2":
        return ((mean - old_mean) ** 2).sum(-1)
    mahalanobis = (((mean - old_mean) / old_std) ** 2).sum(-1)
    return 0.5 * mahalanobis if projection == "kl" else mahalanobis


def _cov_distance(std: th.Tensor, old_std: th.Tensor, projection: str) -> th.Tensor:
    """Covariance part of the distance per state, or a scalar for state-independent stds (any floating dtype)."""
    if projection == "w2":
        return ((std - old_std) ** 2).sum(-1)
    if projection == "frobenius":
        return ((std**2 - old_std**2) ** 2).sum(-1)
    # 0.5 * sum(r - 1 - log r) with r = var / old_var, written with expm1 to keep small values exact
    log_ratio = 2.0 * (th.log(std) - th.log(old_std))
    return 0.5 * (th.expm1(log_ratio) - log_ratio).sum(-1)


def gaussian_distances(
    mean: th.Tensor, std: th.Tensor, old_mean: th.Tensor, old_std: th.Tensor, projection: str = "kl"
) -> tuple[th.Tensor, th.Tensor]:
    """
    The mean and covariance parts of the distance between two diagonal Gaussians, per state.

    :param mean: new means, shape ``(batch, k)``
    :param std: new standard deviations, ``(k,)`` (state-independent) or ``(batch, k)``
    :param old_mean: old means, ``(batch, k)``
    :param old_std: old standard deviations, ``(k,)`` or ``(batch, k)``
    :param projection: one of ``PROJECTIONS`` (see the module docstring for each distance)
    :return: the mean part, shape ``(batch,)``, and the covariance part, ``(batch,)`` if either std is per state,
        else shape ``()``
    """
    _check_projection(projection)
    return _mean_distance(mean, old_mean, old_std, projection), _cov_distance(std, old_std, projection)


class _KLToFixed(th.autograd.Function):
    """
    The KL distance of :func:`gaussian_distances` (mean part plus covariance part) to a Gaussian held fixed, with the
    gradient autograd computes for it written out, the same operations in the same order (one node where autograd
    records about fifteen: TRPL's trust-region term, once per minibatch).
    """

    @staticmethod
    def forward(ctx, mean, std, fixed_mean, fixed_std):  # type: ignore[no-untyped-def,override]
        scaled = (mean - fixed_mean) / fixed_std
        log_ratio = 2.0 * (th.log(std) - th.log(fixed_std))
        expm1 = th.expm1(log_ratio)
        cov_part = 0.5 * (expm1 - log_ratio).sum(-1)
        ctx.save_for_backward(scaled, std, fixed_std, expm1)
        ctx.cov_shape = cov_part.shape
        return 0.5 * (scaled**2).sum(-1) + cov_part

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        scaled, std, fixed_std, expm1 = ctx.saved_tensors
        mean_grad = (grad * 0.5).unsqueeze(-1) * (2.0 * scaled) / fixed_std
        cov_grad = (grad.sum_to_size(ctx.cov_shape) * 0.5).unsqueeze(-1)
        log_ratio_grad = cov_grad * (expm1 + 1) + -cov_grad
        std_grad = (log_ratio_grad * 2.0).sum_to_size(std.shape) / std
        return mean_grad, std_grad, None, None


def gaussian_distance_to_fixed(
    mean: th.Tensor, std: th.Tensor, fixed_mean: th.Tensor, fixed_std: th.Tensor, projection: str = "kl"
) -> th.Tensor:
    """
    The joint distance (mean part plus covariance part, :func:`gaussian_distances`) from ``(mean, std)`` to a Gaussian
    held fixed (no gradient), per state: TRPL's trust-region term ``d(pi_net, stopgrad(pi_proj))``. The KL distance
    takes a fused gradient (:class:`_KLToFixed`, the same values as autograd's).

    :return: ``(batch,)``
    """
    fixed_mean, fixed_std = fixed_mean.detach(), fixed_std.detach()
    if projection == "kl" and mean.shape == fixed_mean.shape:
        return _KLToFixed.apply(mean, std, fixed_mean, fixed_std)
    mean_part, cov_part = gaussian_distances(mean, std, fixed_mean, fixed_std, projection)
    return mean_part + cov_part


class _Interpolation(th.autograd.Function):
    """
    ``x~ = x_old + (x - x_old) s`` with ``s = sqrt(target / d)`` on the states outside the bound (``x`` elsewhere),
    for a distance ``d = sum(weight (x - x_old)^2)``: the closed forms' step, with its gradient written out (a few
    operations, where autograd would record a dozen). ``x_old``, ``d`` and the target are constants.
    """

    @staticmethod
    def forward(ctx, values, old, dist, weight, active, target):  # type: ignore[no-untyped-def,override]
        dist = th.where(active, dist, th.ones_like(dist))  # the states inside keep x: any positive d will do
        scale = th.sqrt(target / dist).unsqueeze(-1)
        delta = values - old
        ctx.save_for_backward(delta, scale, dist, active)
        ctx.weight, ctx.shape = weight, values.shape
        return th.where(active.unsqueeze(-1), old + delta * scale, values)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        delta, scale, dist, active = ctx.saved_tensors
        # d s / d x = -s weight (x - x_old) / d
        along = (grad * delta).sum(-1, keepdim=True) / dist.unsqueeze(-1)
        projected = scale * (grad - along * ctx.weight * delta)
        values_grad = th.where(active.unsqueeze(-1), projected, grad).sum_to_size(ctx.shape)
        return values_grad, None, None, None, None, None


def _project_closed(
    values: th.Tensor,
    old: th.Tensor,
    dist: th.Tensor,
    active: th.Tensor,
    target: float | th.Tensor,
    weight: float | th.Tensor = 1.0,
) -> th.Tensor:
    """
    Closed-form projection of a distance ``d = sum(weight (values - old)^2)`` (the means; the stds in W2; the
    variances in Frobenius), float64 in and out.

    :param dist: the distance of ``values`` per state (a constant: the gradient is :class:`_Interpolation`'s)
    :param active: the states outside the bound
    :param weight: the distance's weight per dimension
    """
    # mu~ = (mu + omega mu_old) / (1 + omega) = mu_old + (mu - mu_old) / (1 + omega), with 1 + omega = sqrt(d / target)
    return _Interpolation.apply(values, old, dist.detach(), weight, active, target)


def _mean_weight(old_std: th.Tensor, projection: str) -> float | th.Tensor:
    """The weight per dimension of the mean part of the distance (:func:`_mean_distance`)."""
    if projection == "w2":
        return 1.0
    return (0.5 if projection == "kl" else 1.0) / old_std**2


def _project_frobenius_cov(
    std: th.Tensor, old_std: th.Tensor, dist: th.Tensor, active: th.Tensor, target: float | th.Tensor
) -> th.Tensor:
    """Closed-form Frobenius covariance projection (variance interpolation), float64 in and out."""
    return th.sqrt(_project_closed(std**2, old_std**2, dist, active, target))


def _kl_cov_constraint(t: th.Tensor, ratio_m1: th.Tensor, target: float | th.Tensor) -> tuple[th.Tensor, th.Tensor]:
    """
    KL covariance part after interpolating precisions with weight ``t``, minus the target, and its derivative in ``t``.

    The projected precision over the old one is ``x = 1 + t (r - 1)`` per dimension, and the covariance part is
    ``0.5 sum(1/x - 1 + log x)``, written with ``u = x - 1`` as ``0.5 sum(log1p(u) - u / (1 + u))``.
    """
    u = t.unsqueeze(-1) * ratio_m1
    value = 0.5 * (th.log1p(u) - u / (1.0 + u)).sum(-1) - target
    slope = 0.5 * (ratio_m1 * u / (1.0 + u) ** 2).sum(-1)
    return value, slope


@functools.lru_cache(maxsize=64)
def _one_dim_precision_ratios(target: float) -> tuple[float, float]:
    """
    The two precision ratios ``x`` (projected over old) at which a one-dimensional Gaussian's KL covariance part,
    ``0.5 (1/x - 1 + log x)``, equals ``target``: one below 1 (a wider projection), one above (a narrower one).

    Newton in ``u = x - 1`` on the square root of the part, which is close to linear in ``u``, from its quadratic
    approximation ``u = +-2 sqrt(target)``; a step that would leave ``x > 0`` is halved instead. Cached: every
    minibatch of a run asks for the same target.
    """
    roots = []
    for sign in (-1.0, 1.0):
        u = sign * min(2.0 * math.sqrt(target), 0.5)
        for _ in range(_MAX_ROOT_ITERATIONS):
            part = 0.5 * (math.log1p(u) - u / (1.0 + u))
            slope = 0.5 * u / (1.0 + u) ** 2
            step = 2.0 * (part - target) * math.sqrt(part) / (slope * (math.sqrt(part) + math.sqrt(target)))
            while u - step <= -1.0:
                step *= 0.5
            u -= step
            if abs(step) <= 1e-15 * abs(u):
                break
        roots.append(1.0 + u)
    return roots[0], roots[1]


def _project_kl_cov(
    std: th.Tensor, old_std: th.Tensor, cov_part: th.Tensor, active: th.Tensor, bound: float, target: float | th.Tensor
) -> th.Tensor:
    """
    KL covariance projection (precision interpolation with a per-state multiplier), float64 in and out.

    With one action dimension the interpolated precision that meets a common target is the same in every state,
    one ratio to the old precision for a narrower and one for a wider std (:func:`_one_dim_precision_ratios`), and the
    projection is closed form. Its gradient with respect to ``std`` is then zero, as the implicit one is.

    :param cov_part: the covariance part of ``std`` per state (:func:`_cov_distance`)
    :param active: the states outside the bound
    """
    if std.shape[-1] == 1 and isinstance(target, float):
        wider, narrower = _one_dim_precision_ratios(target)
        # the projection keeps the side of the network's std: narrower than the old one means a larger precision
        # (the factors as float64 tensors: th.where would make Python floats float32)
        narrower_factor, wider_factor = old_std.new_tensor(narrower**-0.5), old_std.new_tensor(wider**-0.5)
        projected = old_std * th.where(std < old_std, narrower_factor, wider_factor)
        return th.where(active.unsqueeze(-1), projected, std)
    with th.no_grad():
        ratio_m1 = th.expm1(2.0 * (th.log(old_std) - th.log(std)))  # r - 1, with r = precision / old precision
        t0 = th.sqrt(target / th.where(active, cov_part, th.ones_like(cov_part))).clamp(max=1.0)
        t_root = _solve_increasing(lambda t: _kl_cov_constraint(t, ratio_m1, target), t0, target, bound, active)
    return _PrecisionInterpolation.apply(std, old_std, ratio_m1, t_root, active)


class _PrecisionInterpolation(th.autograd.Function):
    """
    ``std~ = old_std / sqrt(1 + t (r - 1))`` on the states outside the bound (``std`` elsewhere), ``r`` the precision
    ratio and ``t`` the root of the KL covariance constraint, with the implicit gradient of ``t`` written out:
    ``dt/dr = -g_r / g_t`` at the root. ``old_std`` and the target are constants.
    """

    @staticmethod
    def forward(ctx, std, old_std, ratio_m1, t, active):  # type: ignore[no-untyped-def,override]
        x = 1.0 + t.unsqueeze(-1) * ratio_m1
        projected = old_std * th.rsqrt(x)  # std~ = old_std / sqrt(x)
        ctx.save_for_backward(std, ratio_m1, x, projected, t, active)
        ctx.shape = std.shape
        return th.where(active.unsqueeze(-1), projected, std)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        std, ratio_m1, x, projected, t, active = ctx.saved_tensors
        t_ = t.unsqueeze(-1)
        along_x = -0.5 * grad * projected / x  # d std~ / d x = -std~ / (2 x)
        # the constraint g = 0.5 sum(log x - (x - 1) / x) - target, x = 1 + t (r - 1): g_t and g_(r-1) per dimension
        slope = (t_ * ratio_m1) / x**2
        g_t = 0.5 * (ratio_m1 * slope).sum(-1, keepdim=True)
        g_t = th.where(active.unsqueeze(-1) & (g_t > 0), g_t, th.ones_like(g_t))
        # d x_i / d (r_j - 1) = t delta_ij + (r_i - 1) dt/d(r_j - 1), with dt/d(r_j - 1) = -0.5 t slope_j / g_t
        ratio_grad = along_x * t_ - (along_x * ratio_m1).sum(-1, keepdim=True) * 0.5 * t_ * slope / g_t
        std_grad = ratio_grad * (-2.0 * (ratio_m1 + 1.0) / std)  # r = (old_std / std)^2
        return th.where(active.unsqueeze(-1), std_grad, grad).sum_to_size(ctx.shape), None, None, None, None


def project_gaussian(
    mean: th.Tensor,
    std: th.Tensor,
    old_mean: th.Tensor,
    old_std: th.Tensor,
    mean_bound: float,
    cov_bound: float,
    projection: str = "kl",
) -> tuple[th.Tensor, th.Tensor]:
    """
    Project diagonal Gaussians, state by state, onto the trust region around the old ones.

    Mean and covariance are projected separately, each onto its own bound (see the module docstring). With
    state-independent standard deviations (SB3's ``log_std``, shape ``(k,)`` for both ``std`` and ``old_std``), the
    covariance projection is computed once for all states.

    :param mean: new means, shape ``(batch, k)``
    :param std: new standard deviations, ``(k,)`` or ``(batch, k)``
    :param old_mean: old means, ``(batch, k)`` (treated as a constant)
    :param old_std: old standard deviations, ``(k,)`` or ``(batch, k)`` (treated as a constant)
    :param mean_bound: bound on the mean part of the distance
    :param cov_bound: bound on the covariance part of the distance
    :param projection: one of ``PROJECTIONS``
    :return: the projected means ``(batch, k)`` and standard deviations (the shape of ``std``, or ``(batch, k)`` if
        only ``old_std`` is per state)
    """
    projected = project_gaussian_with_distances(mean, std, old_mean, old_std, mean_bound, cov_bound, projection)
    return projected.mean, projected.std


def project_gaussian_with_distances(
    mean: th.Tensor,
    std: th.Tensor,
    old_mean: th.Tensor,
    old_std: th.Tensor,
    mean_bound: float,
    cov_bound: float,
    projection: str = "kl",
) -> GaussianProjection:
    """
    :func:`project_gaussian`, also returning the distances to the old Gaussians before and after the projection that
    it evaluates anyway. A part (mean or covariance) with no state outside its bound is returned as the input tensor
    itself, in the dtype of ``mean``.

    :return: the projection and the distances (:class:`GaussianProjection`)
    """
    _check_projection(projection)
    _check_bound(mean_bound, "mean_bound")
    _check_bound(cov_bound, "cov_bound")
    mean_bound, cov_bound = float(mean_bound), float(cov_bound)
    _check_same_shape(mean, old_mean, "mean")
    if std.shape[-1:] != mean.shape[-1:] or old_std.shape[-1:] != mean.shape[-1:]:
        raise ValueError(
            f"`std` {tuple(std.shape)} and `old_std` {tuple(old_std.shape)} must end with the action size "
            f"{mean.shape[-1]} of `mean`: pass (k,) for a state-independent std or (batch, k)"
        )
    dtype = mean.dtype
    mean64, std64 = mean.to(th.float64), std.to(th.float64)
    old_mean64, old_std64 = old_mean.detach().to(th.float64), old_std.detach().to(th.float64)
    # Each distance is evaluated once: the activity test, the closed forms' scale and the root search's start share it
    # (constants: the projections' gradients are written out, :class:`_Interpolation`, :class:`_PrecisionInterpolation`)
    with th.no_grad():
        mean_dist = _mean_distance(mean64, old_mean64, old_std64, projection)
        cov_dist = _cov_distance(std64, old_std64, projection)
    mean_active, cov_active = mean_dist > mean_bound, cov_dist > cov_bound
    # One host read for both parts; a part with no state outside is the identity and skips its projection entirely
    move_mean, move_cov = th.stack((mean_active.any(), cov_active.any())).tolist()

    if move_mean:
        mean_weight = _mean_weight(old_std64, projection)
        new_mean, mean_after = _round_inside(
            lambda target: _project_closed(mean64, old_mean64, mean_dist, mean_active, target, mean_weight),
            lambda x: _mean_distance(x, old_mean64, old_std64, projection),
            old_mean64,
            mean_bound,
            dtype,
            separable=True,
        )
    else:
        new_mean, mean_after = mean, mean_dist.detach()

    if move_cov:
        if projection == "kl":
            solve_cov = lambda target: _project_kl_cov(std64, old_std64, cov_dist, cov_active, cov_bound, target)  # noqa: E731
        elif projection == "w2":
            solve_cov = lambda target: _project_closed(std64, old_std64, cov_dist, cov_active, target)  # noqa: E731
        else:
            solve_cov = lambda target: _project_frobenius_cov(std64, old_std64, cov_dist, cov_active, target)  # noqa: E731
        new_std, cov_after = _round_inside(
            solve_cov, lambda x: _cov_distance(x, old_std64, projection), old_std64, cov_bound, dtype, separable=True
        )
    else:
        # shaped as a projection would be: per state if either std is
        shape = th.broadcast_shapes(std.shape, old_std.shape)
        new_std, cov_after = (std if std.shape == shape else std.expand(shape)), cov_dist.detach()
    return GaussianProjection(
        new_mean.to(dtype), new_std.to(dtype), mean_dist.detach(), mean_after, cov_dist.detach(), cov_after
    )


def gaussian_entropy_projection(std: th.Tensor, min_entropy: float) -> th.Tensor:
    """
    Scale standard deviations up, state by state, so that the entropy of the diagonal Gaussian is at least
    ``min_entropy``; states already at or above it are unchanged. (Optional entropy control of TRPL.)

    :param std: standard deviations, ``(k,)`` or ``(batch, k)``
    :param min_entropy: the lowest entropy allowed, in nats
    :return: standard deviations of the same shape
    """
    k = std.shape[-1]
    entropy = th.log(std).sum(-1) + 0.5 * k * (1.0 + math.log(2.0 * math.pi))
    # multiplying every std by exp(delta / k) adds delta to the entropy
    raise_by = th.clamp(min_entropy - entropy, min=0.0)
    return th.where((raise_by > 0).unsqueeze(-1), std * th.exp(raise_by / k).unsqueeze(-1), std)


def _log_normalize(logits: th.Tensor) -> th.Tensor:
    """Log-probabilities from logits (``log_softmax``, written with ``logsumexp``, which is faster on small rows)."""
    return logits - logits.logsumexp(-1, keepdim=True)


def _split_factors(logits: th.Tensor, action_dims: Sequence[int]) -> tuple[th.Tensor, ...]:
    """Split concatenated logits into one tensor per factor, checking the sizes."""
    if logits.shape[-1] != sum(action_dims):
        raise ValueError(
            f"`action_dims` {list(action_dims)} must add up to the last dimension of the logits ({logits.shape[-1]}): "
            "pass [n] for Discrete(n) and list(nvec) for MultiDiscrete(nvec)"
        )
    return th.split(logits, list(action_dims), dim=-1)


def categorical_kl(logits: th.Tensor, old_logits: th.Tensor, action_dims: Sequence[int]) -> th.Tensor:
    """
    Joint KL(new || old) per state of (Multi)Categorical distributions given by concatenated logits (the package's
    exact KL, :meth:`~sb3_kl.common.kl.MultiCategoricalParams.kl_per_dim`, summed over factors).

    :param logits: new logits, ``(batch, sum(action_dims))``
    :param old_logits: old logits, same shape
    :param action_dims: ``[n]`` for ``Discrete(n)``, ``list(nvec)`` for ``MultiDiscrete(nvec)``
    :return: the KL per state, ``(batch,)``
    """
    _split_factors(logits, action_dims)  # fails with the sizes named if they do not add up
    return MultiCategoricalParams(list(action_dims)).kl_per_dim(logits, old_logits).sum(-1)


def _categorical_constraint(
    t: th.Tensor, deltas: tuple[th.Tensor, ...], old_logits: tuple[th.Tensor, ...], target: float
) -> tuple[th.Tensor, th.Tensor]:
    """
    Joint KL of the geometric interpolation ``z_old + t (z - z_old)`` to the old factors, minus the target, and its
    derivative in ``t``, which is ``t * Var_q(z - z_old)`` summed over factors. The old factors must be normalized
    log-probabilities.
    """
    t_ = t.unsqueeze(-1)
    value, variance = -target, 0.0
    for delta, old in zip(deltas, old_logits, strict=True):
        interpolated = old + t_ * delta
        log_norm = interpolated.logsumexp(-1, keepdim=True)
        q = (interpolated - log_norm).exp()
        mean = (q * delta).sum(-1, keepdim=True)
        # log q - old = t delta - log_norm, so the KL is t E_q[delta] - log_norm
        value = value + (t_ * mean - log_norm).squeeze(-1)
        variance = variance + (q * (delta - mean) ** 2).sum(-1)
    return value, t * variance


def _categorical_factors_kl(new: tuple[th.Tensor, ...], old_log_probs: tuple[th.Tensor, ...]) -> th.Tensor:
    """Joint KL(new || old) per state of categorical factors, the old ones given as normalized log-probabilities."""
    value = None
    for logits, old in zip(new, old_log_probs, strict=True):
        log_q = _log_normalize(logits)
        kl = (log_q.exp() * (log_q - old)).sum(-1)
        value = kl if value is None else value + kl
    return value


def _project_interpolation(
    logits: th.Tensor,
    old_logits: th.Tensor,
    bound: float,
    split: Callable[[th.Tensor], tuple[th.Tensor, ...]],
    constraint: Callable[[th.Tensor, tuple[th.Tensor, ...], tuple[th.Tensor, ...], float], tuple[th.Tensor, th.Tensor]],
    kl: Callable[[tuple[th.Tensor, ...], tuple[th.Tensor, ...]], th.Tensor],
    normalize: Callable[[tuple[th.Tensor, ...]], th.Tensor],
    normalize_old: bool,
) -> LogitsProjection:
    """
    I-projection by geometric interpolation of natural parameters, shared by the categorical and Bernoulli cases.

    :param split: splits logits into factors
    :param constraint: ``(t, deltas, old factors, target) -> (KL - target, dKL/dt)``
    :param kl: ``(new factors, old factors) -> KL`` per state: the constraint's KL at ``t = 1``, without its slope
        (the test of every minibatch, and the re-check of the result)
    :param normalize: maps projected factors back to one logits tensor (normalized, for float32 precision)
    :param normalize_old: turn the old factors into log-probabilities first (categorical)
    :return: the projected logits (``logits`` itself when no state is outside the bound) and the KL before and after
    """
    dtype = logits.dtype
    z = split(logits.to(th.float64))
    z_old = split(old_logits.detach().to(th.float64))
    if normalize_old:
        z_old = tuple(_log_normalize(old) for old in z_old)
    with th.no_grad():
        full = kl(tuple(new.detach() for new in z), z_old)
    active = full > bound
    if not bool(active.any()):
        # The projection is the identity (the usual minibatch late in training): no root search, no re-check
        return LogitsProjection(logits, full, full)
    deltas = tuple(new - old for new, old in zip(z, z_old, strict=True))
    fixed = tuple(delta.detach() for delta in deltas)

    def solve(target: float | th.Tensor) -> th.Tensor:
        with th.no_grad():
            t0 = th.sqrt(target / th.where(active, full, th.ones_like(full))).clamp(max=1.0)
            t_root = _solve_increasing(lambda t: constraint(t, fixed, z_old, target), t0, target, bound, active)
        t = _implicit_t(t_root, lambda t: constraint(t, deltas, z_old, target), active).unsqueeze(-1)
        projected = normalize(tuple(old + t * delta for old, delta in zip(z_old, deltas, strict=True)))
        return th.where(active.unsqueeze(-1), projected, logits.to(th.float64))

    def distance(x: th.Tensor) -> th.Tensor:
        return kl(split(x), z_old)

    projected, after = _round_inside(solve, distance, old_logits.detach().to(th.float64), bound, dtype, separable=False)
    return LogitsProjection(projected.to(dtype), full, after)


def project_categorical(logits: th.Tensor, old_logits: th.Tensor, bound: float, action_dims: Sequence[int]) -> th.Tensor:
    """
    Project (Multi)Categorical distributions, state by state, onto ``KL(new || old) <= bound`` (joint KL over the
    factors), minimising ``KL(projected || new)``: ``z~ = (z + eta z_old) / (1 + eta)`` with one ``eta`` per state.

    :param logits: new logits, ``(batch, sum(action_dims))``, concatenated as in SB3
    :param old_logits: old logits, same shape (treated as a constant)
    :param bound: the KL bound
    :param action_dims: ``[n]`` for ``Discrete(n)``, ``list(nvec)`` for ``MultiDiscrete(nvec)``
    :return: projected logits, same shape and dtype; states inside the bound are returned as they were, projected
        ones as normalized log-probabilities
    """
    return project_categorical_with_distances(logits, old_logits, bound, action_dims).logits


def project_categorical_with_distances(
    logits: th.Tensor, old_logits: th.Tensor, bound: float, action_dims: Sequence[int]
) -> LogitsProjection:
    """
    :func:`project_categorical`, also returning the joint KL to the old distribution per state before and after the
    projection, which it evaluates anyway. With no state outside the bound, the logits returned are ``logits`` itself.

    :return: the projection and the KL (:class:`LogitsProjection`)
    """
    _check_bound(bound, "bound")
    _split_factors(logits, action_dims)
    _check_same_shape(logits, old_logits, "logits")
    bound = float(bound)
    return _project_interpolation(
        logits,
        old_logits,
        bound,
        lambda x: _split_factors(x, action_dims),
        _categorical_constraint,
        _categorical_factors_kl,
        lambda factors: th.cat([_log_normalize(factor) for factor in factors], dim=-1),
        normalize_old=True,
    )


def bernoulli_kl(logits: th.Tensor, old_logits: th.Tensor) -> th.Tensor:
    """
    Joint KL(new || old) per state of independent Bernoulli variables (MultiBinary), summed over the last dimension.
    The same KL as :meth:`~sb3_kl.common.kl.BernoulliParams.kl_per_dim`, written with one sigmoid instead of two
    exponentials: it runs in every iteration of :func:`project_bernoulli`'s root search, where that form is about 8 %
    faster.

    :param logits: new logits, ``(batch, n)``
    :param old_logits: old logits, same shape
    :return: the KL per state, ``(batch,)``
    """
    p = th.sigmoid(logits)
    kl = p * (F.logsigmoid(logits) - F.logsigmoid(old_logits)) + (1.0 - p) * (
        F.logsigmoid(-logits) - F.logsigmoid(-old_logits)
    )
    return kl.sum(-1)


def _bernoulli_constraint(
    t: th.Tensor, deltas: tuple[th.Tensor, ...], old_logits: tuple[th.Tensor, ...], target: float
) -> tuple[th.Tensor, th.Tensor]:
    """Joint Bernoulli KL of the interpolated logits minus the target, and its derivative ``t sum s (1 - s) delta^2``."""
    (delta,), (old,) = deltas, old_logits
    new = old + t.unsqueeze(-1) * delta
    s = th.sigmoid(new)
    return bernoulli_kl(new, old) - target, t * (s * (1.0 - s) * delta**2).sum(-1)


def project_bernoulli(logits: th.Tensor, old_logits: th.Tensor, bound: float) -> th.Tensor:
    """
    Project independent Bernoulli distributions (MultiBinary), state by state, onto ``KL(new || old) <= bound``
    (joint KL over the last dimension), minimising ``KL(projected || new)``: the logits are interpolated,
    ``z~ = (z + eta z_old) / (1 + eta)``, with one ``eta`` per state.

    :param logits: new logits, ``(batch, n)``
    :param old_logits: old logits, same shape (treated as a constant)
    :param bound: the KL bound
    :return: projected logits, same shape and dtype
    """
    return project_bernoulli_with_distances(logits, old_logits, bound).logits


def project_bernoulli_with_distances(logits: th.Tensor, old_logits: th.Tensor, bound: float) -> LogitsProjection:
    """
    :func:`project_bernoulli`, also returning the joint KL to the old distribution per state before and after the
    projection, which it evaluates anyway. With no state outside the bound, the logits returned are ``logits`` itself.

    :return: the projection and the KL (:class:`LogitsProjection`)
    """
    _check_bound(bound, "bound")
    _check_same_shape(logits, old_logits, "logits")
    bound = float(bound)
    return _project_interpolation(
        logits,
        old_logits,
        bound,
        lambda x: (x,),
        _bernoulli_constraint,
        lambda new, old: bernoulli_kl(new[0], old[0]),
        lambda factors: factors[0],
        normalize_old=False,
    )
