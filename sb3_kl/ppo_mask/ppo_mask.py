from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib import MaskablePPO
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.vec_env import VecEnv

from sb3_kl.common.learning_rate import DEFAULT_LR_BOUNDS
from sb3_kl.common.controllers import KLController
from sb3_kl.common.maskable.buffers import MaskableKLBufferMixin, MaskableKLDictRolloutBuffer, MaskableKLRolloutBuffer
from sb3_kl.common.reference import ReferenceSource
from sb3_kl.klppo.klppo import KLPPO
from sb3_kl.ppo_mask.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

SelfMaskableKLPPO = TypeVar("SelfMaskableKLPPO", bound="MaskableKLPPO")


class _MaskableOnPolicy(OnPolicyAlgorithm):
    """
    What :class:`MaskableKLPPO` takes from sb3-contrib's ``MaskablePPO`` as it is: the rollout collection (the masks
    of every step read from the env, passed to the policy and stored in the buffer) and its model set-up (maskable
    policies take no ``use_sde``; the clip schedules are KLPPO's). It comes after ``KLOnPolicyAlgorithm`` in the
    method resolution order, so the KL bookkeeping (NaN checks, policy version of the buffer) wraps the collection.
    """

    collect_rollouts = MaskablePPO.collect_rollouts  # type: ignore[assignment]

    def _setup_model(self) -> None:
        self._setup_lr_schedule()
        self.set_random_seed(self.seed)
        self.policy = self.policy_class(  # type: ignore[assignment]
            self.observation_space,
            self.action_space,
            self.lr_schedule,
            **self.policy_kwargs,
        )
        self.policy = self.policy.to(self.device)
        if not isinstance(self.policy, MaskableActorCriticPolicy):
            raise ValueError(
                f"Policy must subclass MaskableActorCriticPolicy, got {type(self.policy).__name__}: use 'MlpPolicy', "
                "'CnnPolicy' or 'MultiInputPolicy' (sb3-contrib's maskable policies)."
            )
        self.rollout_buffer = self.rollout_buffer_class(  # type: ignore[misc]
            self.n_steps,
            self.observation_space,
            self.action_space,
            self.device,
            gamma=self.gamma,
            gae_lambda=self.gae_lambda,
            n_envs=self.n_envs,
            **self.rollout_buffer_kwargs,
        )


class MaskableKLPPO(KLPPO, _MaskableOnPolicy):
    """
    PPO with an adaptive KL penalty and invalid-action masking: :class:`~sb3_kl.KLPPO`'s update on sb3-contrib's
    ``MaskablePPO`` (a drop-in for it: same arguments, policies, ``predict(..., action_masks=)``,
    ``learn(..., use_masking=True)``, ``ActionMasker`` envs).

    The KL (in the loss, after each update and to a reference policy) is between the *masked* distributions: invalid
    actions have probability 0 under both policies, so the KL is taken over the valid ones. Each state's masks are
    stored in the rollout buffer and applied to the rollout policy, the updated policy and the reference alike.
    As in ``KLPPO``, ``clip_range`` defaults to None (the KL penalty alone controls the step) and ``target_kl`` is
    the controller's target, not an early-stopping threshold (``kl_stop_factor`` is).

    Paper: https://arxiv.org/abs/1707.06347 (section 4); invalid action masking: https://arxiv.org/abs/2006.14171

    :param policy: The policy model to use (MlpPolicy, CnnPolicy, MultiInputPolicy: sb3-contrib's maskable policies)
    :param env: The environment to learn from (if registered in Gym, can be str); it must expose ``action_masks()``
        (e.g. through sb3-contrib's ``ActionMasker``) unless ``learn(use_masking=False)``
    :param learning_rate: The learning rate, it can be a function of the current progress remaining (from 1 to 0).
        ``"auto"`` (or ``"auto_<start>"``, e.g. ``"auto_1e-3"``; ``"auto"`` starts at 3e-4) adapts it from the exact
        KL so that each update's KL is ``target_kl``: the rate sets the first epoch's KL, beta the update's, and a step
        scale lands an update outside [0.5, 2] x target in the band (docs: "learning_rate='auto'"). The adapted rate
        is saved with the model
    :param n_steps: The number of steps to run for each environment per update
    :param batch_size: Minibatch size; None: the whole rollout as one minibatch (as in MaskablePPO)
    :param n_epochs: Number of epoch when optimizing the surrogate loss
    :param gamma: Discount factor
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param clip_range: Ratio clipping parameter (number or schedule). ``None`` (default): no ratio clipping
    :param clip_range_vf: Clipping parameter for the value function (as in PPO); None = no clipping
    :param normalize_advantage: Whether to normalize or not the advantage
    :param ent_coef: Entropy coefficient for the loss calculation
    :param vf_coef: Value function coefficient for the loss calculation
    :param max_grad_norm: The maximum value for the gradient clipping
    :param rollout_buffer_class: Rollout buffer class to use; must subclass ``MaskableKLRolloutBuffer`` (or its Dict
        variant). If ``None``, it will be automatically selected.
    :param rollout_buffer_kwargs: Keyword arguments to pass to the rollout buffer on creation
    :param target_kl: Target KL of each update for the coefficient controller (number or schedule); None: 0.02
    :param kl_coef: Initial KL coefficient beta
    :param kl_controller: ``"adaptive"``, ``"fixed"``, ``"proportional"`` or a ``KLController`` instance
    :param kl_adapt_factor: Adaptive controller: beta is multiplied/divided by this factor (> 1)
    :param kl_band: Adaptive controller: beta grows when KL > band[1] * target, shrinks when KL < band[0] * target
    :param kl_coef_bounds: Bounds (min, max) of beta
    :param kl_window: Adaptive controller: number of recent update KLs averaged (1 = last update)
    :param kl_horizon: Proportional controller: horizon in environment steps
    :param kl_estimator: ``"analytic"`` (exact, default), ``"k1"`` or ``"k3"`` (sample estimators)
    :param kl_direction: ``"forward"`` = KL(old||new) (default) or ``"reverse"`` = KL(new||old)
    :param kl_reduction: ``"sum"`` (joint KL, default) or ``"mean"`` over action dimensions
    :param log_ratio_clip: Log-ratios are clamped to +/- this value before exponentiation (the sample estimators that
        exponentiate them, k3 and the reverse direction, are evaluated at the clamped value; forward k1 is never clamped),
        and without ratio clipping (``clip_range=None``) the surrogate's ratio; with clipping it is PPO's
    :param kl_stop_factor: Skip the remaining epochs once an epoch's KL exceeds ``kl_stop_factor * target_kl``
        (None, the default, as in KLPPO: no early stop)
    :param kl_saturation_stop_factor: While beta sits at the upper end of ``kl_coef_bounds``, the update ends before
        the first optimizer step whose minibatch KL (exact, of the policy as it acts, before the step) exceeds
        ``kl_saturation_stop_factor * target_kl`` (default 1.5, as in KLPPO; None: never)
    :param kl_hinge_coef: Coefficient of a quadratic hinge on the minibatch KL above ``kl_hinge_factor * target_kl``
    :param kl_hinge_factor: Where the hinge starts, as a multiple of the target
    :param min_std: Variance floor of Gaussian policies; masked policies are discrete, so it must stay None
        (accepted for the same signature as KLPPO, refused otherwise)
    :param kl_quantiles: Quantiles of the per-state KL logged after each update (as ``train/kl_p<q>``; with a
        sample ``kl_estimator``, quantiles of the one-action estimates, of which only the mean estimates the KL)
    :param ref_policy: Reference policy to anchor to: the path of a saved ``MaskablePPO``/``MaskableKLPPO`` model, such
        a model or its ``MaskableActorCriticPolicy`` (the reference is masked with the same masks). None: no anchor
    :param ref_kl_coef: Coefficient beta_ref of the reference KL (fixed, or initial value with ``ref_target_kl``)
    :param ref_target_kl: Target of the mean reference KL for an adaptive beta_ref; None = fixed ``ref_kl_coef``
    :param ref_kl_controller: Rule adapting beta_ref (same choices as ``kl_controller``)
    :param ref_kl_coef_bounds: Bounds (min, max) of beta_ref
    :param ref_kl_direction: ``"reverse"`` = KL(pi || pi_ref) (default) or ``"forward"`` = KL(pi_ref || pi)
    :param ref_kl_estimator: ``"analytic"`` (default), ``"k1"`` or ``"k3"``
    :param lr_bounds: ``(min, max)`` of the learning rate with ``learning_rate="auto"``, default ``(1e-6, 0.1)``
    :param stats_window_size: Window size for the rollout logging, specifying the number of episodes to average
        the reported success rate, mean episode length, and mean reward over
    :param tensorboard_log: the log location for tensorboard (if None, no logging)
    :param policy_kwargs: additional arguments to be passed to the policy on creation
    :param verbose: Verbosity level: 0 for no output, 1 for info messages, 2 for debug messages
    :param seed: Seed for the pseudo random generators
    :param device: Device (cpu, cuda, ...) on which the code should be run.
    :param _init_setup_model: Whether or not to build the network at the creation of the instance
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpPolicy": MlpPolicy,
        "CnnPolicy": CnnPolicy,
        "MultiInputPolicy": MultiInputPolicy,
    }
    policy_base: ClassVar[type[BasePolicy]] = MaskableActorCriticPolicy
    _supported_action_spaces: ClassVar[tuple[type[spaces.Space], ...]] = (
        spaces.Discrete,
        spaces.MultiDiscrete,
        spaces.MultiBinary,
    )
    policy: MaskableActorCriticPolicy  # type: ignore[assignment]
    rollout_buffer: MaskableKLRolloutBuffer | MaskableKLDictRolloutBuffer  # type: ignore[assignment]

    def __init__(
        self,
        policy: str | type[MaskableActorCriticPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule | str = 3e-4,
        n_steps: int = 2048,
        batch_size: int | None = 64,
        n_epochs: int = 10,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        clip_range: float | Schedule | None = None,
        clip_range_vf: float | Schedule | None = None,
        normalize_advantage: bool = True,
        ent_coef: float = 0.0,
        vf_coef: float = 0.5,
        max_grad_norm: float = 0.5,
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
        if batch_size is None:
            # MaskablePPO's ``get(None)``: the whole rollout as one minibatch
            n_envs = env.num_envs if isinstance(env, VecEnv) else 1
            batch_size = n_steps * n_envs if isinstance(n_steps, int) else n_steps
        super().__init__(
            policy,
            env,
            learning_rate=learning_rate,
            n_steps=n_steps,
            batch_size=batch_size,  # type: ignore[arg-type]
            n_epochs=n_epochs,
            gamma=gamma,
            gae_lambda=gae_lambda,
            clip_range=clip_range,
            clip_range_vf=clip_range_vf,
            normalize_advantage=normalize_advantage,
            ent_coef=ent_coef,
            vf_coef=vf_coef,
            max_grad_norm=max_grad_norm,
            use_sde=False,
            sde_sample_freq=-1,
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

    def _setup_model(self) -> None:
        if self.rollout_buffer_class is None:
            dict_obs = isinstance(self.observation_space, spaces.Dict)
            self.rollout_buffer_class = MaskableKLDictRolloutBuffer if dict_obs else MaskableKLRolloutBuffer
        elif not issubclass(self.rollout_buffer_class, MaskableKLBufferMixin):
            raise TypeError(
                f"`rollout_buffer_class`={self.rollout_buffer_class.__name__} does not store both the action masks and "
                "the rollout policy's distribution: pass a subclass of sb3_kl.common.maskable.buffers."
                "MaskableKLRolloutBuffer (or MaskableKLDictRolloutBuffer)."
            )
        super()._setup_model()
        if self.ref_policy is not None and not isinstance(self.ref_policy, MaskableActorCriticPolicy):
            raise ValueError(
                f"`ref_policy` has a {type(self.ref_policy).__name__}, whose action distribution cannot be masked: the KL "
                "to it would count the invalid actions it favours. Pass a MaskablePPO or MaskableKLPPO model (or its "
                "saved zip or MaskableActorCriticPolicy) as the reference."
            )

    def learn(  # type: ignore[override]
        self: SelfMaskableKLPPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "MaskableKLPPO",
        reset_num_timesteps: bool = True,
        use_masking: bool = True,
        progress_bar: bool = False,
    ) -> SelfMaskableKLPPO:
        """
        MaskablePPO's learning loop: ``use_masking=False`` collects rollouts without masks (all actions valid).
        See ``BaseAlgorithm.learn`` for the other arguments.
        """
        return MaskablePPO.learn(  # type: ignore[arg-type,return-value]
            self,  # type: ignore[arg-type]
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            use_masking=use_masking,
            progress_bar=progress_bar,
        )

    def predict(  # type: ignore[override]
        self,
        observation: np.ndarray | dict[str, np.ndarray],
        state: tuple[np.ndarray, ...] | None = None,
        episode_start: np.ndarray | None = None,
        deterministic: bool = False,
        action_masks: np.ndarray | None = None,
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
        """
        The policy's action for an observation, restricted to the valid actions when ``action_masks`` is given
        (e.g. ``sb3_contrib.common.maskable.utils.get_action_masks(env)``).

        :param observation: the input observation
        :param state: unused (recurrent policies only)
        :param episode_start: unused (recurrent policies only)
        :param deterministic: Whether or not to return deterministic actions.
        :param action_masks: Valid actions of the observation(s)
        :return: the model's action and the next hidden state (None)
        """
        return self.policy.predict(observation, state, episode_start, deterministic, action_masks=action_masks)
