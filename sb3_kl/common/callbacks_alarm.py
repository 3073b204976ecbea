"""
KLAlarmCallback: the known signs of a failing KL control as logged, warned and recorded alarms.
Re-exported by :mod:`sb3_kl.callbacks`.
"""

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.type_aliases import Schedule

from sb3_kl.common.callbacks_monitor import KLMonitorCallback, MonitorUser, is_trust_region_family, model_target_kl
from sb3_kl.common.controllers import FixedKLController
from sb3_kl.common.on_policy_algorithm import DEFAULT_TARGET_KL
from sb3_kl.common.user_warnings import warn_and_print, warn_at_user_frame
from sb3_kl.common.validation import (
    MIN_TARGET_KL,
    as_schedule,
    check_bool,
    check_int,
    check_pair,
    check_positive,
    check_schedule,
    target_kl_value,
)

#: ``max_kl_factor``'s default: a single update whose mean KL exceeds this many times the target raises ``kl_spike``
#: at once. Chosen by ``benchmarks/studies/alarm_spike_rule.py`` from the committed benchmark runs' per-update KLs (the
#: smallest factor with which the callback, sustained rule included, alarms on every stress run whose KL ran away, and
#: whose own alarms stay on at most 5 % of the normal runs and of the KL-controlled stress runs and on at most half of
#: the seeds of any algorithm-environment cell at rl-zoo's settings; see ``benchmarks/results/alarm_spike_rule.md``)
MAX_KL_FACTOR = 50.0
#: Target of the trust-region family (sb3-contrib ``TRPO``'s default ``target_kl``) when a model has none
TRUST_REGION_DEFAULT_TARGET_KL = 0.01
#: With the ``k1`` estimator, ``negative_kl`` needs the update's mean KL this many standard errors below 0: the mean
#: of k1 samples is unbiased but noisy, and below about 2 / (number of states) nats it is often negative by chance
NEGATIVE_K1_STANDARD_ERRORS = 4.0


def family_default_target_kl(model: Any) -> tuple[float, str]:
    """
    The KL target the alarms use for a model that has none (e.g. SB3's ``PPO`` with ``target_kl=None``, ``A2C``).

    :param model: The algorithm
    :return: the target and a description of where it comes from: the trust-region family (an algorithm with
        ``cg_max_steps``, like TRPO) uses sb3-contrib TRPO's default 0.01; every other algorithm (the PPO family, A2C)
        uses KLPPO's defaults, 0.02 for discrete action spaces and 0.03 for ``Box``
    """
    if is_trust_region_family(model):
        return TRUST_REGION_DEFAULT_TARGET_KL, "the TRPO family's default (sb3-contrib TRPO's target_kl)"
    continuous = isinstance(getattr(model, "action_space", None), spaces.Box)
    kind = "continuous" if continuous else "discrete"
    return DEFAULT_TARGET_KL[kind], f"the PPO family's default for {'Box' if continuous else 'discrete'} actions"


class SpikeRule:
    """
    The KL-spike checks on the sequence of per-update ``mean KL / target`` ratios: a single update above
    ``max_kl_factor`` alarms at once; ``patience`` consecutive updates above ``spike_factor`` alarm too (and every
    further update of the streak). Shared by :class:`KLAlarmCallback` and ``benchmarks/studies/alarm_spike_rule.py``.

    :param max_kl_factor: Single-update factor (None: no single-update check)
    :param spike_factor: Sustained factor
    :param patience: Length of the sustained streak
    """

    def __init__(self, max_kl_factor: float | None, spike_factor: float, patience: int):
        self.max_kl_factor = max_kl_factor
        self.spike_factor = spike_factor
        self.patience = patience
        self.streak = 0

    def check(self, ratio: float) -> str | None:
        """
        :param ratio: Mean KL of the update divided by the target (NaN/inf counts as above every factor)
        :return: ``"single"``, ``"sustained"`` or None
        """
        finite = math.isfinite(ratio)
        self.streak = self.streak + 1 if not finite or ratio > self.spike_factor else 0
        if self.max_kl_factor is not None and (not finite or ratio > self.max_kl_factor):
            return "single"
        if self.streak >= self.patience:
            return "sustained"
        return None


@dataclass
class KLAlarm:
    """
    One alarm raised by :class:`KLAlarmCallback`.

    :param update: Index of the update (as counted by the monitor)
    :param num_timesteps: Environment steps at the time
    :param kind: ``"negative_kl"``, ``"nonfinite_kl"``, ``"kl_spike"``, ``"beta_at_upper_bound"``,
        ``"beta_at_lower_bound"``, ``"heavy_tail"`` or ``"grad_ratio"``
    :param value: The offending value (KL, beta, tail ratio or gradient ratio)
    :param message: What happened and what to check
    """

    update: int
    num_timesteps: int
    kind: str
    value: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        """:return: the record as a dict"""
        return asdict(self)


class KLAlarmCallback(MonitorUser):
    """
    Turn the known signs of a failing KL control into alarms. After each measured update it checks:

    - ``negative_kl``: a per-state KL below ``-negative_tol`` (for the ``k1`` estimator, whose single samples may be
      negative, the update's mean more than ``negative_tol`` plus :data:`NEGATIVE_K1_STANDARD_ERRORS` standard errors
      below 0): a KL is never negative, so the KL implementation or the inputs are wrong;
    - ``nonfinite_kl``: the KL is NaN or infinite (the policy's outputs overflowed);
    - ``kl_spike``: the mean KL of a single update > ``max_kl_factor`` x target (at once), or > ``spike_factor`` x
      target for ``patience`` consecutive updates. Target: ``target_kl``, compared with the monitor's KL (its own
      convention); else the algorithm's own target when it has one, else the family default
      (:func:`family_default_target_kl`: 0.02 discrete / 0.03 ``Box`` for PPO, A2C and the like, 0.01 for TRPO),
      announced once with a warning; these two are stated in the algorithm's convention, so they are compared with
      the update's exact KL in that convention (the monitor's ``mean_in_target_convention``, e.g. KL(new||old)
      averaged over action dimensions for sb3-contrib's TRPO on ``Box`` actions, whatever the monitor measures);
    - ``beta_at_upper_bound``: the sb3_kl algorithm's KL coefficient sits at its upper bound for ``patience``
      consecutive updates (the penalty cannot hold the KL any more);
    - ``beta_at_lower_bound``: it sits at its lower bound for ``patience`` consecutive updates (the KL stayed below
      the band long enough to drive beta down to it: the penalty does nothing, a clip or a small step does the work);
    - ``heavy_tail``: p99 / mean of the per-state KL > ``tail_ratio`` (a few states carry the update's KL);
      only checked when the mean KL exceeds ``min_kl`` (tiny updates have meaningless ratios), and never with a ``k1``
      monitor (the tail ratio of signed samples is not defined, ``kl/tail_ratio`` is NaN);
    - ``grad_ratio``: the sb3_kl algorithm's ``train/kl_grad_ratio`` (norm of the KL term's gradient / norm of the
      surrogate's) outside ``grad_ratio_band`` for ``patience`` consecutive updates: above the band the penalty
      drowns the surrogate (the policy stops learning); below it while the KL is above target, the penalty has no
      grip. (A small ratio with a KL below target is normal: the KL's gradient vanishes with the KL itself.)

    Each alarm is appended to :attr:`alarms` (:class:`KLAlarm` records), warned once per kind with ``warnings.warn``
    (what to check), counted in ``kl/alarms`` (cumulative count, logged after every measured update) and printed when
    ``verbose >= 1``. With ``stop_training=True`` the next ``_on_step`` returns False, which ends ``learn()`` before the
    next update.

    :param target_kl: KL target for the spike check (number or schedule of progress remaining), in the monitor's
        convention; None: the algorithm's, or the family default when it has none (:func:`family_default_target_kl`),
        each compared with the KL in the algorithm's convention
    :param spike_factor: How many times the target counts as a spike when sustained for ``patience`` updates
    :param max_kl_factor: How many times the target counts as a spike in a single update (None: no single-update
        check); default :data:`MAX_KL_FACTOR`, chosen on the committed benchmark runs
    :param patience: Number of consecutive updates a sustained spike, a beta pinned at either bound or a
        gradient-ratio drift must last
    :param tail_ratio: Threshold of p99 / mean (at most 100 for a non-negative KL); None disables the check
    :param grad_ratio_band: ``(low, high)`` acceptable gradient ratio; None disables the check
    :param negative_tol: Tolerance of the negative-KL check (float32 rounding of nearly equal distributions)
    :param min_kl: Mean KL below which the tail-ratio check is skipped
    :param stop_training: End ``learn()`` at the first alarm
    :param monitor: A :class:`KLMonitorCallback` also passed to ``learn()``, whose measurements are used;
        None: measure privately
    :param verbose: Verbosity level: 0 warnings only, 1 print every alarm
    """

    def __init__(
        self,
        target_kl: float | Schedule | None = None,
        spike_factor: float = 5.0,
        patience: int = 3,
        max_kl_factor: float | None = MAX_KL_FACTOR,
        tail_ratio: float | None = 50.0,
        grad_ratio_band: tuple[float, float] | None = (0.01, 10.0),
        negative_tol: float = 1e-5,
        min_kl: float = 1e-6,
        stop_training: bool = False,
        monitor: KLMonitorCallback | None = None,
        verbose: int = 0,
    ):
        super().__init__(monitor, verbose)
        check_schedule("target_kl", target_kl, allow_none=True, allow_zero_at_end=True)
        check_positive("spike_factor", spike_factor)
        check_positive("max_kl_factor", max_kl_factor, allow_none=True, hint=" or None (no single-update check)")
        check_int("patience", patience, 1)
        check_positive("tail_ratio", tail_ratio, allow_none=True)
        check_positive("negative_tol", negative_tol)
        check_positive("min_kl", min_kl)
        check_bool("stop_training", stop_training)
        self.target_kl = as_schedule(target_kl) if target_kl is not None else None
        self.spike_factor = float(spike_factor)
        self.max_kl_factor = None if max_kl_factor is None else float(max_kl_factor)
        self.patience = patience
        self.tail_ratio = tail_ratio
        self.grad_ratio_band = check_pair("grad_ratio_band", grad_ratio_band) if grad_ratio_band is not None else None
        self.negative_tol = float(negative_tol)
        self.min_kl = float(min_kl)
        self.stop_training = stop_training
        self.alarms: list[KLAlarm] = []
        self._warned: set[str] = set()
        self._streaks = {"beta_at_upper_bound": 0, "beta_at_lower_bound": 0, "grad_ratio": 0}
        self._spike_rule = SpikeRule(self.max_kl_factor, self.spike_factor, patience)
        self._stop = False
        self._announced_default_target = False

    def _target(self) -> tuple[float, str, bool]:
        """
        :return: the target of the spike checks, the key of the monitor's record to compare with it (``"mean"``, the
            monitor's own convention, for the callback's ``target_kl``; ``"mean_in_target_convention"`` for the
            algorithm's target or the family default, which are stated in the algorithm's convention,
            :func:`~sb3_kl.common.callbacks_monitor.target_kl_settings`), and whether the target is a schedule that has
            decayed to 0 (the callback's at 0, or the algorithm's at the floor it raises 0 to), which sets no size
        """
        if self.target_kl is not None:
            value = target_kl_value(self.target_kl, self.model._current_progress_remaining)
            return max(value, MIN_TARGET_KL), "mean", value == 0
        target = model_target_kl(self.model)
        if target is not None:
            return target, "mean_in_target_convention", target <= MIN_TARGET_KL
        target, source = family_default_target_kl(self.model)
        if not self._announced_default_target:
            self._announced_default_target = True
            message = (
                f"{type(self).__name__}: {type(self.model).__name__} has no KL target; the spike checks use {target:g}, "
                f"{source}. Pass target_kl= to the callback to choose it."
            )
            warn_and_print(message, self.verbose)
        return target, "mean_in_target_convention", False

    def _streak(self, kind: str, condition: bool) -> bool:
        """Count consecutive updates with ``condition``; True when the count reaches ``patience``."""
        self._streaks[kind] = self._streaks[kind] + 1 if condition else 0
        return self._streaks[kind] >= self.patience

    def _on_kl_measured(self, record: dict[str, Any], per_state: np.ndarray) -> None:
        if not self._active:
            return
        raised: list[tuple[str, float, str]] = []
        mean = record["mean"]
        if not np.all(np.isfinite(per_state)):
            raised.append(
                (
                    "nonfinite_kl",
                    mean,
                    "the KL of the update is NaN or infinite: the policy's outputs overflowed. Check observations and "
                    "rewards for NaN/inf (VecCheckNan), lower the learning rate, set max_grad_norm.",
                )
            )
        else:
            raised += self._negative_kl_alarms(record, per_state)
        target, key, ended = self._target()
        if self.target_kl is not None:
            self._record_target(target)
        if key not in record:  # a record that does not carry the conversion: the monitor's KL, and the message says so
            key = "mean"
        kl = record[key]
        convention = self.monitor.convention if key == "mean" else record["target_convention"]
        # a schedule that has decayed to 0 sets no size to hold the KL to: the checks against the target skip the update
        spike = None if ended else self._spike_rule.check(kl / target)
        if spike is not None and math.isfinite(kl):  # a non-finite KL is its own alarm (above)
            what = (
                f"{self.max_kl_factor:g} x target ({target:.3g}) in a single update"
                if spike == "single"
                else f"{self.spike_factor:g} x target ({target:.3g}) for {self.patience} consecutive updates"
            )
            raised.append(
                (
                    "kl_spike",
                    kl,
                    f"the KL ({kl:.3g}, {convention}) exceeded {what}: the policy moves much more than intended. Lower "
                    "the learning rate or the number of epochs, or strengthen the KL control (kl_coef, kl_coef_bounds, "
                    "clip range).",
                )
            )
        raised += self._beta_bound_alarms()
        tail = record.get("tail_ratio", float("nan"))
        if self.tail_ratio is not None and mean > self.min_kl and math.isfinite(tail) and tail > self.tail_ratio:
            raised.append(
                (
                    "heavy_tail",
                    tail,
                    f"p99/mean of the per-state KL is {tail:.3g} > {self.tail_ratio:g}: a few states carry the update's KL. "
                    "Look at those states (KLMonitorCallback(top_k=...)); rare or unnormalised observations are the "
                    "usual cause.",
                )
            )
        grad_ratio = record.get("grad_ratio")
        if self.grad_ratio_band is not None and grad_ratio is not None and math.isfinite(grad_ratio):
            low, high = self.grad_ratio_band
            too_weak = grad_ratio < low and kl > target and not ended
            if self._streak("grad_ratio", too_weak or grad_ratio > high):
                raised.append(
                    (
                        "grad_ratio",
                        grad_ratio,
                        f"the gradient ratio |grad KL term| / |grad surrogate| = {grad_ratio:.3g} stayed outside "
                        f"[{low:g}, {high:g}] for {self.patience} updates (above: the KL penalty drowns the surrogate and "
                        "the policy stops learning; below with the KL above target: the penalty has no grip). "
                        "Check kl_coef and its bounds, the advantage scale and normalisation.",
                    )
                )
        for kind, value, message in raised:
            self._raise(record, kind, value, message)
        self.logger.record("kl/alarms", len(self.alarms))
        record["alarms"] = len(self.alarms)

    def _negative_kl_alarms(self, record: dict[str, Any], per_state: np.ndarray) -> list[tuple[str, float, str]]:
        """
        ``negative_kl``: with an exact or ``k3`` KL, a per-state value below ``-negative_tol`` (neither can be negative);
        with ``k1``, whose single samples can, the update's mean more than ``negative_tol`` plus
        :data:`NEGATIVE_K1_STANDARD_ERRORS` standard errors (:meth:`_k1_standard_error`) below 0 (the expectation of k1
        is the KL, never negative).
        """
        if self.monitor.settings.estimator == "k1":
            lowest = record["mean"]
            standard_error = self._k1_standard_error(per_state)
            if lowest >= -(self.negative_tol + NEGATIVE_K1_STANDARD_ERRORS * standard_error):
                return []
            what = (
                f"the mean k1 estimate of the KL is {lowest:.3g}, {-lowest / max(standard_error, 1e-300):.1f} standard "
                "errors below 0"
            )
        else:
            lowest = record["min"]
            if lowest >= -self.negative_tol:
                return []
            what = f"a KL of {lowest:.3g} < 0 was measured"
        return [
            (
                "negative_kl",
                lowest,
                f"{what}; a KL is never negative, so this is an implementation bug: check the KL direction, the "
                "distribution parameters and the log-probabilities fed to it.",
            )
        ]

    def _k1_standard_error(self, per_state: np.ndarray) -> float:
        """
        The standard error of the update's mean k1 estimate (``per_state``: the monitor's samples, step-major over the
        rollout's ``n_steps * n_envs`` states). Each state's action is an independent draw, unless the policy explores
        with gSDE: the states of one env between two resamplings of its exploration matrix (``sde_sample_freq`` steps,
        or the whole rollout with -1) share one draw of the noise, and their k1 samples move together. The standard
        error is then that of the mean of those blocks' means (``inf``, so no alarm, with a single block: one env and
        one matrix per rollout leave the sign of the mean untestable).

        :return: the standard error (0 with fewer than two states)
        """
        n_states = len(per_state)
        if n_states < 2:
            return 0.0
        n_envs = int(getattr(self.model, "n_envs", 1))
        if not getattr(self.model, "use_sde", False) or n_states % n_envs:
            return float(np.std(per_state, ddof=1) / np.sqrt(n_states))
        n_steps = n_states // n_envs
        frequency = int(getattr(self.model, "sde_sample_freq", -1))
        period = n_steps if frequency <= 0 else min(frequency, n_steps)
        by_step = per_state.reshape(n_steps, n_envs)
        blocks = np.concatenate([by_step[start : start + period].mean(axis=0) for start in range(0, n_steps, period)])
        if len(blocks) < 2:
            return math.inf
        return float(np.std(blocks, ddof=1) / np.sqrt(len(blocks)))

    def _beta_bound_alarms(self) -> list[tuple[str, float, str]]:
        """
        ``beta_at_upper_bound`` / ``beta_at_lower_bound`` for an sb3_kl algorithm whose adapting controller kept beta at a
        bound (a fixed beta is the user's choice, not a controller that ran out of room: never alarmed).
        """
        if not getattr(self.model, "has_kl_coef", False):  # stock agents and KLTRPO's hard constraint have no beta
            return []
        controller = self.model.kl_controller
        if isinstance(controller, FixedKLController):
            return []
        low, high = controller.kl_coef_bounds
        kl_coef = float(controller.kl_coef)
        raised = []
        if self._streak("beta_at_upper_bound", kl_coef >= high):
            raised.append(
                (
                    "beta_at_upper_bound",
                    kl_coef,
                    f"the KL coefficient is pinned at its upper bound ({high:g}) for {self.patience} updates: the penalty "
                    "can no longer hold the KL. Raise kl_coef_bounds, lower the learning rate, or check the target_kl "
                    "is reachable.",
                )
            )
        if self._streak("beta_at_lower_bound", kl_coef <= low):
            raised.append(
                (
                    "beta_at_lower_bound",
                    kl_coef,
                    f"the KL coefficient is pinned at its lower bound ({low:g}) for {self.patience} updates: the KL stays "
                    "below the target band and the penalty does nothing (with a ratio clip, the clip alone limits the "
                    "step). If the KL control should act, lower target_kl (or raise the learning rate); if the clip is "
                    "meant to do the work, this is expected.",
                )
            )
        return raised

    def _raise(self, record: dict[str, Any], kind: str, value: float, message: str) -> None:
        alarm = KLAlarm(int(record["update"]), int(record["num_timesteps"]), kind, float(value), message)
        self.alarms.append(alarm)
        if kind not in self._warned:
            self._warned.add(kind)
            warn_at_user_frame(f"KL alarm '{kind}' at update {alarm.update} ({alarm.num_timesteps} steps): {message}")
        if self.verbose >= 1:
            print(f"{type(self).__name__}: {kind} at update {alarm.update}: {value:.4g}")
        if self.stop_training:
            self._stop = True

    def _on_training_start(self) -> None:
        super()._on_training_start()
        self._stop = False

    def _on_step(self) -> bool:
        if self._stop:
            if self.verbose >= 1:
                print(f"{type(self).__name__}: stopping training after the alarm '{self.alarms[-1].kind}'")
            return False
        return True
