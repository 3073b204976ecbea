import math
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib import RecurrentPPO
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy
from sb3_contrib.common.recurrent.type_aliases import RNNStates
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.policies import BaseModel, BasePolicy
from stable_baselines3.common.type_aliases import GymEnv, MaybeCallback, Schedule
from stable_baselines3.common.utils import explained_variance
from stable_baselines3.common.vec_env import VecEnv

from sb3_kl.common.learning_rate import DEFAULT_LR_BOUNDS
from sb3_kl.common.controllers import KLController
from sb3_kl.common.host_sync import DeviceLog, without_distribution_validation
from sb3_kl.common.kl import as_float64, attach_sde_features, per_state_kl
from sb3_kl.common.modes import (
    has_mode_dependent_modules,
    has_running_statistics,
    kept_running_statistics,
    restore_running_statistics,
    save_running_statistics,
)
from sb3_kl.common.on_policy_algorithm import KLOnPolicyAlgorithm
from sb3_kl.common.recurrent import (
    SequenceEvaluation,
    evaluate_sequences,
    is_recurrent_policy,
    restored_lstm_states,
    zero_lstm_states,
)
from sb3_kl.common.recurrent_buffers import (
    RecurrentKLBufferMixin,
    RecurrentKLDictRolloutBuffer,
    RecurrentKLRolloutBuffer,
    RecurrentKLRolloutBufferSamples,
)
from sb3_kl.common.reference import ReferenceSource
from sb3_kl.common.validation import check_bool, check_finite, check_int, check_non_negative, check_positive, check_schedule
from sb3_kl.klppo.klppo import KLPPO
from sb3_kl.ppo_recurrent.policies import CnnLstmPolicy, MlpLstmPolicy, MultiInputLstmPolicy

SelfRecurrentKLPPO = TypeVar("SelfRecurrentKLPPO", bound="RecurrentKLPPO")


class RecurrentKLPPO(KLOnPolicyAlgorithm, RecurrentPPO):
    """
    Recurrent Proximal Policy Optimization with an adaptive KL penalty: KLPPO for LSTM policies, a drop-in for
    sb3-contrib's ``RecurrentPPO`` (a subclass of it: same rollout collection, policies, ``predict(obs, state,
    episode_start)``).

    Loss per minibatch (RecurrentPPO's padded sequence minibatches; padding is masked out of every mean):
    ``-E[r A] + beta * KL + vf_coef * L_V - ent_coef * H``, as :class:`~sb3_kl.KLPPO`'s, whose loss pieces it shares.
    The KL is between *sequence-evaluated* distributions: the rollout policy's parameters at every stored step are
    computed once per update by re-running its LSTM over each env's whole rollout in time order, from the state stored
    at the env's first step (episode starts resetting it), and stored in the buffer; the KL measured after the update
    (``train/kl``, quantiles), which drives beta, re-runs the updated policy the same way
    (:mod:`sb3_kl.common.recurrent`). A recurrent ``ref_policy`` is re-run over the same sequences, its LSTM state
    carried from one rollout to the next as if it had acted alongside. With gSDE the KL terms are differentiated
    through the LSTM features the action std is built from (:func:`~sb3_kl.common.kl.attach_sde_features`).

    Two defaults differ from ``RecurrentPPO`` as in ``KLPPO``: ``clip_range=None`` (no ratio clipping; pass 0.2 to clip
    as well) and ``target_kl`` is the controller's target (``None``: 0.02 discrete, 0.03 ``Box``), not an early stop.

    Paper: https://arxiv.org/abs/1707.06347 (section 4, "Adaptive KL Penalty Coefficient")
    Code: rollouts and minibatches are sb3-contrib's RecurrentPPO's (https://github.com/Stable-Baselines-Team/stable-baselines3-contrib)

    :param policy: The policy model to use (MlpLstmPolicy, CnnLstmPolicy, MultiInputLstmPolicy)
    :param env: The environment to learn from (if registered in Gym, can be str)
    :param learning_rate: The learning rate, it can be a function of the current progress remaining (from 1 to 0).
        ``"auto"`` (or ``"auto_<start>"``, e.g. ``"auto_1e-3"``; ``"auto"`` starts at 3e-4) adapts it from the exact
        KL so that each update's KL is ``target_kl``: the rate sets the first epoch's KL, beta the update's, and a step
        scale lands an update outside [0.5, 2] x target in the band (docs: "learning_rate='auto'"). The adapted rate
        is saved with the model
    :param n_steps: The number of steps to run for each environment per update
        (i.e. batch size is n_steps * n_env where n_env is number of environment copies running in parallel)
    :param batch_size: Minibatch size (None: the whole buffer)
    :param n_epochs: Number of epoch when optimizing the surrogate loss
    :param gamma: Discount factor
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param clip_range: Ratio clipping parameter (number or schedule). ``None`` (default): no ratio clipping,
        the KL penalty alone controls the step; a value adds PPO's clipped surrogate as well
    :param clip_range_vf: Clipping parameter for the value function (as in RecurrentPPO); None = no clipping
    :param normalize_advantage: Whether to normalize or not the advantage
    :param ent_coef: Entropy coefficient for the loss calculation
    :param vf_coef: Value function coefficient for the loss calculation
    :param max_grad_norm: The maximum value for the gradient clipping
    :param use_sde: Whether to use generalized State Dependent Exploration (gSDE)
    :param sde_sample_freq: Sample a new noise matrix every n steps when using gSDE (-1: once per rollout)
    :param target_kl: Target KL of each update for the coefficient controller (number or schedule of progress
        remaining). ``None``: 0.02 for discrete action spaces, 0.03 for ``Box``. Not an early-stopping threshold; see
        ``kl_stop_factor`` for that
    :param kl_coef: Initial KL coefficient beta
    :param kl_controller: ``"adaptive"`` (default), ``"fixed"``, ``"proportional"`` or a ``KLController`` instance
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
    :param kl_stop_factor: When set, the remaining epochs are skipped once the KL of the states seen in an epoch
        exceeds ``kl_stop_factor * target_kl`` (judged once per epoch)
    :param kl_saturation_stop_factor: While beta sits at the upper end of ``kl_coef_bounds`` (an adapting controller
        that cannot raise it further), the update ends before the first optimizer step whose minibatch KL (exact, of the
        policy as it acts, before the step) exceeds ``kl_saturation_stop_factor * target_kl`` and beta is held
        there, as in KLPPO. Default 1.5; None: never
    :param kl_hinge_coef: Coefficient of a quadratic hinge on the minibatch KL above ``kl_hinge_factor * target_kl``
        (1000 by default, as KLPPO: it holds the KL of a minibatch within the update); 0 disables it
    :param kl_hinge_factor: Where the hinge starts, as a multiple of the target
    :param min_std: Variance floor for Gaussian policies: after every optimizer step std >= min_std. None = no floor
    :param kl_quantiles: Quantiles of the per-state KL logged after each update (as ``train/kl_p<q>``; with a
        sample ``kl_estimator``, quantiles of the one-action estimates, of which only the mean estimates the KL)
    :param ref_policy: Reference policy to anchor to: the path of a saved SB3 model, a model or a policy, recurrent
        (e.g. a ``RecurrentPPO``) or feed-forward. A frozen copy is kept as ``model.ref_policy`` and saved with the
        model. None (default): no anchor
    :param ref_kl_coef: Coefficient beta_ref of the reference KL (fixed when ``ref_target_kl`` is None, else its
        initial value; 0 with ``ref_target_kl=None`` only measures and logs the KL to the reference)
    :param ref_target_kl: Target of the mean reference KL; None (default): fixed beta_ref
    :param ref_kl_controller: Rule adapting beta_ref (same choices as ``kl_controller``)
    :param ref_kl_coef_bounds: Bounds (min, max) of beta_ref
    :param ref_kl_direction: ``"reverse"`` = KL(pi || pi_ref) (default) or ``"forward"`` = KL(pi_ref || pi)
    :param ref_kl_estimator: ``"analytic"`` (default), ``"k1"`` or ``"k3"``
    :param lr_bounds: ``(min, max)`` of the learning rate with ``learning_rate="auto"``, default ``(1e-6, 0.1)``
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
        "MlpLstmPolicy": MlpLstmPolicy,
        "CnnLstmPolicy": CnnLstmPolicy,
        "MultiInputLstmPolicy": MultiInputLstmPolicy,
    }
    rollout_buffer: RecurrentKLRolloutBuffer | RecurrentKLDictRolloutBuffer  # type: ignore[assignment]
    policy: RecurrentActorCriticPolicy

    # KLPPO's loss pieces, shared (not copied): surrogate with optional clip, beta * KL (+ hinge), value loss,
    # guarded optimizer step with the variance floor, gradient ratio, per-epoch early stop
    _surrogate_loss = KLPPO._surrogate_loss
    _kl_penalty = KLPPO._kl_penalty
    _value_loss = staticmethod(KLPPO._value_loss)
    _optimizer_step = KLPPO._optimizer_step
    _gradient_ratio = KLPPO._gradient_ratio
    _kl_ran_away = KLPPO._kl_ran_away
    _saturation_stop_kl = KLPPO._saturation_stop_kl
    _minibatch_kl_ran_away = KLPPO._minibatch_kl_ran_away
    _judged_minibatch_kl = KLPPO._judged_minibatch_kl
    _epoch_stop_kl = KLPPO._epoch_stop_kl
    _stops_at_bound = KLPPO._stops_at_bound
    #: The early stop judges KLPPO's documented rule: the mean of the epoch's minibatch KLs (see ``KLPPO._kl_ran_away``)
    _kl_stop_judge: ClassVar[str] = "minibatch_mean"
    supports_auto_learning_rate: ClassVar[bool] = True

    def __init__(
        self,
        policy: str | type[RecurrentActorCriticPolicy],
        env: GymEnv | str,
        learning_rate: float | Schedule | str = 3e-4,
        n_steps: int = 128,
        batch_size: int | None = 128,
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
            stats_window_size=stats_window_size,
            tensorboard_log=tensorboard_log,
            policy_kwargs=policy_kwargs,
            verbose=verbose,
            seed=seed,
            device=device,
            _init_setup_model=False,
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
        # The checks KLPPO makes (RecurrentPPO makes none of them)
        check_int("n_steps", n_steps, 1)  # RecurrentPPO takes 0 and fails in its first rollout, naming nothing
        check_bool("normalize_advantage", normalize_advantage)
        if batch_size is not None:
            check_int("batch_size", batch_size, 1)
        check_int("n_epochs", n_epochs, 1)
        check_finite("ent_coef", ent_coef)
        check_non_negative("vf_coef", vf_coef)
        check_positive("max_grad_norm", max_grad_norm, allow_inf=True, hint=" (inf: no gradient clipping)")
        if clip_range is not None:
            try:
                check_schedule("clip_range", clip_range, allow_zero_at_end=True)
            except ValueError as error:
                raise ValueError(f"{error} Pass a positive clip_range, or None to disable ratio clipping.") from None
        check_positive("kl_stop_factor", kl_stop_factor, allow_none=True, hint=" or None (no early stop)")
        check_positive(
            "kl_saturation_stop_factor", kl_saturation_stop_factor, allow_none=True, hint=" or None (no stop at the bound)"
        )
        check_non_negative("kl_hinge_coef", kl_hinge_coef, hint=" (0 disables the hinge)")
        check_positive("kl_hinge_factor", kl_hinge_factor)
        self.kl_stop_factor = kl_stop_factor
        self.kl_saturation_stop_factor = kl_saturation_stop_factor
        self.kl_hinge_coef = float(kl_hinge_coef)
        self.kl_hinge_factor = float(kl_hinge_factor)
        # LSTM state of a recurrent reference at the end of the last rollout (carried like ``_last_lstm_states``)
        self._last_ref_lstm_states: tuple[th.Tensor, th.Tensor] | None = None
        self._update_evaluation: SequenceEvaluation | None = None

        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        if self.rollout_buffer_class is None:
            self.rollout_buffer_class = (
                RecurrentKLDictRolloutBuffer if isinstance(self.observation_space, spaces.Dict) else RecurrentKLRolloutBuffer
            )
        elif not issubclass(self.rollout_buffer_class, RecurrentKLBufferMixin):
            raise TypeError(
                f"`rollout_buffer_class`={self.rollout_buffer_class.__name__} is not a recurrent KL buffer: pass a "
                "subclass of sb3_kl.common.recurrent_buffers.RecurrentKLRolloutBuffer (or its Dict variant)."
            )
        # RecurrentPPO's set-up (policy, LSTM states, buffer) wraps clip_range unconditionally: None (no clipping)
        # is held aside meanwhile
        clip_range = self.clip_range
        if clip_range is None:
            self.clip_range = 0.0
        # load(): the LSTM states saved with the model, which RecurrentPPO's set-up resets to zeros
        saved_states = self.__dict__.get("_last_lstm_states")
        try:
            super()._setup_model()
        finally:
            if clip_range is None:
                self.clip_range = None
        self._last_lstm_states = restored_lstm_states(saved_states, self._last_lstm_states, self.device)
        if self._last_ref_lstm_states is not None:
            self._last_ref_lstm_states = tuple(state.to(self.device) for state in self._last_ref_lstm_states)  # type: ignore[assignment]
        # RecurrentPPO builds its own buffer class: the same buffer with the KL fields instead
        stock = self.rollout_buffer
        self.rollout_buffer = self.rollout_buffer_class(  # type: ignore[call-arg]
            self.n_steps,
            self.observation_space,
            self.action_space,
            stock.hidden_state_shape,
            self.device,
            gamma=self.gamma,
            gae_lambda=self.gae_lambda,
            n_envs=self.n_envs,
        )

    def _check_reference_policy(self, policy: BasePolicy) -> None:
        """
        Any actor-critic reference is accepted, recurrent ones included: a recurrent reference's LSTM is re-run over
        the rollout's sequences (:meth:`_prepare_reference_distribution`). Overrides the feed-forward algorithms'
        refusal of recurrent references.
        """

    def save(self, *args: Any, **kwargs: Any) -> None:
        # the carried LSTM states go into the pickled data, which SB3 loads without a device map: saved on CPU, so that
        # a model trained on GPU loads on a machine without one (``_setup_model`` moves them to the model's device)
        states = self._last_lstm_states
        if states is not None:
            self._last_lstm_states = RNNStates(tuple(t.cpu() for t in states.pi), tuple(t.cpu() for t in states.vf))
        # saved within a rollout (e.g. by CheckpointCallback), the policy's state is that after the steps stored so far:
        # the reference's is saved after the same steps
        ref_states = self._last_ref_lstm_states
        saved_ref_states = self._reference_states_after_stored_steps()
        if saved_ref_states is not None:
            self._last_ref_lstm_states = tuple(t.cpu() for t in saved_ref_states)  # type: ignore[assignment]
        try:
            super().save(*args, **kwargs)
        finally:
            self._last_lstm_states, self._last_ref_lstm_states = states, ref_states

    def _excluded_save_params(self) -> list[str]:
        # The LSTM states at the end of the last rollout (the policy's and a recurrent reference's) are saved, unlike
        # RecurrentPPO's: a loaded model given the env in the same state (``force_reset=False``) continues the
        # training exactly, instead of acting its next steps from zero states
        saved = ("_last_lstm_states", "_last_ref_lstm_states")
        return [name for name in [*super()._excluded_save_params(), "_update_evaluation"] if name not in saved]

    # ----------------------------------------------------------------------------------------------------------
    # Rollouts

    def collect_rollouts(self, env: VecEnv, callback: BaseCallback, rollout_buffer: Any, n_rollout_steps: int) -> bool:
        """
        RecurrentPPO's collection. When ``learn()`` stops within the rollout (a callback returned False), its steps
        never reach ``train()``, but the policy carries its LSTM state on from the last stored one: a recurrent
        reference's carried state advances over the same steps.
        """
        continue_training = super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)
        if not continue_training:
            self._last_ref_lstm_states = self._reference_states_after_stored_steps()
            self.rollout_buffer.ref_states_steps = self.rollout_buffer.stored_steps
        return continue_training

    def _reference_start_states(self) -> tuple[th.Tensor, th.Tensor]:
        """A recurrent reference's LSTM state before the buffer's first step: carried from the previous rollout."""
        assert self.ref_policy is not None
        states = self._last_ref_lstm_states
        expected = zero_lstm_states(self.ref_policy, self.n_envs)
        if states is None or states[0].shape != expected[0].shape:
            return expected
        return states

    @th.no_grad()
    def _reference_states_after_stored_steps(self) -> tuple[th.Tensor, th.Tensor] | None:
        """
        The carried LSTM state of a recurrent reference once it has acted alongside the policy on the steps stored in
        the buffer so far (its current one when it has already advanced over them, or is not recurrent).
        """
        buffer = self.rollout_buffer
        if (
            self.ref_policy is None
            or not is_recurrent_policy(self.ref_policy)
            or buffer.ref_states_steps >= buffer.stored_steps
        ):
            return self._last_ref_lstm_states
        assert self.ref_dist_params is not None and buffer.ref_states_steps == 0
        evaluation = evaluate_sequences(
            self.ref_policy,
            buffer.sequences(with_actions=False, partial=True),
            self.ref_dist_params,
            lstm_states=self._reference_start_states(),
        )
        return evaluation.lstm_states

    # ----------------------------------------------------------------------------------------------------------
    # Before the update

    @th.no_grad()
    def _prepare_reference_distribution(self) -> None:
        """
        Evaluate the frozen reference on the rollout's sequences once per update and store it in the buffer. A
        recurrent reference's LSTM starts from its state at the end of the previous rollout (zeros at first; the
        episode starts reset it anyway), as if it had acted alongside the policy.
        """
        if self.ref_policy is None or self.rollout_buffer.ref_dist_params is not None:
            return
        assert self.ref_dist_params is not None
        sample_estimator = self.ref_kl_settings.estimator != "analytic"
        recurrent = is_recurrent_policy(self.ref_policy)
        evaluation = evaluate_sequences(
            self.ref_policy,
            self.rollout_buffer.sequences(with_actions=sample_estimator),
            self.ref_dist_params,
            lstm_states=self._reference_start_states() if recurrent else None,
            with_log_prob=sample_estimator,
        )
        self._last_ref_lstm_states = evaluation.lstm_states
        self.rollout_buffer.ref_states_steps = self.rollout_buffer.stored_steps
        self.rollout_buffer.store_reference(evaluation)

    # ----------------------------------------------------------------------------------------------------------
    # The loss

    def _sequence_distribution(
        self, observations: Any, lstm_states: tuple[th.Tensor, th.Tensor], episode_starts: th.Tensor
    ) -> Distribution:
        """
        The policy's ``get_distribution(obs, lstm_states, episode_starts)`` (the same modules in the same order), with
        the latent features kept so that, with gSDE, the KL terms are differentiated through the features the std is
        built from (:func:`~sb3_kl.common.kl.attach_sde_features`).

        :return: the action distribution (with gradients)
        """
        policy = self.policy
        features = BaseModel.extract_features(policy, observations, policy.pi_features_extractor)
        latent_pi, _ = policy._process_sequence(features, lstm_states, episode_starts, policy.lstm_actor)
        latent_pi = policy.mlp_extractor.forward_actor(latent_pi)
        distribution = policy._get_action_dist_from_latent(latent_pi)
        attach_sde_features(distribution, latent_pi, getattr(policy, "log_std", None))
        return distribution

    def _acting_samples_distribution(self, rollout_data: RecurrentKLRolloutBufferSamples) -> Distribution:
        """
        :param rollout_data: A padded sequence minibatch
        :return: the policy's action distribution on its steps, from the minibatch's stored LSTM states
        """
        return self._sequence_distribution(rollout_data.observations, rollout_data.lstm_states.pi, rollout_data.episode_starts)

    def _valid_states(self, rollout_data: RecurrentKLRolloutBufferSamples) -> th.Tensor:
        """
        :param rollout_data: A padded sequence minibatch
        :return: its valid (unpadded) steps
        """
        return rollout_data.mask > 1e-8

    def _minibatch_loss(
        self,
        data: RecurrentKLRolloutBufferSamples,
        clip_range: float | None,
        clip_range_vf: float | None,
        kl_coef: float,
        ref_kl_coef: float,
        target_kl: float,
    ) -> dict[str, Any]:
        """
        KLPPO's loss on one padded sequence minibatch, every mean taken over its valid (unpadded) steps only.

        :return: the loss and its terms (tensors), the clip fraction, the mean KL and log-ratio of the valid steps
        """
        mask = self._valid_states(data)
        actions = self._actions_for_log_prob(data.actions)
        # The policy's own sequence evaluation from the minibatch's stored LSTM states (RecurrentPPO's minibatches)
        distribution = self._sequence_distribution(data.observations, data.lstm_states.pi, data.episode_starts)
        values = self.policy.predict_values(data.observations, data.lstm_states.vf, data.episode_starts).flatten()
        log_prob = distribution.log_prob(actions)
        with th.set_grad_enabled(self.ent_coef != 0):
            entropy = distribution.entropy()
        log_ratio = log_prob - data.old_log_prob
        kl_log_prob, kl_log_ratio = self._log_probs_for_kl(distribution, actions, log_prob, data.old_log_prob)
        kl = self._per_state_kl(data.old_dist_params, distribution, kl_log_ratio)[mask].mean()
        advantages = self._normalized_advantages(data.advantages[mask])
        policy_loss, clip_fraction = self._surrogate_loss(log_ratio[mask], advantages, clip_range)
        kl_loss = self._kl_penalty(kl, kl_coef, target_kl)
        value_loss = self._value_loss(values[mask], data.old_values[mask], data.returns[mask], clip_range_vf)
        entropy_loss = -th.mean(-log_prob[mask]) if entropy is None else -th.mean(entropy[mask])
        loss = policy_loss + kl_loss + self.vf_coef * value_loss
        if ref_kl_coef > 0:
            assert data.ref_dist_params is not None
            ref_kl = self._reference_kl(data.ref_dist_params, distribution, kl_log_prob, data.ref_log_prob, data.old_log_prob)[
                mask
            ].mean()
            loss = loss + ref_kl_coef * ref_kl
        if self.ent_coef != 0:
            loss = loss + self.ent_coef * entropy_loss
        return {
            "loss": loss,
            "policy_loss": policy_loss,
            "kl_loss": kl_loss,
            "value_loss": value_loss,
            "entropy_loss": entropy_loss,
            "clip_fraction": clip_fraction,
            "kl": kl,
            "log_ratio": log_ratio[mask],
            "distribution": distribution,
        }

    @without_distribution_validation
    def train(self) -> None:
        """
        Update policy using the currently gathered rollout buffer.
        """
        self._prepare_rollout_distribution()
        self._prepare_reference_distribution()
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        clip_range, clip_range_vf = self._current_clip_ranges()
        target_kl = self._current_target_kl()
        kl_coef = self.kl_coef
        ref_kl_coef = self.ref_kl_coef if self.ref_policy is not None else 0.0
        terms = (clip_range, clip_range_vf, kl_coef, ref_kl_coef, target_kl)

        # what is logged stays on the device until the update ends: no host synchronisation per minibatch
        logs = DeviceLog("entropy_loss", "policy_gradient_loss", "value_loss", "kl_loss", "approx_kl", "clip_fraction")
        n_samples = self.rollout_buffer.buffer_size * self.rollout_buffer.n_envs
        n_minibatches = math.ceil(n_samples / (self.batch_size or n_samples))
        applied_steps, minibatch_steps = th.zeros((), dtype=th.long, device=self.device), 0
        kl_grad_ratio = float("nan")
        early_stop_epoch = self.n_epochs
        loss = th.zeros(())
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
                out = self._minibatch_loss(rollout_data, *terms)  # type: ignore[arg-type]
                loss = out["loss"]
                with th.no_grad():
                    # SB3's approx_kl (k3 estimate of KL(old||new)) over the valid steps, as RecurrentPPO logs it
                    log_ratio = out["log_ratio"]
                    logs.add("approx_kl", th.mean(th.expm1(log_ratio) - log_ratio))
                    if self.kl_stop_factor is not None:
                        epoch_kl_sum += self._epoch_stop_kl(out["kl"], rollout_data, stop_in_acting_mode) * len(log_ratio)
                        epoch_states += len(log_ratio)
                logs.add("policy_gradient_loss", out["policy_loss"])
                logs.add("value_loss", out["value_loss"])
                logs.add("entropy_loss", out["entropy_loss"])
                logs.add("kl_loss", out["kl_loss"])
                if out["clip_fraction"] is not None:
                    logs.add("clip_fraction", out["clip_fraction"])
                if saturation_stop_kl is not None and self._stops_at_bound(
                    out["kl"], rollout_data, out["distribution"], saturation_stop_kl, epoch
                ):
                    restore_running_statistics(statistics)
                    stopped_at_bound = True
                    break
                if epoch == self.n_epochs - 1 and batch_idx == n_minibatches - 1:
                    kl_grad_ratio = self._gradient_ratio(out["kl_loss"], out["policy_loss"])
                # a boolean tensor, False for a non-finite loss or gradient (the step is skipped)
                applied_steps += self._optimizer_step(loss)
                minibatch_steps += 1

            self._n_updates += 1
            self._measure_first_epoch_kl(epoch)  # learning_rate="auto" sets the next rate from it
            if stopped_at_bound or self._kl_ran_away(epoch_kl_sum, epoch_states, target_kl, epoch):
                early_stop_epoch = epoch + 1
                if stopped_at_bound or epoch < self.n_epochs - 1:
                    # the gradient ratio on the last minibatch seen, with the final parameters (running statistics
                    # restored after this train-mode pass, which must leave the policy as the last step left it)
                    with kept_running_statistics(self.policy):
                        out = self._minibatch_loss(rollout_data, *terms)  # type: ignore[arg-type]
                        kl_grad_ratio = self._gradient_ratio(out["kl_loss"], out["policy_loss"])
                break

        self._count_nonfinite_steps(applied_steps, minibatch_steps)

        per_state, new_params = self._measure_final_update_kl(target_kl)
        self._finish_update()
        explained_var = explained_variance(self.rollout_buffer.values.flatten(), self.rollout_buffer.returns.flatten())

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
        self._update_evaluation = None

    # ----------------------------------------------------------------------------------------------------------
    # After the update: the KL between sequence-evaluated distributions

    @th.no_grad()
    def _measure_update_kl(self, chunk_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """
        The updated policy re-run over each env's sequence (eval mode, as it will act) against the rollout policy's
        stored parameters.

        :return: the per-state KL in the algorithm's convention (float64) and the updated policy's distribution
            parameters, both in the buffer's flat env-major order
        """
        buffer = self.rollout_buffer
        need_log_prob = self.kl_settings.estimator != "analytic" or (
            self.ref_policy is not None and self.ref_kl_settings.estimator != "analytic"
        )
        evaluation = evaluate_sequences(
            self.policy, buffer.sequences(with_actions=need_log_prob), self.dist_params, with_log_prob=need_log_prob
        )
        self._update_evaluation = evaluation  # reused by the reference measurement
        new_params = evaluation.params.reshape(-1, evaluation.params.shape[-1])
        old_params = th.as_tensor(buffer.old_dist_params, device=new_params.device)
        log_ratio = None
        if evaluation.log_prob is not None:
            log_ratio = evaluation.log_prob.reshape(-1) - th.as_tensor(self._flat_old_log_prob(), device=new_params.device)
        per_state = per_state_kl(self.kl_settings, self.dist_params, *as_float64(old_params, new_params, log_ratio))
        return per_state.cpu().numpy(), new_params.cpu().numpy()

    def _flat_old_log_prob(self) -> np.ndarray:
        """The rollout's log-probabilities in get()'s env-major order, whether or not get() flattened the buffer."""
        buffer = self.rollout_buffer
        if buffer.generator_ready:
            return buffer.log_probs.reshape(-1)
        return buffer.log_probs.swapaxes(0, 1).reshape(-1)

    @th.no_grad()
    def _measure_reference_kl(self, chunk_size: int = 4096) -> np.ndarray:
        """
        :return: the per-state KL between the updated policy and the reference, both on the rollout's sequences
            (float64)
        """
        buffer = self.rollout_buffer
        evaluation = self._update_evaluation
        if evaluation is None:
            sample_estimator = self.ref_kl_settings.estimator != "analytic"
            evaluation = evaluate_sequences(
                self.policy,
                buffer.sequences(with_actions=sample_estimator),
                self.dist_params,
                with_log_prob=sample_estimator,
            )
        assert buffer.ref_dist_params is not None
        device = evaluation.params.device
        new_params = evaluation.params.reshape(-1, evaluation.params.shape[-1])
        log_prob = None if evaluation.log_prob is None else evaluation.log_prob.reshape(-1)
        ref_params = th.as_tensor(buffer.ref_dist_params, device=device)
        ref_log_prob = None if buffer.ref_log_prob is None else th.as_tensor(buffer.ref_log_prob, device=device)
        old_log_prob = th.as_tensor(self._flat_old_log_prob(), device=device) if log_prob is not None else None
        return self._reference_kl(*as_float64(ref_params, new_params, log_prob, ref_log_prob, old_log_prob)).cpu().numpy()

    def learn(
        self: SelfRecurrentKLPPO,
        total_timesteps: int,
        callback: MaybeCallback = None,
        log_interval: int = 1,
        tb_log_name: str = "RecurrentKLPPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> SelfRecurrentKLPPO:
        return super().learn(
            total_timesteps=total_timesteps,
            callback=callback,
            log_interval=log_interval,
            tb_log_name=tb_log_name,
            reset_num_timesteps=reset_num_timesteps,
            progress_bar=progress_bar,
        )
