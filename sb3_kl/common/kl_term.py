"""
The KL term of KLPPO's loss as one autograd node: the minibatch KL (the mean over its states of the per-state KL between
the rollout policy and the current one, in the algorithm's convention) and the penalty on it,
``kl_coef * KL + hinge_coef * max(0, KL - hinge_kl)^2``, with the forward and the backward written out.

Built from autograd operations (:func:`~sb3_kl.common.kl.per_state_kl_to`, the mean, KLPPO's ``_kl_penalty``) the term
dispatches about 20 operations forward and as many backward on a minibatch's small tensors, where each pays eager
PyTorch's dispatch cost (``benchmarks/results/kl_term_floor.md``). The node takes what the minibatch has computed once
already: the new distribution's parameters as its log-probabilities (the ratio) use them, a Gaussian's mean and std
(with gSDE the std differentiable in the features, :func:`~sb3_kl.common.kl.kl_normal`) or a categorical's logits,
which ``torch.distributions`` keeps normalized (so they are not normalized a second time), and for the sample
estimators the log-ratio of the stored actions. Stored categorical parameters are the normalized logits
:meth:`~sb3_kl.common.kl.DistributionParams.extract` gives.

The values and gradients are those of the autograd path up to rounding, since the operations differ
(``tests/test_kl_term.py`` compares them in float64 for every case). Covered: diagonal Gaussian (state-independent
std and gSDE), Categorical, MultiCategorical (the masked ones included) and Bernoulli; both directions; the analytic,
k1 and k3 estimators; both reductions; the log-ratio clamp; with and without the hinge. :func:`fused_kl_term` returns
None where it does not apply, and the caller builds the term from autograd operations: a distribution layout that
computes another KL than this module's four (:func:`_family`), stored parameters that require a gradient, an empty
minibatch, a Gaussian whose std is not shaped as its mean, a log-ratio that is not one value per state. The node is
first-order only (:func:`_first_order`): a second derivative needs the autograd path.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch as th
from stable_baselines3.common.distributions import Distribution
from torch.nn import functional as F

from sb3_kl.common.kl import (
    BernoulliParams,
    CategoricalParams,
    DistributionParams,
    GaussianParams,
    KLSettings,
    MultiCategoricalParams,
    kl_normal,
)


def _first_order(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """
    A backward that refuses to build a graph (``create_graph=True``, the engine then runs it with grad mode on).
    ``once_differentiable`` would let this node's gradients through as constants whenever the incoming gradients are
    (the seed of ``autograd.grad`` is): where the inputs also reach the loss by another path (a categorical's
    normalization), a second derivative would silently miss this node's part.
    """

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: th.Tensor | None) -> tuple:
        if th.is_grad_enabled():
            raise RuntimeError(
                "sb3-kl's fused KL term is first-order only: for a second derivative build the term from autograd "
                "operations (KLPPO._fused_kl_term = False)."
            )
        return backward(ctx, *grads)

    return wrapper


def _penalty(
    ctx: Any, total: th.Tensor, factor: float, coef: float, hinge_coef: float, hinge_kl: float
) -> tuple[th.Tensor, th.Tensor, th.Tensor | None]:
    """
    The node's outputs from the sum of its per-element terms: ``kl = factor * total`` and the penalty on it. Keeps on
    ``ctx`` what :func:`_total_grad` needs.

    :return: ``(kl, penalty, excess)``, ``excess = max(0, kl - hinge_kl)`` (None without a hinge)
    """
    kl = total * factor
    ctx.factor, ctx.coef, ctx.hinge_coef = factor, coef, hinge_coef
    if hinge_coef > 0:
        excess = (kl - hinge_kl).clamp_(min=0.0)
        return kl, th.addcmul(kl * coef, excess, excess, value=hinge_coef), excess
    return kl, kl * coef, None


def _total_grad(
    ctx: Any, grad_kl: th.Tensor | None, grad_penalty: th.Tensor | None, excess: th.Tensor | None, sign: float = 1.0
) -> th.Tensor | None:
    """
    The gradient of the node's outputs in the sum of its terms, times ``sign`` (a backward may fold a sign in here, on
    a scalar, rather than on its tensors): ``d kl / d total = factor``, ``d penalty / d kl = coef + 2 hinge_coef excess``.

    :param grad_kl: The gradient reaching the node's KL output (None: unused)
    :param grad_penalty: The gradient reaching its penalty output (None: unused)
    :param excess: The hinge's excess (None without a hinge)
    :return: a scalar tensor, or None when neither output is used
    """
    factor = sign * ctx.factor
    grad = None
    if grad_penalty is not None:
        grad = grad_penalty * (factor * ctx.coef)
        if excess is not None:
            grad = th.addcmul(grad, grad_penalty, excess, value=2.0 * ctx.hinge_coef * factor)
    if grad_kl is not None:
        grad = grad_kl * factor if grad is None else th.add(grad, grad_kl, alpha=factor)
    return grad


def _saved(ctx: Any, *tensors: th.Tensor, excess: th.Tensor | None) -> None:
    """``save_for_backward`` of ``tensors`` and of the hinge's excess when there is one."""
    ctx.has_excess = excess is not None
    ctx.save_for_backward(*tensors, *([excess] if excess is not None else []))


def _unsaved(ctx: Any) -> tuple[list[th.Tensor], th.Tensor | None]:
    """:return: the tensors :func:`_saved` kept, and the excess (None without a hinge)"""
    saved = list(ctx.saved_tensors)
    return (saved[:-1], saved[-1]) if ctx.has_excess else (saved, None)


class _GaussianKLTerm(th.autograd.Function):
    """
    The term on a diagonal Gaussian: ``loc`` and ``scale`` (the new policy's, differentiable), ``old_params``
    (``[mean, log_std]`` of the rollout policy, constants). Per dimension, with ``delta = log(scale / std_old)``:

    - forward, KL(old || new) = ``0.5 (expm1(-2 delta) + z^2) + delta``, ``z = (mean_old - loc) / scale``;
      d/dloc = ``-z / scale``, d/dscale = ``-(expm1(-2 delta) + z^2) / scale``;
    - reverse, KL(new || old) = ``0.5 (expm1(2 delta) + z^2) - delta``, ``z = (loc - mean_old) / std_old``;
      d/dloc = ``z / std_old``, d/dscale = ``expm1(2 delta) / scale``.

    The per-dimension terms are summed at twice their value, ``factor`` holding the 0.5.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        loc: th.Tensor,
        scale: th.Tensor,
        old_params: th.Tensor,
        reverse: bool,
        factor: float,
        coef: float,
        hinge_coef: float,
        hinge_kl: float,
    ) -> tuple[th.Tensor, th.Tensor]:
        ctx.set_materialize_grads(False)
        mean_old, log_std_old = old_params.split(loc.shape[-1], dim=-1)
        log_std_ratio = th.log(scale) - log_std_old
        if reverse:
            std_old = th.exp(log_std_old)
            z = (loc - mean_old) / std_old
            variance_ratio_m1 = th.expm1(2.0 * log_std_ratio)
            terms = th.add(th.addcmul(variance_ratio_m1, z, z), log_std_ratio, alpha=-2.0)
            saved = (z, std_old, variance_ratio_m1, scale)
        else:
            z = (mean_old - loc) / scale
            weighted = th.addcmul(th.expm1(-2.0 * log_std_ratio), z, z)
            terms = th.add(weighted, log_std_ratio, alpha=2.0)
            saved = (z, weighted, scale)
        kl, penalty, excess = _penalty(ctx, terms.sum(), factor, coef, hinge_coef, hinge_kl)
        _saved(ctx, *saved, excess=excess)
        ctx.reverse = reverse
        return kl, penalty

    @staticmethod
    @_first_order
    def backward(ctx: Any, grad_kl: th.Tensor | None, grad_penalty: th.Tensor | None) -> tuple:  # type: ignore[override]
        saved, excess = _unsaved(ctx)
        needs_loc, needs_scale = ctx.needs_input_grad[:2]
        if ctx.reverse:
            z, std_old, variance_ratio_m1, scale = saved
            grad = _total_grad(ctx, grad_kl, grad_penalty, excess, sign=2.0)
            if grad is None:
                return (None,) * 8
            grad_loc = th.div(z, std_old).mul_(grad) if needs_loc else None
            grad_scale = th.div(variance_ratio_m1, scale).mul_(grad) if needs_scale else None
        else:
            z, weighted, scale = saved
            grad = _total_grad(ctx, grad_kl, grad_penalty, excess, sign=-2.0)
            if grad is None:
                return (None,) * 8
            per_scale = th.div(grad, scale)
            grad_loc = z * per_scale if needs_loc else None
            grad_scale = weighted * per_scale if needs_scale else None
        return grad_loc, grad_scale, None, None, None, None, None, None


class _CategoricalKLTerm(th.autograd.Function):
    """
    The term on categoricals (one or several, concatenated): ``logits`` (the new policy's normalized log-probabilities,
    differentiable) and ``old_logits`` (the rollout policy's, constants). Forward, KL(old || new) =
    ``sum p_old (log p_old - log p_new)``, d/dlog p_new = ``-p_old``; reverse, KL(new || old) =
    ``sum p_new (log p_new - log p_old)``, d/dlog p_new = ``p_new (log p_new - log p_old + 1)`` (the gradient of the
    expression in its argument: composed with the normalization ``torch.distributions`` applies, it is the KL's).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: th.Tensor,
        old_logits: th.Tensor,
        reverse: bool,
        factor: float,
        coef: float,
        hinge_coef: float,
        hinge_kl: float,
    ) -> tuple[th.Tensor, th.Tensor]:
        ctx.set_materialize_grads(False)
        # kl_div(input, target, log_target=True) sums exp(target) * (target - input)
        if reverse:
            total = F.kl_div(old_logits, logits, reduction="sum", log_target=True)
        else:
            total = F.kl_div(logits, old_logits, reduction="sum", log_target=True)
        kl, penalty, excess = _penalty(ctx, total, factor, coef, hinge_coef, hinge_kl)
        _saved(ctx, logits, old_logits, excess=excess)
        ctx.reverse = reverse
        return kl, penalty

    @staticmethod
    @_first_order
    def backward(ctx: Any, grad_kl: th.Tensor | None, grad_penalty: th.Tensor | None) -> tuple:  # type: ignore[override]
        (logits, old_logits), excess = _unsaved(ctx)
        grad = _total_grad(ctx, grad_kl, grad_penalty, excess, sign=1.0 if ctx.reverse else -1.0)
        if grad is None or not ctx.needs_input_grad[0]:
            return (None,) * 7
        if ctx.reverse:
            probs = th.exp(logits)
            grad_logits = th.addcmul(probs, probs, logits - old_logits).mul_(grad)
        else:
            grad_logits = th.exp(old_logits).mul_(grad)
        return grad_logits, None, None, None, None, None, None


class _BernoulliKLTerm(th.autograd.Function):
    """
    The term on independent Bernoullis: ``logits`` (the new policy's, differentiable) and ``old_logits`` (constants).
    Per dimension the KL is a difference of binary cross-entropies with the first distribution's probabilities as
    targets, ``KL(p || q) = CE(p, q) - CE(p, p)``: forward, d/dlogit = ``sigmoid(logit) - p_old``; reverse,
    d/dlogit = ``p_new (1 - p_new) (logit - old_logit)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: th.Tensor,
        old_logits: th.Tensor,
        reverse: bool,
        factor: float,
        coef: float,
        hinge_coef: float,
        hinge_kl: float,
    ) -> tuple[th.Tensor, th.Tensor]:
        ctx.set_materialize_grads(False)
        first, second = (logits, old_logits) if reverse else (old_logits, logits)
        probs = th.sigmoid(first)
        cross = F.binary_cross_entropy_with_logits(second, probs, reduction="none")
        terms = cross - F.binary_cross_entropy_with_logits(first, probs, reduction="none")
        kl, penalty, excess = _penalty(ctx, terms.sum(), factor, coef, hinge_coef, hinge_kl)
        _saved(ctx, logits, old_logits, probs, excess=excess)
        ctx.reverse = reverse
        return kl, penalty

    @staticmethod
    @_first_order
    def backward(ctx: Any, grad_kl: th.Tensor | None, grad_penalty: th.Tensor | None) -> tuple:  # type: ignore[override]
        (logits, old_logits, probs), excess = _unsaved(ctx)
        grad = _total_grad(ctx, grad_kl, grad_penalty, excess)
        if grad is None or not ctx.needs_input_grad[0]:
            return (None,) * 7
        if ctx.reverse:
            variance = th.addcmul(probs, probs, probs, value=-1.0)
            grad_logits = (logits - old_logits).mul_(variance).mul_(grad)
        else:
            grad_logits = (th.sigmoid(logits) - probs).mul_(grad)
        return grad_logits, None, None, None, None, None, None


class _SampleKLTerm(th.autograd.Function):
    """
    The term of a sample estimator (:func:`~sb3_kl.common.kl.sample_kl`) on the log-ratio ``l`` of the stored actions
    (differentiable), clamped to ``+/- clip`` (``c``) where the estimate exponentiates it; the derivatives in ``l``
    (zero where the clamp holds it):

    - forward k1: ``-l``, derivative ``-1`` (never clamped);
    - forward k3: ``expm1(c) - c``, derivative ``expm1(c)``;
    - reverse k1: ``exp(c) c``, derivative ``exp(c) (c + 1)``;
    - reverse k3: ``exp(c) c - expm1(c)``, derivative ``exp(c) c``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        log_ratio: th.Tensor,
        estimator: str,
        reverse: bool,
        clip: float,
        factor: float,
        coef: float,
        hinge_coef: float,
        hinge_kl: float,
    ) -> tuple[th.Tensor, th.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.plain = not reverse and estimator == "k1"
        if ctx.plain:
            kl, penalty, excess = _penalty(ctx, log_ratio.sum(), -factor, coef, hinge_coef, hinge_kl)
            ctx.shape = log_ratio.shape
            _saved(ctx, excess=excess)
            return kl, penalty
        clamped = log_ratio.clamp(-clip, clip)
        if not reverse:  # k3
            slope = th.expm1(clamped)
            terms = slope - clamped
            saved = (slope,)
        else:
            ratio = th.exp(clamped)
            weighted = ratio * clamped
            if estimator == "k1":
                terms = weighted
                saved = (weighted, ratio)
            else:
                terms = weighted - th.expm1(clamped)
                saved = (weighted,)
        kl, penalty, excess = _penalty(ctx, terms.sum(), factor, coef, hinge_coef, hinge_kl)
        _saved(ctx, log_ratio, clamped, *saved, excess=excess)
        return kl, penalty

    @staticmethod
    @_first_order
    def backward(ctx: Any, grad_kl: th.Tensor | None, grad_penalty: th.Tensor | None) -> tuple:  # type: ignore[override]
        saved, excess = _unsaved(ctx)
        grad = _total_grad(ctx, grad_kl, grad_penalty, excess)
        if grad is None or not ctx.needs_input_grad[0]:
            return (None,) * 8
        if ctx.plain:
            return (grad.expand(ctx.shape), *(None,) * 7)
        log_ratio, clamped, *rest = saved
        slope = rest[0] + rest[1] if len(rest) == 2 else rest[0]  # reverse k1: exp(c) c + exp(c)
        # the clamp passes the gradient where it left the log-ratio as it was (as autograd's clamp, NaN excluded)
        grad_log_ratio = th.where(clamped == log_ratio, slope, 0.0).mul_(grad)
        return (grad_log_ratio, *(None,) * 7)


def fused_kl_term(
    settings: KLSettings,
    dist_params: DistributionParams,
    old_params: th.Tensor,
    distribution: Distribution,
    log_ratio: th.Tensor | None,
    kl_coef: float,
    hinge_coef: float = 0.0,
    hinge_kl: float = 0.0,
) -> tuple[th.Tensor, th.Tensor] | None:
    """
    The minibatch KL and the loss's KL term on it in one autograd node (module docstring): the mean over the states of
    :func:`~sb3_kl.common.kl.per_state_kl_to`, and ``kl_coef * KL + hinge_coef * max(0, KL - hinge_kl)^2``.

    :param settings: Direction, estimator, reduction, log-ratio clamp
    :param dist_params: Parameter layout of the action distribution
    :param old_params: Parameters of the rollout policy, ``(batch, n_params)``
    :param distribution: The current policy's distribution on the same states (gradients flow into it)
    :param log_ratio: ``log pi_new(a|s) - log pi_old(a|s)`` of the stored actions, ``(batch,)``; used (and required)
        by the sample estimators only
    :param kl_coef: The penalty's coefficient beta
    :param hinge_coef: The hinge's coefficient (0: no hinge)
    :param hinge_kl: The KL above which the hinge acts
    :return: ``(kl, penalty)``, two scalar tensors, or None where the node does not apply (module docstring)
    """
    if old_params.requires_grad:
        return None
    n_dims = dist_params.n_dims if settings.reduction == "mean" else 1
    reverse = settings.direction == "reverse"
    penalty = (float(kl_coef), float(hinge_coef), float(hinge_kl))
    if settings.estimator != "analytic":
        if log_ratio is None or log_ratio.dim() != 1 or len(log_ratio) == 0:
            return None
        factor = 1.0 / (len(log_ratio) * n_dims)
        return _SampleKLTerm.apply(log_ratio, settings.estimator, reverse, settings.log_ratio_clip, factor, *penalty)
    family = _family(dist_params)
    if family is GaussianParams:
        normal = kl_normal(distribution)
        loc, scale = normal.loc, normal.scale
        if loc.dim() != 2 or scale.shape != loc.shape or old_params.shape != (len(loc), 2 * loc.shape[1]) or len(loc) == 0:
            return None
        return _GaussianKLTerm.apply(loc, scale, old_params, reverse, 0.5 / (len(loc) * n_dims), *penalty)
    if family is not None:
        logits = dist_params.extract(distribution)
        if logits.dim() != 2 or logits.shape != old_params.shape or len(logits) == 0:
            return None
        function = _BernoulliKLTerm if family is BernoulliParams else _CategoricalKLTerm
        return function.apply(logits, old_params, reverse, 1.0 / (len(logits) * n_dims), *penalty)
    return None


def _family(dist_params: DistributionParams) -> type[DistributionParams] | None:
    """
    The layout among this module's four that ``dist_params`` computes the KL of: its class or a subclass that keeps
    the KL methods (a subclass may read the parameters otherwise, as sb3-kl's layout of sb3-contrib's maskable
    MultiCategorical does; a Gaussian's must also keep their order), else None.
    """
    kept = ("kl_per_dim", "kl_per_dim_to", "joint_kl_to")
    for family in (GaussianParams, CategoricalParams, MultiCategoricalParams, BernoulliParams):
        if isinstance(dist_params, family):
            methods = (*kept, "extract", "split") if family is GaussianParams else kept
            same = all(getattr(type(dist_params), name) is getattr(family, name) for name in methods)
            return family if same else None
    return None
