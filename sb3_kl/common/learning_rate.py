"""
``learning_rate="auto"``: the learning rate adapted from the exact KL so that each update's KL meets the target, from
below as well as from above, with beta's penalty still shaping the step.

Who does what:

- **The rate sets the first epoch's KL.** After the update's first epoch, one no-grad pass measures the exact KL over
  the rollout's states; the next update's rate is this one times :func:`rate_factor`, which would bring that KL to
  :func:`first_epoch_share` of the target, ``1 / n_epochs`` (from the median of recent updates, :func:`recent_kl`).
  The rate so stays high enough for the penalty to shape the update's later epochs, as in KLPPO at a well-chosen fixed
  rate: a rate low enough to meet the target alone made HalfCheetah-v5's return swing (``docs/guide/learning_rate.md``).
  Where the later epochs add too little and the update ends below the band, the rate rises towards the one whose
  update meets the target (from the updates' unscaled KLs), if that is larger.
- **Beta and the hinge hold the update's KL** from the KL of the update as the epochs left it.
- **A guard lands the rest in the band.** An update whose KL ends outside :data:`GUARD_BAND` x target has its whole
  parameter change ``delta`` scaled by a factor found on the exact KL (:func:`find_step_scale`):
  ``theta_old + alpha * delta`` lands just inside the band (:data:`GUARD_AIM`), shrinking a step that went too far and
  extending (at most :data:`MAX_STEP_SCALE`) one that fell short. Beta adapts from the unscaled KL, so the guard stays
  a correction.

The rate rises only while the first epoch's KL still follows it (:func:`rate_follows_kl`): where the clip range already
stops the update, a higher rate buys no KL, and raising it anyway would wind the rate up without end.
Only the parameters the action distribution depends on are scaled; the value function keeps its whole update
(:func:`value_only_parameters`), and trains in an optimizer group of its own (:func:`split_value_group`) at the
adapted rate or the starting one, whichever is larger: its loss has no KL, so the policy's rate falling to meet the
target does not slow it.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch import nn

#: ``learning_rate="auto"`` starts at SB3 PPO's default rate
DEFAULT_AUTO_LEARNING_RATE = 3e-4
#: The default ``lr_bounds``: wide, since the KL, not the bounds, sets the rate
DEFAULT_LR_BOUNDS = (1e-6, 0.1)
#: The key marking the optimizer group of the value function's own parameters (``learning_rate="auto"``)
VALUE_GROUP_KEY = "value_function"
#: The largest factor an update's step is extended by (a rate far too small then grows by this factor per update)
MAX_STEP_SCALE = 4.0
#: The largest factor the rate grows or shrinks by in one update
MAX_RATE_FACTOR = 16.0
#: How far (a factor either way) the first epoch's KL may lie from its goal for the rate to follow it damped
#: (:func:`rate_factor`)
DAMPED_WITHIN = 16.0
#: The updates whose KLs set the next rate (:func:`recent_kl`)
MEDIAN_WINDOW = 5
#: The band, as multiples of the target, outside which an update's step is scaled (:func:`find_step_scale`)
GUARD_BAND = (0.5, 2.0)
#: Where the guard's scale aims, as multiples of the target, from below and from above: just inside the band, so the
#: correction is the least that lands the update in it
GUARD_AIM = (0.6, 1.6)
#: The smallest factor a step is shrunk to (a step whose KL stays above the band even there is kept at this scale)
MIN_STEP_SCALE = 1.0 / 1024
#: KL evaluations the search may spend beyond the update's own measurement
MAX_SCALE_EVALUATIONS = 6
#: The recent updates whose rates and first-epoch KLs tell whether the KL still follows the rate (:func:`rate_follows_kl`)
RATE_RESPONSE_WINDOW = 10
#: The least slope of log KL against log rate over that window for the rate to keep rising (2 for a small step, where
#: the KL is quadratic in it; near 0 where the clip range holds the update)
MIN_RATE_RESPONSE = 1.0


class AdaptiveLRSchedule:
    """
    A learning-rate "schedule" returning the value set by the adaptation (``learning_rate="auto"`` or
    :class:`~sb3_kl.callbacks.KLAdaptiveLRCallback`), whatever the progress.
    A class (not a lambda) so that a model saved with it can be pickled.

    :param learning_rate: The current learning rate
    """

    def __init__(self, learning_rate: float):
        self.learning_rate = float(learning_rate)

    def __call__(self, progress_remaining: float) -> float:
        return self.learning_rate

    def __repr__(self) -> str:
        return f"AdaptiveLRSchedule({self.learning_rate:.6g})"


def parse_auto_learning_rate(value: object) -> float | None:
    """
    :param value: A ``learning_rate`` as given to an algorithm
    :return: the starting rate of ``"auto"`` (:data:`DEFAULT_AUTO_LEARNING_RATE`) or ``"auto_<start>"``; None for a
        number or a schedule
    :raises ValueError: for any other string, or a start that is not a positive finite number
    """
    if not isinstance(value, str):
        return None
    hint = 'Use "auto" (adapted from the KL, starting at 3e-4), "auto_<start>" such as "auto_1e-3", a number or a schedule.'
    if value == "auto":
        return DEFAULT_AUTO_LEARNING_RATE
    prefix, sep, text = value.partition("_")
    try:
        start = float(text) if prefix == "auto" and sep else float("nan")
    except ValueError:
        start = float("nan")
    if not (math.isfinite(start) and start > 0):
        raise ValueError(f"`learning_rate`={value!r} is not a learning rate. {hint}")
    return start


def find_step_scale(
    kl_at: Callable[[float], float],
    kl_full: float,
    target: float,
    band: tuple[float, float],
    max_scale: float = MAX_STEP_SCALE,
    max_evaluations: int = MAX_SCALE_EVALUATIONS,
) -> tuple[float, float]:
    """
    The factor ``alpha`` that brings the update's KL into ``[band[0], band[1]] * target``.

    Until the target is bracketed, each guess assumes the KL quadratic in the step (``alpha * sqrt(target / KL)``; a
    non-finite KL halves the scale); once a scale below and one above the band are known, the guess interpolates
    between them on log-log axes, kept inside the bracket (far along a long step the KL is far from quadratic). The
    search stops in the band, at ``max_scale`` with the KL still below it, or after ``max_evaluations``, and returns the
    evaluated scale whose KL is closest to the target on a log scale.

    :param kl_at: The KL of the step scaled by a factor (sets the policy's parameters to that point and measures)
    :param kl_full: The KL of the whole step (``alpha = 1``), already measured
    :param target: The target KL (> 0)
    :param band: ``(low, high)`` multiples of the target that are accepted
    :param max_scale: The largest factor tried
    :param max_evaluations: The most calls of ``kl_at``
    :return: ``(alpha, kl)``: the chosen factor and its KL (the policy's parameters are left at the last evaluated
        point, which the caller resets to the chosen one)
    """
    low, high = band[0] * target, band[1] * target
    points = [(1.0, kl_full)]
    below: tuple[float, float] | None = None  # the largest scale known to fall short of the band
    above: tuple[float, float] | None = None  # the smallest scale known to overshoot it (or to overflow)
    for _ in range(max_evaluations + 1):
        alpha, kl = points[-1]
        finite = math.isfinite(kl)
        if finite and low <= kl <= high:
            break
        if finite and kl < low:
            below = (alpha, kl) if below is None or alpha > below[0] else below
        else:
            above = (alpha, kl) if above is None or alpha < above[0] else above
        if len(points) > max_evaluations:
            break
        if below is not None and above is not None:
            guess = _between(below, above, target)
        elif below is not None:
            guess = min(below[0] * math.sqrt(target / below[1]) if below[1] > 0 else max_scale, max_scale)
        else:
            assert above is not None
            guess = above[0] * math.sqrt(target / above[1]) if math.isfinite(above[1]) else above[0] / 2
            guess = max(guess, MIN_STEP_SCALE)
        if any(guess == a for a, _ in points):  # at a limit of the scale: nothing left to try
            break
        points.append((guess, float(kl_at(guess))))

    def distance(point: tuple[float, float]) -> float:
        return abs(math.log(point[1] / target)) if math.isfinite(point[1]) and point[1] > 0 else math.inf

    return min(points, key=distance)


def _between(below: tuple[float, float], above: tuple[float, float], target: float) -> float:
    """
    A scale between ``below`` and ``above`` (each ``(alpha, kl)``): where the line through them on log-log axes
    meets ``target``, kept off the ends (at least a fifth of the log-interval away), else their geometric mean.
    """
    (a0, k0), (a1, k1) = below, above
    l0, l1 = math.log(a0), math.log(a1)
    middle = math.exp((l0 + l1) / 2)
    if not (math.isfinite(k1) and k0 > 0 and k1 > k0):
        return middle
    fraction = (math.log(target) - math.log(k0)) / (math.log(k1) - math.log(k0))
    return math.exp(l0 + min(max(fraction, 0.2), 0.8) * (l1 - l0))


def first_epoch_share(n_epochs: int) -> float:
    """
    The share of the target the rate gives an update's first epoch: ``1 / n_epochs``, the target spread evenly over the
    epochs (the whole target for a one-epoch update). A fixed share asks too much of a first epoch that is a small part
    of the update: at rl-zoo's CartPole-v1 settings (20 epochs of one minibatch) a quarter of the target for one step
    of twenty wound the rate far above what the update needs (``docs/guide/learning_rate.md``).

    :param n_epochs: The algorithm's ``n_epochs``
    """
    return 1.0 / n_epochs


def rate_factor(kl: float, goal: float) -> float:
    """
    The factor the next update's learning rate is multiplied by, from the one that would have brought the first
    epoch's ``kl`` to ``goal``: ``sqrt(goal / kl)`` (the KL is quadratic in a small step), within ``1 / MAX_RATE_FACTOR``
    and :data:`MAX_RATE_FACTOR`. Within :data:`DAMPED_WITHIN` x of the goal, its square root: the first epoch's KL
    varies several-fold from one rollout to the next, and a rate following it in full would swing with it.

    :param kl: The exact KL after the first epoch (after the update, when it has one epoch), or of the update before
        the guard's scale, as :func:`recent_kl` expects it at the current rate
    :param goal: What that KL should be: :func:`first_epoch_share` x target (the target for a one-epoch update), or
        the target for the update's unscaled KL
    """
    if not (math.isfinite(kl) and kl > 0):
        return 1.0 / MAX_RATE_FACTOR if not math.isfinite(kl) else MAX_RATE_FACTOR
    factor = min(max(math.sqrt(goal / kl), 1.0 / MAX_RATE_FACTOR), MAX_RATE_FACTOR)
    return math.sqrt(factor) if goal / DAMPED_WITHIN <= kl <= DAMPED_WITHIN * goal else factor


def recent_kl(history: Sequence[tuple[float, float]], rate: float, window: int = MEDIAN_WINDOW) -> float:
    """
    The KL to expect at ``rate``: the median over the last ``window`` updates of their KL (of the first epoch, or of
    the update before the guard's scale), each rescaled from its own rate as ``KL * (rate / its rate) ** 2`` (the KL is
    quadratic in a small step). One rollout whose first epoch barely moved the policy, or moved it far, then does not
    swing the rate.

    :param history: ``(rate, KL)`` of recent updates, the latest last
    :param rate: The rate the next update's factor applies to (the latest update's)
    """
    rescaled = [kl * (rate / old_rate) ** 2 for old_rate, kl in history[-window:] if old_rate > 0 and not math.isnan(kl)]
    return float(np.median(rescaled)) if rescaled else math.nan


def in_guard_band(kl: float, target: float) -> bool:
    """Whether an update's KL lies in :data:`GUARD_BAND` x ``target`` (False when not finite): then no step scale."""
    return GUARD_BAND[0] * target <= kl <= GUARD_BAND[1] * target


def guard_aim(kl: float, target: float) -> tuple[float, tuple[float, float]]:
    """
    What the guard's :func:`find_step_scale` aims at for an update whose KL ``kl`` lies outside the band: the
    :data:`GUARD_AIM` on its side (above for a non-finite KL), with the band as multiples of that aim.

    :return: ``(aim, band)``, the ``target`` and ``band`` arguments of :func:`find_step_scale`
    """
    aim = (GUARD_AIM[0] if kl < GUARD_BAND[0] * target else GUARD_AIM[1]) * target
    return aim, (GUARD_BAND[0] * target / aim, GUARD_BAND[1] * target / aim)


def rate_follows_kl(rates: Sequence[float], kls: Sequence[float], min_slope: float = MIN_RATE_RESPONSE) -> bool:
    """
    Whether raising the learning rate still raises the KL of the first epoch: the least-squares slope of log KL
    against log rate over recent updates is at least ``min_slope``. True while their rates are too alike (within a
    factor of 2) to tell.

    :param rates: The learning rates of recent updates
    :param kls: The KL after each of those updates' first epoch
    """
    rates_, kls_ = np.asarray(rates, dtype=float), np.asarray(kls, dtype=float)
    usable = np.isfinite(rates_) & np.isfinite(kls_) & (rates_ > 0) & (kls_ > 0)
    log_rates, log_kls = np.log(rates_[usable]), np.log(kls_[usable])
    if len(log_rates) < 2 or np.ptp(log_rates) < math.log(2.0):
        return True
    centred = log_rates - log_rates.mean()
    return float(centred @ (log_kls - log_kls.mean()) / (centred @ centred)) >= min_slope


def value_only_parameters(policy: nn.Module) -> list[nn.Parameter]:
    """
    The parameters only the value function uses (SB3's and sb3-contrib's actor-critic policies): the guard's step
    scale of ``learning_rate="auto"`` leaves them at the end of the update, since the KL does not depend on them.

    :param policy: An actor-critic policy
    """
    extractor = getattr(policy, "mlp_extractor", None)
    modules = [
        getattr(policy, "value_net", None),
        getattr(extractor, "value_net", None),
        getattr(policy, "lstm_critic", None),
        getattr(policy, "critic", None),
    ]
    if not getattr(policy, "share_features_extractor", True):
        modules.append(getattr(policy, "vf_features_extractor", None))
    found: dict[int, nn.Parameter] = {}
    for module in modules:
        if isinstance(module, nn.Module):
            found.update((id(param), param) for param in module.parameters())
    return list(found.values())


def split_value_group(policy: nn.Module) -> None:
    """
    Move the value-only parameters (:func:`value_only_parameters`) of the policy's optimizer into a group of their own,
    marked by :data:`VALUE_GROUP_KEY`, with the same settings. Nothing happens when the optimizer already has more than
    one group (split already, or the user's own groups) or the policy has no value-only parameters.

    :param policy: An actor-critic policy with its ``optimizer``
    """
    optimizer = policy.optimizer
    if len(optimizer.param_groups) != 1:
        return
    value = {id(param) for param in value_only_parameters(policy)}
    group = optimizer.param_groups[0]
    params = list(group["params"])
    if not any(id(param) in value for param in params):
        return
    group["params"] = [param for param in params if id(param) not in value]
    settings = {key: setting for key, setting in group.items() if key != "params"}
    optimizer.add_param_group({**settings, "params": [param for param in params if id(param) in value], VALUE_GROUP_KEY: True})


def optimizer_state_in_layout(saved: dict[str, Any], policy: nn.Module) -> dict[str, Any]:
    """
    A saved optimizer state rearranged for the policy's optimizer when one of them has the value group of
    :func:`split_value_group` and the other not (a model saved with ``learning_rate="auto"`` loaded with a fixed rate,
    or the other way round, or a stock PPO zip): each parameter keeps its own state (Adam's moments). Returned unchanged
    when the layouts already agree or are not these two.

    :param saved: ``optimizer.state_dict()`` of the saved model
    :param policy: The policy (same architecture) whose optimizer will load it
    """
    groups, current = saved.get("param_groups", []), policy.optimizer.param_groups
    saved_split = [bool(group.get(VALUE_GROUP_KEY)) for group in groups]
    current_split = [bool(group.get(VALUE_GROUP_KEY)) for group in current]
    layouts = ([False], [False, True])
    if saved_split == current_split or saved_split not in layouts or current_split not in layouts:
        return saved
    params = list(policy.parameters())
    value = {id(param) for param in value_only_parameters(policy)}
    actor = [i for i, param in enumerate(params) if id(param) not in value]
    critic = [i for i, param in enumerate(params) if id(param) in value]
    saved_order = actor + critic if saved_split == [False, True] else list(range(len(params)))
    saved_ids = [index for group in groups for index in group["params"]]
    if len(saved_ids) != len(params):
        return saved
    saved_id_of = dict(zip(saved_order, saved_ids, strict=True))
    position = {id(param): i for i, param in enumerate(params)}
    settings = {key: setting for key, setting in groups[0].items() if key not in ("params", VALUE_GROUP_KEY)}
    new_groups = []
    for group in current:
        ids = [saved_id_of[position[id(param)]] for param in group["params"]]
        new_groups.append({**settings, "params": ids, **({VALUE_GROUP_KEY: True} if group.get(VALUE_GROUP_KEY) else {})})
    return {**saved, "param_groups": new_groups}
