"""
KLMonitorCallback: the exact per-state KL of every update of an SB3 on-policy agent, and the base of the callbacks
that act on it. Public names are re-exported by :mod:`sb3_kl.callbacks` (see its docstring for the timing).
"""

import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.logger import TensorBoardOutputFormat
from stable_baselines3.common.vec_env import unwrap_vec_normalize

from sb3_kl.common.keywords import SuggestsKeywords
from sb3_kl.common.kl import (
    KL_DIRECTIONS,
    KL_ESTIMATORS,
    KL_REDUCTIONS,
    BernoulliParams,
    CategoricalParams,
    DistributionParams,
    actions_for_log_prob,
    as_float64,
    GaussianParams,
    KLSettings,
    MultiCategoricalParams,
    kl_quantiles,
    make_distribution_params,
    per_state_kl,
    quantile_name,
    sb3_contrib_kl_reduction,
)
from sb3_kl.common.modes import acting_mode
from sb3_kl.common.normalization import RolloutNormalization, rollout_normalization
from sb3_kl.common.policy_copy import build_reference_policy, reference_spec
from sb3_kl.common.recurrent import RolloutSequences, evaluate_sequences, is_recurrent_policy, step_major
from sb3_kl.common.user_warnings import warn_at_user_frame
from sb3_kl.common.validation import check_bool, check_choice, check_int, check_path, check_quantiles

try:  # sb3-contrib is optional: only needed to recognise MaskablePPO's distributions
    from sb3_contrib.common.maskable.distributions import (
        MaskableBernoulliDistribution,
        MaskableCategoricalDistribution,
        MaskableMultiCategoricalDistribution,
    )
except ImportError:  # pragma: no cover
    MaskableBernoulliDistribution = MaskableCategoricalDistribution = MaskableMultiCategoricalDistribution = None  # type: ignore[assignment,misc]

#: Keys every ``KLMonitorCallback.history`` record has (besides the quantiles, named ``p50``, ``p90``, ...)
HISTORY_KEYS = (
    "update",
    "num_timesteps",
    "n_updates",
    "mean",
    "max",
    "min",
    "tail_ratio",
    "entropy",
    "target_convention",
    "mean_in_target_convention",
)

# Logger formats that must not receive the per-state KL histogram (a tensor)
_HISTOGRAM_EXCLUDE = ("stdout", "log", "json", "csv")


class _MaskableMultiCategoricalParams(MultiCategoricalParams):
    """MultiCategorical layout for sb3-contrib's maskable distribution, which keeps its categoricals in ``distributions``."""

    def extract(self, distribution: Distribution) -> th.Tensor:
        return th.cat([categorical.logits for categorical in distribution.distributions], dim=-1)  # type: ignore[attr-defined]


def distribution_params_for_policy(action_dist: Distribution) -> DistributionParams:
    """
    The KL core's parameter layout for a policy's action distribution, including sb3-contrib's maskable ones
    (masked logits are ``-1e8``, so masked actions have probability 0 in both policies and add nothing to the KL).

    :param action_dist: The policy's ``action_dist``
    :return: the matching :class:`~sb3_kl.common.kl.DistributionParams`
    """
    if MaskableCategoricalDistribution is not None:
        if isinstance(action_dist, MaskableBernoulliDistribution):
            return _MaskableMultiCategoricalParams(list(action_dist.action_dims))
        if isinstance(action_dist, MaskableMultiCategoricalDistribution):
            return _MaskableMultiCategoricalParams(list(action_dist.action_dims))
        if isinstance(action_dist, MaskableCategoricalDistribution):
            return CategoricalParams(action_dist.action_dim)
    return make_distribution_params(action_dist)


def model_target_kl(model: Any) -> float | None:
    """
    The KL target an algorithm currently uses, if it has one: sb3_kl algorithms (``_current_target_kl()``, None for
    TRPL bounding a W2 or Frobenius distance), stock PPO/TRPO with a number or schedule as ``target_kl``; otherwise None.
    """
    if hasattr(model, "_current_target_kl"):
        target = model._current_target_kl()
        return None if target is None else float(target)
    target = getattr(model, "target_kl", None)
    if target is None:
        return None
    if callable(target):
        target = target(model._current_progress_remaining)
    if isinstance(target, (int, float, np.floating)) and not isinstance(target, bool):
        return float(target)
    return None


def is_trust_region_family(model: Any) -> bool:
    """Whether an algorithm is of the TRPO family (sb3-contrib's ``TRPO``, KLTRPO): it has ``cg_max_steps``."""
    return hasattr(model, "cg_max_steps")


def target_kl_settings(model: Any) -> KLSettings:
    """
    The KL convention in which an algorithm's KL target is stated (:func:`model_target_kl`; without one, the family
    default the alarms use, :func:`~sb3_kl.common.callbacks_alarm.family_default_target_kl`), so that a KL measured in
    another convention is never compared with it:

    - sb3_kl algorithms: their own ``kl_direction`` and ``kl_reduction`` (KLTRPO's ``"sb3_contrib"`` resolved for the
      action space);
    - the TRPO family (sb3-contrib's ``TRPO``): KL(new||old), reduced as TRPO reduces it on the action space
      (:func:`~sb3_kl.common.kl.sb3_contrib_kl_reduction`);
    - the PPO family (``PPO``, ``RecurrentPPO``, ``MaskablePPO``) and ``A2C``: KL(old||new) summed over action
      dimensions, the KL whose estimate SB3's ``target_kl`` early stop compares (``approx_kl``).

    The estimator is always ``"analytic"``: a target bounds the KL itself, whichever estimate an algorithm steers by.

    :param model: The algorithm
    :return: the convention, as :class:`~sb3_kl.common.kl.KLSettings`
    """
    settings = getattr(model, "kl_settings", None)
    if isinstance(settings, KLSettings):
        return KLSettings(direction=settings.direction, reduction=settings.reduction)
    if is_trust_region_family(model):
        return KLSettings(direction="reverse", reduction=sb3_contrib_kl_reduction(model.action_space))
    return KLSettings(direction="forward", reduction="sum")


def _step_major_observations(sequences: RolloutSequences) -> Any:
    if isinstance(sequences.observations, dict):
        return {key: step_major(value) for key, value in sequences.observations.items()}
    return step_major(sequences.observations)


class KLMonitorCallback(SuggestsKeywords, BaseCallback):
    """
    Measure the per-state KL between the rollout policy and the updated policy after every update: by default the
    exact KL(pi_rollout || pi_updated) summed over action dimensions; ``direction``, ``estimator`` and ``reduction``
    choose otherwise, and ``kl/convention`` says which. With a sample estimator (``k1``/``k3``) a state's value is the
    estimate from its one stored action: the means (``kl/mean``, ``kl/env_<i>``) estimate the KL, the quantiles and
    the maximum are those of the single-sample estimates, not of the per-state KL.

    At the end of each rollout the rollout policy's distribution parameters are computed on the buffer's
    observations (parameters only, no copy of the network; a no-grad forward pass in eval mode, by chunks). After
    ``train()`` the updated policy is evaluated on the same states and the per-state KL is logged through the model's
    logger:

    - ``kl/mean``, ``kl/p50``, ``kl/p90``, ``kl/p99`` (configurable ``quantiles``), ``kl/max``;
    - ``kl/tail_ratio``: p99 / mean (how much of the KL sits in a few states; the p99 whichever ``quantiles`` are
      logged); NaN when the mean is not positive and always with the ``k1`` estimator, whose per-state values are
      signed samples;
    - ``kl/env_<i>``: mean KL over the states of environment ``i`` of the VecEnv (``per_env=True``);
    - ``kl/entropy``: mean entropy of the updated policy on those states (not logged with ``squash_output=True``, NaN
      in :attr:`history`: a tanh-squashed policy's entropy has no closed form, SB3's ``entropy()`` is None there);
    - ``kl/to_uniform``: discrete actions only, the mean exact KL(pi_updated || uniform) = log(#actions) - entropy
      (only the valid actions count with action masks), whatever ``direction`` and ``estimator``, divided by the
      number of action dimensions with ``reduction="mean"``: how far the policy is from uniform exploration;
    - ``kl/hist``: a TensorBoard histogram of the per-state KL (only when a TensorBoard output is configured);
    - ``kl/convention``: e.g. ``forward/analytic/sum`` (not sent to TensorBoard);
    - ``kl/normalization_shift``: when the model's environment normalizes observations with ``VecNormalize``
      (``normalization_shift=True``), the mean exact KL over the rollout's states between the acting policy at the
      rollout's start and at its end with the same parameters: the change that ``VecNormalize``'s statistics update
      alone makes in the policy during the rollout, which no per-update KL sees. Always exact, in the monitor's
      ``direction`` (forward: KL(pi_start || pi_end)) and ``reduction``, whatever ``estimator``. Not measured (a
      warning says so) when a wrapper after ``VecNormalize`` changes the observations;
    - ``kl/drift`` and ``kl/drift_lag``: with ``drift_lag=k``, the mean exact KL over the rollout's states between the
      policy that acted ``k`` updates before the updated one and the updated policy (forward: KL(pi_{-k} ||
      pi_updated)), in the monitor's ``direction`` and ``reduction`` whatever ``estimator``: how far ``k`` updates
      moved the policy together. Each update may stay inside its KL target while many move the policy the same way
      (the KL of ``k`` steps in one direction grows as ``k**2`` times a step's); ``drift_lag=1`` is the update's own
      exact KL. Logged from the ``k``-th update of a ``learn()`` call on (the policies of an earlier call are not
      kept). Recurrent policies: the lagged policy's LSTM is re-run from the states the rollout stored, as the
      updated policy's is;
    - with an sb3_kl algorithm: ``kl/coef`` (beta after this update's adjustment, the one the next update uses, as
      ``train/kl_coef``; not with KLTRPO, which has none), ``kl/target`` and
      ``kl/grad_ratio`` (from ``train/kl_grad_ratio``);
      with a stock algorithm whose ``target_kl`` is set: ``kl/target``;
    - with ``kl/target``: ``kl/target_convention`` (the convention the algorithm states its target in,
      :func:`target_kl_settings`, e.g. ``reverse/analytic/mean`` for sb3-contrib's TRPO on ``Box`` actions; not sent to
      TensorBoard) and ``kl/mean_in_target_convention`` (the update's exact mean KL in that convention, the number to
      compare with ``kl/target``; equal to ``kl/mean`` when the monitor measures in it).

    The values of an update are recorded right after it (in the next ``_on_rollout_start``), so they are written
    at the next ``dump_logs``; the last update of ``learn()`` is measured in ``_on_training_end`` and, like SB3's own
    last ``train/`` values, is only readable from ``model.logger.name_to_value`` and :attr:`history`.

    Every measured update appends a dict to :attr:`history`: ``update`` (0-based count of updates seen by this
    callback), ``num_timesteps``, ``n_updates`` (the model's counter), ``mean``, the quantiles (``p50``...),
    ``max``, ``min``, ``tail_ratio``, ``entropy``, ``target_convention`` and ``mean_in_target_convention`` (see above;
    also without a target: then the convention of the family default the alarms use), ``to_uniform`` (discrete),
    ``coef``/``target``/``grad_ratio``/``normalization_shift``/``drift`` and ``drift_lag`` (when available) and
    ``env_means`` (a list, with ``per_env``).
    :attr:`last_per_state` holds the per-state KL of the last measured update (numpy array, states ordered
    step-major: ``index = step * n_envs + env``).

    Top-k drill-down: with ``top_k > 0`` the ``top_k`` highest-KL states of every measured update are kept in
    :attr:`top_states`, together with a random background sample of ``background_size`` other states of the same
    update. With ``top_k_path`` they are saved to a ``.npz`` at the end of training (:meth:`save_top_states`), with keys:

    - ``observations`` ``(n, *obs_shape)``, ``kl`` ``(n,)``, ``update`` ``(n,)``, ``num_timesteps`` ``(n,)``,
      ``env_index`` ``(n,)``, ``step_index`` ``(n,)``: the high-KL states;
    - ``background_observations``, ``background_kl``, ``background_update``: ordinary states for comparison;
    - ``convention``: the KL convention string, ``obs_keys``: the observation keys (Dict observation spaces, whose
      observations are stored as ``observations/<key>`` and ``background_observations/<key>``; empty otherwise);
    - ``obs_normalized``: whether the observations are ``VecNormalize``'s normalized ones, as the rollout buffer
      stores them (the policy's input, in units whose statistics move during training), not the env's raw values.

    Action masks of ``MaskablePPO`` are applied to both policies (taken from the rollout buffer). Recurrent policies
    (sb3-contrib's ``RecurrentPPO``, ``RecurrentKLPPO``) are measured on their sequences: each policy's LSTM is re-run
    over each env's rollout in time order, from the LSTM state stored at that env's first step, the stored episode
    starts resetting it (one sequence per env, never cut elsewhere; see :mod:`sb3_kl.common.recurrent`).

    :param direction: ``"forward"`` = KL(pi_rollout || pi_updated) (default) or ``"reverse"``
    :param estimator: ``"analytic"`` (exact, default), or ``"k1"`` / ``"k3"`` sample estimators from the rollout's actions
    :param reduction: ``"sum"`` (joint KL, default) or ``"mean"`` over action dimensions
    :param quantiles: Quantiles of the per-state KL to log, strictly between 0 and 1
    :param every: Measure every ``every``-th update only (the others cost nothing)
    :param per_env: Log the mean KL of each environment of the VecEnv as ``kl/env_<i>``
    :param normalization_shift: Measure ``kl/normalization_shift`` when the environment normalizes observations with
        ``VecNormalize`` (two more forward passes over the rollout per measured update)
    :param drift_lag: Measure ``kl/drift``, the KL between the policy ``drift_lag`` updates before the updated one and
        the updated policy (one more forward pass per measured update; ``drift_lag`` copies of the policy's weights
        are kept); None: not measured
    :param top_k: Number of highest-KL states kept per measured update (0: none)
    :param top_k_path: Where to save the kept states (``.npz``) at the end of training; None: keep them in memory only
    :param background_size: Number of other states sampled per measured update for comparison (default: ``4 * top_k``)
    :param chunk_size: Number of states per forward pass
    :param seed: Seed of the background sampling
    :param verbose: Verbosity level: 0 no output, 1 info (saved files), 2 one line per measured update
    """

    def __init__(
        self,
        direction: str = "forward",
        estimator: str = "analytic",
        reduction: str = "sum",
        quantiles: tuple[float, ...] = (0.5, 0.9, 0.99),
        every: int = 1,
        per_env: bool = False,
        normalization_shift: bool = True,
        drift_lag: int | None = 10,
        top_k: int = 0,
        top_k_path: str | os.PathLike | None = None,
        background_size: int | None = None,
        chunk_size: int = 4096,
        seed: int = 0,
        verbose: int = 0,
    ):
        check_int("verbose", verbose, 0)
        super().__init__(verbose)
        # Checked under the callback's own argument names (KLSettings would name them kl_*)
        for name, value, choices in (
            ("direction", direction, KL_DIRECTIONS),
            ("estimator", estimator, KL_ESTIMATORS),
            ("reduction", reduction, KL_REDUCTIONS),
        ):
            try:
                check_choice(name, value, choices)
            except ValueError as error:
                raise ValueError(f"{error} (The same option as the algorithms' `kl_{name}`.)") from None
        check_bool("per_env", per_env)
        check_bool("normalization_shift", normalization_shift)
        if seed is not None:
            check_int("seed", seed, 0)
        self.settings = KLSettings(estimator=estimator, direction=direction, reduction=reduction)
        quantiles = check_quantiles("quantiles", quantiles)
        check_int("every", every, 1)
        if drift_lag is not None:
            try:
                check_int("drift_lag", drift_lag, 1)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{error} (None: the drift is not measured.)") from None
        check_int("top_k", top_k, 0)
        check_int("chunk_size", chunk_size, 1)
        check_path("top_k_path", top_k_path)
        if top_k_path is not None and top_k == 0:
            raise ValueError("`top_k_path` is set but `top_k`=0 keeps no state: pass top_k > 0 or top_k_path=None.")
        if background_size is None:
            background_size = 4 * top_k
        check_int("background_size", background_size, 0)
        self.quantiles = quantiles
        self.every = every
        self.per_env = per_env
        self.normalization_shift = normalization_shift
        self.drift_lag = drift_lag
        self.top_k = top_k
        self.top_k_path = top_k_path
        self.background_size = background_size
        self.chunk_size = chunk_size
        self.history: list[dict[str, Any]] = []
        self.last_per_state: np.ndarray | None = None
        self.top_states: list[dict[str, Any]] = []
        self._listeners: list[Callable[[dict[str, Any], np.ndarray], None]] = []
        # False for a MonitorUser's private monitor when a KLMonitorCallback of the user's takes part in the same
        # learn(): its figures would overwrite that monitor's kl/ keys (MonitorUser._on_training_start)
        self._writes_logger = True
        self._rng = np.random.default_rng(seed)
        self._updates_seen = 0
        self._snapshot: dict[str, Any] | None = None
        self._dist_params: DistributionParams | None = None
        self._masked = False
        self._recurrent = False
        self._has_tensorboard = False
        self._normalization: RolloutNormalization | None = None
        # the weights of the last ``drift_lag`` rollout policies (oldest first) and a frozen copy to evaluate them in
        self._lagged_weights: deque[dict[str, th.Tensor]] = deque(maxlen=int(drift_lag or 1))
        self._lagged_policy: Any = None

    # ----------------------------------------------------------------------------------------------------------
    # Public helpers

    def add_listener(self, listener: Callable[[dict[str, Any], np.ndarray], None]) -> None:
        """
        Call ``listener(record, per_state_kl)`` after every measurement (used by the other KL callbacks so that
        one monitor measures for all of them).

        :param listener: A callable taking the history record and the per-state KL array
        """
        self._listeners.append(listener)

    @property
    def convention(self) -> str:
        """The KL convention, e.g. ``"forward/analytic/sum"``."""
        return self.settings.convention

    # ----------------------------------------------------------------------------------------------------------
    # Hooks

    def _init_callback(self) -> None:
        policy = self.model.policy
        self._recurrent = is_recurrent_policy(policy)
        if self._recurrent and not hasattr(self.model.rollout_buffer, "hidden_states_pi"):
            raise ValueError(
                f"{type(self).__name__}: the policy {type(policy).__name__} is recurrent but the rollout buffer "
                f"{type(self.model.rollout_buffer).__name__} stores no LSTM states: use sb3-contrib's "
                "RecurrentRolloutBuffer (RecurrentPPO's)."
            )
        if not hasattr(policy, "get_distribution"):
            raise ValueError(
                f"{type(self).__name__} needs an actor-critic policy with `get_distribution`, got {type(policy).__name__}."
            )
        self._dist_params = distribution_params_for_policy(policy.action_dist)
        self._masked = MaskableCategoricalDistribution is not None and isinstance(
            policy.action_dist, (MaskableCategoricalDistribution, MaskableMultiCategoricalDistribution)
        )
        if self._masked and not hasattr(self.model.rollout_buffer, "action_masks"):
            raise ValueError(
                f"The policy uses action masks but the rollout buffer {type(self.model.rollout_buffer).__name__} stores "
                "none: use sb3-contrib's MaskableRolloutBuffer (MaskablePPO's default)."
            )
        self._has_tensorboard = any(isinstance(f, TensorBoardOutputFormat) for f in self.logger.output_formats)
        self._normalization = rollout_normalization(self.model, type(self).__name__) if self.normalization_shift else None
        # the copy that evaluates the lagged weights is this model's policy's (a monitor may be attached to another)
        self._lagged_policy = None

    def _on_training_start(self) -> None:
        # A snapshot from a previous learn() call does not belong to this run, nor do its policies
        self._snapshot = None
        self._lagged_weights.clear()

    def _on_rollout_end(self) -> None:
        if self.drift_lag is not None:  # the policy that acted in this rollout, whether or not its update is measured
            self._lagged_weights.append({key: value.detach().clone() for key, value in self.model.policy.state_dict().items()})
        if self._updates_seen % self.every == 0:
            self._snapshot = self._take_snapshot()
            self._snapshot["normalization_shift"] = self._normalization_shift(self._snapshot)
        else:
            self._snapshot = None
        if self._normalization is not None:
            self._normalization.stop()
        self._updates_seen += 1

    def _on_rollout_start(self) -> None:
        # First hook after train(): the buffer was reset but the snapshot holds its states
        self._measure_pending()
        normalization = self._normalization
        if normalization is not None and self._updates_seen % self.every == 0:  # the rollout about to be measured
            if not normalization.start(self.model._last_obs):
                warn_at_user_frame(
                    f"{type(self).__name__}: the model's observations are not VecNormalize's normalized ones (another "
                    "wrapper changes them), so `kl/normalization_shift` is not measured. Put VecNormalize last, or "
                    "pass normalization_shift=False."
                )
                self._normalization = None

    def _on_training_end(self) -> None:
        self._measure_pending()
        if self.top_k_path is not None and self.top_states:
            try:
                self.save_top_states(self.top_k_path)
            except OSError as error:
                raise OSError(
                    f"{type(self).__name__} could not save the kept high-KL states to `top_k_path`={self.top_k_path!r} "
                    f"({error}): pass a writable path."
                ) from error

    def _on_step(self) -> bool:
        if self._normalization is not None:
            self._normalization.step()
        return True

    # ----------------------------------------------------------------------------------------------------------
    # Measuring

    def _buffer_arrays(self) -> tuple[Any, np.ndarray, np.ndarray | None, int, int]:
        """
        The rollout buffer's observations, actions and masks as flat arrays of ``n_steps * n_envs`` states in
        step-major order, whether or not ``get()`` already flattened them (it swaps to env-major in place).

        :return: observations (array or dict of arrays), actions, masks or None, n_steps, n_envs
        """
        buffer = self.model.rollout_buffer
        n_steps, n_envs = buffer.buffer_size, buffer.n_envs
        if not buffer.full:
            raise RuntimeError(f"{type(self).__name__}: the rollout buffer is not full at the end of the rollout.")

        def flat(array: np.ndarray) -> np.ndarray:
            if buffer.generator_ready:  # (n_envs * n_steps, ...) env-major -> (n_steps * n_envs, ...) step-major
                array = array.reshape(n_envs, n_steps, *array.shape[1:]).swapaxes(0, 1)
            return array.reshape(n_steps * n_envs, *array.shape[2:])

        if isinstance(buffer.observations, dict):
            observations: Any = {key: flat(value) for key, value in buffer.observations.items()}
        else:
            observations = flat(buffer.observations)
        masks = flat(buffer.action_masks) if self._masked else None
        return observations, flat(buffer.actions), masks, n_steps, n_envs

    def _to_tensor(self, array: np.ndarray) -> th.Tensor:
        # th.tensor always copies: the snapshot must not share memory with the buffer
        return th.tensor(np.ascontiguousarray(array), device=self.model.device)

    def _chunks(self, n: int) -> list[slice]:
        return [slice(start, min(start + self.chunk_size, n)) for start in range(0, n, self.chunk_size)]

    @staticmethod
    def _index(observations: th.Tensor | dict[str, th.Tensor], chunk: slice) -> Any:
        if isinstance(observations, dict):
            return {key: value[chunk] for key, value in observations.items()}
        return observations[chunk]

    def _distribution(self, observations: Any, masks: th.Tensor | None, policy: Any = None) -> Distribution:
        distribution = (self.model.policy if policy is None else policy).get_distribution(observations)
        if masks is not None:
            distribution.apply_masking(masks)
        return distribution

    def _actions_for_log_prob(self, actions: th.Tensor) -> th.Tensor:
        return actions_for_log_prob(actions, self.model.action_space)

    @th.no_grad()
    def _evaluate(
        self, snapshot: dict[str, Any], policy: Any = None, with_log_prob: bool | None = None
    ) -> tuple[th.Tensor, th.Tensor | None]:
        """
        Distribution parameters of the current policy (or of ``policy``) on the snapshot's states (eval mode, no
        grad, by chunks), and the log-probability of the stored actions when ``with_log_prob`` (by default: when a
        sample estimator needs it).
        """
        assert self._dist_params is not None
        policy = self.model.policy if policy is None else policy
        if with_log_prob is None:
            with_log_prob = self.settings.estimator != "analytic"
        if snapshot.get("sequences") is not None:
            return self._evaluate_sequences(snapshot, policy, with_log_prob)
        params, log_probs = [], []
        with acting_mode(policy):
            for chunk in self._chunks(snapshot["n"]):
                masks = snapshot["masks"][chunk] if snapshot["masks"] is not None else None
                distribution = self._distribution(self._index(snapshot["observations"], chunk), masks, policy)
                params.append(self._dist_params.extract(distribution))
                if with_log_prob:
                    log_probs.append(distribution.log_prob(self._actions_for_log_prob(snapshot["actions"][chunk])))
        return th.cat(params), (th.cat(log_probs) if log_probs else None)

    def _evaluate_sequences(
        self, snapshot: dict[str, Any], policy: Any, with_log_prob: bool
    ) -> tuple[th.Tensor, th.Tensor | None]:
        """
        Recurrent policy: its LSTM re-run over each env's rollout in time order, from the state stored at the env's
        first step, episode starts resetting it (:mod:`sb3_kl.common.recurrent`); results in step-major order.
        """
        assert self._dist_params is not None
        evaluation = evaluate_sequences(
            policy,
            snapshot["sequences"],
            self._dist_params,
            with_log_prob=with_log_prob,
            chunk_size=self.chunk_size,
        )
        log_prob = None if evaluation.log_prob is None else step_major(evaluation.log_prob)
        return step_major(evaluation.params), log_prob

    def _take_recurrent_snapshot(self) -> dict[str, Any]:
        buffer = self.model.rollout_buffer
        if not buffer.full:
            raise RuntimeError(f"{type(self).__name__}: the rollout buffer is not full at the end of the rollout.")
        sequences = RolloutSequences.from_buffer(buffer, with_actions=self.settings.estimator != "analytic")
        snapshot = {
            "sequences": sequences,
            # step-major observations, only kept for the top-k drill-down
            "observations": _step_major_observations(sequences) if self.top_k > 0 else None,
            "masks": None,
            "n": sequences.n_steps * sequences.n_envs,
            "n_envs": sequences.n_envs,
            "update": self._updates_seen,
        }
        snapshot["old_params"], snapshot["old_log_prob"] = self._evaluate(snapshot)
        return snapshot

    def _take_snapshot(self) -> dict[str, Any]:
        if self._recurrent:
            return self._take_recurrent_snapshot()
        observations, actions, masks, n_steps, n_envs = self._buffer_arrays()
        if isinstance(observations, dict):
            obs_tensor: Any = {key: self._to_tensor(value) for key, value in observations.items()}
        else:
            obs_tensor = self._to_tensor(observations)
        snapshot = {
            "observations": obs_tensor,
            "actions": self._to_tensor(actions) if self.settings.estimator != "analytic" else None,
            "masks": self._to_tensor(masks) if masks is not None else None,
            "n": n_steps * n_envs,
            "n_envs": n_envs,
            "update": self._updates_seen,
        }
        snapshot["old_params"], snapshot["old_log_prob"] = self._evaluate(snapshot)
        return snapshot

    def _normalization_shift(self, snapshot: dict[str, Any]) -> float | None:
        """
        The mean exact KL between the acting policy at the rollout's start and at its end (same parameters, the
        ``VecNormalize`` statistics of the start and of the end) on the snapshot's states; None when not measured.
        """
        normalization = self._normalization
        if normalization is None:
            return None
        normalized = normalization.normalized(snapshot["n"] // snapshot["n_envs"])
        if normalized is None:
            return None
        sequences = snapshot.get("sequences")
        stored = snapshot["observations"] if sequences is None else sequences.observations

        def as_stored(observations: Any) -> Any:
            def convert(array: np.ndarray, like: th.Tensor) -> th.Tensor:
                if sequences is not None:  # step-major (n_steps, n_envs, ...) -> env-major like the sequences
                    array = array.swapaxes(0, 1)
                return th.as_tensor(np.ascontiguousarray(array), dtype=like.dtype, device=like.device).reshape(like.shape)

            if isinstance(stored, dict):
                keys = normalization.normalizer.norm_obs_keys or []
                return {key: convert(observations[key], value) if key in keys else value for key, value in stored.items()}
            return convert(observations, stored)

        assert self._dist_params is not None
        at_start, at_end = (as_stored(observations) for observations in normalized)
        if sequences is None:
            params = [self._evaluate({**snapshot, "observations": obs}, with_log_prob=False)[0] for obs in (at_start, at_end)]
        else:
            # both inputs in one pass over twice the envs: the LSTM's steps run once, not twice
            if isinstance(at_start, dict):
                observations: Any = {key: th.cat([at_start[key], at_end[key]]) for key in at_start}
            else:
                observations = th.cat([at_start, at_end])
            both = RolloutSequences(
                observations,
                sequences.episode_starts.repeat(2, 1),
                (sequences.lstm_states[0].repeat(1, 2, 1), sequences.lstm_states[1].repeat(1, 2, 1)),
            )
            evaluation = evaluate_sequences(self.model.policy, both, self._dist_params, chunk_size=2 * self.chunk_size)
            n_envs = sequences.n_envs
            params = [step_major(evaluation.params[:n_envs]), step_major(evaluation.params[n_envs:])]
        exact = KLSettings(estimator="analytic", direction=self.settings.direction, reduction=self.settings.reduction)
        return float(per_state_kl(exact, self._dist_params, *as_float64(params[0], params[1])).mean())

    def _measure_pending(self) -> None:
        if self._snapshot is None:
            return
        snapshot, self._snapshot = self._snapshot, None
        assert self._dist_params is not None
        new_params, new_log_prob = self._evaluate(snapshot)
        log_ratio = None
        if new_log_prob is not None:
            log_ratio = new_log_prob - snapshot["old_log_prob"]
        # In float64: a small per-state KL is a difference of nearly equal terms, which float32 rounds to ~1e-7
        per_state_t = per_state_kl(
            self.settings,
            self._dist_params,
            *as_float64(snapshot["old_params"], new_params, log_ratio),
        )
        per_state = per_state_t.cpu().numpy().astype(np.float64)
        record = self._statistics(snapshot, per_state, new_params)
        drift = self._drift(snapshot, new_params)
        if drift is not None:
            record["drift"], record["drift_lag"] = drift, self.drift_lag
        self.history.append(record)
        self.last_per_state = per_state
        if self._writes_logger:
            self._log(record, per_state_t)
        if self.top_k > 0:
            self._keep_top_states(snapshot, per_state, record)
        if self.verbose >= 2:
            print(
                f"{type(self).__name__}: update {record['update']} at {record['num_timesteps']} steps: "
                f"KL mean {record['mean']:.4g}, max {record['max']:.4g}"
            )
        for listener in self._listeners:
            listener(record, per_state)

    def _drift(self, snapshot: dict[str, Any], new_params: th.Tensor) -> float | None:
        """
        The mean exact KL between the policy ``drift_lag`` updates before the updated one and the updated policy on
        the snapshot's states; None when not measured or fewer than ``drift_lag`` rollouts of this ``learn()`` were
        seen.
        """
        if self.drift_lag is None or len(self._lagged_weights) < self.drift_lag:
            return None
        assert self._dist_params is not None
        if self._lagged_policy is None:
            # Built from the policy's constructor parameters, as a reference policy is: a deep copy of the module fails
            # on gSDE policies, whose distribution holds the sampled exploration matrices (non-leaf tensors)
            policy_class, constructor_kwargs = reference_spec(self.model.policy)
            # its initial weights (overwritten below) come from a fork of torch's global generator, so that the
            # monitored run samples the same actions as an unmonitored one
            with th.random.fork_rng(devices=[]):
                self._lagged_policy = build_reference_policy(policy_class, constructor_kwargs, self.model.device)
        self._lagged_policy.load_state_dict(self._lagged_weights[0])
        lagged_params, _ = self._evaluate(snapshot, self._lagged_policy, with_log_prob=False)
        exact = KLSettings(estimator="analytic", direction=self.settings.direction, reduction=self.settings.reduction)
        return float(per_state_kl(exact, self._dist_params, *as_float64(lagged_params, new_params)).mean())

    @th.no_grad()
    def _statistics(self, snapshot: dict[str, Any], per_state: np.ndarray, new_params: th.Tensor) -> dict[str, Any]:
        assert self._dist_params is not None
        record: dict[str, Any] = {
            "update": snapshot["update"],
            "num_timesteps": int(self.model.num_timesteps),
            "n_updates": int(getattr(self.model, "_n_updates", 0)),
        }
        finite = bool(np.all(np.isfinite(per_state)))
        if finite:
            record.update(kl_quantiles(per_state, self.quantiles))
        else:  # reported as NaN/inf (an alarm), quantiles of non-finite data are meaningless
            record["mean"] = float(np.mean(per_state))
            record.update({quantile_name(q): float("nan") for q in self.quantiles})
            record["max"] = float(np.max(per_state))
        record["min"] = float(np.min(per_state))
        record["tail_ratio"] = self._tail_ratio(per_state, record) if finite else float("nan")
        target_settings = target_kl_settings(self.model)
        record["target_convention"] = target_settings.convention
        record["mean_in_target_convention"] = self._mean_in(target_settings, snapshot["old_params"], new_params, record)
        entropy = self._dist_params.entropy(new_params)
        # A tanh-squashed policy (gSDE with squash_output=True) has no closed-form entropy (SB3's entropy() is None
        # there): the Gaussian's before the tanh would not be the policy's, so it is NaN in the history, not logged
        squashed = getattr(self.model.policy, "squash_output", False)
        record["entropy"] = float("nan") if squashed else float(entropy.mean())
        to_uniform = self._kl_to_uniform(entropy, snapshot["masks"])
        if to_uniform is not None:
            record["to_uniform"] = to_uniform
        if self.per_env:
            n_envs = snapshot["n_envs"]
            record["env_means"] = [float(x) for x in per_state.reshape(-1, n_envs).mean(axis=0)]
        model = self.model
        if getattr(model, "has_kl_coef", False):  # an sb3_kl algorithm with a KL penalty (not KLTRPO)
            record["coef"] = float(model.kl_coef)
        target = model_target_kl(model)
        if target is not None:
            record["target"] = target
        grad_ratio = model.logger.name_to_value.get("train/kl_grad_ratio")
        if grad_ratio is not None:
            record["grad_ratio"] = float(grad_ratio)
        if snapshot.get("normalization_shift") is not None:
            record["normalization_shift"] = snapshot["normalization_shift"]
        return record

    def _tail_ratio(self, per_state: np.ndarray, record: dict[str, Any]) -> float:
        """
        p99 / mean of the per-state KL (the record's p99 when 0.99 is among ``quantiles``, else computed here). NaN
        when the mean is not positive, and always with the ``k1`` estimator: its per-state values are signed
        single-action samples, whose p99 says nothing about how the KL is spread over the states.
        """
        mean = record["mean"]
        if self.settings.estimator == "k1" or not mean > 0:
            return float("nan")
        p99 = record.get(quantile_name(0.99))
        return float((np.quantile(per_state, 0.99) if p99 is None else p99) / mean)

    def _mean_in(self, settings: KLSettings, old_params: th.Tensor, new_params: th.Tensor, record: dict[str, Any]) -> float:
        """
        The exact mean per-state KL of the update in another convention (analytic, from the same distribution
        parameters); the measured mean when ``settings`` is the monitor's own exact convention.
        """
        assert self._dist_params is not None
        if settings.convention == self.settings.convention:
            return float(record["mean"])
        per_state = per_state_kl(settings, self._dist_params, *as_float64(old_params, new_params))
        return float(per_state.mean())

    def _kl_to_uniform(self, entropy: th.Tensor, masks: th.Tensor | None) -> float | None:
        """Mean KL(pi || uniform over the valid actions) = log(#valid actions) - entropy, for discrete actions."""
        dist_params = self._dist_params
        if isinstance(dist_params, GaussianParams) or dist_params is None:
            return None
        if isinstance(dist_params, CategoricalParams):
            sizes = [dist_params.n_params]
        elif isinstance(dist_params, MultiCategoricalParams):
            sizes = dist_params.nvec
        elif isinstance(dist_params, BernoulliParams):
            sizes = [2] * dist_params.n_dims
        else:
            return None
        if masks is None:
            log_n = th.full_like(entropy, float(sum(math.log(n) for n in sizes)))
        else:
            valid = [part.sum(dim=-1).clamp(min=1.0) for part in th.split(masks.float(), sizes, dim=-1)]
            log_n = th.stack([th.log(v) for v in valid], dim=-1).sum(dim=-1)
        kl = log_n - entropy
        if self.settings.reduction == "mean":
            kl = kl / dist_params.n_dims
        return float(kl.mean())

    def _log(self, record: dict[str, Any], per_state: th.Tensor) -> None:
        logger = self.model.logger
        logger.record("kl/mean", record["mean"])
        for q in self.quantiles:
            name = quantile_name(q)
            logger.record(f"kl/{name}", record[name])
        for key in (
            "max",
            "tail_ratio",
            "entropy",
            "to_uniform",
            "coef",
            "target",
            "grad_ratio",
            "normalization_shift",
            "drift",
            "drift_lag",
        ):
            if key in record and not (key == "entropy" and math.isnan(record[key])):
                logger.record(f"kl/{key}", record[key])
        if "target" in record:
            # the target is in the algorithm's convention: the KL to compare it with, and which convention that is
            logger.record("kl/mean_in_target_convention", record["mean_in_target_convention"])
            logger.record("kl/target_convention", record["target_convention"], exclude="tensorboard")
        for i, value in enumerate(record.get("env_means", [])):
            logger.record(f"kl/env_{i}", value)
        logger.record("kl/convention", self.settings.convention, exclude="tensorboard")
        if self._has_tensorboard and bool(th.isfinite(per_state).all()):
            logger.record("kl/hist", per_state.detach().cpu(), exclude=_HISTOGRAM_EXCLUDE)

    # ----------------------------------------------------------------------------------------------------------
    # Top-k drill-down

    def _keep_top_states(self, snapshot: dict[str, Any], per_state: np.ndarray, record: dict[str, Any]) -> None:
        n, n_envs = snapshot["n"], snapshot["n_envs"]
        k = min(self.top_k, n)
        order = np.argsort(np.nan_to_num(per_state, nan=-np.inf))
        top = order[::-1][:k].copy()
        rest = order[: n - k]
        background = self._rng.choice(rest, size=min(self.background_size, len(rest)), replace=False)

        def take(indices: np.ndarray) -> Any:
            index = th.as_tensor(indices, device=self.model.device, dtype=th.long)
            obs = snapshot["observations"]
            if isinstance(obs, dict):
                return {key: value[index].cpu().numpy() for key, value in obs.items()}
            return obs[index].cpu().numpy()

        self.top_states.append(
            {
                "update": record["update"],
                "num_timesteps": record["num_timesteps"],
                "observations": take(top),
                "kl": per_state[top],
                "env_index": top % n_envs,
                "step_index": top // n_envs,
                "background_observations": take(background),
                "background_kl": per_state[background],
            }
        )

    def _observations_normalized(self) -> bool:
        """Whether the stored observations are VecNormalize's normalized ones (the policy's input)."""
        vec_normalize = unwrap_vec_normalize(self.model.get_env()) if self.model is not None else None
        return bool(vec_normalize is not None and vec_normalize.norm_obs)

    def save_top_states(self, path: str | os.PathLike) -> None:
        """
        Save the kept high-KL states and the background sample to a ``.npz`` (keys in the class docstring); missing
        parent folders are created, as SB3's ``CheckpointCallback`` creates its ``save_path``.

        :param path: Destination file
        """
        if not self.top_states:
            raise ValueError("No top-k state was kept: set top_k > 0 and train for at least one update.")
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)

        def stack_obs(name: str) -> dict[str, np.ndarray]:
            first = self.top_states[0][name]
            if isinstance(first, dict):
                return {f"{name}/{key}": np.concatenate([entry[name][key] for entry in self.top_states]) for key in first}
            return {name: np.concatenate([entry[name] for entry in self.top_states])}

        def repeat(key: str, name: str) -> np.ndarray:
            return np.concatenate([np.full(len(entry[name]), entry[key], dtype=np.int64) for entry in self.top_states])

        first_obs = self.top_states[0]["observations"]
        np.savez_compressed(
            path,
            **stack_obs("observations"),
            kl=np.concatenate([entry["kl"] for entry in self.top_states]),
            update=repeat("update", "kl"),
            num_timesteps=repeat("num_timesteps", "kl"),
            env_index=np.concatenate([entry["env_index"] for entry in self.top_states]).astype(np.int64),
            step_index=np.concatenate([entry["step_index"] for entry in self.top_states]).astype(np.int64),
            **stack_obs("background_observations"),
            background_kl=np.concatenate([entry["background_kl"] for entry in self.top_states]),
            background_update=repeat("update", "background_kl"),
            convention=np.array(self.settings.convention),
            obs_normalized=np.array(self._observations_normalized()),
            obs_keys=np.array(sorted(first_obs) if isinstance(first_obs, dict) else [], dtype=str),
        )
        if self.verbose >= 1:
            print(f"{type(self).__name__}: saved {sum(len(e['kl']) for e in self.top_states)} high-KL states to {path}")


def _callbacks_in(callback: BaseCallback | None) -> Iterator[BaseCallback]:
    """:return: ``callback`` and every callback it holds (``CallbackList`` members, an ``EventCallback``'s child)"""
    if callback is None:
        return
    yield callback
    for child in getattr(callback, "callbacks", None) or ():
        yield from _callbacks_in(child)
    yield from _callbacks_in(getattr(callback, "callback", None))


class MonitorUser(SuggestsKeywords, BaseCallback):
    """
    Base of the callbacks that act on the measured KL: they listen to a :class:`KLMonitorCallback`, either the one
    passed as ``monitor`` (which must also be given to ``learn()``, so the KL is measured once) or a private one
    they drive themselves.
    """

    def __init__(self, monitor: KLMonitorCallback | None, verbose: int = 0):
        check_int("verbose", verbose, 0)
        super().__init__(verbose)
        if monitor is not None and not isinstance(monitor, KLMonitorCallback):
            raise TypeError(f"`monitor` must be a KLMonitorCallback or None, got {type(monitor).__name__}.")
        self._own_monitor = monitor is None
        # a private monitor measures only what the callback acts on (it is not driven step by step)
        self.monitor = monitor if monitor is not None else KLMonitorCallback(normalization_shift=False, drift_lag=None)
        self.monitor.add_listener(self._on_kl_measured)
        self._active = False
        self._logged_convention: str | None = None  # the convention of the ``kl/mean`` this learn() logs

    def _record_target(self, target: float) -> None:
        """
        Log the callback's own KL target as ``kl/target_kl``, read by ``sb3-kl report`` when the algorithm logged no
        target, beside the ``kl/mean`` it is compared with: only when that mean is in the callback's convention.
        """
        if self._logged_convention == self.monitor.convention:
            self.logger.record("kl/target_kl", target)

    def _on_kl_measured(self, record: dict[str, Any], per_state: np.ndarray) -> None:
        raise NotImplementedError

    def _init_callback(self) -> None:
        if self._own_monitor:
            self.monitor.init_callback(self.model)

    def _on_training_start(self) -> None:
        if self._own_monitor:
            # The private monitor logs its figures only when no KLMonitorCallback of the user's takes part in this
            # learn(): its kl/ keys would replace the user's (in their convention) key by key within one row
            users = [c for c in _callbacks_in(self.locals.get("callback")) if isinstance(c, KLMonitorCallback)]
            self.monitor._writes_logger = not users
            self._logged_convention = users[-1].convention if users else self.monitor.convention
            self.monitor.on_training_start(self.locals, self.globals)
        elif getattr(self.monitor, "model", None) is not self.model or (
            "callback" in self.locals and not any(c is self.monitor for c in _callbacks_in(self.locals["callback"]))
        ):
            # (a monitor passed to an earlier learn() of this model still holds it, but would measure nothing now)
            raise ValueError(
                f"The KLMonitorCallback passed to {type(self).__name__} is not one of this learn()'s callbacks: pass "
                "it to learn() as well, every time, e.g. callback=[monitor, this_callback]."
            )
        else:
            self._logged_convention = self.monitor.convention
        self._active = True

    def _on_rollout_start(self) -> None:
        if self._own_monitor:
            self.monitor.on_rollout_start()

    def _on_rollout_end(self) -> None:
        if self._own_monitor:
            self.monitor.update_locals(self.locals)
            self.monitor.on_rollout_end()

    def _on_training_end(self) -> None:
        if self._own_monitor:
            self.monitor.on_training_end()
        else:
            # Measure the last update now if the shared monitor has not yet (it may come later in the callback list)
            self.monitor._measure_pending()
        self._active = False
