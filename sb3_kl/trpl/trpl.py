import copy
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    DiagGaussianDistribution,
    Distribution,
    StateDependentNoiseDistribution,
)
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from torch import nn
from torch.nn import functional as F

from sb3_kl.common.host_sync import DeviceLog, without_distribution_validation
from sb3_kl.common.kl import (
    GaussianParams,
    MultiCategoricalParams,
    as_float64,
    attach_sde_features,
    kl_normal,
    per_state_kl,
)
from sb3_kl.common.modes import acting_mode
from sb3_kl.common.on_policy_algorithm import KLOnPolicyAlgorithm, saved_target_kl
from sb3_kl.common.projections import (
    PROJECTIONS,
    gaussian_distance_to_fixed,
    gaussian_distances,
    gaussian_entropy_projection,
    project_bernoulli_with_distances,
    project_categorical_with_distances,
    project_gaussian_with_distances,
)
from sb3_kl.common.user_warnings import warn_and_print
from sb3_kl.common.validation import check_bool, check_choice, check_finite, check_int, check_non_negative, check_positive
from sb3_kl.trpl.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

SelfTRPL = TypeVar("SelfTRPL", bound="TRPL")

#: An update whose enforcement kept less than this fraction of the epochs' step counts as mostly undone
MOSTLY_UNDONE_FRACTION = 0.1
#: Consecutive mostly undone updates after which TRPL warns (once) that the actor is barely learning
MOSTLY_UNDONE_UPDATES = 5


@th.no_grad()
def _copy_flat_to_parameters(flat: th.Tensor, parameters: list[nn.Parameter]) -> None:
    """Write a flat vector into the parameters, in place (unlike ``vector_to_parameters``, no aliasing of ``flat``)."""
    start = 0
    for param in parameters:
        param.copy_(flat[start : start + param.numel()].view_as(param))
        start += param.numel()


class TRPL(KLOnPolicyAlgorithm):
    """
    Trust Region Projection Layers (TRPL): a trust region held in every state, by differentiable projection.

    In each minibatch, the action distribution the network outputs in a state is projected onto the set of
    distributions within ``mean_bound`` (mean part) and ``cov_bound`` (covariance part) of the rollout policy's
    distribution in that state, and the loss is built on the projected policy: the importance-sampled surrogate
    ``-E[pi_proj / pi_old * A]`` (no ratio clipping), plus ``trust_region_coef * d(pi_net, stopgrad(pi_proj))``, which
    pulls the network toward its projection, plus the value loss and the optional entropy bonus. The gradient flows
    through the projection.

    With ``projection="kl"`` the bound is on KL(pi_new || pi_old) per state (the package's ``kl_direction="reverse"``):
    for a Gaussian the mean part ``0.5 (mu - mu_old)^T Sigma_old^-1 (mu - mu_old) <= mean_bound`` and the covariance
    part ``<= cov_bound``, so the joint per-state KL is at most ``mean_bound + cov_bound``; for a categorical policy
    (``Discrete``; ``MultiDiscrete`` and ``MultiBinary`` jointly over their factors) the joint per-state KL is at most
    ``mean_bound``. ``"w2"`` and ``"frobenius"`` bound the Gaussian's parts in those distances instead
    (:mod:`sb3_kl.common.projections` defines them), with the bounds in that distance's units: the joint bound is then
    no KL target (it is logged as ``train/distance_bound``, no ``train/target_kl``, and callbacks see no target).

    As in SB3, the policy that acts (``predict``, ``policy.get_distribution``) is the network itself, not its
    projection. After the epochs the bounds are enforced on it, in eval mode, over the update's rollout states, each
    part on its own (a Gaussian's mean part by ``mean_bound`` and covariance part by ``cov_bound`` in every state, not
    only their sum): while a part exceeds ``bound_tolerance`` times its bound in some state, up to
    ``max_enforce_steps`` regression steps move the network toward its projection on the states above a bound (along
    the regression's gradient scaled by the policy Adam's second moments, each step's size found by a line search); if
    that is not enough, the actor's parameters are moved back along the straight line to the rollout policy's (where
    the distance is 0) until the bounds hold.

    Paper: Otto et al., "Differentiable Trust Region Layers for Deep Reinforcement Learning", ICLR 2021,
    https://arxiv.org/abs/2101.09207

    Code: the minibatch loop follows SB3's PPO (https://github.com/DLR-RM/stable-baselines3); the projections are
    this package's own, :mod:`sb3_kl.common.projections`

    :param policy: The policy model to use (MlpPolicy, CnnPolicy, ...)
    :param env: The environment to learn from (if registered in Gym, can be str)
    :param learning_rate: The learning rate, it can be a function of the current progress remaining (from 1 to 0)
    :param n_steps: The number of steps to run for each environment per update
        (i.e. rollout buffer size is n_steps * n_envs where n_envs is number of environment copies running in parallel)
    :param batch_size: Minibatch size
    :param n_epochs: Number of epochs when optimizing the surrogate loss
    :param gamma: Discount factor
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param normalize_advantage: Whether to normalize or not the advantage
    :param ent_coef: Entropy coefficient for the loss calculation (entropy of the projected policy, the policy the
        loss is built on; ``train/entropy_loss`` logs that term)
    :param vf_coef: Value function coefficient for the loss calculation
    :param max_grad_norm: The maximum value for the gradient clipping
    :param use_sde: Whether to use generalized State Dependent Exploration (gSDE): the std is then per state and so
        is its projection (without gSDE the std is state-independent and projected once per minibatch); as in SB3,
        the std is built on the actor's features detached, so the losses do not train the features through it (only
        the bound enforcement's regression does, to bring each state's std back within ``cov_bound``)
    :param sde_sample_freq: Sample a new noise matrix every n steps when using gSDE
        Default: -1 (only sample at the beginning of the rollout)
    :param rollout_buffer_class: Rollout buffer class to use; must subclass ``KLRolloutBuffer`` (or its Dict variant).
        If ``None``, it will be automatically selected.
    :param rollout_buffer_kwargs: Keyword arguments to pass to the rollout buffer on creation
    :param projection: ``"kl"`` (default), ``"w2"`` or ``"frobenius"`` (the last two for ``Box`` actions only)
    :param mean_bound: Bound on the mean part of the per-state distance (for categorical policies: on the whole
        per-state KL)
    :param cov_bound: Bound on the covariance part of the per-state distance (Gaussian policies)
    :param trust_region_coef: Coefficient alpha of the regression of the network onto its projection
    :param target_entropy: Entropy control for Gaussian policies: when set, an entropy floor
        ``target_entropy + (initial - target_entropy) * progress_remaining``, where ``initial`` is the rollout policy's
        mean entropy at the first update (``initial_entropy``, saved with the model), decays linearly from the initial
        entropy to the target. In each state the network's std is raised to the floor before the trust-region
        projection, and the trust region wins where they conflict: the projected policy stays within ``cov_bound``
        of the rollout policy's covariance, so it reaches the floor only where that is within the bound, and a floor
        far above the rollout policy's entropy is approached over several updates (the regression onto the
        projection pulls the network's std up). None (default): no entropy control
    :param max_enforce_steps: Largest number of regression tries of the bound enforcement after the epochs, each a pass
        over the buffer: the line search's steps kept (``train/enforcement_steps``) and undone
        (``train/enforcement_rejected_tries``) together (0: go straight to the move back toward the rollout policy
        when a bound is exceeded)
    :param bound_tolerance: After each update, in every state of its rollout, the acting policy's mean part must be at
        most ``bound_tolerance * mean_bound`` and its covariance part at most ``bound_tolerance * cov_bound``
        (a categorical policy's KL at most ``bound_tolerance * mean_bound``)
    :param kl_quantiles: Quantiles of the per-state KL logged after each update (as ``train/kl_p<q>``)
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
    has_kl_coef: ClassVar[bool] = False  # a projection, no penalty coefficient
    kl_family: ClassVar[str] = "projection"
    #: How the bound enforcement's regression steps are taken: ``"line_search_capped"`` (the default), steps along the
    #: regression's gradient scaled by the policy Adam's second moments, scaled down where their root mean square
    #: exceeds 1 (a step of size ``t`` then moves the parameters by at most ``t`` in RMS), each step's size found by a
    #: search on the states' summed excess over the bound (:meth:`_line_search_regression`). Kept to compare
    #: (``benchmarks/studies/trpl_enforcement_optimizer.py``): ``"line_search"``, without the cap;
    #: ``"line_search_unit"``, rescaled to RMS 1 always; ``"fresh"``, an optimizer of the policy optimizer's class and
    #: hyperparameters with moments of its own, made anew each update; ``"shared"``, the policy's optimizer itself;
    #: ``"scaled"`` (Adam only, else ``"fresh"``), a copy of the policy's Adam without momentum that keeps its second
    #: moments.
    _enforcement_optimizer: ClassVar[str] = "line_search_capped"

    def __init__(
        self,
        policy: str | type[MlpPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule = 3e-4,
        n_steps: int = 2048,
        batch_size: int = 64,
        n_epochs: int = 10,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        normalize_advantage: bool = True,
        ent_coef: float = 0.0,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
        use_sde: bool = False,
        sde_sample_freq: int = -1,
        rollout_buffer_class: type[RolloutBuffer] | None = None,
        rollout_buffer_kwargs: dict[str, Any] | None = None,
        projection: str = "kl",
        mean_bound: float = 0.03,
        cov_bound: float = 0.001,
        trust_region_coef: float = 8.0,
        target_entropy: float | None = None,
        max_enforce_steps: int = 30,
        bound_tolerance: float = 1.05,
        kl_quantiles: tuple[float, ...] = (0.5, 0.9, 0.99),
        stats_window_size: int = 100,
        tensorboard_log: str | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        verbose: int = 0,
        seed: int | None = None,
        device: th.device | str = "auto",
        _init_setup_model: bool = True,
    ):
        # Checked before building anything, so a bad argument fails fast
        check_choice("projection", projection, PROJECTIONS)
        mean_bound = check_positive("mean_bound", mean_bound, hint=" (pass e.g. mean_bound=0.03)")
        cov_bound = check_positive("cov_bound", cov_bound, hint=" (pass e.g. cov_bound=0.001)")
        trust_region_coef = check_non_negative("trust_region_coef", trust_region_coef)
        if target_entropy is not None:
            target_entropy = check_finite("target_entropy", target_entropy)
        check_int("max_enforce_steps", max_enforce_steps, 0)
        bound_tolerance = check_positive("bound_tolerance", bound_tolerance)
        if bound_tolerance < 1:
            raise ValueError(
                f"`bound_tolerance` must be >= 1 (a multiple of the bound), got {bound_tolerance!r}: pass e.g. "
                "bound_tolerance=1.05."
            )
        check_int("batch_size", batch_size, 2)
        check_int("n_epochs", n_epochs, 1)
        check_bool("normalize_advantage", normalize_advantage)
        ent_coef = check_non_negative("ent_coef", ent_coef)
        vf_coef = check_non_negative("vf_coef", vf_coef)
        max_grad_norm = check_positive("max_grad_norm", max_grad_norm)

        super().__init__(
            policy,
            env,
            learning_rate=learning_rate,
            n_steps=n_steps,
            gamma=gamma,
            gae_lambda=gae_lambda,
            ent_coef=ent_coef,
            vf_coef=vf_coef,
            max_grad_norm=max_grad_norm,
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
            supported_action_spaces=(spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary),
            # ``target_kl`` is the per-state bound (resolved for the action space in _setup_model); the KL logged
            # is the one the KL projection bounds: KL(new||old), exact, of the joint action distribution
            target_kl=None,
            kl_estimator="analytic",
            kl_direction="reverse",
            kl_reduction="sum",
            kl_quantiles=kl_quantiles,
        )
        self.batch_size = batch_size
        self.n_epochs = n_epochs
        self.normalize_advantage = normalize_advantage
        self.projection = projection
        self.mean_bound = mean_bound
        self.cov_bound = cov_bound
        self.trust_region_coef = trust_region_coef
        self.target_entropy = target_entropy
        self.initial_entropy: float | None = None
        self.max_enforce_steps = max_enforce_steps
        self.bound_tolerance = bound_tolerance
        # consecutive updates whose enforcement undid most of the step, and whether that was warned about
        self.mostly_undone_updates = 0
        self.mostly_undone_warned = False
        if self.env is not None:
            self._check_action_space(self.action_space)
            assert self.n_steps * self.env.num_envs > 1 or not normalize_advantage, (
                f"`n_steps * n_envs` must be greater than 1. Currently n_steps={self.n_steps} and n_envs={self.env.num_envs}"
            )
            self._warn_if_truncated_minibatch(batch_size)
        if _init_setup_model:
            self._setup_model()

    def _check_action_space(self, action_space: spaces.Space) -> None:
        """Refuse the options that only exist for Gaussian policies on another action space."""
        if isinstance(action_space, spaces.Box):
            return
        kind = type(action_space).__name__
        if self.projection != "kl":
            raise ValueError(
                f"`projection`={self.projection!r} projects Gaussian policies (Box actions); this action space is "
                f"{kind}, whose categorical policy is projected in KL: pass projection='kl'."
            )
        if self.target_entropy is not None:
            raise ValueError(
                f"`target_entropy`={self.target_entropy!r} controls the entropy of a Gaussian policy (Box actions); "
                f"this action space is {kind}: pass target_entropy=None (or use ent_coef for an entropy bonus)."
            )

    def _setup_model(self) -> None:
        self._check_action_space(self.action_space)
        super()._setup_model()
        action_dist = self.policy.action_dist
        if getattr(action_dist, "bijector", None) is not None:
            raise ValueError("TRPL projects the Gaussian before any squashing: pass policy_kwargs without squash_output=True.")
        self._is_gaussian = isinstance(self.dist_params, GaussianParams)
        self._per_state_std = isinstance(action_dist, StateDependentNoiseDistribution)

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_is_gaussian", "_per_state_std"]

    def _target_kl_schedule(self, target_kl: float | Schedule | None) -> Schedule:
        # The per-state bound of the joint distance is the target the KL logs and callbacks compare with
        if target_kl is None:
            target_kl = self.joint_bound
        return super()._target_kl_schedule(target_kl)

    def _current_target_kl(self) -> float | None:  # type: ignore[override]
        # the bound in force, also after ``load(..., mean_bound=...)`` (what the KL logs and callbacks compare with);
        # a W2 or Frobenius bound is not a KL target: None (logged as ``train/distance_bound``)
        return self.joint_bound if self.projection == "kl" else None

    @classmethod
    def _saved_target_note(cls, data: dict[str, Any]) -> str:
        # the saved target_kl is the joint bound the model was built with, in the projection's distance
        target = saved_target_kl(data)
        projection = data.get("projection", "kl")
        distance = "KL(new||old)" if projection == "kl" else f"{projection} distance, not a KL"
        value = "" if target is None else f" {target:g}"
        return f"target_kl{value} was its bound on every state's {distance} (mean_bound + cov_bound)"

    def _loaded_target_note(self, given: set[str]) -> str:
        distance = "KL(new||old)" if self.projection == "kl" else f"{self.projection} distance"
        note = f"TRPL bounds every state's {distance} by mean_bound + cov_bound = {self.joint_bound:g} instead"
        if {"mean_bound", "cov_bound"} & given:
            return note
        return note + ": pass mean_bound= and cov_bound= to load() to choose it"

    @property
    def joint_bound(self) -> float:
        """The bound on the joint per-state distance: ``mean_bound + cov_bound`` (Gaussian), ``mean_bound`` (categorical)."""
        return self.mean_bound + (self.cov_bound if isinstance(self.action_space, spaces.Box) else 0.0)

    def min_entropy(self) -> float | None:
        """The entropy control's floor now, to which the network's std is raised before the projection (None without it)."""
        if self.target_entropy is None or self.initial_entropy is None:
            return None
        progress = min(max(self._current_progress_remaining, 0.0), 1.0)
        return self.target_entropy + (self.initial_entropy - self.target_entropy) * progress

    # ----------------------------------------------------------------------------------------------------------
    # The projection

    def _distribution_from_latent(self, latent_pi: th.Tensor) -> Distribution:
        """
        SB3's action distribution on the actor latent, as the policy builds it: with gSDE its std is built from the
        latent features detached unless ``learn_features=True`` (SB3's ``StateDependentNoiseDistribution``), so the
        losses of the epochs (surrogate, trust-region term, entropy bonus) do not train the features through the std
        (the bound enforcement's regression does, :meth:`_enforcement_distribution`).
        """
        return self.policy._get_action_dist_from_latent(latent_pi)

    def _gaussian_parts(self, distribution: Distribution) -> tuple[th.Tensor, th.Tensor]:
        """
        The network's Gaussian: mean ``(batch, k)`` and std, ``(k,)`` for SB3's state-independent ``log_std`` (its
        covariance is projected once per minibatch) or ``(batch, k)`` with gSDE (differentiable in the features only
        with ``learn_features=True``, as in SB3).
        """
        normal = kl_normal(distribution)
        if self._per_state_std:
            return normal.loc, normal.scale
        return normal.loc, th.exp(self.policy.log_std)

    def _old_gaussian(self, old_params: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """The rollout policy's mean and std, the std shaped as the network's (:meth:`_gaussian_parts`)."""
        old_mean, old_log_std = self.dist_params.split(old_params)  # type: ignore[attr-defined]
        return old_mean, th.exp(old_log_std if self._per_state_std else old_log_std[0])

    def _project(self, distribution: Distribution, old_params: th.Tensor, min_entropy: float | None) -> dict[str, Any]:
        """
        Project the network's distribution on a minibatch onto the trust region around the rollout policy's.

        :param distribution: The network's distribution (with gradients)
        :param old_params: The rollout policy's distribution parameters on the same states
        :param min_entropy: Entropy floor the network's std is raised to before the projection (None: no entropy control)
        :return: ``distribution``: the projected distribution (SB3 ``Distribution``, differentiable);
            ``trust_region``: ``d(pi_net, stopgrad(pi_proj))`` per state; ``moved``: whether the projection changed
            each state; ``projected``: the projected distribution's joint distance to the rollout policy per state,
            and ``parts``: its mean and covariance parts (no gradient)
        """
        if self._is_gaussian:
            mean, std = self._gaussian_parts(distribution)
            old_mean, old_std = self._old_gaussian(old_params)
            net_std = std
            if min_entropy is not None:
                std = gaussian_entropy_projection(std, min_entropy)
            result = project_gaussian_with_distances(
                mean, std, old_mean, old_std, self.mean_bound, self.cov_bound, self.projection
            )
            proj_mean, proj_std = result.mean, result.std
            if proj_mean is mean and proj_std is net_std:
                # The projection is the identity: d(pi_net, pi_proj) is 0 with a zero gradient, exactly
                trust_region = mean.new_zeros(mean.shape[:-1])
            else:
                trust_region = gaussian_distance_to_fixed(mean, net_std, proj_mean, proj_std, self.projection)
            # the distances to the rollout policy come from the projection, which measured them (in float64)
            moved = (result.mean_before > self.mean_bound) | (result.cov_before > self.cov_bound)
            after_mean, after_cov = result.mean_after, result.cov_after.expand_as(result.mean_after)
            projected = DiagGaussianDistribution(self.dist_params.n_dims).proba_distribution(proj_mean, th.log(proj_std))
            return {
                "distribution": projected,
                "trust_region": trust_region,
                "moved": moved,
                "projected": after_mean + after_cov,
                "parts": (after_mean, after_cov),
            }
        logits = self.dist_params.extract(distribution)
        if isinstance(self.policy.action_dist, BernoulliDistribution):
            result = project_bernoulli_with_distances(logits, old_params, self.mean_bound)
        else:
            action_dims = self.dist_params.nvec if isinstance(self.dist_params, MultiCategoricalParams) else [logits.shape[-1]]
            result = project_categorical_with_distances(logits, old_params, self.mean_bound, action_dims)
        proj_logits = result.logits
        if proj_logits is logits:
            # The projection is the identity: KL(pi_net || pi_proj) is 0, and so is its gradient
            trust_region = logits.new_zeros(logits.shape[:-1])
        else:
            # KL(pi_net || stopgrad(pi_proj)), from the shared KL core
            trust_region = self.dist_params.kl_per_dim(logits, proj_logits.detach()).sum(dim=-1)
        # the KL to the rollout policy before and after comes from the projection, which measured it (in float64)
        moved = result.before > self.mean_bound
        # the network's own distribution when the projection is the identity (the same logits, built once)
        projected = (
            distribution
            if proj_logits is logits
            else copy.copy(self.policy.action_dist).proba_distribution(action_logits=proj_logits)
        )
        return {
            "distribution": projected,
            "trust_region": trust_region,
            "moved": moved,
            "projected": result.after,
            "parts": None,
        }

    @property
    def part_bounds(self) -> tuple[float, ...]:
        """
        The bound of each part of the per-state distance: ``(mean_bound, cov_bound)`` for a Gaussian policy (mean and
        covariance part), ``(mean_bound,)`` for a categorical one (its whole KL).
        """
        return (self.mean_bound, self.cov_bound) if self._is_gaussian else (self.mean_bound,)

    def _bound_ratios(self, new_params: th.Tensor, old_params: th.Tensor) -> th.Tensor:
        """
        Each part of the per-state distance the projection bounds, between two parameter tensors, over its bound
        (:attr:`part_bounds`; computed in float64): for a Gaussian the mean part and the covariance part of KL(new||old)
        (or of the W2/Frobenius distance), for a categorical policy KL(new||old) (the shared KL core).

        :return: ``(batch, n_parts)`` float64; the bound holds in a state where every entry is at most 1
        """
        new_params, old_params = as_float64(new_params, old_params)
        bounds = th.tensor(self.part_bounds, dtype=th.float64, device=new_params.device)
        if not self._is_gaussian:
            return per_state_kl(self.kl_settings, self.dist_params, old_params, new_params).unsqueeze(-1) / bounds
        new_mean, new_log_std = self.dist_params.split(new_params)  # type: ignore[attr-defined]
        old_mean, old_log_std = self.dist_params.split(old_params)  # type: ignore[attr-defined]
        mean_dist, cov_dist = gaussian_distances(new_mean, th.exp(new_log_std), old_mean, th.exp(old_log_std), self.projection)
        return th.stack([mean_dist, cov_dist.expand_as(mean_dist)], dim=-1) / bounds

    # ----------------------------------------------------------------------------------------------------------
    # The update

    @without_distribution_validation
    def train(self) -> None:
        """
        Update policy using the currently gathered rollout buffer.
        """
        self._prepare_rollout_distribution()
        if self.target_entropy is not None and self.initial_entropy is None:
            old_params = th.as_tensor(self.rollout_buffer.old_dist_params)
            self.initial_entropy = float(self.dist_params.entropy(old_params).mean())
        # Switch to train mode (this affects batch norm / dropout)
        self.policy.set_training_mode(True)
        # Update optimizer learning rate
        self._update_learning_rate(self.policy.optimizer)
        min_entropy = self.min_entropy()
        actor_params = self._actor_parameters()
        rollout_actor = nn.utils.parameters_to_vector(actor_params).detach().clone()

        # what is logged stays on the device until the update ends: no host synchronisation per minibatch
        logs = DeviceLog("entropy_loss", "policy_gradient_loss", "value_loss", "trust_region_loss", "projected_fraction")
        # running maxima of the projected distances (joint, mean part, covariance part), float64 as measured
        maxima = th.zeros(3, dtype=th.float64, device=self.device)
        applied_steps, minibatch_steps = th.zeros((), dtype=th.long, device=self.device), 0
        loss = th.zeros(())
        for _ in range(self.n_epochs):
            for rollout_data in self.rollout_buffer.get(self.batch_size):
                actions = self._actions_for_log_prob(rollout_data.actions)
                values, distribution = self._forward_samples(rollout_data)
                projection = self._project(distribution, rollout_data.old_dist_params, min_entropy)
                projected = projection["distribution"]
                # Importance-sampled surrogate of the projected policy, no clipping (the projection is the trust
                # region); the log-ratio is clamped before exponentiation so that one far-off sample cannot overflow
                log_ratio = projected.log_prob(actions) - rollout_data.old_log_prob
                clip = self.kl_settings.log_ratio_clip
                ratio = th.exp(th.clamp(log_ratio, -clip, clip))
                advantages = self._normalized_advantages(rollout_data.advantages)
                policy_loss = -(advantages * ratio).mean()
                trust_region_loss = projection["trust_region"].mean()
                value_loss = F.mse_loss(rollout_data.returns, values)
                # the loss's entropy term, PPO's `train/entropy_loss`: of the projected policy, which the loss is on
                # (the acting network's std is logged as `train/action_std_mean`)
                with th.set_grad_enabled(self.ent_coef != 0):
                    entropy_loss = -projected.entropy().mean()
                loss = policy_loss + self.trust_region_coef * trust_region_loss + self.vf_coef * value_loss
                if self.ent_coef != 0:
                    loss = loss + self.ent_coef * entropy_loss

                logs.add("policy_gradient_loss", policy_loss)
                logs.add("value_loss", value_loss)
                logs.add("entropy_loss", entropy_loss)
                logs.add("trust_region_loss", trust_region_loss)
                logs.add("projected_fraction", projection["moved"].float().mean())
                projected_max, parts = projection["projected"].max(), projection["parts"]
                minibatch_maxima = (
                    th.stack([projected_max, *(part.max() for part in parts)]) if parts else projected_max.expand(3)
                )
                maxima = th.maximum(maxima, minibatch_maxima)

                # a boolean tensor, False for a non-finite loss or gradient (the step is skipped)
                applied_steps += self._optimizer_step(loss)
                minibatch_steps += 1
        self._n_updates += self.n_epochs

        self._count_nonfinite_steps(applied_steps, minibatch_steps)

        enforcement = self._enforce_bound(actor_params, rollout_actor, min_entropy)
        self._check_mostly_undone(enforcement["kept_fraction"])
        if self.kl_settings.estimator == "analytic":
            # the enforcement's last pass over the buffer evaluated the final acting policy already: its KL and
            # parameters are those _measure_update_kl would compute again
            per_state, new_params = enforcement["final_kl"].cpu().numpy(), enforcement["final_params"].cpu().numpy()
        else:  # a sample estimate needs the log-probabilities of the stored actions
            per_state, new_params = self._measure_update_kl()
        self._finish_update()
        explained_var = explained_variance(self.rollout_buffer.values.flatten(), self.rollout_buffer.returns.flatten())

        # Logs (PPO's keys for the same things)
        means = logs.means()
        projected_max, mean_part_max, cov_part_max = maxima.tolist()
        for name in ("entropy_loss", "policy_gradient_loss", "value_loss", "trust_region_loss"):
            self.logger.record(f"train/{name}", means[name])
        self.logger.record("train/loss", loss.item())
        self.logger.record("train/explained_variance", explained_var)
        if hasattr(self.policy, "log_std"):
            self.logger.record("train/std", th.exp(self.policy.log_std).mean().item())
        self.logger.record("train/projected_fraction", means["projected_fraction"])
        self.logger.record("train/projected_max", projected_max)
        if self._is_gaussian:
            self.logger.record("train/projected_mean_part_max", mean_part_max)
            self.logger.record("train/projected_cov_part_max", cov_part_max)
        if min_entropy is not None:
            self.logger.record("train/min_entropy", min_entropy)
        self.logger.record("train/distance_max_before_enforcement", enforcement["before"])
        self.logger.record("train/distance_max", enforcement["after"])
        if self._is_gaussian:
            mean_ratio_max, cov_ratio_max = enforcement["ratio_max"]
            self.logger.record("train/mean_part_max_ratio", mean_ratio_max)
            self.logger.record("train/cov_part_max_ratio", cov_ratio_max)
        self.logger.record("train/enforcement_steps", enforcement["steps"])
        self.logger.record("train/enforcement_rejected_tries", enforcement["rejected_tries"])
        self.logger.record("train/enforcement_step_fraction", enforcement["step_fraction"])
        self.logger.record("train/update_kept_fraction", enforcement["kept_fraction"])
        self.logger.record("train/bound_met", float(max(enforcement["ratio_max"]) <= self.bound_tolerance))
        self.logger.record("train/nonfinite_steps", self._last_nonfinite_steps)
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if self.projection != "kl":
            self.logger.record("train/distance_bound", self.joint_bound)
        self._record_update_kl(per_state, new_params, self._current_target_kl())

    # ----------------------------------------------------------------------------------------------------------
    # The bound on the acting policy

    def _actor_parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter of the policy except the critic's (``mlp_extractor.value_net``, ``value_net``)."""
        critic = set()
        for module in (self.policy.value_net, self.policy.mlp_extractor.value_net):
            critic.update(id(p) for p in module.parameters())
        if not self.policy.share_features_extractor:
            critic.update(id(p) for p in self.policy.vf_features_extractor.parameters())
        return [p for p in self.policy.parameters() if p.requires_grad and id(p) not in critic]

    @th.no_grad()
    def _acting_ratios(self, chunk_size: int = 4096) -> tuple[th.Tensor, th.Tensor]:
        """
        The acting policy (eval mode) on every state of the buffer, in one no-grad pass as :meth:`_measure_update_kl`
        makes it.

        :return: each part of its per-state distance to the rollout policy over its bound (:meth:`_bound_ratios`,
            ``(n_states, n_parts)`` float64) and its distribution parameters
        """
        ratios, params = [], []
        with acting_mode(self.policy):
            for data in self.rollout_buffer.ordered_samples(chunk_size):
                distribution = self._samples_distribution(self.policy, data)
                new_params = self.dist_params.extract(distribution)
                ratios.append(self._bound_ratios(new_params, data.old_dist_params))
                params.append(new_params)
        return th.cat(ratios), th.cat(params)

    def _joint_distances(self, ratios: th.Tensor) -> th.Tensor:
        """The joint per-state distance (the parts added up, ``(n_states,)``) from :meth:`_bound_ratios`' ratios."""
        return (ratios * ratios.new_tensor(self.part_bounds)).sum(dim=-1)

    def _final_kl(self, params: th.Tensor) -> th.Tensor:
        """
        The per-state KL of the final acting policy, in the algorithm's convention (float64), from the parameters of the
        enforcement's last pass (no other pass over the buffer).
        """
        old_params = th.as_tensor(self.rollout_buffer.old_dist_params, device=params.device)
        return per_state_kl(self.kl_settings, self.dist_params, *as_float64(old_params, params))

    def _make_enforcement_optimizer(self, actor_params: list[nn.Parameter]) -> th.optim.Optimizer:
        """
        The optimizer of this update's regression steps (:attr:`_enforcement_optimizer`): a new one of the policy
        optimizer's class over the actor's parameters, with the hyperparameters of its (first) parameter group, the
        learning rate of this update included; or the policy's optimizer itself (``"shared"``).
        """
        optimizer = self.policy.optimizer
        if self._enforcement_optimizer == "shared":
            return optimizer
        group = optimizer.param_groups[0]
        hyperparameters = {name: group[name] for name in optimizer.defaults if name in group}
        if self._enforcement_optimizer != "scaled" or not isinstance(optimizer, th.optim.Adam):
            return type(optimizer)(actor_params, **hyperparameters)
        scaled = type(optimizer)(actor_params, **{**hyperparameters, "betas": (0.0, group["betas"][1])})
        for param in actor_params:
            state = optimizer.state.get(param)
            if state and "exp_avg_sq" in state:
                scaled.state[param] = {
                    "step": state["step"].clone(),
                    "exp_avg": th.zeros_like(state["exp_avg"]),
                    "exp_avg_sq": state["exp_avg_sq"].clone(),
                }
        return scaled

    def _enforcement_distribution(self, data: Any) -> Distribution:
        """
        The network's action distribution on a buffer sample, for the enforcement's regression: the actor's forward
        pass only (no value head). With gSDE (``learn_features=False``, SB3's) its std is made differentiable in the
        actor's features (:func:`~sb3_kl.common.kl.attach_sde_features`, the same values), unlike in the losses of the
        epochs: the epochs move the features through the mean, and with them each state's std, and only the features
        can bring one state's std back into its bound (gSDE's exploration weights are shared by every state).

        :param data: Samples from the rollout buffer
        """
        features = BasePolicy.extract_features(self.policy, data.observations, self.policy.pi_features_extractor)
        latent_pi = self.policy.mlp_extractor.forward_actor(features)
        distribution = self._distribution_from_latent(latent_pi)
        attach_sde_features(distribution, latent_pi, getattr(self.policy, "log_std", None))
        masks = self._sample_masks(data)
        if masks is not None:
            distribution.apply_masking(masks)  # type: ignore[attr-defined]
        return distribution

    def _regression_loss(self, ratios: th.Tensor, min_entropy: float | None, toward_rollout: bool = False) -> th.Tensor:
        """
        The regression of the network onto its projection (the trust-region term), averaged over the buffer's states
        where a part of the distance exceeds its bound (``ratios``, :meth:`_bound_ratios`): what every regression step
        of the enforcement descends. With ``toward_rollout``, their distance to the rollout policy instead, each part
        over its bound (times the joint bound, the distance's scale): the summed excess's own gradient.
        """
        outside = np.flatnonzero((ratios.max(dim=-1).values > 1).cpu().numpy())
        data = self.rollout_buffer._get_samples(outside)  # type: ignore[attr-defined]
        distribution = self._enforcement_distribution(data)
        if not toward_rollout:
            return self._project(distribution, data.old_dist_params, min_entropy)["trust_region"].mean()
        if self._is_gaussian:
            mean, std = self._gaussian_parts(distribution)
            old_mean, old_std = self._old_gaussian(data.old_dist_params)
            mean_part, cov_part = gaussian_distances(mean, std, old_mean, old_std, self.projection)
            relative = mean_part / self.mean_bound + cov_part / self.cov_bound
        else:
            logits = self.dist_params.extract(distribution)
            relative = self.dist_params.kl_per_dim(logits, data.old_dist_params).sum(dim=-1) / self.mean_bound
        return self.joint_bound * relative.mean()

    def _preconditioner(self, actor_params: list[nn.Parameter]) -> list[th.Tensor | float]:
        """
        Per parameter, the policy Adam's inverse scale ``1 / (sqrt(v_hat) + eps)`` (its bias-corrected second moment),
        so that a regression step moves each parameter on the scale the policy's own steps use; 1 where there is none.
        """
        optimizer = self.policy.optimizer
        group = optimizer.param_groups[0]
        scales: list[th.Tensor | float] = []
        for param in actor_params:
            state = optimizer.state.get(param)
            if isinstance(optimizer, th.optim.Adam) and state and "exp_avg_sq" in state and float(state["step"]) > 0:
                bias_correction = 1 - group["betas"][1] ** float(state["step"])
                scales.append(1 / ((state["exp_avg_sq"] / bias_correction).sqrt() + group["eps"]))
            else:
                scales.append(1.0)
        return scales

    @staticmethod
    def _excess(ratios: th.Tensor) -> float:
        """The summed excess of the per-state parts over their bounds, each in units of its bound (``ratios``)."""
        return (ratios - 1).clamp(min=0).sum().item()

    def _line_search_regression(
        self, actor_params: list[nn.Parameter], ratios: th.Tensor, params: th.Tensor, min_entropy: float | None
    ) -> tuple[th.Tensor, th.Tensor, int, int]:
        """
        The regression steps of ``_enforcement_optimizer = "line_search_capped"`` (and of ``"line_search"`` and
        ``"line_search_unit"``): from the gradient of the regression onto the projection on the states above the
        bound, scaled by :meth:`_preconditioner`, its RMS capped at 1 (none; set to 1), a step of size ``t`` is
        kept if it lowers the summed excess of the per-state parts over their bounds (:meth:`_excess`; ``t`` then
        doubles for the next step), else undone (``t`` halves). ``t`` starts at the current learning rate each
        update; every try is a pass over the buffer and counts as one of ``max_enforce_steps``. The regression's
        gradient need not lower the excess: after three tries in a row fail, the rest of the update steps along the
        excess's own gradient (the outside states' distance to the rollout policy), ``t`` back at the learning rate.

        :param ratios: The acting policy's parts over their bounds, per state (:meth:`_acting_ratios`)
        :param params: Its distribution parameters
        :return: the ratios and distribution parameters of the acting policy it ends with, the steps it kept and the
            tries it undid
        """
        scales = self._preconditioner(actor_params)
        first_size = self.policy.optimizer.param_groups[0]["lr"]
        size = first_size

        merit, direction, failures, toward_rollout = self._excess(ratios), None, 0, False
        accepted = rejected = 0
        while ratios.max().item() > self.bound_tolerance and accepted + rejected < self.max_enforce_steps:
            if failures == 3 and not toward_rollout and self._enforcement_optimizer == "line_search_capped":
                # stalled: the regression's direction does not lower the excess here
                direction, toward_rollout, size = None, True, first_size
            if direction is None:
                loss = self._regression_loss(ratios, min_entropy, toward_rollout)
                grads = th.autograd.grad(loss, actor_params, allow_unused=True)
                direction = nn.utils.parameters_to_vector(
                    [-(th.zeros_like(p) if g is None else g * s) for p, g, s in zip(actor_params, grads, scales, strict=True)]
                )
                rms = direction.pow(2).mean().sqrt()
                if self._enforcement_optimizer == "line_search_unit":
                    direction /= rms.clamp(min=1e-12)
                elif self._enforcement_optimizer == "line_search_capped":
                    direction /= rms.clamp(min=1.0)
                start = nn.utils.parameters_to_vector(actor_params).detach().clone()
            with th.no_grad():
                _copy_flat_to_parameters(start + size * direction, actor_params)
                self._apply_variance_floor()
            new_ratios, new_params = self._acting_ratios()
            new_merit = self._excess(new_ratios)
            if np.isfinite(new_merit) and new_merit < merit:
                ratios, params, merit, direction, failures = new_ratios, new_params, new_merit, None, 0
                size *= 2.0
                accepted += 1
            else:
                with th.no_grad():
                    _copy_flat_to_parameters(start, actor_params)
                size *= 0.5
                failures += 1
                rejected += 1
        return ratios, params, accepted, rejected

    def _enforce_bound(
        self, actor_params: list[nn.Parameter], rollout_actor: th.Tensor, min_entropy: float | None
    ) -> dict[str, Any]:
        """
        Bring every part of the acting policy's per-state distance to the rollout policy, over the update's states,
        within ``bound_tolerance`` times its own bound (:attr:`part_bounds`: for a Gaussian the mean part within
        ``mean_bound`` and the covariance part within ``cov_bound`` in every state, not only their sum): first up to
        ``max_enforce_steps`` regression steps of the network onto its projection, on the states above a bound (by
        default the line search of :meth:`_line_search_regression`; with ``"fresh"``, ``"shared"`` or ``"scaled"``,
        optimizer steps, :meth:`_make_enforcement_optimizer`); then, if still needed, the actor's parameters are moved
        back toward the rollout policy's, ``theta = theta_old + t (theta - theta_old)``, with the largest ``t`` of
        ``1, 0.8, 0.8^2, ...`` (20 tries, then ``t = 0``: the rollout policy, distance 0) meeting the bounds.

        :param actor_params: The parameters of the action distribution
        :param rollout_actor: Their values at the rollout (flat)
        :param min_entropy: The entropy control's floor of this update (:meth:`_project`)
        :return: the largest joint distance before and after (``before``, ``after``), each part's largest ratio to
            its bound after (``ratio_max``), the regression steps kept (``steps``) and the line search's tries undone
            (``rejected_tries``), the factor ``t`` (``step_fraction``), the fraction of the epochs' step it kept
            (``kept_fraction``, :meth:`_kept_fraction`); and the last pass over
            the buffer, of the final acting policy: its per-state KL (``final_kl``, as :meth:`_measure_update_kl`
            measures it) and distribution parameters (``final_params``)
        """
        limit = self.bound_tolerance
        epochs_actor = nn.utils.parameters_to_vector(actor_params).detach().clone()
        ratios, params = self._acting_ratios()
        before = self._joint_distances(ratios).max().item()
        if self._enforcement_optimizer in ("line_search", "line_search_unit", "line_search_capped"):
            ratios, params, steps, rejected = self._line_search_regression(actor_params, ratios, params, min_entropy)
        else:
            steps, rejected, optimizer = 0, 0, None
            while ratios.max().item() > limit and steps < self.max_enforce_steps:
                if optimizer is None:
                    optimizer = self._make_enforcement_optimizer(actor_params)
                self._optimizer_step(self._regression_loss(ratios, min_entropy), optimizer)
                steps += 1
                ratios, params = self._acting_ratios()
        step_fraction = 1.0
        if ratios.max().item() > limit:
            with th.no_grad():
                current = nn.utils.parameters_to_vector(actor_params).detach().clone()
                for _ in range(20):
                    step_fraction *= 0.8
                    _copy_flat_to_parameters(rollout_actor + step_fraction * (current - rollout_actor), actor_params)
                    ratios, params = self._acting_ratios()
                    if ratios.max().item() <= limit:
                        break
                else:
                    step_fraction = 0.0
                    _copy_flat_to_parameters(rollout_actor, actor_params)
                    ratios, params = self._acting_ratios()
        final_actor = nn.utils.parameters_to_vector(actor_params).detach()
        return {
            "before": before,
            "after": self._joint_distances(ratios).max().item(),
            "kept_fraction": self._kept_fraction(rollout_actor, epochs_actor, final_actor),
            "ratio_max": ratios.max(dim=0).values.tolist(),
            "steps": steps,
            "rejected_tries": rejected,
            "step_fraction": step_fraction,
            "final_kl": self._final_kl(params),
            "final_params": params,
        }

    @staticmethod
    def _kept_fraction(rollout_actor: th.Tensor, epochs_actor: th.Tensor, final_actor: th.Tensor) -> float:
        """
        The fraction of the epochs' step on the actor's parameters that the enforcement kept: the component of the
        update's final step along the epochs' step, ``<final - rollout, epochs - rollout> / |epochs - rollout|^2``
        (1: all kept, 0: back at the rollout policy's parameters; 1 when the epochs did not move them).

        :param rollout_actor: The actor's parameters at the rollout (flat)
        :param epochs_actor: After the epochs, before the enforcement
        :param final_actor: After the enforcement
        """
        step = (epochs_actor - rollout_actor).double()
        norm = step.dot(step).item()
        if norm == 0.0:
            return 1.0
        return (final_actor - rollout_actor).double().dot(step).item() / norm

    def _check_mostly_undone(self, kept_fraction: float) -> None:
        """
        Count the consecutive updates whose enforcement kept less than :data:`MOSTLY_UNDONE_FRACTION` of the epochs'
        step; at :data:`MOSTLY_UNDONE_UPDATES`, warn once (and print with ``verbose >= 1``): the bounds hold and the
        logged KL is small, but only because the actor hardly moves.

        :param kept_fraction: This update's kept fraction (:meth:`_kept_fraction`)
        """
        if kept_fraction >= MOSTLY_UNDONE_FRACTION:
            self.mostly_undone_updates = 0
            return
        self.mostly_undone_updates += 1
        if self.mostly_undone_updates < MOSTLY_UNDONE_UPDATES or self.mostly_undone_warned:
            return
        self.mostly_undone_warned = True
        bounds = f"mean_bound={self.mean_bound:g}" + (f", cov_bound={self.cov_bound:g}" if self._is_gaussian else "")
        message = (
            f"TRPL: the bound enforcement has undone most of the actor's update in {self.mostly_undone_updates} "
            f"consecutive updates (it kept less than {MOSTLY_UNDONE_FRACTION:g} of the epochs' step; last: "
            f"{kept_fraction:.3g}, logged as train/update_kept_fraction), so the actor barely learns although "
            "train/bound_met is 1 and the KL is small. The epochs' steps leave the trust region far behind: most likely "
            f"`learning_rate` ({self.policy.optimizer.param_groups[0]['lr']:g} now) is too large for the bounds "
            f"({bounds}). Fixes: a smaller learning_rate or fewer n_epochs, or larger bounds."
        )
        warn_and_print(message, self.verbose)

    def learn(
        self: SelfTRPL,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "TRPL",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfTRPL:
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
        )
