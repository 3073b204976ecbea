"""
The KL core shared by every sb3_kl algorithm and callback.

A policy's action distribution is reduced to a flat tensor of *distribution parameters* per state
(``(batch, n_params)``), so that the rollout ("old") policy can be stored in a buffer or a snapshot
without copying any network, and the per-state KL between two policies can be computed from
two such tensors.

Conventions (each is an option with a documented default):

- **direction**: ``"forward"`` is KL(pi_old || pi_new), the divergence PPO and TRPO constrain (default);
  ``"reverse"`` is KL(pi_new || pi_old).
- **estimator**: ``"analytic"`` is the exact KL from the two distributions (default);
  ``"k1"`` and ``"k3"`` are Schulman's sample estimators (http://joschu.net/blog/kl-approx.html) computed from
  the log-ratio ``log r = log pi_new(a|s) - log pi_old(a|s)`` of the action ``a`` the rollout policy took.
  Forward: k1 = -log r, k3 = (r - 1) - log r.
  Reverse (importance-weighted by r, since actions come from pi_old): k1 = r log r, k3 = r log r - (r - 1).
  Both k3 forms are never negative; k1 may be negative on a single sample.
  The KL to a *reference* policy from the rollout policy's samples (a third distribution) needs importance weights:
  :func:`importance_sampled_kl`.
- **reduction** over action dimensions: ``"sum"`` is the joint KL of the action distribution (default);
  ``"mean"`` divides it by the number of independent action dimensions (one for ``Discrete``,
  ``len(nvec)`` for ``MultiDiscrete``, ``n`` for ``MultiBinary``, the action size for ``Box``).

The KL of a tanh-squashed Gaussian (gSDE with ``squash_output=True``) equals the KL of the underlying Gaussians,
because KL is invariant under the same bijection applied to both distributions.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from torch.autograd.function import once_differentiable
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    Distribution,
    MultiCategoricalDistribution,
    StateDependentNoiseDistribution,
    sum_independent_dims,
)
from torch.nn import functional as F

from sb3_kl.common.validation import check_choice, is_number  # check_choice: re-exported, used elsewhere

KL_ESTIMATORS = ("analytic", "k1", "k3")
KL_DIRECTIONS = ("forward", "reverse")
KL_REDUCTIONS = ("sum", "mean")


class DistributionParams(ABC):
    """
    Translates between an SB3 action distribution and a flat tensor of its parameters,
    and computes the exact per-dimension KL between two parameter tensors.

    :param n_params: Number of parameters per state
    :param n_dims: Number of independent action dimensions (used by the ``"mean"`` reduction)
    """

    def __init__(self, n_params: int, n_dims: int):
        self.n_params = n_params
        self.n_dims = n_dims

    @abstractmethod
    def extract(self, distribution: Distribution) -> th.Tensor:
        """
        :param distribution: A distribution built by the policy (``proba_distribution`` already called)
        :return: Its parameters, shape ``(batch, n_params)``; differentiable when the distribution is
        """

    @abstractmethod
    def kl_per_dim(self, p: th.Tensor, q: th.Tensor) -> th.Tensor:
        """
        Exact KL(p || q) for each independent action dimension.

        :param p: Parameters of the first distribution, ``(batch, n_params)``
        :param q: Parameters of the second distribution, ``(batch, n_params)``
        :return: ``(batch, n_dims)``
        """

    def kl_per_dim_to(self, old_params: th.Tensor, distribution: Distribution, reverse: bool = False) -> th.Tensor:
        """
        Exact per-dimension KL between stored parameters and a live distribution (gradients flow
        into ``distribution``).

        :param old_params: Parameters of the rollout policy, ``(batch, n_params)``
        :param distribution: The current policy's distribution on the same states
        :param reverse: ``False``: KL(old || new); ``True``: KL(new || old)
        :return: ``(batch, n_dims)``
        """
        new_params = self.extract(distribution)
        return self.kl_per_dim(new_params, old_params) if reverse else self.kl_per_dim(old_params, new_params)

    def joint_kl_to(self, old_params: th.Tensor, distribution: Distribution, reverse: bool = False) -> th.Tensor:
        """
        Exact joint KL (summed over action dimensions) between stored parameters and a live distribution:
        the form inside the losses, where it runs on every minibatch (layouts may fuse it).

        :param old_params: Parameters of the rollout policy, ``(batch, n_params)``
        :param distribution: The current policy's distribution on the same states
        :param reverse: ``False``: KL(old || new); ``True``: KL(new || old)
        :return: ``(batch,)``
        """
        return self.kl_per_dim_to(old_params, distribution, reverse).sum(dim=-1)

    @abstractmethod
    def entropy(self, params: th.Tensor) -> th.Tensor:
        """
        :param params: ``(batch, n_params)``
        :return: The joint entropy per state, ``(batch,)``
        """

    @abstractmethod
    def torch_distributions(self, params: th.Tensor) -> list[th.distributions.Distribution]:
        """
        Independent ``torch.distributions`` objects whose KLs add up to the joint KL
        (one per factor; used to check this module against PyTorch's own ``kl_divergence``).

        :param params: ``(batch, n_params)``
        """


#: Attribute under which :func:`attach_sde_features` keeps its Normal beside a gSDE distribution
_KL_NORMAL_ATTRIBUTE = "_sb3_kl_normal"


def attach_sde_features(distribution: Distribution, latent_sde: th.Tensor, log_std: th.Tensor | None) -> None:
    """
    Let the KL of a gSDE distribution be differentiated through the policy's features.

    gSDE (``StateDependentNoiseDistribution``) makes the action std a function of the policy's latent features,
    ``std^2 = latent^2 @ sigma^2 + epsilon``, but with SB3's default ``learn_features=False`` it is built from a
    *detached* copy of them: the log-probabilities (the policy gradient) do not move the features through the std,
    which is gSDE's design. A KL term built on that distribution has the right value, since the std at a state
    moves with the features, but the wrong gradient: nothing pushes back on the change of std that a change of
    features causes, so the KL penalty and hinge cannot hold it, however large beta grows. With LSTM features (and
    ReLU latents that switch off) the std of some states collapses within one update and the KL is in the
    thousands (``benchmarks/results/recurrent_kl_probe.md``).

    This keeps, beside ``distribution``, a Normal with the same values whose std is differentiable in
    ``latent_sde``; the KL functions of this module (:func:`kl_normal`) use it. The distribution itself
    (log-probabilities, entropy, sampling) is unchanged. Nothing is done for other distributions or when the
    distribution already learns its features.

    :param distribution: The distribution just built by ``proba_distribution(mean_actions, log_std, latent_sde)``
    :param latent_sde: The latent features it was built from, with their gradient
    :param log_std: The policy's ``log_std`` parameter it was built from (None for a policy without one)
    """
    if not isinstance(distribution, StateDependentNoiseDistribution) or distribution.learn_features or log_std is None:
        return
    # the same values as the distribution's own Normal, which SB3 has validated already
    normal = _sde_normal(distribution, distribution.distribution.loc, latent_sde, log_std)
    # Keyed by the distribution's current Normal: a policy reuses its distribution object, and the next
    # proba_distribution() call replaces the Normal, which makes this one stale
    setattr(distribution, _KL_NORMAL_ATTRIBUTE, (distribution.distribution, normal))


def _sde_normal(
    distribution: StateDependentNoiseDistribution, mean_actions: th.Tensor, latent_sde: th.Tensor, log_std: th.Tensor
) -> th.distributions.Normal:
    """gSDE's Normal as SB3 builds it (``std^2 = latent^2 @ sigma^2 + epsilon``), on the features as given."""
    variance = th.mm(latent_sde**2, distribution.get_std(log_std) ** 2)
    return th.distributions.Normal(mean_actions, th.sqrt(variance + distribution.epsilon), validate_args=False)


def kl_log_prob(distribution: Distribution, actions: th.Tensor, log_prob: th.Tensor) -> th.Tensor:
    """
    The log-probabilities of the stored actions that the sample KL estimates (k1, k3, and the reference's importance
    weights) are built from: ``log_prob`` itself, except for a gSDE distribution with features attached by
    :func:`attach_sde_features`, where the same values are recomputed on that Normal, so that the sample estimates
    are differentiated through the features as the analytic KL is. The policy-gradient surrogate keeps ``log_prob``
    (gSDE's design: the policy gradient does not move the features through the std).

    :param distribution: The current policy's distribution
    :param actions: The stored actions, as ``distribution.log_prob`` takes them
    :param log_prob: ``distribution.log_prob(actions)``
    :return: ``(batch,)``, equal in value to ``log_prob``
    """
    normal = kl_normal(distribution) if isinstance(distribution, StateDependentNoiseDistribution) else None
    if normal is None or normal is distribution.distribution:
        return log_prob
    # as StateDependentNoiseDistribution.log_prob, on the attached Normal (the squash correction depends on the
    # actions only)
    bijector = distribution.bijector
    gaussian_actions = bijector.inverse(actions) if bijector is not None else actions
    attached = sum_independent_dims(normal.log_prob(gaussian_actions))
    if bijector is not None:
        attached = attached - th.sum(bijector.log_prob_correction(gaussian_actions), dim=1)
    return attached


def kl_normal(distribution: Distribution) -> th.distributions.Normal:
    """
    :param distribution: A Gaussian SB3 distribution (diagonal or gSDE)
    :return: The Normal the KL is computed on: the one :func:`attach_sde_features` attached to the distribution's
        current Normal if any (same values, std differentiable in the features), else the distribution's own
    """
    attached = getattr(distribution, _KL_NORMAL_ATTRIBUTE, None)
    if attached is not None and attached[0] is distribution.distribution:
        return attached[1]
    return distribution.distribution  # type: ignore[return-value]


class GaussianParams(DistributionParams):
    """
    Diagonal Gaussian (``Box`` actions, with or without gSDE): parameters are ``[mean, log_std]``.

    :param action_dim: Size of the action vector
    """

    def __init__(self, action_dim: int):
        super().__init__(n_params=2 * action_dim, n_dims=action_dim)
        self.action_dim = action_dim

    def extract(self, distribution: Distribution) -> th.Tensor:
        normal = kl_normal(distribution)
        return th.cat([normal.loc, th.log(normal.scale)], dim=-1)

    def split(self, params: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """:return: mean and log_std, each ``(batch, action_dim)``"""
        return params[..., : self.action_dim], params[..., self.action_dim :]

    def kl_per_dim(self, p: th.Tensor, q: th.Tensor) -> th.Tensor:
        mean_p, log_std_p = self.split(p)
        mean_q, log_std_q = self.split(q)
        # KL(N(mp, sp) || N(mq, sq)) = log(sq / sp) + (sp^2 + (mp - mq)^2) / (2 sq^2) - 1/2
        var_ratio = th.exp(2.0 * (log_std_p - log_std_q))
        mean_term = ((mean_p - mean_q) * th.exp(-log_std_q)) ** 2
        return 0.5 * (var_ratio + mean_term - 1.0) - (log_std_p - log_std_q)

    def kl_per_dim_to(self, old_params: th.Tensor, distribution: Distribution, reverse: bool = False) -> th.Tensor:
        # Straight from the live distribution's mean and std (no concatenation)
        normal = kl_normal(distribution)
        mean_old, log_std_old = self.split(old_params)
        var_old = th.exp(2.0 * log_std_old)
        diff_sq = (normal.loc - mean_old) ** 2
        var_new = normal.scale**2
        log_std_ratio = th.log(normal.scale) - log_std_old  # log(s_new / s_old)
        if reverse:  # KL(new || old)
            return (var_new + diff_sq) / (2.0 * var_old) - 0.5 - log_std_ratio
        return (var_old + diff_sq) / (2.0 * var_new) - 0.5 + log_std_ratio

    def joint_kl_to(self, old_params: th.Tensor, distribution: Distribution, reverse: bool = False) -> th.Tensor:
        # One autograd node with a closed-form gradient instead of a dozen elementwise nodes: this KL sits in every
        # minibatch of KLPPO's loss, where the per-op overhead of small tensors dominates its cost
        normal = kl_normal(distribution)
        loc, scale = normal.loc, normal.scale
        fused = th.is_grad_enabled() and not old_params.requires_grad and loc.shape == scale.shape
        if not fused or not (loc.requires_grad or scale.requires_grad):
            return self.kl_per_dim_to(old_params, distribution, reverse).sum(dim=-1)
        mean_old, log_std_old = self.split(old_params)
        return _GaussianJointKL.apply(loc, scale, mean_old, log_std_old, reverse)

    def entropy(self, params: th.Tensor) -> th.Tensor:
        _, log_std = self.split(params)
        return (log_std + 0.5 * math.log(2.0 * math.pi * math.e)).sum(dim=-1)

    def std(self, params: th.Tensor) -> th.Tensor:
        """:return: the standard deviation per state and action dimension"""
        return th.exp(self.split(params)[1])

    def torch_distributions(self, params: th.Tensor) -> list[th.distributions.Distribution]:
        mean, log_std = self.split(params)
        return [th.distributions.Normal(mean, th.exp(log_std))]


class _GaussianJointKL(th.autograd.Function):
    """
    Joint KL between a stored diagonal Gaussian (``mean_old``, ``log_std_old``; constants) and a live one
    (``loc``, ``scale``; differentiable), summed over action dimensions, with its closed-form gradient.

    Forward KL(old || new) per dimension: ``0.5 * (var_old + d^2) / scale^2 - 0.5 + log(scale) - log_std_old``
    with ``d = loc - mean_old``; d/dloc = ``d / scale^2``, d/dscale = ``(1 - (var_old + d^2) / scale^2) / scale``.
    Reverse KL(new || old): ``0.5 * (scale^2 + d^2) / var_old - 0.5 - log(scale) + log_std_old``;
    d/dloc = ``d / var_old``, d/dscale = ``scale / var_old - 1 / scale``.
    First-order only (``once_differentiable``): second derivatives (e.g. Fisher-vector products) use
    :meth:`DistributionParams.kl_per_dim`, which is built from differentiable operations.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, loc: th.Tensor, scale: th.Tensor, mean_old: th.Tensor, log_std_old: th.Tensor, reverse: bool
    ) -> th.Tensor:
        diff = loc - mean_old
        diff_sq = diff * diff
        if reverse:
            inv_var_old = th.exp(-2.0 * log_std_old)
            kl = (0.5 * (scale * scale + diff_sq) * inv_var_old + (log_std_old - 0.5) - th.log(scale)).sum(dim=-1)
            ctx.save_for_backward(diff, scale, inv_var_old)
        else:
            inv_var = scale.pow(-2)
            weighted = (th.exp(2.0 * log_std_old) + diff_sq) * inv_var
            kl = (0.5 * weighted + th.log(scale) - (log_std_old + 0.5)).sum(dim=-1)
            ctx.save_for_backward(diff, scale, inv_var, weighted)
        ctx.reverse = reverse
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_kl: th.Tensor) -> tuple[th.Tensor | None, ...]:  # type: ignore[override]
        grad = grad_kl.unsqueeze(-1)
        if ctx.reverse:
            diff, scale, inv_var_old = ctx.saved_tensors
            grad_loc = grad * diff * inv_var_old
            grad_scale = grad * (scale * inv_var_old - scale.reciprocal())
        else:
            diff, scale, inv_var, weighted = ctx.saved_tensors
            grad_loc = grad * diff * inv_var
            grad_scale = grad * (1.0 - weighted) / scale
        return grad_loc, grad_scale, None, None, None


class CategoricalParams(DistributionParams):
    """
    Categorical over ``n`` actions (``Discrete``): parameters are the normalized log-probabilities.

    :param n: Number of actions
    """

    def __init__(self, n: int):
        super().__init__(n_params=n, n_dims=1)

    def extract(self, distribution: Distribution) -> th.Tensor:
        return distribution.distribution.logits  # type: ignore[union-attr]

    def kl_per_dim(self, p: th.Tensor, q: th.Tensor) -> th.Tensor:
        log_p = th.log_softmax(p, dim=-1)
        log_q = th.log_softmax(q, dim=-1)
        return (th.exp(log_p) * (log_p - log_q)).sum(dim=-1, keepdim=True)

    def entropy(self, params: th.Tensor) -> th.Tensor:
        log_p = th.log_softmax(params, dim=-1)
        return -(th.exp(log_p) * log_p).sum(dim=-1)

    def torch_distributions(self, params: th.Tensor) -> list[th.distributions.Distribution]:
        return [th.distributions.Categorical(logits=params)]


class MultiCategoricalParams(DistributionParams):
    """
    Independent categoricals (``MultiDiscrete``): parameters are the concatenated log-probabilities.

    :param nvec: Number of choices of each sub-action
    """

    def __init__(self, nvec: list[int]):
        super().__init__(n_params=int(sum(nvec)), n_dims=len(nvec))
        self.nvec = [int(n) for n in nvec]

    def extract(self, distribution: Distribution) -> th.Tensor:
        return th.cat([categorical.logits for categorical in distribution.distribution], dim=-1)  # type: ignore[union-attr]

    def kl_per_dim(self, p: th.Tensor, q: th.Tensor) -> th.Tensor:
        kls = []
        for p_i, q_i in zip(th.split(p, self.nvec, dim=-1), th.split(q, self.nvec, dim=-1), strict=True):
            log_p = th.log_softmax(p_i, dim=-1)
            log_q = th.log_softmax(q_i, dim=-1)
            kls.append((th.exp(log_p) * (log_p - log_q)).sum(dim=-1))
        return th.stack(kls, dim=-1)

    def entropy(self, params: th.Tensor) -> th.Tensor:
        entropy = th.zeros(params.shape[:-1], device=params.device)
        for p_i in th.split(params, self.nvec, dim=-1):
            log_p = th.log_softmax(p_i, dim=-1)
            entropy = entropy - (th.exp(log_p) * log_p).sum(dim=-1)
        return entropy

    def torch_distributions(self, params: th.Tensor) -> list[th.distributions.Distribution]:
        return [th.distributions.Categorical(logits=p_i) for p_i in th.split(params, self.nvec, dim=-1)]


class BernoulliParams(DistributionParams):
    """
    Independent Bernoullis (``MultiBinary``): parameters are the logits.

    :param n: Number of binary actions
    """

    def __init__(self, n: int):
        super().__init__(n_params=n, n_dims=n)

    def extract(self, distribution: Distribution) -> th.Tensor:
        return distribution.distribution.logits  # type: ignore[union-attr]

    def kl_per_dim(self, p: th.Tensor, q: th.Tensor) -> th.Tensor:
        # log sigma(x) and log(1 - sigma(x)) = log sigma(-x), computed stably
        log_p1, log_p0 = F.logsigmoid(p), F.logsigmoid(-p)
        log_q1, log_q0 = F.logsigmoid(q), F.logsigmoid(-q)
        return th.exp(log_p1) * (log_p1 - log_q1) + th.exp(log_p0) * (log_p0 - log_q0)

    def entropy(self, params: th.Tensor) -> th.Tensor:
        log_p1, log_p0 = F.logsigmoid(params), F.logsigmoid(-params)
        return -(th.exp(log_p1) * log_p1 + th.exp(log_p0) * log_p0).sum(dim=-1)

    def torch_distributions(self, params: th.Tensor) -> list[th.distributions.Distribution]:
        return [th.distributions.Bernoulli(logits=params)]


def make_distribution_params(action_dist: Distribution, action_space: spaces.Space | None = None) -> DistributionParams:
    """
    Choose the parameter layout for a policy's action distribution.

    :param action_dist: The policy's ``action_dist``
    :param action_space: Unused, kept for symmetry with SB3's ``make_proba_distribution``
    :return: The matching :class:`DistributionParams`
    """
    if isinstance(action_dist, (DiagGaussianDistribution, StateDependentNoiseDistribution)):
        return GaussianParams(action_dist.action_dim)
    if isinstance(action_dist, CategoricalDistribution):
        return CategoricalParams(action_dist.action_dim)
    if isinstance(action_dist, MultiCategoricalDistribution):
        return MultiCategoricalParams(list(action_dist.action_dims))
    if isinstance(action_dist, BernoulliDistribution):
        return BernoulliParams(action_dist.action_dims)
    raise TypeError(
        f"sb3_kl has no exact KL for the action distribution {type(action_dist).__name__}: "
        "supported are Categorical, MultiCategorical, Bernoulli, DiagGaussian and StateDependentNoise (gSDE)."
    )


@dataclass(frozen=True)
class KLSettings:
    """
    Which KL is computed: direction, estimator, reduction over action dimensions.

    :param estimator: ``"analytic"`` (exact), ``"k1"`` or ``"k3"`` (sample estimators from the stored old log-probs)
    :param direction: ``"forward"`` = KL(pi_old || pi_new) or ``"reverse"`` = KL(pi_new || pi_old)
    :param reduction: ``"sum"`` (joint KL) or ``"mean"`` (per action dimension) over action dimensions
    :param log_ratio_clip: Log-ratios are clamped to +/- this value before exponentiation (the sample estimators that
        exponentiate them, k3 and the reverse direction, are evaluated at the clamped value; forward k1 is never clamped)
    """

    estimator: str = "analytic"
    direction: str = "forward"
    reduction: str = "sum"
    log_ratio_clip: float = 20.0

    def __post_init__(self) -> None:
        check_choice("kl_estimator", self.estimator, KL_ESTIMATORS)
        check_choice("kl_direction", self.direction, KL_DIRECTIONS)
        check_choice("kl_reduction", self.reduction, KL_REDUCTIONS)
        if (
            not (is_number(self.log_ratio_clip) and math.isfinite(self.log_ratio_clip))
            or self.log_ratio_clip <= 0
        ):
            raise ValueError(f"`log_ratio_clip` must be a positive finite number, got {self.log_ratio_clip!r}.")

    @property
    def convention(self) -> str:
        """Short label of the convention, e.g. ``"forward/analytic/sum"`` (logged beside every KL figure)."""
        return f"{self.direction}/{self.estimator}/{self.reduction}"

    @property
    def description(self) -> str:
        """Human-readable description, e.g. ``"KL(old||new), analytic, summed over action dimensions"``."""
        kl = "KL(old||new)" if self.direction == "forward" else "KL(new||old)"
        reduction = "summed over" if self.reduction == "sum" else "averaged over"
        return f"{kl}, {self.estimator}, {reduction} action dimensions"


def sample_kl(log_ratio: th.Tensor, estimator: str, direction: str, log_ratio_clip: float = 20.0) -> th.Tensor:
    """
    Per-sample KL estimate from ``log r = log pi_new(a|s) - log pi_old(a|s)``, ``a ~ pi_old``.

    :param log_ratio: ``(batch,)`` joint log-ratio of the taken actions
    :param estimator: ``"k1"`` or ``"k3"``
    :param direction: ``"forward"`` or ``"reverse"``
    :param log_ratio_clip: clamp for ``log r`` before exponentiation: the estimates that exponentiate it (``k3``, and
        both of the reverse direction) are evaluated at the clamped ``log r`` (so ``k3`` stays >= 0); the forward ``k1``
        estimate, ``-log r``, exponentiates nothing and is never clamped
    :return: ``(batch,)``
    """
    if direction == "forward" and estimator == "k1":
        return -log_ratio
    log_ratio = th.clamp(log_ratio, -log_ratio_clip, log_ratio_clip)
    if direction == "forward":
        return th.expm1(log_ratio) - log_ratio
    ratio = th.exp(log_ratio)
    if estimator == "k1":
        return ratio * log_ratio
    return ratio * log_ratio - th.expm1(log_ratio)


def importance_sampled_kl(
    log_prob: th.Tensor,
    ref_log_prob: th.Tensor,
    sampler_log_prob: th.Tensor,
    estimator: str,
    direction: str,
    log_ratio_clip: float = 20.0,
) -> th.Tensor:
    """
    Per-sample estimate of the KL between a policy ``pi`` and a reference ``pi_ref`` from actions drawn by a third
    policy ``mu`` (the rollout policy), importance-weighted so that its expectation over ``a ~ mu`` is the KL exactly,
    for every ``pi``: its expected gradient (``mu`` fixed) is then the gradient of that KL.

    - ``"reverse"``, KL(pi || pi_ref) = E_pi[k(pi_ref / pi)] = E_mu[(pi / mu) k(pi_ref / pi)];
    - ``"forward"``, KL(pi_ref || pi) = E_pi_ref[k(pi / pi_ref)] = E_mu[(pi_ref / mu) k(pi / pi_ref)];

    with ``k1(rho) = -log rho`` and ``k3(rho) = (rho - 1) - log rho`` (each has expectation KL under the
    distribution it is written for). The weight ``pi / mu`` of the reverse direction depends on ``pi``: that is the
    score-function part of the gradient, which a plain log-ratio estimator on ``mu``'s samples misses.
    With ``mu = pi_ref`` this is :func:`sample_kl` (``pi`` in its "new" slot).

    :param log_prob: ``log pi(a|s)`` (gradients flow through it), ``(batch,)``
    :param ref_log_prob: ``log pi_ref(a|s)``, ``(batch,)``
    :param sampler_log_prob: ``log mu(a|s)`` of the policy that drew the actions, ``(batch,)``
    :param estimator: ``"k1"`` or ``"k3"``
    :param direction: ``"reverse"`` = KL(pi || pi_ref) or ``"forward"`` = KL(pi_ref || pi)
    :param log_ratio_clip: clamp of every log-ratio before exponentiation: the weight's always, ``log rho`` for ``k3``
        (which exponentiates it, and is evaluated at the clamped value); ``k1``'s ``-log rho`` is not clamped
    :return: ``(batch,)``
    """
    check_choice("estimator", estimator, ("k1", "k3"))
    check_choice("direction", direction, KL_DIRECTIONS)
    if direction == "reverse":
        weight_log, log_rho = log_prob - sampler_log_prob, ref_log_prob - log_prob
    else:
        weight_log, log_rho = ref_log_prob - sampler_log_prob, log_prob - ref_log_prob
    weight = th.exp(th.clamp(weight_log, -log_ratio_clip, log_ratio_clip))
    if estimator == "k1":
        return -weight * log_rho
    log_rho = th.clamp(log_rho, -log_ratio_clip, log_ratio_clip)
    return weight * (th.expm1(log_rho) - log_rho)


def per_state_importance_sampled_kl(
    settings: KLSettings,
    dist_params: DistributionParams,
    log_prob: th.Tensor,
    ref_log_prob: th.Tensor,
    sampler_log_prob: th.Tensor,
) -> th.Tensor:
    """
    :func:`importance_sampled_kl` in the estimator, direction and reduction of ``settings`` (the direction as for a
    reference: ``"reverse"`` = KL(pi || pi_ref), ``"forward"`` = KL(pi_ref || pi)).

    :return: ``(batch,)``
    """
    if settings.estimator == "analytic":
        raise ValueError("The analytic KL needs no samples: use per_state_kl or per_state_kl_to.")
    joint = importance_sampled_kl(
        log_prob, ref_log_prob, sampler_log_prob, settings.estimator, settings.direction, settings.log_ratio_clip
    )
    return _reduce(settings, dist_params, joint)


def as_float64(*tensors: th.Tensor | None) -> tuple[th.Tensor | None, ...]:
    """
    The inputs of a KL measured after an update, cast to float64 (None kept): a per-state KL is a small difference of
    log-probabilities, which float32 rounds to ~1e-7 of their size, so the KL of a small update would lose its digits.

    :return: ``tensors`` in float64, in their order
    """
    return tuple(None if tensor is None else tensor.double() for tensor in tensors)


def per_state_kl(
    settings: KLSettings,
    dist_params: DistributionParams,
    old_params: th.Tensor,
    new_params: th.Tensor,
    log_ratio: th.Tensor | None = None,
) -> th.Tensor:
    """
    The per-state KL between the old and new policy, in the convention of ``settings``.

    :param settings: Direction, estimator, reduction
    :param dist_params: Parameter layout of the action distribution
    :param old_params: Parameters of the rollout policy, ``(batch, n_params)``
    :param new_params: Parameters of the current policy, ``(batch, n_params)``
    :param log_ratio: ``log pi_new(a|s) - log pi_old(a|s)`` of the stored actions, ``(batch,)``;
        required by the sample estimators
    :return: ``(batch,)``
    """
    if settings.estimator == "analytic":
        if settings.direction == "forward":
            kl = dist_params.kl_per_dim(old_params, new_params)
        else:
            kl = dist_params.kl_per_dim(new_params, old_params)
        return _reduce(settings, dist_params, kl.sum(dim=-1))
    return _reduce(settings, dist_params, _sample_estimate(settings, log_ratio))


def _sample_estimate(settings: KLSettings, log_ratio: th.Tensor | None) -> th.Tensor:
    if log_ratio is None:
        raise ValueError(f"The {settings.estimator!r} KL estimator needs the log-ratio of the stored actions.")
    return sample_kl(log_ratio, settings.estimator, settings.direction, settings.log_ratio_clip)


def _reduce(settings: KLSettings, dist_params: DistributionParams, joint_kl: th.Tensor) -> th.Tensor:
    """Joint KL per state -> the configured reduction over action dimensions."""
    return joint_kl / dist_params.n_dims if settings.reduction == "mean" else joint_kl


def per_state_kl_to(
    settings: KLSettings,
    dist_params: DistributionParams,
    old_params: th.Tensor,
    distribution: Distribution,
    log_ratio: th.Tensor | None = None,
) -> th.Tensor:
    """
    :func:`per_state_kl` against a live distribution (gradients flow into it): the form used inside the losses.

    :param settings: Direction, estimator, reduction
    :param dist_params: Parameter layout of the action distribution
    :param old_params: Parameters of the rollout policy, ``(batch, n_params)``
    :param distribution: The current policy's distribution on the same states
    :param log_ratio: ``log pi_new(a|s) - log pi_old(a|s)`` of the stored actions; required by the sample estimators
    :return: ``(batch,)``
    """
    if settings.estimator == "analytic":
        kl = dist_params.joint_kl_to(old_params, distribution, reverse=settings.direction == "reverse")
        return _reduce(settings, dist_params, kl)
    return _reduce(settings, dist_params, _sample_estimate(settings, log_ratio))


def actions_for_log_prob(actions: th.Tensor, action_space: spaces.Space) -> th.Tensor:
    """
    Stored actions in the form SB3's distributions take in ``log_prob``: ``Discrete`` actions (stored with shape
    ``(batch, 1)``) as a flat integer vector, all others as floats. SB3's buffers keep ``MultiBinary`` and
    ``MultiDiscrete`` actions in the action space's integer dtype and cast them to float32 only when sampling
    minibatches; ``Bernoulli.log_prob`` needs floats.

    :param actions: Actions as stored in a rollout buffer
    :param action_space: The action space
    :return: The actions for ``distribution.log_prob``
    """
    if isinstance(action_space, spaces.Discrete):
        return actions.long().flatten()
    return actions if th.is_floating_point(actions) else actions.float()


def kl_quantiles(per_state: np.ndarray, quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    """
    Summary statistics of a per-state KL array.

    :param per_state: per-state KL values
    :param quantiles: which quantiles to report (in [0, 1])
    :return: ``{"mean": ..., "p50": ..., "p90": ..., "p99": ..., "max": ...}`` as Python floats
    """
    stats = {"mean": float(np.mean(per_state))}
    values = np.quantile(per_state, quantiles)
    for q, value in zip(quantiles, values, strict=True):
        stats[quantile_name(q)] = float(value)
    stats["max"] = float(np.max(per_state))
    return stats


def quantile_name(q: float) -> str:
    """
    ``0.99 -> "p99"``, ``0.5 -> "p50"``, ``0.999 -> "p99.9"``, ``0.9999999 -> "p99.99999"``: the percentage written
    exactly from the shortest decimal form of ``q`` (never rounded, so distinct quantiles get distinct names and only
    the maximum could read as ``p100``).
    """
    percent = Decimal(repr(float(q))) * 100
    return f"p{format(percent.normalize(), 'f')}"


def sb3_contrib_kl_reduction(action_space: spaces.Space) -> str:
    """
    The reduction over action dimensions of the KL sb3-contrib's TRPO constrains on an action space.

    TRPO bounds ``kl_divergence(new, old).mean()`` (SB3's ``kl_divergence``, i.e. KL(new||old)). For a
    ``MultiDiscrete`` space SB3 sums the KL of the sub-actions, so the ``.mean()`` runs over states only: the joint
    KL (``"sum"``; ``Discrete`` has one dimension, where sum and mean agree). For ``Box`` (with or without gSDE) and
    ``MultiBinary``, PyTorch returns one KL per action dimension and ``.mean()`` averages over states *and*
    dimensions: ``"mean"``.

    :param action_space: The action space
    :return: ``"sum"`` or ``"mean"``
    """
    return "sum" if isinstance(action_space, (spaces.Discrete, spaces.MultiDiscrete)) else "mean"


def distribution_params_for_space(action_space: spaces.Space) -> DistributionParams:
    """
    The parameter layout SB3's default action distribution has for an action space
    (as chosen by ``make_proba_distribution``); known before any policy exists, e.g. to size a buffer.

    :param action_space: The action space
    :return: The matching :class:`DistributionParams`
    """
    if isinstance(action_space, spaces.Box):
        return GaussianParams(int(np.prod(action_space.shape)))
    if isinstance(action_space, spaces.Discrete):
        return CategoricalParams(int(action_space.n))
    if isinstance(action_space, spaces.MultiDiscrete):
        return MultiCategoricalParams([int(n) for n in np.asarray(action_space.nvec).flatten()])
    if isinstance(action_space, spaces.MultiBinary):
        return BernoulliParams(int(np.prod(action_space.shape)))
    raise TypeError(
        f"sb3_kl supports Box, Discrete, MultiDiscrete and MultiBinary actions, not {type(action_space).__name__}."
    )
