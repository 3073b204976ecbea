"""
Argument checks shared by the algorithms, the controllers, the reference-policy options and the callbacks.

Every helper raises at construction with a message that names the argument and says what to pass instead:
``TypeError`` for a value of the wrong type, ``ValueError`` for a value of the right type out of range. The
checks SB3's own algorithms make with ``assert`` (e.g. ``batch_size > 1``) stay asserts in the algorithms.
"""

import math
import os
from typing import Any
from collections.abc import Callable

import numpy as np
from stable_baselines3.common.utils import FloatSchedule


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (Python or numpy, ``bool`` excluded)."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))


def check_number(name: str, value: Any, hint: str = "a number") -> float:
    """
    :raises TypeError: unless ``value`` is a real number
    :return: ``value`` as a float
    """
    if not is_number(value):
        raise TypeError(f"`{name}` must be {hint}, got {value!r} ({type(value).__name__}).")
    return float(value)


def check_finite(name: str, value: Any) -> float:
    """
    :raises TypeError: unless ``value`` is a number
    :raises ValueError: if it is NaN or infinite
    :return: ``value`` as a float
    """
    number = check_number(name, value, "a finite number")
    if not math.isfinite(number):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    return number


def check_positive(name: str, value: Any, allow_none: bool = False, allow_inf: bool = False, hint: str = "") -> float | None:
    """
    :param allow_none: Whether None is accepted (returned as is)
    :param allow_inf: Whether ``+inf`` is accepted
    :param hint: Appended to the message, e.g. ``" (or None to disable it)"``
    :raises TypeError: unless ``value`` is a number (or None when allowed)
    :raises ValueError: unless it is > 0, not NaN, and finite (unless ``allow_inf``)
    :return: ``value`` as a float (None if None)
    """
    if value is None and allow_none:
        return None
    what = "a positive number" if allow_inf else "a positive finite number"
    number = check_number(name, value, what + hint)
    if math.isnan(number) or number <= 0 or (math.isinf(number) and not allow_inf):
        raise ValueError(f"`{name}` must be {what}{hint}, got {value!r}.")
    return number


def check_non_negative(name: str, value: Any, hint: str = "") -> float:
    """
    :raises TypeError: unless ``value`` is a number
    :raises ValueError: unless it is finite and >= 0
    :return: ``value`` as a float
    """
    number = check_number(name, value, "a finite number >= 0" + hint)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"`{name}` must be a finite number >= 0{hint}, got {value!r}.")
    return number


def check_range(
    name: str, value: Any, low: float, high: float | None, closed_low: bool = True, closed_high: bool = False, hint: str = ""
) -> float:
    """
    :param low: Lower end of the interval
    :param high: Upper end (None: no upper end, the value must then be finite)
    :param closed_low: Whether ``low`` itself is accepted
    :param closed_high: Whether ``high`` itself is accepted
    :param hint: How the interval is described in the message (default: built from the ends)
    :raises TypeError: unless ``value`` is a number
    :raises ValueError: unless it is finite and within the interval
    :return: ``value`` as a float
    """
    if not hint:
        upper = "inf)" if high is None else f"{high}{']' if closed_high else ')'}"
        hint = f"in {'[' if closed_low else '('}{low}, {upper}"
    number = check_number(name, value, hint)
    ok = (
        math.isfinite(number)
        and (number >= low if closed_low else number > low)
        and (high is None or (number <= high if closed_high else number < high))
    )
    if not ok:
        raise ValueError(f"`{name}` must be {hint}, got {value!r}.")
    return number


def check_probability(name: str, value: Any) -> float:
    """:raises TypeError, ValueError: unless ``value`` is a number in [0, 1] (NaN rejected)"""
    return check_range(name, value, 0.0, 1.0, closed_low=True, closed_high=True, hint="a number in [0, 1]")


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """
    :param minimum: Smallest value accepted (None: any integer)
    :raises TypeError: unless ``value`` is an integer (Python or numpy, ``bool`` excluded)
    :raises ValueError: if it is below ``minimum``
    :return: ``value`` as an int
    """
    what = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be {what}, got {value!r} ({type(value).__name__}).")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be {what}, got {value!r}.")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """
    :raises TypeError: unless ``value`` is True or False (a truthy string such as ``"yes"`` is not accepted)
    :return: ``value`` as a bool
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    return bool(value)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """:raises ValueError: when ``value`` is not one of ``choices``, naming the argument"""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Unknown `{name}`={value!r}: choose one of {', '.join(repr(c) for c in choices)}.")


def check_pair(name: str, value: Any, positive: bool = True) -> tuple[float, float]:
    """
    A pair ``(low, high)`` with ``low < high``; with ``positive`` both ends must be positive finite numbers.

    :raises ValueError: naming the argument when it is not such a pair
    :return: ``(low, high)`` as floats
    """
    try:
        low, high = value
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a pair (low, high), got {value!r}.") from None
    if positive:
        for index, end in enumerate((low, high)):
            if not is_number(end) or not math.isfinite(end) or end <= 0:
                raise ValueError(
                    f"`{name}` must be a pair (low, high) of positive finite numbers, got {name}[{index}]={end!r}."
                )
    else:
        low, high = check_finite(f"{name}[0]", low), check_finite(f"{name}[1]", high)
    low, high = float(low), float(high)
    if not low < high:
        raise ValueError(f"`{name}` is inverted or empty: low={low} must be < high={high}; pass them as (low, high).")
    return low, high


def check_quantiles(name: str, value: Any) -> tuple[float, ...]:
    """
    A tuple of distinct quantiles strictly between 0 and 1 (each logged under its own key, e.g. ``p99``).

    :raises ValueError: naming the argument when an entry is out of range or repeated
    :return: the quantiles as floats, in the given order
    """
    try:
        quantiles = tuple(value)
    except TypeError:
        raise ValueError(f"`{name}` must be a tuple of quantiles such as (0.5, 0.9, 0.99), got {value!r}.") from None
    for q in quantiles:
        if not is_number(q) or not 0.0 < q < 1.0:
            raise ValueError(f"`{name}` must lie strictly between 0 and 1, got {q!r}.")
    floats = tuple(float(q) for q in quantiles)
    if len(set(floats)) < len(floats):
        raise ValueError(f"`{name}` lists a quantile twice ({value!r}): each one is logged under its own key.")
    return floats


def check_schedule(name: str, value: Any, allow_none: bool = False, allow_zero_at_end: bool = False) -> None:
    """
    A positive finite number, or a schedule (a callable of the progress remaining, 1 -> 0) whose values at the
    start (progress 1.0) and at the end (progress 0.0) are positive finite numbers.

    :param allow_none: Whether None is accepted
    :param allow_zero_at_end: Whether a schedule may reach 0 at the end of training (e.g. SB3's linear schedules of
        the learning rate or clip range)
    :raises TypeError: unless ``value`` is a number or a schedule returning numbers
    :raises ValueError: when the number, or the schedule's value at progress 1.0 or 0.0, is not positive and finite
    """
    if value is None:
        if allow_none:
            return
        raise ValueError(f"`{name}` must not be None: pass a positive number or a schedule.")
    schedule: Callable[[float], Any] | None = value if callable(value) else None
    samples = {progress: schedule(progress) for progress in (1.0, 0.0)} if schedule is not None else {1.0: value}
    for progress, sample in samples.items():
        if not is_number(sample):
            raise TypeError(
                f"`{name}` must be a number or a schedule returning numbers, got {sample!r} "
                f"({type(sample).__name__}) at progress_remaining={progress}."
            )
        zero_ok = allow_zero_at_end and schedule is not None and progress == 0.0
        if not math.isfinite(sample) or sample < 0 or (sample == 0 and not zero_ok):
            raise ValueError(f"`{name}` must be positive and finite, got {sample!r} at progress_remaining={progress}.")


def as_schedule(value: Any) -> FloatSchedule:
    """
    SB3's picklable ``FloatSchedule`` of a number or a schedule already checked by :func:`check_schedule`; a numpy
    number becomes a Python float first (``FloatSchedule`` asserts a Python ``float`` or ``int``).
    """
    if isinstance(value, FloatSchedule):
        return value
    return FloatSchedule(float(value) if is_number(value) else value)


def scheduled_value(
    name: str, schedule: Callable[[float], Any], progress_remaining: float, allow_zero: bool = False
) -> float:
    """
    The value of a schedule at ``progress_remaining``, checked where it is used: :func:`check_schedule` samples only
    the start and the end, and a value in between that is NaN or negative would otherwise train silently (a negative
    learning rate ascends the loss, a negative clip range clips everything).

    Past the budget (``progress_remaining < 0``: ``learn()`` ends with the rollout in which the budget is reached, and
    SB3 trains on it) a linear schedule ``progress_remaining * initial`` goes below 0, and SB3's algorithms use that
    value: there only finiteness is checked, so that training stays the stock algorithm's.

    :param allow_zero: Whether 0 is a valid value (a linear schedule's end)
    :raises ValueError: naming the argument and the progress, unless the value is a finite number > 0 (>= 0 with
        ``allow_zero``; any finite number past the budget)
    """
    value = schedule(progress_remaining)
    valid = is_number(value) and math.isfinite(value)
    if valid and progress_remaining >= 0:
        valid = value > 0 or (value == 0 and allow_zero)
    if not valid:
        raise ValueError(
            f"The schedule of `{name}` returned {value!r} at progress_remaining={progress_remaining:.6g}: it must stay "
            f"a {'finite number >= 0' if allow_zero else 'positive finite number'} over the whole training."
        )
    return float(value)


#: The smallest KL target used: where a ``target_kl`` schedule reaches 0 (a linear decay to 0 at the end of training:
#: rl-zoo's ``lin_0.02``, or ``lambda progress: 0.02 * progress``), the update uses this floor
MIN_TARGET_KL = 1e-8


def target_kl_value(schedule: Callable[[float], Any], progress_remaining: float) -> float:
    """
    The value of a ``target_kl`` schedule at ``progress_remaining``, checked as :func:`scheduled_value` checks it (0
    allowed). A ``target_kl`` schedule is defined over the training: past the budget (``progress_remaining < 0``, where
    SB3 trains on the last rollout when it overshoots the budget) it is read at its end, progress 0, so that a linear
    decay gives its end value there rather than a negative one (or, for a square root, NaN).

    :raises ValueError: naming ``target_kl``, unless the value is a finite number >= 0
    """
    return scheduled_value("target_kl", schedule, max(progress_remaining, 0.0), allow_zero=True)


def scheduled_target_kl(schedule: Callable[[float], Any], progress_remaining: float) -> float:
    """
    The KL target of a ``target_kl`` schedule at ``progress_remaining`` (:func:`target_kl_value`), raised to
    :data:`MIN_TARGET_KL`: where a schedule decays to 0, the last update uses the floor.

    :raises ValueError: naming ``target_kl``, unless the value is a finite number >= 0
    """
    return max(target_kl_value(schedule, progress_remaining), MIN_TARGET_KL)


def check_path(name: str, value: Any, allow_none: bool = True) -> None:
    """:raises TypeError: unless ``value`` is a str, an ``os.PathLike`` (or None when allowed)"""
    if value is None and allow_none:
        return
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a path (str or os.PathLike){' or None' if allow_none else ''}, got {value!r}.")


class ArgumentFileNotFoundError(FileNotFoundError, ValueError):
    """A path argument names no file: a ``FileNotFoundError`` and a ``ValueError`` (the argument's value is wrong)."""


def check_existing_file(name: str, path: "str | os.PathLike", suffix: str = "") -> None:
    """
    :param suffix: A suffix the loader appends when the path lacks it (SB3's ``load`` adds ``.zip``)
    :raises ArgumentFileNotFoundError: when neither ``path`` nor ``path + suffix`` is a file
    """
    text = os.fspath(path)
    if os.path.isfile(text) or (suffix and not text.endswith(suffix) and os.path.isfile(text + suffix)):
        return
    raise ArgumentFileNotFoundError(
        f"`{name}`={text!r}: no such file. Pass the path of an existing file"
        + (f" (the {suffix!r} suffix may be left out)" if suffix else "")
        + "."
    )

