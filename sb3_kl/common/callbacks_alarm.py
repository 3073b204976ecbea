"""
KLAlarmCallback: the known signs of a failing KL control as logged, warned and recorded alarms.
Re-exported by :mod:`sb3_kl.callbacks`.
"""

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from stable_baselines3.common.type_aliases import Schedule
from stable_baselines3.common.utils import FloatSchedule

from sb3_kl.common.callbacks_monitor import KLMonitorCallback, MonitorUser, model_target_kl
from sb3_kl.common.validation import check_bool, check_int, check_pair, check_positive


@dataclass
class KLAlarm:
    """
    One alarm raised by :class:`KLAlarmCallback`.

    :param update: Index of the update (as counted by the monitor)
    :param num_timesteps: Environment steps at the time
    :param kind: ``"negative_kl"``, ``"nonfinite_kl"``, ``"kl_spike"``, ``"beta_at_upper_bound"``, ``"heavy_tail"``
        or ``"grad_ratio"``
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

    - ``negative_kl``: a per-state KL below ``-negative_tol`` (the mean, for the ``k1`` estimator, whose single
      samples may be negative): an exact KL is never negative, so the KL implementation or the inputs are wrong;
    - ``nonfinite_kl``: the KL is NaN or infinite (the policy's outputs overflowed);
    - ``kl_spike``: mean KL > ``spike_factor`` x target for ``patience`` consecutive updates (target: ``target_kl``,
      or else the algorithm's own target when it has one; no check without a target);
    - ``beta_at_upper_bound``: the sb3_kl algorithm's KL coefficient sits at its upper bound for ``patience``
      consecutive updates (the penalty cannot hold the KL any more);
    - ``heavy_tail``: p99 / mean of the per-state KL > ``tail_ratio`` (a few states carry the update's KL);
      only checked when the mean KL exceeds ``min_kl`` (tiny updates have meaningless ratios);
    - ``grad_ratio``: the sb3_kl algorithm's ``train/kl_grad_ratio`` (|grad of the KL term| / |grad of the
      surrogate|) outside ``grad_ratio_band`` for ``patience`` consecutive updates: above the band the penalty
      drowns the surrogate (the policy stops learning); below it while the KL is above target, the penalty has no
      grip. (A small ratio with a KL below target is normal: the KL's gradient vanishes with the KL itself.)

    Each alarm is appended to :attr:`alarms` (:class:`KLAlarm` records), warned once per kind with ``warnings.warn``
    (what to check), counted in ``kl/alarms`` (cumulative count, logged after every measured update) and printed when
    ``verbose >= 1``. With ``stop_training=True`` the next ``_on_step`` returns False, which ends ``learn()`` before the
    next update.

    :param target_kl: KL target for the spike check (number or schedule of progress remaining); None: the algorithm's
    :param spike_factor: How many times the target counts as a spike
    :param patience: Number of consecutive updates a spike, a pinned beta or a gradient-ratio drift must last
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
        tail_ratio: float | None = 50.0,
        grad_ratio_band: tuple[float, float] | None = (0.01, 10.0),
        negative_tol: float = 1e-5,
        min_kl: float = 1e-6,
        stop_training: bool = False,
        monitor: KLMonitorCallback | None = None,
        verbose: int = 0,
    ):
        super().__init__(monitor, verbose)
        if target_kl is not None and not callable(target_kl):
            check_positive("target_kl", target_kl)
        check_positive("spike_factor", spike_factor)
        check_int("patience", patience, 1)
        check_positive("tail_ratio", tail_ratio, allow_none=True)
        check_positive("negative_tol", negative_tol)
        check_positive("min_kl", min_kl)
        check_bool("stop_training", stop_training)
        self.target_kl = FloatSchedule(target_kl) if target_kl is not None else None
        self.spike_factor = float(spike_factor)
        self.patience = patience
        self.tail_ratio = tail_ratio
        self.grad_ratio_band = check_pair("grad_ratio_band", grad_ratio_band) if grad_ratio_band is not None else None
        self.negative_tol = float(negative_tol)
        self.min_kl = float(min_kl)
        self.stop_training = stop_training
        self.alarms: list[KLAlarm] = []
        self._warned: set[str] = set()
        self._streaks = {"kl_spike": 0, "beta_at_upper_bound": 0, "grad_ratio": 0}
        self._stop = False

    def _target(self) -> float | None:
        if self.target_kl is not None:
            return float(self.target_kl(self.model._current_progress_remaining))
        return model_target_kl(self.model)

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
            sample_k1 = self.monitor.settings.estimator == "k1"
            lowest = mean if sample_k1 else record["min"]
            if lowest < -self.negative_tol:
                raised.append(
                    (
                        "negative_kl",
                        lowest,
                        f"a KL of {lowest:.3g} < 0 was measured; an exact KL is never negative, so this is an implementation "
                        "bug: check the KL direction, the distribution parameters and the log-probabilities fed to it.",
                    )
                )
        target = self._target()
        if target is not None and self._streak("kl_spike", not math.isfinite(mean) or mean > self.spike_factor * target):
            raised.append(
                (
                    "kl_spike",
                    mean,
                    f"the KL ({mean:.3g}) exceeded {self.spike_factor:g} x target ({target:.3g}) for {self.patience} "
                    "consecutive updates: the policy moves much more than intended. Lower the learning rate or the "
                    "number of epochs, or strengthen the KL control (kl_coef, kl_coef_bounds, clip range).",
                )
            )
        controller = getattr(self.model, "kl_controller", None)
        if controller is not None and self._streak("beta_at_upper_bound", bool(getattr(controller, "at_upper_bound", False))):
            raised.append(
                (
                    "beta_at_upper_bound",
                    float(self.model.kl_coef),
                    f"the KL coefficient is pinned at its upper bound ({controller.kl_coef_bounds[1]:g}) for {self.patience} "
                    "updates: the penalty can no longer hold the KL. Raise kl_coef_bounds, lower the learning rate, "
                    "or check the target_kl is reachable.",
                )
            )
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
            too_weak = grad_ratio < low and target is not None and mean > target
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

    def _raise(self, record: dict[str, Any], kind: str, value: float, message: str) -> None:
        alarm = KLAlarm(int(record["update"]), int(record["num_timesteps"]), kind, float(value), message)
        self.alarms.append(alarm)
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"KL alarm '{kind}' at update {alarm.update} ({alarm.num_timesteps} steps): {message}", stacklevel=2)
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
