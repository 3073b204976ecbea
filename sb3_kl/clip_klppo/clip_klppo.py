from typing import Any, TypeVar

import torch as th
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule

from sb3_kl.clip_klppo.policies import MlpPolicy
from sb3_kl.common.learning_rate import DEFAULT_LR_BOUNDS
from sb3_kl.common.controllers import KLController
from sb3_kl.common.reference import ReferenceSource
from sb3_kl.klppo.klppo import KLPPO

SelfClipKLPPO = TypeVar("SelfClipKLPPO", bound="ClipKLPPO")


class ClipKLPPO(KLPPO):
    """
    Clipped surrogate plus adaptive KL penalty (ClipKLPPO): PPO's clipped objective with KLPPO's KL penalty on top,
    and an early stop of the epoch loop when the update's KL runs away.

    Loss per minibatch: ``-E[min(r A, clip(r, 1 - eps, 1 + eps) A)] + beta * KL + vf_coef * L_V - ent_coef * H``.
    Clipping bounds each sample's ratio; the KL penalty (by default exact, forward ``KL(pi_old || pi_new)``, summed
    over action dimensions) keeps the policy close on the distribution as a whole, and beta is adapted after each
    update so that the update's KL tracks ``target_kl``. Once the KL of an epoch exceeds ``kl_stop_factor * target_kl``,
    the remaining epochs are skipped: judged once per epoch (a single minibatch's KL is too noisy to stop on) on the
    mean over the epoch's minibatch states of the per-state KL to the rollout policy, each taken before that
    minibatch's step, so it lags the policy the epoch leaves (see ``KLPPO._kl_ran_away``); ``train/early_stop_epoch``
    logs the epoch at
    which the update stopped (``n_epochs`` when it did not). A hinge (``kl_hinge_coef``), as in Schulman's
    modular_rl, adds a steep quadratic penalty on the minibatch KL above ``kl_hinge_factor * target_kl``.

    This is :class:`~sb3_kl.KLPPO` with ratio clipping and early stopping switched on by default; the loss is KLPPO's.

    Paper: https://arxiv.org/abs/1707.06347 (sections 3 and 4)
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
    :param clip_range: Ratio clipping parameter, it can be a function of the current progress remaining (from 1 to 0).
        Must be set (use :class:`~sb3_kl.KLPPO` for a KL penalty without clipping)
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
    :param target_kl: Target KL of each update for the coefficient controller and the early stop (number or schedule
        of progress remaining). ``None``: 0.02 for discrete action spaces, 0.03 for ``Box``
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
    :param kl_stop_factor: The remaining epochs are skipped once the KL of an epoch (mean of its minibatches'
        per-state KLs, each taken before that minibatch's step, as the policy acts when it has dropout or batch norm)
        exceeds ``kl_stop_factor * target_kl`` (default 2.0); None disables the early stop
    :param kl_saturation_stop_factor: While beta sits at the upper end of ``kl_coef_bounds``, the update ends before
        the first optimizer step whose minibatch KL (exact, of the policy as it acts, before the step) exceeds
        ``kl_saturation_stop_factor * target_kl`` (default 1.5, as in KLPPO; None: never)
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
        With a reference, ``beta_ref * KL_ref`` is added to the loss as in :class:`~sb3_kl.KLPPO`
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
        clip_range: float | Schedule = 0.2,
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
        kl_stop_factor: float | None = 2.0,
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
        # ``load()`` calls the constructor with defaults only, so None only reaches here from a user
        if clip_range is None:
            raise ValueError("ClipKLPPO needs `clip_range` (e.g. 0.2): for a KL penalty without clipping use KLPPO.")
        super().__init__(
            policy,
            env,
            learning_rate=learning_rate,
            n_steps=n_steps,
            batch_size=batch_size,
            n_epochs=n_epochs,
            gamma=gamma,
            gae_lambda=gae_lambda,
            clip_range=clip_range,
            clip_range_vf=clip_range_vf,
            normalize_advantage=normalize_advantage,
            ent_coef=ent_coef,
            vf_coef=vf_coef,
            max_grad_norm=max_grad_norm,
            use_sde=use_sde,
            sde_sample_freq=sde_sample_freq,
            rollout_buffer_class=rollout_buffer_class,
            rollout_buffer_kwargs=rollout_buffer_kwargs,
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
            kl_stop_factor=kl_stop_factor,
            kl_saturation_stop_factor=kl_saturation_stop_factor,
            kl_hinge_coef=kl_hinge_coef,
            kl_hinge_factor=kl_hinge_factor,
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
            stats_window_size=stats_window_size,
            tensorboard_log=tensorboard_log,
            policy_kwargs=policy_kwargs,
            verbose=verbose,
            seed=seed,
            device=device,
            _init_setup_model=_init_setup_model,
        )

    def learn(
        self: SelfClipKLPPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "ClipKLPPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfClipKLPPO:
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
        )
