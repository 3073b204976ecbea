import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib.common.utils import conjugate_gradient_solver
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.distributions import Distribution, StateDependentNoiseDistribution
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from torch import nn
from torch.nn import functional as F

from sb3_kl.common.controllers import KLController
from sb3_kl.common.kl import as_float64, attach_sde_features, per_state_kl, sb3_contrib_kl_reduction
from sb3_kl.common.modes import RUNNING_STATISTICS_MODULES, acting_mode, has_mode_dependent_modules, modules_run_by
from sb3_kl.common.on_policy_algorithm import KLOnPolicyAlgorithm, NonFiniteUpdateError
from sb3_kl.common.reference import ReferenceSource
from sb3_kl.common.user_warnings import warn_at_user_frame
from sb3_kl.common.validation import check_bool, check_choice, check_int, check_range
from sb3_kl.kltrpo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

SelfKLTRPO = TypeVar("SelfKLTRPO", bound="KLTRPO")

#: ``kl_reduction`` value that constrains the KL sb3-contrib's TRPO constrains, whatever the action space
SB3_CONTRIB_KL = "sb3_contrib"
#: The line search stops growing the step once the accepted candidate uses this fraction of the KL budget
BUDGET_STOP = 0.95
#: Fraction of the KL budget a grown candidate aims at (a little under the bound, so an accurate guess is accepted)
BUDGET_AIM = 0.98
#: Largest growth of the step per forward pass while no larger step has been rejected
MAX_GROWTH = 4.0


def _stack(observations: list[Any]) -> Any:
    """A batch of observations of one space (arrays, or dicts of arrays), as a VecEnv returns them."""
    if isinstance(observations[0], dict):
        return {key: np.stack([obs[key] for obs in observations]) for key in observations[0]}
    return np.stack(observations)


@th.no_grad()
def _copy_flat_to_parameters(flat: th.Tensor, parameters: list[nn.Parameter]) -> None:
    """Write a flat vector into the parameters, in place (unlike ``vector_to_parameters``, no aliasing of ``flat``)."""
    start = 0
    for param in parameters:
        n_params = param.numel()
        param.copy_(flat[start : start + n_params].view_as(param))
        start += n_params


class KLTRPO(KLOnPolicyAlgorithm):
    """
    Trust Region Policy Optimization with an exact KL constraint and an optional bound on the KL of the tail
    of the states (KLTRPO), a drop-in for sb3-contrib's ``TRPO``.

    Each update maximizes the surrogate ``E[r A]`` subject to ``mean_s KL(s) <= target_kl``, where ``KL(s)`` is the
    exact per-state KL between the rollout and the updated policy in the algorithm's convention: by default
    forward ``KL(pi_old || pi_new)`` summed over action dimensions, i.e. the KL of the joint action distribution.

    sb3-contrib's TRPO constrains ``KL(pi_new || pi_old)`` reduced the way SB3's ``kl_divergence(...).mean()``
    reduces it, which depends on the action space: summed over the sub-actions of ``Discrete``/``MultiDiscrete``,
    averaged over the dimensions of ``Box`` (with or without gSDE) and ``MultiBinary`` (there the joint KL may reach
    ``action_dim * target_kl``). ``kl_reduction="sb3_contrib"`` constrains exactly that KL on every space (it
    implies ``kl_direction="reverse"``); with ``line_search_grow_iter=0`` KLTRPO then takes TRPO's updates.

    1. Conjugate gradient on Fisher-vector products (Hessian-vector products of the mean analytic KL, plus
       ``cg_damping`` scaled to that KL's reduction) gives the natural-gradient direction ``d``.
    2. The quadratic model of the KL gives the step ``beta d``, ``beta = sqrt(2 target_kl / d^T (F + damping) d)``.
    3. Line search along ``d`` for the largest step whose *measured* KL meets the constraints (mean KL
       ``<= target_kl`` and, when ``tail_kl`` is set, ``tail_quantile`` of the per-state KL ``<= tail_kl``, both
       on the whole buffer even when the policy step is sub-sampled) and whose surrogate improves: TRPO's
       backtracking from ``beta d`` (shrinking by ``line_search_shrinking_factor``, at most ``line_search_max_iter``
       candidates) finds a first acceptable step; then up to ``line_search_grow_iter`` more candidates grow it
       toward the bound, past ``beta d`` when the quadratic model overestimated the KL, interpolating on the
       measured KL between the largest accepted and the smallest rejected step; a larger candidate whose surrogate
       is below the accepted one's is rejected (past the surrogate's maximum). Only a measured, accepted
       candidate is kept; if none is accepted the policy is unchanged. Candidates are measured on the policy as it
       acts (eval mode: dropout off), like the rollout distribution they are compared with; the gradient and
       Fisher pass runs in train mode, as SB3 trains. Batch norm on the actor's path is refused: its running
       statistics move the acting policy at every train-mode forward pass, outside any step the line search measures.
    4. The critic is fitted by ``n_critic_updates`` epochs of Adam on minibatches (the actor's gradients removed).

    Paper: https://arxiv.org/abs/1502.05477 (and John Schulman's thesis, http://joschu.net/docs/thesis.pdf, p40-42)
    Code: follows the structure of sb3-contrib's TRPO (https://github.com/Stable-Baselines-Team/stable-baselines3-contrib)

    :param policy: The policy model to use (MlpPolicy, CnnPolicy, ...)
    :param env: The environment to learn from (if registered in Gym, can be str)
    :param learning_rate: The learning rate for the value function, it can be a function
        of the current progress remaining (from 1 to 0)
    :param n_steps: The number of steps to run for each environment per update
        (i.e. rollout buffer size is n_steps * n_envs where n_envs is number of environment copies running in parallel)
    :param batch_size: Minibatch size for the value function
    :param gamma: Discount factor
    :param cg_max_steps: maximum number of steps in the Conjugate Gradient algorithm
        for computing the Hessian vector product
    :param cg_damping: damping in the Hessian vector product computation, in the scale of sb3-contrib TRPO's KL (see
        :meth:`cg_damping_scale`): TRPO's and rl-zoo's values carry over, and ``kl_reduction`` changes the units of
        ``target_kl``, not the search direction
    :param line_search_shrinking_factor: step-size reduction factor for the line-search
        (i.e., ``theta_new = theta + alpha^i * step``), in (0, 1)
    :param line_search_max_iter: maximum number of iterations for the backtracking line-search
    :param n_critic_updates: number of critic updates per policy update
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param use_sde: Whether to use generalized State Dependent Exploration (gSDE)
        instead of action noise exploration (default: False)
    :param sde_sample_freq: Sample a new noise matrix every n steps when using gSDE
        Default: -1 (only sample at the beginning of the rollout)
    :param rollout_buffer_class: Rollout buffer class to use; must subclass ``KLRolloutBuffer`` (or its Dict variant).
        If ``None``, it will be automatically selected.
    :param rollout_buffer_kwargs: Keyword arguments to pass to the rollout buffer on creation
    :param normalize_advantage: Whether to normalize or not the advantage
    :param target_kl: Bound on the mean per-state KL of each update (number or schedule of progress remaining),
        the delta of the trust region. Default 0.01
    :param sub_sampling_factor: Use one state in ``sub_sampling_factor`` for the gradient, the Fisher-vector
        products and the surrogate of the policy step, to make computation faster (see p40-42 of John Schulman's
        thesis); the KL constraints are still checked on every state of the buffer (forward passes only)
    :param kl_estimator: Must be ``"analytic"``: the trust region needs the exact KL and its Hessian
    :param kl_direction: ``"forward"`` = KL(old||new) or ``"reverse"`` = KL(new||old). None (default):
        ``"forward"``, or ``"reverse"`` with ``kl_reduction="sb3_contrib"``
    :param kl_reduction: ``"sum"`` (joint KL, default), ``"mean"`` over action dimensions, or ``"sb3_contrib"``:
        the KL sb3-contrib's TRPO constrains on this action space (KL(new||old), ``"sum"`` for ``Discrete`` and
        ``MultiDiscrete``, ``"mean"`` for ``Box`` and ``MultiBinary``; see :func:`sb3_contrib_kl_reduction`). It is
        resolved when the action space is known: ``train/kl_convention`` and ``kl_settings`` show the resolved
        convention, e.g. ``reverse/analytic/mean``
    :param tail_kl: When set, a step is also rejected if the ``tail_quantile`` of the per-state KL exceeds it
    :param tail_quantile: Quantile of the per-state KL bounded by ``tail_kl`` (default 0.99)
    :param line_search_grow_iter: Largest number of extra candidates (one forward pass each, two with
        sub-sampling) the line search spends growing the first accepted step toward the KL bound, past the
        quadratic model's step when the model overestimates the KL; it stops earlier once a step uses 95% of the
        budget, and a larger step is taken only if its surrogate objective is at least the smaller one's (past the
        surrogate's maximum along the direction it is not). With ``line_search_max_iter`` it bounds the forward passes
        of an update. 0: TRPO's backtracking only
    :param min_std: Variance floor for Gaussian policies: std >= min_std after every accepted step (``log_std`` of
        each candidate of the line search is clamped, so the constraints hold for the floored policy; a std that starts
        below the floor is never lowered further). With gSDE it floors the std of the exploration weights (what
        ``train/std`` averages; with ``use_expln`` that std is expln(log_std), which ``train/std``, SB3's mean of
        exp(log_std), does not show), not the per-state action std ``train/action_std_min``. None = no floor
    :param kl_quantiles: Quantiles of the per-state KL logged after each update (as ``train/kl_p<q>``)
    :param ref_policy: Reference policy to anchor to while learning (e.g. a new reward): the path of a saved SB3
        model (any on-policy algorithm), a model or an ``ActorCriticPolicy``. A frozen copy is kept as
        ``model.ref_policy`` (eval mode, no gradients, never updated) and saved with the model. Must share the action
        and observation spaces. None (default): no anchor.
        With a reference, the maximized objective is ``E[r A] - beta_ref * KL_ref`` (mean over the states): it enters
        the gradient that conjugate gradient turns into the step direction, and the line search accepts a step only
        if this combined objective improves. The trust region (``target_kl`` on the KL to the rollout policy) still
        bounds every step; the reference term only changes which direction and length within it are taken
    :param ref_kl_coef: Coefficient beta_ref of the reference KL: fixed when ``ref_target_kl`` is None, else its
        initial value. 0 with ``ref_target_kl=None`` only measures and logs the KL to the reference
    :param ref_target_kl: Target of the mean reference KL (after each update, over the buffer's states); when set,
        beta_ref is adapted toward it by its own ``ref_kl_controller``. None (default): fixed beta_ref
    :param ref_kl_controller: Rule adapting beta_ref: ``"adaptive"``, ``"fixed"``, ``"proportional"`` or a
        ``KLController`` (own instance and state)
    :param ref_kl_coef_bounds: Bounds (min, max) of beta_ref
    :param ref_kl_direction: ``"reverse"`` = KL(pi || pi_ref) (default, as in RLHF) or ``"forward"`` = KL(pi_ref || pi)
    :param ref_kl_estimator: ``"analytic"`` (exact, default), ``"k1"`` or ``"k3"`` (from the stored actions, drawn by
        the rollout policy)
    :param stats_window_size: Window size for the rollout logging, specifying the number of episodes to average
        the reported success rate, mean episode length, and mean reward over
    :param tensorboard_log: the log location for tensorboard (if None, no logging)
    :param policy_kwargs: additional arguments to be passed to the policy on creation
    :param verbose: the verbosity level: 0 no output, 1 info, 2 debug
    :param seed: Seed for the pseudo random generators
    :param device: Device (cpu, cuda, ...) on which the code should be run.
        Setting it to auto, the code will be run on the GPU if possible.
    :param _init_setup_model: Whether or not to build the network at the creation of the instance
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpPolicy": MlpPolicy,
        "CnnPolicy": CnnPolicy,
        "MultiInputPolicy": MultiInputPolicy,
    }
    has_kl_coef: ClassVar[bool] = False  # a hard constraint, no penalty coefficient
    kl_family: ClassVar[str] = "constraint"

    def __init__(
        self,
        policy: str | type[MlpPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule = 1e-3,
        n_steps: int = 2048,
        batch_size: int = 128,
        gamma: float = 0.99,
        cg_max_steps: int = 15,
        cg_damping: float = 0.1,
        line_search_shrinking_factor: float = 0.8,
        line_search_max_iter: int = 10,
        n_critic_updates: int = 10,
        gae_lambda: float = 0.95,
        use_sde: bool = False,
        sde_sample_freq: int = -1,
        rollout_buffer_class: type[RolloutBuffer] | None = None,
        rollout_buffer_kwargs: dict[str, Any] | None = None,
        normalize_advantage: bool = True,
        target_kl: float | Schedule = 0.01,
        sub_sampling_factor: int = 1,
        kl_estimator: str = "analytic",
        kl_direction: str | None = None,
        kl_reduction: str = "sum",
        tail_kl: float | None = None,
        tail_quantile: float = 0.99,
        line_search_grow_iter: int = 5,
        min_std: float | None = None,
        kl_quantiles: tuple[float, ...] = (0.5, 0.9, 0.99),
        ref_policy: ReferenceSource | None = None,
        ref_kl_coef: float = 1.0,
        ref_target_kl: float | None = None,
        ref_kl_controller: str | KLController = "adaptive",
        ref_kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
        ref_kl_direction: str = "reverse",
        ref_kl_estimator: str = "analytic",
        stats_window_size: int = 100,
        tensorboard_log: str | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        verbose: int = 0,
        seed: int | None = None,
        device: th.device | str = "auto",
        _init_setup_model: bool = True,
    ):
        # Checked before building anything, so a bad argument fails fast
        if target_kl is None:
            raise ValueError("`target_kl` is the trust-region bound of KLTRPO and must be set (e.g. 0.01), got None.")
        if kl_estimator != "analytic":
            raise ValueError(
                f"`kl_estimator`={kl_estimator!r} is not supported by KLTRPO: the trust region needs the exact KL "
                "and its Hessian, pass kl_estimator='analytic'."
            )
        check_int("cg_max_steps", cg_max_steps, 1)
        check_range("cg_damping", cg_damping, 0.0, None, closed_low=True, hint="a finite number >= 0")
        check_range("line_search_shrinking_factor", line_search_shrinking_factor, 0.0, 1.0, closed_low=False, hint="in (0, 1)")
        check_int("line_search_max_iter", line_search_max_iter, 1)
        check_int("n_critic_updates", n_critic_updates, 0)
        check_int("sub_sampling_factor", sub_sampling_factor, 1)
        check_int("batch_size", batch_size, 1)
        check_bool("normalize_advantage", normalize_advantage)
        if tail_kl is not None:
            check_range("tail_kl", tail_kl, 0.0, None, closed_low=False, hint="a positive finite number (None: no tail bound)")
        check_range("tail_quantile", tail_quantile, 0.0, 1.0, closed_low=False, hint="strictly between 0 and 1")
        check_int("line_search_grow_iter", line_search_grow_iter, 0)
        check_choice("kl_reduction", kl_reduction, ("sum", "mean", SB3_CONTRIB_KL))
        sb3_contrib_kl = kl_reduction == SB3_CONTRIB_KL
        if sb3_contrib_kl:
            if kl_direction not in (None, "reverse"):
                raise ValueError(
                    f"`kl_reduction`={SB3_CONTRIB_KL!r} constrains sb3-contrib TRPO's KL, which is KL(new||old): "
                    f"pass kl_direction='reverse' (or leave it None), got kl_direction={kl_direction!r}."
                )
            kl_direction = "reverse"
            kl_reduction = "sum"  # resolved for the action space below (or in _setup_model when it is not known yet)
        elif kl_direction is None:
            kl_direction = "forward"

        super().__init__(
            policy,
            env,
            learning_rate=learning_rate,
            n_steps=n_steps,
            gamma=gamma,
            gae_lambda=gae_lambda,
            ent_coef=0.0,  # entropy bonus is not used by TRPO
            vf_coef=0.0,  # value function is optimized separately
            max_grad_norm=0.0,
            use_sde=use_sde,
            sde_sample_freq=sde_sample_freq,
            rollout_buffer_class=rollout_buffer_class,
            rollout_buffer_kwargs=rollout_buffer_kwargs,
            stats_window_size=stats_window_size,
            tensorboard_log=tensorboard_log,
            policy_kwargs=policy_kwargs,
            verbose=verbose,
            device=device,
            seed=seed,
            _init_setup_model=False,
            supported_action_spaces=(
                spaces.Box,
                spaces.Discrete,
                spaces.MultiDiscrete,
                spaces.MultiBinary,
            ),
            target_kl=target_kl,
            kl_estimator=kl_estimator,
            kl_direction=kl_direction,
            kl_reduction=kl_reduction,
            min_std=min_std,
            kl_quantiles=kl_quantiles,
            ref_policy=ref_policy,
            ref_kl_coef=ref_kl_coef,
            ref_target_kl=ref_target_kl,
            ref_kl_controller=ref_kl_controller,
            ref_kl_coef_bounds=ref_kl_coef_bounds,
            ref_kl_direction=ref_kl_direction,
            ref_kl_estimator=ref_kl_estimator,
        )

        self.normalize_advantage = normalize_advantage
        # Same sanity checks as sb3-contrib's TRPO (same exceptions, so TRPO users see no difference)
        if self.env is not None:
            buffer_size = self.env.num_envs * self.n_steps
            if normalize_advantage:
                assert buffer_size > 1, (
                    "`n_steps * n_envs` must be greater than 1. "
                    f"Currently n_steps={self.n_steps} and n_envs={self.env.num_envs}"
                )
            untruncated_batches = buffer_size // batch_size
            if buffer_size % batch_size > 0:
                warn_at_user_frame(
                    f"You have specified a mini-batch size of {batch_size},"
                    f" but because the `RolloutBuffer` is of size `n_steps * n_envs = {buffer_size}`,"
                    f" after every {untruncated_batches} untruncated mini-batches,"
                    f" there will be a truncated mini-batch of size {buffer_size % batch_size}\n"
                    f"We recommend using a `batch_size` that is a factor of `n_steps * n_envs`.\n"
                    f"Info: (n_steps={self.n_steps} and n_envs={self.env.num_envs})"
                )
        self.batch_size = batch_size
        # Conjugate gradients parameters
        self.cg_max_steps = cg_max_steps
        self.cg_damping = float(cg_damping)
        # Backtracking line search parameters
        self.line_search_shrinking_factor = float(line_search_shrinking_factor)
        self.line_search_max_iter = line_search_max_iter
        self.n_critic_updates = n_critic_updates
        self.sub_sampling_factor = sub_sampling_factor
        self.tail_kl = None if tail_kl is None else float(tail_kl)
        self.tail_quantile = float(tail_quantile)
        self.line_search_grow_iter = line_search_grow_iter
        self.sb3_contrib_kl = sb3_contrib_kl
        self._resolve_kl_convention()

        if _init_setup_model:
            self._setup_model()
            self._refuse_running_statistics_on_the_actor()

    @classmethod
    def _no_kl_coef_message(cls) -> str:
        return (
            f"{super()._no_kl_coef_message()} It holds the KL under `target_kl` as a hard constraint: set `target_kl` "
            "to change its steps (the reference penalty's coefficient is `ref_kl_coef`)."
        )

    def _resolve_kl_convention(self) -> None:
        """With ``kl_reduction="sb3_contrib"``, set the constrained (and reference) KL's reduction for the action space."""
        if getattr(self, "sb3_contrib_kl", False) and getattr(self, "action_space", None) is not None:
            reduction = sb3_contrib_kl_reduction(self.action_space)
            self.kl_settings = dataclasses.replace(self.kl_settings, reduction=reduction)
            self.ref_kl_settings = dataclasses.replace(self.ref_kl_settings, reduction=reduction)

    def _setup_model(self) -> None:
        # checked here too for a loaded model: a zip of KLPPO with a sample estimator loads into KLTRPO
        if self.kl_settings.estimator != "analytic":
            raise ValueError(
                f"This model's KL estimator is {self.kl_settings.estimator!r} (a KLPPO zip?): KLTRPO's trust region "
                "needs the exact KL and its Hessian. Load it with the algorithm that saved it, or build a KLTRPO with "
                "kl_estimator='analytic' and load the weights with set_parameters()."
            )
        self._resolve_kl_convention()
        super()._setup_model()

    def _setup_learn(self, *args: Any, **kwargs: Any) -> Any:
        # checked here too for a loaded model (which may still be loaded to predict)
        self._refuse_running_statistics_on_the_actor()
        return super()._setup_learn(*args, **kwargs)

    def _refuse_running_statistics_on_the_actor(self) -> None:
        """
        Raise a ``ValueError`` when a module with running statistics (batch norm) computes the action distribution:
        every train-mode forward pass (the gradient pass, the critic fit through a shared features extractor) updates
        them and so moves the policy that acts, which no candidate of the line search measures, and the constraint
        could not hold.
        """
        # two observations (batch norm without running statistics needs a batch), drawn from a copy of the space:
        # sampling the space itself would draw from the random state the env may share
        space = copy.deepcopy(self.observation_space)
        observation, _ = self.policy.obs_to_tensor(_stack([space.sample(), space.sample()]))
        with acting_mode(self.policy), th.no_grad():
            ran = modules_run_by(self.policy, lambda: self.policy.get_distribution(observation), RUNNING_STATISTICS_MODULES)
        if ran:
            named = self.policy.named_modules(remove_duplicate=False)
            names = ", ".join(name for name, module in named if any(module is m for m in ran))
            raise ValueError(
                f"KLTRPO bounds the KL of the policy as it acts, but the module(s) {names} on the actor's path keep "
                "running statistics (batch norm), which every train-mode forward pass updates: the acting policy would "
                "move outside any step the line search measures. Build the policy without them (`policy_kwargs`: "
                "nn.LayerNorm normalizes without running statistics), or use KLPPO, whose KL is a penalty."
            )

    def cg_damping_scale(self) -> float:
        """
        The factor applied to ``cg_damping`` before it is added to the Fisher-vector products.

        sb3-contrib's TRPO adds ``cg_damping`` to the Hessian of its own KL, which it averages over the dimensions of
        ``Box`` and ``MultiBinary`` actions and sums over the sub-actions of ``MultiDiscrete`` ones (see
        :func:`sb3_contrib_kl_reduction`). Where KLTRPO reduces the other way its KL's Hessian is ``n_dims`` times
        larger (summing what TRPO averages) or smaller (averaging what TRPO sums), and so is the damping here. The damped
        system then has the same solution direction in every convention: ``kl_reduction`` only rescales the bound
        (``target_kl`` summed over ``n`` dimensions is ``n`` times the per-dimension one), and a ``cg_damping`` tuned
        for TRPO, such as rl-zoo's, means what it meant there.

        :return: ``n_dims``, ``1 / n_dims`` or 1 (the direction of the KL does not matter: at the rollout policy both
            directions have the Fisher information matrix as their Hessian)
        """
        reduction = self.kl_settings.reduction
        if self.action_space is None or reduction == sb3_contrib_kl_reduction(self.action_space):
            return 1.0
        n_dims = self.dist_params.n_dims
        return float(n_dims) if reduction == "sum" else 1.0 / n_dims

    def _actor_parameters(self) -> list[nn.Parameter]:
        """
        The parameters the KL constraint applies to: every trainable parameter of the policy except the critic's
        (``mlp_extractor.value_net`` and ``value_net``). Parameters that turn out not to affect the action
        distribution are dropped in :meth:`train`.
        """
        critic = set()
        for module in (self.policy.value_net, self.policy.mlp_extractor.value_net):
            critic.update(id(p) for p in module.parameters())
        if not self.policy.share_features_extractor:
            critic.update(id(p) for p in self.policy.vf_features_extractor.parameters())
        return [p for p in self.policy.parameters() if p.requires_grad and id(p) not in critic]

    def _constrained_kl(self, old_params: th.Tensor, distribution: Any) -> th.Tensor:
        """
        Per-state analytic KL between the rollout policy and ``distribution``, in the algorithm's convention, built
        from plain differentiable tensor operations: the Fisher-vector products differentiate it twice.

        :param old_params: Rollout-policy parameters from the buffer
        :param distribution: The current policy's distribution on the same states
        :return: ``(batch,)``
        """
        return per_state_kl(self.kl_settings, self.dist_params, old_params, self.dist_params.extract(distribution))

    def _candidate_log_std_floor(self) -> th.Tensor | None:
        """
        The lower bound of ``log_std`` for the line search's candidates: the base's floor (std >= ``min_std``), except
        where the rollout policy is already below it (e.g. ``log_std_init`` under the floor), where the bound is the
        current value: the std may then rise, or stay, but flooring never forces a jump the trust region forbids.
        Moving ``log_std`` back toward the rollout policy's value never increases a Gaussian's KL, and the line search
        measures the KL of the floored candidate anyway.
        """
        floor = self._min_log_std_parameter()
        if floor is None:
            return None
        return th.clamp(self.policy.log_std.detach(), max=floor).clone()

    def _fit_critic(self, actor_params: list[nn.Parameter]) -> tuple[list[float], int, int]:
        """
        ``n_critic_updates`` epochs of Adam on random minibatches of the whole buffer, with the actor's gradients
        removed so the critic cannot move the policy. The minibatches are those ``rollout_buffer.get(batch_size)``
        would give, as in sb3-contrib's TRPO (one permutation of the buffer's own order per epoch, from the same numpy
        draw), sliced from the whole buffer read once in that order.

        :param actor_params: The parameters of the policy step (their gradients are dropped before each Adam step)
        :return: the value loss of every minibatch, the number of steps skipped for a non-finite loss or gradient and
            the number applied
        """
        value_losses = []
        nonfinite_steps, applied_steps = 0, 0
        n_samples = self.rollout_buffer.buffer_size * self.rollout_buffer.n_envs
        whole_buffer = next(self.rollout_buffer.ordered_samples(chunk_size=n_samples))
        all_observations, all_returns = whole_buffer.observations, whole_buffer.returns
        for _ in range(self.n_critic_updates):
            permutation = th.as_tensor(np.random.permutation(n_samples), device=self.device)
            for start in range(0, n_samples, self.batch_size):
                indices = permutation[start : start + self.batch_size]
                if isinstance(all_observations, dict):
                    batch_observations = {key: obs[indices] for key, obs in all_observations.items()}
                else:
                    batch_observations = all_observations[indices]
                values_pred = self.policy.predict_values(batch_observations)  # type: ignore[arg-type]
                value_loss = F.mse_loss(all_returns[indices], values_pred.flatten())
                value_losses.append(value_loss.item())
                self.policy.optimizer.zero_grad()
                value_loss.backward()
                for param in actor_params:
                    param.grad = None
                # A non-finite loss or gradient skips the step, as in KLPPO: applied, it would make the critic NaN
                # (one sum per tensor and one host sync: a NaN or inf in any gradient makes the total non-finite)
                grads = [param.grad for param in self.policy.parameters() if param.grad is not None]
                if not math.isfinite(float(th.stack([grad.sum() for grad in grads]).sum())):
                    self.policy.optimizer.zero_grad()
                    nonfinite_steps += 1
                    continue
                self.policy.optimizer.step()
                applied_steps += 1
        return value_losses, nonfinite_steps, applied_steps

    def _anchor_distribution(self, observations: Any, distribution: Distribution) -> Distribution:
        """
        The policy's distribution as the reference term of the objective differentiates it. With gSDE, SB3 builds the
        std from detached features, and the constraint keeps that (as sb3-contrib's TRPO does); the anchor's gradient
        must also move the std through the features, as it does in KLPPO: a shallow copy of ``distribution`` (the
        same values, the policy's distribution object left as it is) carries a Normal whose std is differentiable in
        the latent features (:func:`~sb3_kl.common.kl.attach_sde_features`). Other distributions are returned as
        they are.

        :param observations: The states ``distribution`` was built on
        :param distribution: ``self.policy.get_distribution(observations)``
        """
        if not isinstance(distribution, StateDependentNoiseDistribution) or distribution.learn_features:
            return distribution
        features = self.policy.extract_features(observations)  # type: ignore[arg-type]
        pi_features = features if self.policy.share_features_extractor else features[0]
        latent_pi = self.policy.mlp_extractor.forward_actor(pi_features)
        anchored = copy.copy(distribution)
        attach_sde_features(anchored, latent_pi, self.policy.log_std)
        return anchored

    def _budget_used(self, mean_kl: float, tail: float | None, target_kl: float) -> float:
        """
        The fraction of the trust region a candidate uses: its measured mean KL over ``target_kl`` or, with
        ``tail_kl``, its ``tail_quantile`` over ``tail_kl`` when that is larger. The constraints hold iff it is <= 1.
        A KL is never negative: a measured one below 0 (float32 rounding of a KL of about 0, e.g. a tiny step under
        ``target_kl`` near its 1e-8 floor) counts as 0, so the search's square roots stay defined.
        """
        used = max(mean_kl, 0.0) / target_kl
        if tail is not None and self.tail_kl is not None:
            used = max(used, max(tail, 0.0) / self.tail_kl)
        return used if math.isfinite(used) else math.inf

    def _search_step_size(
        self,
        evaluate: Callable[[float], tuple[float, float, float | None]],
        max_step_size: float,
        old_objective: float,
        target_kl: float,
    ) -> tuple[float, float, float, int]:
        """
        The largest step size along the natural-gradient direction whose measured KL (and tail quantile) meets the
        constraints and whose objective improves, on the rollout policy's and on every smaller step's tried, within
        ``line_search_max_iter + line_search_grow_iter`` forward passes. Every candidate is measured
        (:meth:`_budget_used`); only a measured feasible one is returned.

        1. TRPO's backtracking: ``max_step_size`` (the quadratic model's step), shrunk by
           ``line_search_shrinking_factor`` until a candidate is accepted.
        2. Growth toward the bound, at most ``line_search_grow_iter`` more candidates, until the accepted step uses
           ``BUDGET_STOP`` of the budget. Without a rejected step above the accepted one, the step grows past it
           by ``sqrt(BUDGET_AIM / used)`` (the KL is quadratic in the step size near 0; at most ``MAX_GROWTH``
           per pass); once one is rejected, the next candidate is interpolated between the two on the square root
           of the budget used (roughly linear in the step size), or bisected when the rejection was the objective's.
           A grown candidate is rejected for the objective when it is below the accepted step's: the step stops at
           the surrogate's maximum along the direction when that lies inside the trust region.

        :param evaluate: Sets the actor to ``step_size`` along the direction; returns the objective, the mean KL and
            the tail quantile (None without ``tail_kl``) of that candidate
        :param max_step_size: The quadratic model's step size
        :param old_objective: The objective of the rollout policy, to improve on
        :param target_kl: The bound on the mean KL
        :return: the accepted step size (0 when none), its objective and mean KL, and the number of candidates tried
        """
        n_tried = 0
        accepted: tuple[float, float, float, float] | None = None  # step size, objective, mean KL, budget used
        rejected: tuple[float, float] | None = None  # smallest rejected step size above the accepted one, budget used
        backtrack_coeff = 1.0
        for _ in range(self.line_search_max_iter):
            step_size = backtrack_coeff * max_step_size
            objective, mean_kl, tail = evaluate(step_size)
            n_tried += 1
            used = self._budget_used(mean_kl, tail, target_kl)
            if objective > old_objective and used <= 1.0:
                accepted = (step_size, objective, mean_kl, used)
                break
            rejected = (step_size, used)
            backtrack_coeff *= self.line_search_shrinking_factor
        if accepted is None:
            return 0.0, old_objective, 0.0, n_tried

        for _ in range(self.line_search_grow_iter):
            low, _, _, low_used = accepted
            if low_used >= BUDGET_STOP:
                break
            if rejected is None:
                growth = MAX_GROWTH if low_used <= 0 else min(MAX_GROWTH, math.sqrt(BUDGET_AIM / low_used))
                step_size = low * growth
            else:
                high, high_used = rejected
                if high <= low * (1.0 + 1e-3):
                    break
                if high_used > 1.0 and math.isfinite(high_used):
                    # secant on sqrt(budget used), which is close to linear in the step size
                    root_low, root_high = math.sqrt(low_used), math.sqrt(high_used)
                    fraction = (math.sqrt(BUDGET_AIM) - root_low) / (root_high - root_low)
                else:
                    fraction = 0.5  # rejected for the objective (or a non-finite KL): bisect
                step_size = low + min(max(fraction, 0.1), 0.9) * (high - low)
            objective, mean_kl, tail = evaluate(step_size)
            n_tried += 1
            used = self._budget_used(mean_kl, tail, target_kl)
            # a larger step is taken only if its objective is at least the accepted one's: one below it is past the
            # surrogate's maximum along the direction, a larger move for a worse objective
            if objective >= accepted[1] and used <= 1.0:
                accepted = (step_size, objective, mean_kl, used)
            elif rejected is None or step_size < rejected[0]:
                rejected = (step_size, used)
        return accepted[0], accepted[1], accepted[2], n_tried

    def train(self) -> None:
        """
        Update policy using the currently gathered rollout buffer.
        """
        self._prepare_rollout_distribution()
        # Switch to train mode (this affects batch norm / dropout)
        self.policy.set_training_mode(True)
        # Update optimizer learning rate (used by the critic only)
        self._update_learning_rate(self.policy.optimizer)
        target_kl = self._current_target_kl()

        # The policy step uses the whole buffer in one batch (optionally sub-sampled)
        rollout_data = next(self.rollout_buffer.get(batch_size=None))
        step = self.sub_sampling_factor
        observations = rollout_data.observations
        if step > 1:
            if isinstance(observations, dict):
                observations = {key: obs[::step] for key, obs in observations.items()}
            else:
                observations = observations[::step]
        actions = self._actions_for_log_prob(rollout_data.actions[::step])
        old_log_prob = rollout_data.old_log_prob[::step]
        old_params = rollout_data.old_dist_params[::step]
        advantages = self._normalized_advantages(rollout_data.advantages[::step])

        # Surrogate objective E[r A] and mean KL to the rollout policy, with their graph
        distribution = self.policy.get_distribution(observations)
        log_prob = distribution.log_prob(actions)
        policy_objective = (advantages * th.exp(log_prob - old_log_prob)).mean()
        # Anchor to the frozen reference (sb3_kl/common/reference.py): -beta_ref * KL_ref joins the maximized objective
        ref_kl_coef = self.ref_kl_coef if self.ref_policy is not None else 0.0
        if ref_kl_coef > 0:
            ref_params, ref_log_prob = self._reference_distribution(observations, actions)
            anchored = self._anchor_distribution(observations, distribution)
            anchored_log_prob, _ = self._log_probs_for_kl(anchored, actions, log_prob, old_log_prob)
            ref_kl = self._reference_kl(ref_params, anchored, anchored_log_prob, ref_log_prob, old_log_prob).mean()
            policy_objective = policy_objective - ref_kl_coef * ref_kl
        kl_div = self._constrained_kl(old_params, distribution).mean()

        # One autograd call over all the actor's parameters (no per-parameter loop); keep those the KL depends on
        candidates = self._actor_parameters()
        kl_grads = th.autograd.grad(kl_div, candidates, create_graph=True, allow_unused=True)
        actor_params = [p for p, g in zip(candidates, kl_grads, strict=True) if g is not None]
        grad_kl = th.cat([g.reshape(-1) for g in kl_grads if g is not None])
        objective_grads = th.autograd.grad(policy_objective, actor_params, retain_graph=True, allow_unused=True)
        policy_objective_gradient = th.cat(
            [
                th.zeros_like(p).reshape(-1) if g is None else g.reshape(-1)
                for p, g in zip(actor_params, objective_grads, strict=True)
            ]
        )

        damping = self.cg_damping * self.cg_damping_scale()

        def fisher_vector_product(vector: th.Tensor, retain_graph: bool = True) -> th.Tensor:
            # Hessian of the mean KL at the rollout policy (= Fisher information matrix) times ``vector``, damped
            grads = th.autograd.grad((grad_kl * vector.detach()).sum(), actor_params, retain_graph=retain_graph)
            return th.cat([g.reshape(-1) for g in grads]) + damping * vector

        # Natural-gradient direction: solve (F + damping) d = g
        search_direction = conjugate_gradient_solver(
            fisher_vector_product, policy_objective_gradient, max_iter=self.cg_max_steps
        )
        # Step meeting the quadratic model of the KL: 1/2 (beta d)^T F (beta d) = target_kl
        curvature = float(th.dot(search_direction, fisher_vector_product(search_direction, retain_graph=False)))
        max_step_size = math.sqrt(2.0 * target_kl / curvature) if curvature > 0 and math.isfinite(curvature) else 0.0

        # The constraints are checked on the whole buffer even when the policy step is sub-sampled (forward passes only)
        full_observations = rollout_data.observations if step > 1 else None
        constraint_old_params = rollout_data.old_dist_params if step > 1 else old_params

        # The candidates are measured on the policy as it acts (eval mode), as the rollout distribution was: with
        # dropout, a train-mode pass would see a KL > 0 at the unchanged policy
        with acting_mode(self.policy), th.no_grad():
            original_flat = nn.utils.parameters_to_vector(actor_params).clone()
            log_std_floor = self._candidate_log_std_floor()

            def set_candidate(step_size: float) -> None:
                _copy_flat_to_parameters(original_flat + step_size * search_direction, actor_params)
                # The variance floor is applied to the candidate, so what is checked is what is kept
                if log_std_floor is not None:
                    self.policy.log_std.copy_(th.maximum(self.policy.log_std, log_std_floor))

            def measure() -> tuple[float, float, float | None]:
                # objective, mean KL and tail quantile of the policy's current parameters
                candidate_distribution = self.policy.get_distribution(observations)
                candidate_log_prob = candidate_distribution.log_prob(actions)
                objective = (advantages * th.exp(candidate_log_prob - old_log_prob)).mean().item()
                if ref_kl_coef > 0:
                    candidate_ref_kl = self._reference_kl(
                        ref_params, candidate_distribution, candidate_log_prob, ref_log_prob, old_log_prob
                    )
                    objective -= ref_kl_coef * candidate_ref_kl.mean().item()
                if full_observations is not None:
                    candidate_distribution = self.policy.get_distribution(full_observations)
                # in float64: near 0 the float32 KL loses its digits to cancellation, and the bound must hold at any
                # target (a schedule's last update has MIN_TARGET_KL = 1e-8)
                old, new = as_float64(constraint_old_params, self.dist_params.extract(candidate_distribution))
                per_state = per_state_kl(self.kl_settings, self.dist_params, old, new)
                tail = th.quantile(per_state, self.tail_quantile).item() if self.tail_kl is not None else None
                return objective, per_state.mean().item(), tail

            def evaluate(step_size: float) -> tuple[float, float, float | None]:
                set_candidate(step_size)
                return measure()

            # The objective the candidates must improve, in eval mode too (the gradient pass's equals it without
            # mode-dependent modules, and saves a forward pass)
            old_objective = measure()[0] if has_mode_dependent_modules(self.policy) else policy_objective.item()
            step_size, accepted_objective, accepted_kl, steps_tried = (
                self._search_step_size(evaluate, max_step_size, old_objective, target_kl)
                if max_step_size > 0
                else (0.0, old_objective, 0.0, 0)
            )
            success = step_size > 0
            # Keep the accepted candidate; if none was accepted the policy is left exactly as it was
            if success:
                set_candidate(step_size)
            else:
                _copy_flat_to_parameters(original_flat, actor_params)

        value_losses, nonfinite_steps, applied_steps = self._fit_critic(actor_params)
        if applied_steps == 0 and nonfinite_steps > 0:
            raise NonFiniteUpdateError(
                f"All {nonfinite_steps} optimizer steps of the critic in this update had a non-finite loss or gradient, "
                "so none was applied. Check the environment's observations and rewards for NaN/inf (wrap it with "
                "VecCheckNan), normalize them (VecNormalize), or lower the learning rate."
            )
        self.nonfinite_steps_total += nonfinite_steps

        self._n_updates += 1
        update_kl, new_params = self._measure_update_kl()
        self._finish_update()
        explained_var = explained_variance(self.rollout_buffer.values.flatten(), self.rollout_buffer.returns.flatten())

        # Logs (sb3-contrib TRPO's keys first)
        self.logger.record("train/policy_objective", accepted_objective)
        self.logger.record("train/value_loss", np.mean(value_losses) if value_losses else float("nan"))
        self.logger.record("train/kl_divergence_loss", accepted_kl)
        self.logger.record("train/explained_variance", explained_var)
        self.logger.record("train/is_line_search_success", float(success))
        if hasattr(self.policy, "log_std"):
            self.logger.record("train/std", th.exp(self.policy.log_std).mean().item())
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/line_search_success", float(success))
        self.logger.record("train/line_search_steps", steps_tried)
        self.logger.record("train/step_size", step_size)
        self.logger.record("train/step_size_ratio", step_size / max_step_size if max_step_size > 0 else 0.0)
        self.logger.record("train/nonfinite_steps", nonfinite_steps)
        if self.tail_kl is not None:
            self.logger.record("train/kl_tail", float(np.quantile(update_kl, self.tail_quantile)))
            self.logger.record("train/tail_kl", self.tail_kl)
        self._record_update_kl(update_kl, new_params, target_kl)
        self._record_reference_kl()

    _kl_state_attributes: ClassVar[tuple[str, ...]] = (*KLOnPolicyAlgorithm._kl_state_attributes, "sb3_contrib_kl")

    @classmethod
    def _target_kl_meaning(cls, kl: str) -> str:
        return f"the bound on the update's mean {kl}, which the line search holds"

    def _stock_convention_notes(self, saved_by: str, given: set[str]) -> list[str]:
        """A TRPO zip: TRPO bounded another KL with the same ``target_kl`` (unless ``load()`` chose the reduction)."""
        if saved_by != "TRPO" or self.sb3_contrib_kl or "kl_reduction" in given:
            return []
        return [
            "TRPO bounded KL(new||old) averaged over action dimensions at this target_kl; pass "
            "kl_reduction='sb3_contrib' to load() to keep TRPO's constraint."
        ]

    def _same_kl_option(self, name: str, value: Any) -> bool:
        # ``kl_reduction="sb3_contrib"`` was resolved for the action space (with KL(new||old)); ``kl_direction=None``
        # is the constructor's default, resolved with the reduction
        if name == "kl_reduction" and value == SB3_CONTRIB_KL:
            settings = self.kl_settings
            return settings.direction == "reverse" and settings.reduction == sb3_contrib_kl_reduction(self.action_space)
        return (name == "kl_direction" and value is None) or super()._same_kl_option(name, value)

    def learn(
        self: SelfKLTRPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "KLTRPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfKLTRPO:
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
        )
