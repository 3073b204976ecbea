"""
KL-coefficient controllers: small objects that hold the penalty coefficient beta and update it
after each policy update from the KL that update produced.

They are plain Python objects with Python-float state, so SB3's ``save()`` keeps them inside the
model's ``data`` and ``load()`` restores them exactly (they are created in ``__init__``, never in
``_setup_model``, which ``load()`` runs *after* restoring attributes).

Expressing well-known rules with :class:`AdaptiveKLController`:

- PPO paper (Schulman et al. 2017, sec. 4): ``kl_adapt_factor=2.0``, ``kl_band=(1 / 1.5, 1.5)``.
- RLlib's PPO: ``kl_adapt_factor=1.5``, ``kl_band=(0.5, 2.0)`` (beta x1.5 above 2 x target, x0.5 below 0.5 x target;
  RLlib shrinks by 0.5 rather than 1 / 1.5, so it is the same rule up to the shrink step).
- sb3_kl default: ``kl_adapt_factor=1.5``, ``kl_band=(0.8, 1.25)``, ``kl_coef_bounds=(1e-4, 10.0)``: a band centred on
  the target on a log scale, so that the KL settles around the target rather than at an edge of a wide band
  (``benchmarks/results/controller_stress.md``).
"""

import math
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

from sb3_kl.common.user_warnings import warn_at_user_frame
from sb3_kl.common.validation import check_int, check_pair, check_positive


class KLController(ABC):
    """
    Base class of the KL-coefficient controllers.

    :param kl_coef: Initial coefficient beta
    :param kl_coef_bounds: beta is kept within (min, max)
    """

    def __init__(self, kl_coef: float = 1.0, kl_coef_bounds: tuple[float, float] = (1e-4, 10.0)):
        self.kl_coef_bounds = check_pair("kl_coef_bounds", kl_coef_bounds)
        kl_coef = check_positive("kl_coef", kl_coef)
        low, high = self.kl_coef_bounds
        if not low <= kl_coef <= high:
            raise ValueError(f"`kl_coef`={kl_coef} lies outside `kl_coef_bounds`={self.kl_coef_bounds}: widen the bounds.")
        self.kl_coef = kl_coef
        self.n_updates = 0
        # beta after each update and the KL that drove it: kept whole so that a resumed run continues the history
        self.kl_history: list[float] = []
        self.kl_coef_history: list[float] = []

    def update(self, kl: float, target_kl: float, n_steps: int = 1, allow_decrease: bool = True) -> float:
        """
        Adjust beta from the KL of the last update.

        :param kl: The measured KL of the update
        :param target_kl: The target KL (current value of the schedule)
        :param n_steps: Environment steps in the update (used by rate-limited controllers)
        :param allow_decrease: False: beta may rise but not fall (an update that a stop ended, whose KL is the stop's
            doing); the KL is recorded either way
        :return: The new beta
        """
        if not math.isfinite(kl):
            raise ValueError(f"The measured KL is {kl}: the policy produced non-finite distributions.")
        next_coef = float(self._next_coef(float(kl), float(target_kl), int(n_steps)))
        self.kl_coef = next_coef if allow_decrease else max(next_coef, self.kl_coef)
        self.n_updates += 1
        self.kl_history.append(float(kl))
        self.kl_coef_history.append(self.kl_coef)
        return self.kl_coef

    @abstractmethod
    def _next_coef(self, kl: float, target_kl: float, n_steps: int) -> float:
        """:return: beta after an update with KL ``kl``"""

    def _clip(self, kl_coef: float) -> float:
        low, high = self.kl_coef_bounds
        return min(max(kl_coef, low), high)

    @property
    def at_upper_bound(self) -> bool:
        """Whether beta is pinned at its upper bound."""
        return self.kl_coef >= self.kl_coef_bounds[1]

    @property
    def near_upper_bound(self) -> bool:
        """
        Whether beta is at its upper bound or one step of the controller below it (a single low-KL update after
        reaching the bound does not count as having left it). Here: at the bound.
        """
        return self.at_upper_bound

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kl_coef={self.kl_coef:.6g}, n_updates={self.n_updates})"


class FixedKLController(KLController):
    """
    Keeps beta constant (a plain KL penalty). The KL of each update is still recorded.

    :param kl_coef: The coefficient beta
    :param kl_coef_bounds: Only checked against ``kl_coef``
    """

    def _next_coef(self, kl: float, target_kl: float, n_steps: int) -> float:
        return self.kl_coef

    @property
    def near_upper_bound(self) -> bool:
        """Never: a fixed beta is the user's choice, not a controller that ran out of room."""
        return False


class AdaptiveKLController(KLController):
    """
    The band rule of the PPO paper: with ``d`` the update's KL (or its moving average over ``kl_window`` updates),
    ``beta <- min(beta * factor, max)`` if ``d > band_hi * target``,
    ``beta <- max(beta / factor, min)`` if ``d < band_lo * target``, unchanged otherwise.

    :param kl_coef: Initial beta
    :param kl_adapt_factor: Multiplicative step, > 1
    :param kl_band: ``(band_lo, band_hi)`` as multiples of the target
    :param kl_coef_bounds: beta is kept within (min, max)
    :param kl_window: Number of recent update KLs averaged to drive beta (1 = the last update only)
    """

    def __init__(
        self,
        kl_coef: float = 1.0,
        kl_adapt_factor: float = 1.5,
        kl_band: tuple[float, float] = (0.8, 1.25),
        kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
        kl_window: int = 1,
    ):
        super().__init__(kl_coef, kl_coef_bounds)
        kl_adapt_factor = check_positive("kl_adapt_factor", kl_adapt_factor)
        if kl_adapt_factor <= 1.0:
            raise ValueError(
                f"`kl_adapt_factor` must be > 1 for the adaptive controller, got {kl_adapt_factor}; "
                "use kl_controller='fixed' for a constant coefficient."
            )
        self.kl_adapt_factor = kl_adapt_factor
        self.kl_band = check_pair("kl_band", kl_band)
        check_int("kl_window", kl_window, 1)
        self.kl_window = kl_window
        self.recent_kls: deque[float] = deque(maxlen=int(kl_window))

    def _next_coef(self, kl: float, target_kl: float, n_steps: int) -> float:
        self.recent_kls.append(kl)
        driving_kl = sum(self.recent_kls) / len(self.recent_kls)
        band_lo, band_hi = self.kl_band
        if driving_kl > band_hi * target_kl:
            return self._clip(self.kl_coef * self.kl_adapt_factor)
        if driving_kl < band_lo * target_kl:
            return self._clip(self.kl_coef / self.kl_adapt_factor)
        return self.kl_coef

    @property
    def near_upper_bound(self) -> bool:
        """Whether beta is at its upper bound or one ``kl_adapt_factor`` step below it."""
        return self.kl_coef * self.kl_adapt_factor >= self.kl_coef_bounds[1] * (1.0 - 1e-9)


class ProportionalKLController(KLController):
    """
    Rate-limited proportional controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences", sec. 2.2), the one TRL used: ``e = clip(KL / target - 1, -kl_error_clip, kl_error_clip)``,
    ``beta <- beta * (1 + e * min(n_steps / kl_horizon, 1))``. The rate limit holds for any batch: an update of more
    environment steps than ``kl_horizon`` counts as one horizon (the paper's rule, for batches far smaller than the
    horizon, would otherwise move beta past zero, to its lower bound in a single update).

    :param kl_coef: Initial beta
    :param kl_horizon: Number of environment steps over which a full error changes beta by a factor (1 + clip); one
        update changes it by at most that factor
    :param kl_error_clip: Bound on the proportional error
    :param kl_coef_bounds: beta is kept within (min, max)
    """

    def __init__(
        self,
        kl_coef: float = 1.0,
        kl_horizon: int = 10_000,
        kl_error_clip: float = 0.2,
        kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
    ):
        super().__init__(kl_coef, kl_coef_bounds)
        self.kl_horizon = check_positive("kl_horizon", kl_horizon)
        self.kl_error_clip = check_positive("kl_error_clip", kl_error_clip)

    @property
    def near_upper_bound(self) -> bool:
        """Whether beta is at its upper bound or one largest step (a factor ``1 + kl_error_clip``) below it."""
        return self.kl_coef * (1.0 + self.kl_error_clip) >= self.kl_coef_bounds[1] * (1.0 - 1e-9)

    def _next_coef(self, kl: float, target_kl: float, n_steps: int) -> float:
        error = min(max(kl / target_kl - 1.0, -self.kl_error_clip), self.kl_error_clip)
        return self._clip(self.kl_coef * (1.0 + error * min(n_steps / self.kl_horizon, 1.0)))


KL_CONTROLLERS: dict[str, type[KLController]] = {
    "adaptive": AdaptiveKLController,
    "fixed": FixedKLController,
    "proportional": ProportionalKLController,
}


def _given(arguments: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """:return: the arguments of ``name=(value, default)`` whose value differs from their default, by name"""
    return {name: value for name, (value, default) in arguments.items() if value != default}


def warn_ignored_arguments(option: str, controller: KLController, **arguments: tuple[Any, Any]) -> None:
    """
    Warn that the arguments given beside a controller object are ignored (the object is used as given).

    :param option: The argument that took the object (``kl_controller``, ``ref_kl_controller``)
    :param controller: The object
    :param arguments: ``name=(value, default)`` of the controller arguments; those that differ from their default warn
    """
    given = _given(arguments)
    if given:
        warn_at_user_frame(
            f"`{option}` is a controller object ({type(controller).__name__}), which is used as given: "
            f"{', '.join(f'`{name}`={value!r}' for name, value in given.items())} is ignored. Set it on the "
            "controller object instead."
        )


#: Controller name -> the optional arguments of :func:`make_kl_controller` it uses (besides ``kl_coef`` and
#: ``kl_coef_bounds``, which every controller takes)
CONTROLLER_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "adaptive": ("kl_adapt_factor", "kl_band", "kl_window"),
    "fixed": (),
    "proportional": ("kl_horizon",),
}


def warn_unused_arguments(kl_controller: str, **arguments: tuple[Any, Any]) -> None:
    """
    Warn that arguments given beside a named controller that does not use them have no effect (a fixed beta has no
    adaptation factor, the band rule no horizon), instead of ignoring them silently.

    :param kl_controller: The controller's name
    :param arguments: ``name=(value, default)`` of the arguments it does not use; those that differ from their
        default warn
    """
    given = _given(arguments)
    if given:
        listed = ", ".join(
            f"`{name}`={value!r} (used by "
            + " and ".join(repr(controller) for controller, names in CONTROLLER_ARGUMENTS.items() if name in names)
            + ")"
            for name, value in given.items()
        )
        warn_at_user_frame(
            f"`kl_controller`={kl_controller!r} does not use {listed}: it has no effect. Leave it at its default, or "
            "choose the controller that uses it."
        )


def _as_tuple(value: Any) -> Any:
    """A list or tuple as a tuple (how a pair compares with its default); anything else unchanged."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def make_kl_controller(
    kl_controller: "str | KLController",
    kl_coef: float = 1.0,
    kl_adapt_factor: float = 1.5,
    kl_band: tuple[float, float] = (0.8, 1.25),
    kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
    kl_window: int = 1,
    kl_horizon: int = 10_000,
) -> KLController:
    """
    Build a controller from an algorithm's keyword arguments.

    :param kl_controller: ``"adaptive"``, ``"fixed"``, ``"proportional"`` or a ready :class:`KLController`
        (which is used as given; the other arguments are then ignored)
    :return: The controller
    """
    # name -> (value, default); a list from a YAML config is the same choice as the tuple, and a value that is no pair
    # is left to the controller's own checks
    arguments = {
        "kl_coef": (kl_coef, 1.0),
        "kl_adapt_factor": (kl_adapt_factor, 1.5),
        "kl_band": (_as_tuple(kl_band), (0.8, 1.25)),
        "kl_coef_bounds": (_as_tuple(kl_coef_bounds), (1e-4, 10.0)),
        "kl_window": (kl_window, 1),
        "kl_horizon": (kl_horizon, 10_000),
    }
    if isinstance(kl_controller, KLController):
        warn_ignored_arguments("kl_controller", kl_controller, **arguments)
        return kl_controller
    if not isinstance(kl_controller, str) or kl_controller not in KL_CONTROLLERS:
        raise ValueError(
            f"Unknown `kl_controller`={kl_controller!r}: choose one of {', '.join(map(repr, KL_CONTROLLERS))} "
            "or pass a KLController instance."
        )
    # Checked whatever the controller, so that a bad value does not wait for a switch to 'proportional'
    check_positive("kl_horizon", kl_horizon)
    used = ("kl_coef", "kl_coef_bounds", *CONTROLLER_ARGUMENTS[kl_controller])
    warn_unused_arguments(kl_controller, **{name: pair for name, pair in arguments.items() if name not in used})
    if kl_controller == "adaptive":
        return AdaptiveKLController(kl_coef, kl_adapt_factor, kl_band, kl_coef_bounds, kl_window)
    if kl_controller == "fixed":
        return FixedKLController(kl_coef, kl_coef_bounds)
    if kl_controller == "proportional":
        return ProportionalKLController(kl_coef, kl_horizon, kl_coef_bounds=kl_coef_bounds)
    raise ValueError(
        f"Unknown `kl_controller`={kl_controller!r}: choose one of {', '.join(map(repr, KL_CONTROLLERS))} "
        "or pass a KLController instance."
    )
