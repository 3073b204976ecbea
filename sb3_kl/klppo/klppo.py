import dataclasses
import math
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from torch.nn import functional as F

from sb3_kl.common.learning_rate import DEFAULT_LR_BOUNDS
from sb3_kl.common.controllers import KLController
from sb3_kl.common.host_sync import DeviceLog, without_distribution_validation
from sb3_kl.common.kl import per_state_kl_to
from sb3_kl.common.kl_term import fused_kl_term
from sb3_kl.common.modes import (
    acting_mode,
    has_mode_dependent_modules,
    has_running_statistics,
    kept_running_statistics,
    restore_running_statistics,
    save_running_statistics,
)
from sb3_kl.common.on_policy_algorithm import KLOnPolicyAlgorithm
from sb3_kl.common.reference import ReferenceSource
from sb3_kl.common.validation import (
    as_schedule,
    check_bool,
    check_finite,
    check_int,
    check_non_negative,
    check_positive,
    check_schedule,
    is_number,
)
from sb3_kl.klppo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

SelfKLPPO = TypeVar("SelfKLPPO", bound="KLPPO")


class KLPPO(KLOnPolicyAlgorithm):
    """
    Proximal Policy Optimization with an adaptive KL penalty (KLPPO), a drop-in for SB3's ``PPO``.

    Loss per minibatch: ``-E[r A] + beta * KL + vf_coef * L_V - ent_coef * H`` where ``r`` is the probability ratio
    between the current and the rollout policy, and ``KL`` is the per-state KL between them averaged over the
    minibatch (by default exact, forward ``KL(pi_old || pi_new)``, summed over action dimensions), plus a steep hinge
    ``kl_hinge_coef * max(0, KL - kl_hinge_factor * target_kl)^2`` that holds the KL within the update.
    After each update, beta is adapted so that the update's KL tracks ``target_kl``.

    Paper: https://arxiv.org/abs/1707.06347 (section 4, "Adaptive KL Penalty Coefficient")
    Code: the minibatch loop follows SB3's PPO (https://github.com/DLR-RM/stable-baselines3)

    :param policy: The policy model to use (MlpPolicy, CnnPolicy, ...)
    :param env: The environment to learn from (if registered in Gym, can be str)
    :param learning_rate: The learning rate, it can be a function of the current progress remaining (from 1 to 0).
        ``"auto"`` (or ``"auto_<start>"``, e.g. ``"auto_1e-3"``; ``"auto"`` starts at 3e-4) adapts it from the exact
        KL so that each update's KL is ``target_kl``: the rate sets the first epoch's KL, beta the update's, and a step
        scale lands an update outside [0.5, 2] x target in the band (docs: "learning_rate='auto'"). The adapted rate
        is saved with the model
    :param n_steps: The number of steps to run for each environment per update
        (i.e. rollout buffer size is n_steps * n_envs where n_envs is number of environment copies running in parallel)
    :param batch_size: Minibatch size
    :param n_epochs: Number of epoch when optimizing the surrogate loss
    :param gamma: Discount factor
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param clip_range: Ratio clipping parameter (number or schedule). ``None`` (default): no ratio clipping,
        the KL penalty alone controls the step; a value adds PPO's clipped surrogate as well
    :param clip_range_vf: Clipping parameter for the value function (as in PPO); None = no clipping
    :param normalize_advantage: Whether to normalize or not the advantage
    :param ent_coef: Entropy coefficient for the loss calculation
    :param vf_coef: Value function coefficient for the loss calculation
    :param max_grad_norm: The maximum value for the gradient clipping
    :param use_sde: Whether to use generalized State Dependent Exploration (gSDE)
    :param sde_sample_freq: Sample a new noise matrix every n steps when using gSDE (-1: once per rollout)
    :param rollout_buffer_class: Rollout buffer class to use; must subclass ``KLRolloutBuffer`` (or its Dict variant).
        If ``None``, it will be automatically selected.
    :param rollout_buffer_kwargs: Keyword arguments to pass to the rollout buffer on creation
    :param target_kl: Target KL of each update for the coefficient controller (number or schedule of progress
        remaining). ``None``: 0.02 for discrete action spaces, 0.03 for ``Box``.
        Unlike PPO's ``target_kl`` it is not an early-stopping threshold; see ``kl_stop_factor`` for that.
    :param kl_coef: Initial KL coefficient beta
    :param kl_controller: ``"adaptive"`` (band rule, default), ``"fixed"`` (constant beta), ``"proportional"``
        (rate-limited rule of Ziegler et al. 2019) or a ``KLController`` instance
    :param kl_adapt_factor: Adaptive controller: beta is multiplied/divided by this factor (> 1)
    :param kl_band: Adaptive controller: beta grows when KL > band[1] * target, shrinks when KL < band[0] * target
        (default ``(0.8, 1.25)``, centred on the target on a log scale)
    :param kl_coef_bounds: Bounds (min, max) of beta
    :param kl_window: Adaptive controller: number of recent update KLs averaged (1 = last update)
    :param kl_horizon: Proportional controller: horizon in environment steps
    :param kl_estimator: ``"analytic"`` (exact, default), ``"k1"`` or ``"k3"`` (sample estimators)
    :param kl_direction: ``"forward"`` = KL(old||new) (default) or ``"reverse"`` = KL(new||old)
    :param kl_reduction: ``"sum"`` (joint KL, default) or ``"mean"`` over action dimensions
    :param log_ratio_clip: Log-ratios are clamped to +/- this value before exponentiation (the sample estimators that
        exponentiate them, k3 and the reverse direction, are evaluated at the clamped value; forward k1 is never clamped),
        and without ratio clipping (``clip_range=None``) the surrogate's ratio; with clipping it is PPO's
    :param kl_stop_factor: When set, the remaining epochs are skipped once the epoch's KL exceeds
        ``kl_stop_factor * target_kl``, judged after each epoch on the mean over its minibatches' states of the
        per-state KL to the rollout policy, each taken before that minibatch's step (so it lags: the first minibatch
        of an update contributes 0, and the epoch's last step is seen by the next epoch only); with dropout or batch
        norm in the policy that KL is taken as the policy acts (eval mode), with batch norm after the minibatch's
        train-mode pass has updated its running statistics (so there the first minibatch adds their shift). None (default): no
        early stop. 1.5 holds the KL far better when the learning rate is too high (HalfCheetah at 10x the zoo rate)
        but was not made the default: at the zoo's rate it changed no return significantly and the drop-in (with
        PPO's clip) collapsed on 3 of 5 Hopper seeds (``benchmarks/results/learning.md``, early-stop section)
    :param kl_saturation_stop_factor: Used only while the controller cannot raise beta any further (beta at the upper
        end of ``kl_coef_bounds`` or one controller step below it, with an adapting controller, so that one low-KL
        update at the bound does not release the next): the update then ends before the first optimizer step
        whose minibatch KL (exact whatever ``kl_estimator``, of the policy as it acts: eval mode, dropout off; mean
        over the minibatch's states, before the step) exceeds ``kl_saturation_stop_factor * target_kl``, SB3's
        per-minibatch rule, and beta is not lowered after an update the stop ended (that KL is the stop's doing,
        not beta's; from one step below the bound it still rises to the bound). With Adam the penalty only turns the
        step's direction, so a learning rate too high for the task (HalfCheetah at 10x the zoo rate) pins beta at its
        bound while the KL stays above the band; there the stop holds the KL, and elsewhere beta stays inside its
        bounds and the updates are as without it (judging every minibatch unconditionally stopped on the noise of
        Pendulum's 64-state minibatches, ``benchmarks/results/learning.md``). Default 1.5; None: never
    :param kl_hinge_coef: Coefficient of a quadratic hinge on the minibatch KL above ``kl_hinge_factor * target_kl``
        (Schulman's modular_rl uses 1000 and 2, the default): it holds the KL of a minibatch near that multiple
        within the update, when beta alone would react only at the next one; 0 disables it
    :param kl_hinge_factor: Where the hinge starts, as a multiple of the target
    :param min_std: Variance floor for Gaussian policies: after every optimizer step std >= min_std
        (``log_std`` clamped in place: the std parameter that ``train/std`` averages; without gSDE that is the action
        std in every state, with gSDE the std of the exploration weights (with ``use_expln``, expln(log_std), which
        ``train/std``, SB3's mean of exp(log_std), does not show), and the per-state action std
        ``train/action_std_min`` is then not floored). None = no floor
    :param kl_quantiles: Quantiles of the per-state KL logged after each update (as ``train/kl_p<q>``; with a
        sample ``kl_estimator``, quantiles of the one-action estimates, of which only the mean estimates the KL)
    :param ref_policy: Reference policy to anchor to while learning (e.g. a new reward): the path of a saved SB3
        model (any on-policy algorithm), a model or an ``ActorCriticPolicy``. A frozen copy is kept as
        ``model.ref_policy`` (eval mode, no gradients, never updated) and saved with the model. Must share the action
        and observation spaces. None (default): no anchor
    :param ref_kl_coef: Coefficient beta_ref of the reference KL: fixed when ``ref_target_kl`` is None, else its
        initial value. 0 with ``ref_target_kl=None`` only measures and logs the KL to the reference
    :param ref_target_kl: Target of the mean reference KL (after each update, over the buffer's states); when set,
        beta_ref is adapted toward it by its own ``ref_kl_controller``. None (default): fixed beta_ref
    :param ref_kl_controller: Rule adapting beta_ref (same choices as ``kl_controller``; own instance and state)
    :param ref_kl_coef_bounds: Bounds (min, max) of beta_ref
    :param ref_kl_direction: ``"reverse"`` = KL(pi || pi_ref) (default, as in RLHF) or ``"forward"`` = KL(pi_ref || pi)
    :param ref_kl_estimator: ``"analytic"`` (exact, default), ``"k1"`` or ``"k3"`` (from the stored actions, drawn by
        the rollout policy, importance-weighted to it: unbiased in value and gradient, see docs/guide/reference_kl.md)
        With a reference, ``beta_ref * KL_ref`` (mean over the minibatch's states) is added to the loss, next to
        ``beta * KL``: the update KL limits each step, the reference KL limits the drift accumulated over all
        updates. The reference is evaluated per minibatch under ``no_grad``
    :param lr_bounds: ``(min, max)`` of the learning rate with ``learning_rate="auto"``, default ``(1e-6, 0.1)``
    :param stats_window_size: Window size for the rollout logging, specifying the number of episodes to average
        the reported success rate, mean episode length, and mean reward over
    :param tensorboard_log: the log location for tensorboard (if None, no logging)
    :param policy_kwargs: additional arguments to be passed to the policy on creation
    :param verbose: Verbosity level: 0 for no output, 1 for info messages (such as device or wrappers used), 2 for
        debug messages
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
    #: What the per-epoch early stop judges: ``"minibatch_mean"`` (the mean of the epoch's per-minibatch KLs, each
    #: taken before that minibatch's step) or ``"epoch_end"`` (the KL of the policy the epoch leaves, over the whole
    #: buffer; kept to compare the rules, see ``_kl_ran_away`` and ``benchmarks/studies/epoch_kl_stop.py``)
    _kl_stop_judge: ClassVar[str] = "minibatch_mean"
    supports_auto_learning_rate: ClassVar[bool] = True
    #: Whether the loss's KL term is the fused autograd node where it applies (:meth:`_kl_term`); False builds it from
    #: autograd operations, the path the node is tested against (the same values and gradients up to rounding)
    _fused_kl_term: ClassVar[bool] = True
    #: Action spaces accepted at construction (SB3's check)
    _supported_action_spaces: ClassVar[tuple[type[spaces.Space], ...]] = (
        spaces.Box,
        spaces.Discrete,
        spaces.MultiDiscrete,
        spaces.MultiBinary,
    )

    def __init__(
        self,
        policy: str | type[MlpPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule | str = 3e-4,
        n_steps: int = 2048,
        batch_size: int = 64,
        n_epochs: int = 10,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        clip_range: float | Schedule | None = None,
        clip_range_vf: float | Schedule | None = None,
        normalize_advantage: bool = True,
        ent_coef: float = 0.0,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
        use_sde: bool = False,
        sde_sample_freq: int = -1,
        rollout_buffer_class: type[RolloutBuffer] | None = None,
        rollout_buffer_kwargs: dict[str, Any] | None = None,
        target_kl: float | Schedule | None = None,
        kl_coef: float = 1.0,
        kl_controller: str | KLController = "adaptive",
        kl_adapt_factor: float = 1.5,
        kl_band: tuple[float, float] = (0.8, 1.25),
        kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
        kl_window: int = 1,
        kl_horizon: int = 10_000,
        kl_estimator: str = "analytic",
        kl_direction: str = "forward",
        kl_reduction: str = "sum",
        log_ratio_clip: float = 20.0,
        kl_stop_factor: float | None = None,
        kl_saturation_stop_factor: float | None = 1.5,
        kl_hinge_coef: float = 1000.0,
        kl_hinge_factor: float = 2.0,
        min_std: float | None = None,
        kl_quantiles: tuple[float, ...] = (0.5, 0.9, 0.99),
        ref_policy: ReferenceSource | None = None,
        ref_kl_coef: float = 1.0,
        ref_target_kl: float | None = None,
        ref_kl_controller: str | KLController = "adaptive",
        ref_kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
        ref_kl_direction: str = "reverse",
        ref_kl_estimator: str = "analytic",
        lr_bounds: tuple[float, float] = DEFAULT_LR_BOUNDS,
        stats_window_size: int = 100,
        tensorboard_log: str | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        verbose: int = 0,
        seed: int | None = None,
        device: th.device | str = "auto",
        _init_setup_model: bool = True,
    ):
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
            supported_action_spaces=self._supported_action_spaces,
            target_kl=target_kl,
            kl_coef=kl_coef,
            kl_controller=kl_controller,
            kl_adapt_factor=kl_adapt_factor,
            kl_band=kl_band,
            kl_coef_bounds=kl_coef_bounds,
            kl_window=kl_window,
            kl_horizon=kl_horizon,
            kl_estimator=kl_estimator,
            kl_direction=kl_direction,
            kl_reduction=kl_reduction,
            log_ratio_clip=log_ratio_clip,
            min_std=min_std,
            kl_quantiles=kl_quantiles,
            ref_policy=ref_policy,
            ref_kl_coef=ref_kl_coef,
            ref_target_kl=ref_target_kl,
            ref_kl_controller=ref_kl_controller,
            ref_kl_coef_bounds=ref_kl_coef_bounds,
            ref_kl_direction=ref_kl_direction,
            ref_kl_estimator=ref_kl_estimator,
            lr_bounds=lr_bounds,
        )

        # Checks SB3's PPO does not make; the ones it makes follow, with the same AssertionErrors as PPO
        check_bool("normalize_advantage", normalize_advantage)
        check_int("batch_size", batch_size, 1)
        check_int("n_epochs", n_epochs, 1)
        check_finite("ent_coef", ent_coef)
        check_non_negative("vf_coef", vf_coef)
        check_positive("max_grad_norm", max_grad_norm, allow_inf=True, hint=" (inf: no gradient clipping)")
        if clip_range is not None:
            # a linear schedule (e.g. rl-zoo's ``lin_0.2``) reaches exactly 0 at the end of training
            try:
                check_schedule("clip_range", clip_range, allow_zero_at_end=True)
            except ValueError as error:
                raise ValueError(f"{error} Pass a positive clip_range, or None to disable ratio clipping.") from None

        # Same sanity checks as SB3's PPO (same exceptions, so PPO users see no difference)
        if normalize_advantage:
            assert batch_size > 1, (
                "`batch_size` must be greater than 1. See https://github.com/DLR-RM/stable-baselines3/issues/440"
            )

        if self.env is not None:
            buffer_size = self.env.num_envs * self.n_steps
            assert buffer_size > 1 or (not normalize_advantage), (
                f"`n_steps * n_envs` must be greater than 1. Currently n_steps={self.n_steps} and n_envs={self.env.num_envs}"
            )
            self._warn_if_truncated_minibatch(batch_size)
        check_positive("kl_stop_factor", kl_stop_factor, allow_none=True, hint=" or None (no early stop)")
        check_positive(
            "kl_saturation_stop_factor", kl_saturation_stop_factor, allow_none=True, hint=" or None (no stop at the bound)"
        )
        check_non_negative("kl_hinge_coef", kl_hinge_coef, hint=" (0 disables the hinge)")
        check_positive("kl_hinge_factor", kl_hinge_factor)
        self.batch_size = batch_size
        self.n_epochs = n_epochs
        self.clip_range = clip_range
        if clip_range_vf is not None and not is_number(clip_range_vf) and not callable(clip_range_vf):
            raise TypeError(
                f"`clip_range_vf` must be a positive number, a schedule or None (no value clipping), got {clip_range_vf!r}."
            )
        if callable(clip_range_vf):
            check_schedule("clip_range_vf", clip_range_vf, allow_zero_at_end=True)
        self.clip_range_vf = clip_range_vf
        self.normalize_advantage = normalize_advantage
        self.kl_stop_factor = kl_stop_factor
        self.kl_saturation_stop_factor = kl_saturation_stop_factor
        self.kl_hinge_coef = float(kl_hinge_coef)
        self.kl_hinge_factor = float(kl_hinge_factor)
        # The early stop's measurement of the policy the last epoch left (per-state KL, parameters), reused by the logs
        self._epoch_end_kl: tuple[np.ndarray, np.ndarray] | None = None

        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        super()._setup_model()

        # Initialize schedules for policy/value clipping
        if self.clip_range is not None:
            self.clip_range = as_schedule(self.clip_range)
        if self.clip_range_vf is not None:
            if is_number(self.clip_range_vf):
                assert self.clip_range_vf > 0, "`clip_range_vf` must be positive, pass `None` to deactivate vf clipping"

            self.clip_range_vf = as_schedule(self.clip_range_vf)

    @without_distribution_validation
    def train(self) -> None:
        """
        Update policy using the currently gathered rollout buffer.
        """
        self._prepare_rollout_distribution()
        # Switch to train mode (this affects batch norm / dropout)
        self.policy.set_training_mode(True)
        # Update optimizer learning rate
        self._update_learning_rate(self.policy.optimizer)
        clip_range, clip_range_vf = self._current_clip_ranges()
        target_kl = self._current_target_kl()
        kl_coef = self.kl_coef
        ref_kl_coef = self.ref_kl_coef if self.ref_policy is not None else 0.0
        self._epoch_end_kl = None

        # what is logged stays on the device until the update ends: no host synchronisation per minibatch
        logs = DeviceLog("entropy_loss", "policy_gradient_loss", "value_loss", "kl_loss", "approx_kl", "clip_fraction")
        n_minibatches = math.ceil(self.rollout_buffer.buffer_size * self.rollout_buffer.n_envs / self.batch_size)
        applied_steps, minibatch_steps = th.zeros((), dtype=th.long, device=self.device), 0
        kl_grad_ratio = float("nan")
        early_stop_epoch = self.n_epochs
        loss = th.zeros(())
        # Beta pinned at its upper bound: the per-minibatch stop takes over (kl_saturation_stop_factor)
        saturation_stop_kl = self._saturation_stop_kl(target_kl)
        stopped_at_bound = False
        stop_in_acting_mode = has_mode_dependent_modules(self.policy)
        # a minibatch the stop at beta's bound refuses takes no step: its train-mode pass must not move batch norm's
        # running statistics either (restored on the stop)
        keep_statistics = saturation_stop_kl is not None and has_running_statistics(self.policy)

        for epoch in range(self.n_epochs):
            logs.clear("approx_kl")  # SB3 logs the last epoch's
            epoch_kl_sum, epoch_states = th.zeros((), device=self.device), 0
            for batch_idx, rollout_data in enumerate(self.rollout_buffer.get(self.batch_size)):
                statistics = save_running_statistics(self.policy) if keep_statistics else []
                actions = self._actions_for_log_prob(rollout_data.actions)
                # One forward pass gives the values, the log-probs and the distribution for the KL
                values, distribution = self._forward_samples(rollout_data)
                log_prob = distribution.log_prob(actions)
                # With ent_coef == 0 the entropy is only logged: keep it out of the graph (saves its backward)
                with th.set_grad_enabled(self.ent_coef != 0):
                    entropy = distribution.entropy()
                log_ratio = log_prob - rollout_data.old_log_prob
                kl_log_prob, kl_log_ratio = self._log_probs_for_kl(distribution, actions, log_prob, rollout_data.old_log_prob)
                kl, kl_loss = self._kl_term(rollout_data.old_dist_params, distribution, kl_log_ratio, kl_coef, target_kl)

                advantages = self._normalized_advantages(rollout_data.advantages)
                policy_loss, clip_fraction = self._surrogate_loss(log_ratio, advantages, clip_range)

                value_loss = self._value_loss(values, rollout_data.old_values, rollout_data.returns, clip_range_vf)
                # Entropy loss favor exploration (approximated by -log_prob when there is no analytical form)
                entropy_loss = -th.mean(-log_prob) if entropy is None else -th.mean(entropy)

                loss = policy_loss + kl_loss + self.vf_coef * value_loss
                if ref_kl_coef > 0:
                    # Anchor to the frozen reference policy (sb3_kl/common/reference.py)
                    ref_kl = self._reference_penalty(
                        rollout_data.observations,
                        actions,
                        distribution,
                        kl_log_prob,
                        rollout_data.old_log_prob,
                        self._sample_masks(rollout_data),
                    )
                    loss = loss + ref_kl_coef * ref_kl
                if self.ent_coef != 0:
                    loss = loss + self.ent_coef * entropy_loss

                # Diagnostics: SB3's approx_kl (k3 estimate of KL(old||new)), see
                # https://github.com/DLR-RM/stable-baselines3/issues/417 and http://joschu.net/blog/kl-approx.html
                with th.no_grad():
                    logs.add("approx_kl", th.mean(th.expm1(log_ratio) - log_ratio))
                    if self.kl_stop_factor is not None and self._kl_stop_judge == "minibatch_mean":
                        # summed as a tensor: one synchronisation per epoch, not per minibatch
                        epoch_kl_sum += self._epoch_stop_kl(kl, rollout_data, stop_in_acting_mode) * len(advantages)
                        epoch_states += len(advantages)
                logs.add("policy_gradient_loss", policy_loss)
                logs.add("value_loss", value_loss)
                logs.add("entropy_loss", entropy_loss)
                logs.add("kl_loss", kl_loss)
                if clip_fraction is not None:
                    logs.add("clip_fraction", clip_fraction)

                if saturation_stop_kl is not None and self._stops_at_bound(
                    kl, rollout_data, distribution, saturation_stop_kl, epoch
                ):
                    restore_running_statistics(statistics)
                    stopped_at_bound = True
                    break
                if epoch == self.n_epochs - 1 and batch_idx == n_minibatches - 1:
                    kl_grad_ratio = self._gradient_ratio(kl_loss, policy_loss)

                # a boolean tensor, False for a non-finite loss or gradient (the step is skipped)
                applied_steps += self._optimizer_step(loss)
                minibatch_steps += 1

            self._n_updates += 1
            # Or the early stop judged once per epoch on the KL of all the states seen in it (see _kl_ran_away)
            self._measure_first_epoch_kl(epoch)  # learning_rate="auto" sets the next rate from it
            if stopped_at_bound or self._kl_ran_away(epoch_kl_sum, epoch_states, target_kl, epoch):
                early_stop_epoch = epoch + 1
                if stopped_at_bound or epoch < self.n_epochs - 1:
                    kl_grad_ratio = self._recompute_gradient_ratio(rollout_data, clip_range, kl_coef, target_kl)
                break

        self._count_nonfinite_steps(applied_steps, minibatch_steps)

        # The early stop's last pass measured the final policy already: reuse it (not after a stop at beta's bound,
        # which may come after steps of an epoch that "epoch_end" judging has not measured)
        per_state, new_params = self._measure_final_update_kl(target_kl, None if stopped_at_bound else self._epoch_end_kl)
        self._epoch_end_kl = None
        self._finish_update()
        explained_var = explained_variance(self.rollout_buffer.values.flatten(), self.rollout_buffer.returns.flatten())

        # Logs
        means = logs.means()
        for name in ("entropy_loss", "policy_gradient_loss", "value_loss", "kl_loss", "approx_kl"):
            self.logger.record(f"train/{name}", means[name])
        if clip_range is not None:
            self.logger.record("train/clip_fraction", means["clip_fraction"])
            self.logger.record("train/clip_range", clip_range)
            self._check_clip_holds_rate(means["clip_fraction"], clip_range)
        self.logger.record("train/loss", loss.item())
        self.logger.record("train/explained_variance", explained_var)
        if hasattr(self.policy, "log_std"):
            self.logger.record("train/std", th.exp(self.policy.log_std).mean().item())
        self.logger.record("train/kl_grad_ratio", kl_grad_ratio)
        self.logger.record("train/early_stop_epoch", early_stop_epoch)
        self.logger.record("train/early_stop_at_kl_coef_bound", float(stopped_at_bound))
        self.logger.record("train/nonfinite_steps", self._last_nonfinite_steps)
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if clip_range_vf is not None:
            self.logger.record("train/clip_range_vf", clip_range_vf)
        self._record_update_kl(per_state, new_params, target_kl, hold_kl_coef=stopped_at_bound)
        self._record_reference_kl()

    def _kl_ran_away(self, epoch_kl_sum: th.Tensor, epoch_states: int, target_kl: float, epoch: int) -> bool:
        """
        Whether the epoch loop stops here (never when ``kl_stop_factor`` is None): the judged KL exceeds
        ``kl_stop_factor * target_kl``. What is judged is the mean, over the states of the epoch's minibatches, of
        the per-state KL (the algorithm's convention, as in the loss) between the rollout policy and the policy
        *before* each minibatch's step. It lags the policy the epoch leaves: the first minibatch of an update
        contributes 0 and the epoch's last step is not seen until the next epoch. Judging the KL of the policy the
        epoch leaves instead (``_kl_stop_judge = "epoch_end"``: one no-grad pass over the buffer, kept in
        ``_epoch_end_kl`` and reused by the logs) was measured on the x10 learning-rate stress setting
        (``benchmarks/results/epoch_kl_stop.md``): it stopped on transient KL peaks that the remaining epochs' KL
        penalty would have brought back, so more updates ended above the threshold and fewer in the band.

        :param epoch_kl_sum: Sum over the epoch's states of their minibatch KL (``"minibatch_mean"``)
        :param epoch_states: Number of states seen in the epoch (``"minibatch_mean"``)
        :param target_kl: The current target
        :param epoch: Index of the epoch (for the verbose message)
        """
        if self.kl_stop_factor is None:
            return False
        if self._kl_stop_judge == "minibatch_mean":
            epoch_kl = epoch_kl_sum.item() / max(epoch_states, 1)
        else:
            # learning_rate="auto" has measured the first epoch's end already (_measure_first_epoch_kl)
            measured = getattr(self, "_first_epoch_measured", None) if epoch == 0 else None
            self._epoch_end_kl = measured or self._measure_update_kl()
            epoch_kl = float(np.mean(self._epoch_end_kl[0]))
        if epoch_kl <= self.kl_stop_factor * target_kl:
            return False
        if self.verbose >= 1:
            print(f"Early stopping at epoch {epoch + 1} due to reaching KL {epoch_kl:.4f}")
        return True

    def _saturation_stop_kl(self, target_kl: float) -> float | None:
        """
        The minibatch KL above which this update stops, or None while beta is not near its upper bound
        (``KLController.near_upper_bound``, never for a fixed beta) or when ``kl_saturation_stop_factor`` is None: see
        ``kl_saturation_stop_factor``. Judged once, at the start of the update, on the beta the update uses.

        :param target_kl: The current target
        """
        if self.kl_saturation_stop_factor is None or not self.kl_controller.near_upper_bound:
            return None
        return self.kl_saturation_stop_factor * target_kl

    def _stops_at_bound(
        self, kl: th.Tensor, rollout_data: Any, distribution: Distribution, stop_kl: float, epoch: int
    ) -> bool:
        """
        Whether the stop at beta's bound ends the update before this minibatch's step: the minibatch KL it judges
        (:meth:`_judged_minibatch_kl`) exceeds ``stop_kl``.

        :param kl: The loss's minibatch KL (mean over the valid states)
        :param rollout_data: The minibatch
        :param distribution: The loss's distribution on its states
        :param stop_kl: The threshold from :meth:`_saturation_stop_kl`
        :param epoch: Index of the epoch (for the verbose message)
        :return: whether the update ends here
        """
        judged_kl = self._judged_minibatch_kl(kl, rollout_data, distribution)
        return self._minibatch_kl_ran_away(judged_kl, stop_kl, epoch)

    @th.no_grad()
    def _judged_minibatch_kl(self, kl: th.Tensor, rollout_data: Any, distribution: Distribution) -> th.Tensor:
        """
        The minibatch KL the stop at beta's bound judges: exact (analytic, whatever ``kl_estimator``), in the
        algorithm's direction and reduction, of the policy as it acts (eval mode), before the step; mean over the
        minibatch's valid states. It is the loss's own ``kl`` when that already is this number (analytic estimator, no
        mode-dependent module in the policy, :func:`~sb3_kl.common.modes.has_mode_dependent_modules`). With batch norm,
        the acting policy includes the running statistics the update's train-mode passes have moved, so the stop may
        end an update at its first minibatch.

        :param kl: The loss's minibatch KL
        :param rollout_data: The minibatch
        :param distribution: The loss's distribution on its states (train mode)
        :return: the judged KL (a scalar tensor)
        """
        if has_mode_dependent_modules(self.policy):
            with acting_mode(self.policy):
                distribution = self._acting_samples_distribution(rollout_data)
        elif self.kl_settings.estimator == "analytic":
            return kl
        exact = dataclasses.replace(self.kl_settings, estimator="analytic")
        per_state = per_state_kl_to(exact, self.dist_params, rollout_data.old_dist_params, distribution)
        valid = self._valid_states(rollout_data)
        return (per_state if valid is None else per_state[valid]).mean()

    @th.no_grad()
    def _epoch_stop_kl(self, kl: th.Tensor, rollout_data: Any, acting_mode_differs: bool) -> th.Tensor:
        """
        A minibatch's KL as ``kl_stop_factor``'s per-epoch rule adds it up: the loss's own ``kl`` (the estimator's
        convention, before the minibatch's step), unless the policy has a mode-dependent module (dropout, batch norm,
        :func:`~sb3_kl.common.modes.has_mode_dependent_modules`). The loss's train-mode KL then carries that module's
        noise (dropout at p=0.5 put an unchanged policy above 2 x target and stopped ClipKLPPO at its first epoch), so
        the same KL is taken again with the policy as it acts (eval mode): one more forward pass, no gradient.

        :param kl: The loss's minibatch KL (mean over the valid states)
        :param rollout_data: The minibatch
        :param acting_mode_differs: Whether the policy has a mode-dependent module (judged once per update)
        :return: the KL to add up (a scalar tensor, no gradient)
        """
        if not acting_mode_differs:
            return kl.detach()
        with acting_mode(self.policy):
            distribution = self._acting_samples_distribution(rollout_data)
        log_ratio = distribution.log_prob(self._actions_for_log_prob(rollout_data.actions)) - rollout_data.old_log_prob
        per_state = self._per_state_kl(rollout_data.old_dist_params, distribution, log_ratio)
        valid = self._valid_states(rollout_data)
        return (per_state if valid is None else per_state[valid]).mean()

    def _acting_samples_distribution(self, rollout_data: Any) -> Distribution:
        """
        :param rollout_data: A minibatch
        :return: the policy's action distribution on its states (in the policy's current mode)
        """
        return self._samples_distribution(self.policy, rollout_data)

    def _valid_states(self, rollout_data: Any) -> th.Tensor | None:
        """
        :param rollout_data: A minibatch
        :return: which of its states count (a boolean mask), or None: all of them
        """
        return None

    def _minibatch_kl_ran_away(self, kl: th.Tensor, stop_kl: float, epoch: int) -> bool:
        """
        Whether the update ends before this minibatch's optimizer step: its KL (mean over its states of the per-state
        KL to the rollout policy, before the step) exceeds ``stop_kl``.

        :param kl: The minibatch's mean per-state KL, from :meth:`_judged_minibatch_kl`
        :param stop_kl: The threshold from :meth:`_saturation_stop_kl`
        :param epoch: Index of the epoch (for the verbose message)
        """
        minibatch_kl = kl.item()
        if minibatch_kl <= stop_kl:
            return False
        if self.verbose >= 1:
            print(
                f"Early stopping in epoch {epoch + 1}: KL coefficient at its upper bound and minibatch KL "
                f"{minibatch_kl:.4f} > {stop_kl:.4f}"
            )
        return True

    @staticmethod
    def _value_loss(values: th.Tensor, old_values: th.Tensor, returns: th.Tensor, clip_range_vf: float | None) -> th.Tensor:
        """
        PPO's value loss: MSE to the returns, with the change of the value clipped to ``clip_range_vf`` when set
        (this depends on the reward scaling).
        """
        if clip_range_vf is not None:
            values = old_values + th.clamp(values - old_values, -clip_range_vf, clip_range_vf)
        return F.mse_loss(returns, values)

    def _surrogate_loss(
        self, log_ratio: th.Tensor, advantages: th.Tensor, clip_range: float | None
    ) -> tuple[th.Tensor, th.Tensor | None]:
        """
        Policy-gradient surrogate ``-E[r A]``, with PPO's clipping when ``clip_range`` is set. With clipping, the
        ratio is SB3's PPO's, ``exp(log_ratio)``; without, where nothing else bounds it, the log-ratio is clamped to
        ``+/- log_ratio_clip`` before exponentiation (so that one far-off sample cannot overflow the loss).

        :return: the loss and the clip fraction (a tensor, None without clipping)
        """
        if clip_range is None:
            ratio = th.exp(th.clamp(log_ratio, -self.kl_settings.log_ratio_clip, self.kl_settings.log_ratio_clip))
            return -(advantages * ratio).mean(), None
        ratio = th.exp(log_ratio)
        policy_loss_1 = advantages * ratio
        policy_loss_2 = advantages * th.clamp(ratio, 1 - clip_range, 1 + clip_range)
        with th.no_grad():
            clip_fraction = th.mean((th.abs(ratio - 1) > clip_range).float())
        return -th.min(policy_loss_1, policy_loss_2).mean(), clip_fraction

    def _kl_term(
        self, old_params: th.Tensor, distribution: Distribution, log_ratio: th.Tensor, kl_coef: float, target_kl: float
    ) -> tuple[th.Tensor, th.Tensor]:
        """
        The minibatch KL (the mean over its states of the per-state KL) and the loss's KL term on it
        (:meth:`_kl_penalty`), in one autograd node (:func:`~sb3_kl.common.kl_term.fused_kl_term`). Built from autograd
        operations instead (:meth:`_per_state_kl`, its mean, :meth:`_kl_penalty`) when ``_fused_kl_term`` is off,
        where the node does not apply, or when a subclass overrides one of those two methods (the term is then theirs).

        :param old_params: Rollout-policy parameters from the buffer
        :param distribution: The current policy's distribution on the minibatch's states
        :param log_ratio: log pi_new(a|s) - log pi_old(a|s) of the stored actions (used by k1/k3)
        :return: the minibatch KL and the KL term, two scalar tensors
        """
        if self._fused_kl_term and self._stock_kl_hooks():
            hinge_kl = self.kl_hinge_factor * target_kl
            fused = fused_kl_term(
                self.kl_settings, self.dist_params, old_params, distribution, log_ratio, kl_coef, self.kl_hinge_coef, hinge_kl
            )
            if fused is not None:
                return fused
        kl = self._per_state_kl(old_params, distribution, log_ratio).mean()
        return kl, self._kl_penalty(kl, kl_coef, target_kl)

    @classmethod
    def _stock_kl_hooks(cls) -> bool:
        """Whether the class builds its KL term with KLPPO's own ``_per_state_kl`` and ``_kl_penalty``."""
        return cls._per_state_kl is KLOnPolicyAlgorithm._per_state_kl and cls._kl_penalty is KLPPO._kl_penalty

    def _kl_penalty(self, kl: th.Tensor, kl_coef: float, target_kl: float) -> th.Tensor:
        """
        ``beta * KL``, plus the optional hinge ``kl_hinge_coef * max(0, KL - kl_hinge_factor * target)^2``.

        :param kl: Mean per-state KL of the minibatch
        """
        penalty = kl_coef * kl
        if self.kl_hinge_coef > 0:
            penalty = penalty + self.kl_hinge_coef * th.clamp(kl - self.kl_hinge_factor * target_kl, min=0.0) ** 2
        return penalty

    def _gradient_ratio(self, kl_loss: th.Tensor, policy_loss: th.Tensor) -> float:
        """
        ``||grad (beta*KL + hinge)|| / ||grad surrogate||`` over the policy's parameters: ``kl_loss`` is the loss's whole
        KL term (:meth:`_kl_penalty`). The graph is kept for the optimizer step.
        """
        params = [p for p in self.policy.parameters() if p.requires_grad]
        norms = []
        for term in (kl_loss, policy_loss):
            if not term.requires_grad:
                norms.append(0.0)
                continue
            grads = [g for g in th.autograd.grad(term, params, retain_graph=True, allow_unused=True) if g is not None]
            # one read of the device: the squared norms summed there (in float64, as Python's sum of their floats)
            norms.append(math.sqrt(float(th.stack([(g**2).sum() for g in grads]).double().sum())) if grads else 0.0)
        return norms[0] / norms[1] if norms[1] > 0 else float("nan")

    def _recompute_gradient_ratio(
        self, rollout_data: Any, clip_range: float | None, kl_coef: float, target_kl: float
    ) -> float:
        """
        The gradient ratio on the last minibatch seen, with the final parameters (when the update stopped early). The
        forward pass runs in train mode, as the loss's did; running statistics (batch norm) are restored after it, so
        that it leaves the policy as the update's last step left it.
        """
        with kept_running_statistics(self.policy):
            _, distribution = self._forward_samples(rollout_data)
            actions = self._actions_for_log_prob(rollout_data.actions)
            log_prob = distribution.log_prob(actions)
            log_ratio = log_prob - rollout_data.old_log_prob
            _, kl_log_ratio = self._log_probs_for_kl(distribution, actions, log_prob, rollout_data.old_log_prob)
            _, kl_loss = self._kl_term(rollout_data.old_dist_params, distribution, kl_log_ratio, kl_coef, target_kl)
            advantages = self._normalized_advantages(rollout_data.advantages)
            policy_loss, _ = self._surrogate_loss(log_ratio, advantages, clip_range)
            return self._gradient_ratio(kl_loss, policy_loss)

    def learn(
        self: SelfKLPPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "KLPPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfKLPPO:
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
        )
