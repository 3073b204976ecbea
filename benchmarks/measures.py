"""What one run's record measures: its area under the curve, collapses, KL per update and band share."""

import math
from typing import Any

import numpy as np

from grid import BAND, SB3_KL_ALGOS


# ----------------------------------------------------------------------------------------------------------------------
# Report


def area_under_curve(curve: list[list[float]], budget: int) -> float:
    """Mean episode return over training (trapezoid area of the curve divided by its span)."""
    if len(curve) < 2:
        return float(curve[0][1]) if curve else float("nan")
    t, r = np.array(curve, dtype=float).T
    return float(np.trapezoid(r, t) / (t[-1] - t[0]))


def collapse_points(curve: list[list[float]]) -> list[tuple[int, int]]:
    """
    The collapses of a learning curve. A collapse: after the return has improved by at least 10 % of its range, it
    falls below 50 % of the way from its starting value to its running best, and never comes back above 90 % of that
    best before the end. (Measured on progress from the start, so it works for negative returns such as Pendulum's.)

    :param curve: ``[timesteps, return]`` points
    :return: for each collapse, the index of the curve's running best when it fell and the index where it fell
        below 50 %
    """
    if len(curve) < 3:
        return []
    returns = np.array([c[1] for c in curve], dtype=float)
    start, span = returns[0], np.ptp(returns)
    if span == 0:
        return []
    points: list[tuple[int, int]] = []
    best, best_index, in_collapse = returns[0], 0, False
    for i, r in enumerate(returns):
        if r > best:
            best, best_index = r, i
        gained = best - start
        if gained < 0.1 * span:
            continue
        progress = (r - start) / gained
        if not in_collapse and progress < 0.5:
            later = (returns[i:] - start) / gained
            if not np.any(later >= 0.9):
                points.append((best_index, i))
                in_collapse = True
        elif in_collapse and progress >= 0.9:
            in_collapse = False
    return points


def count_collapses(curve: list[list[float]]) -> int:
    """The number of collapses of a learning curve (:func:`collapse_points`)."""
    return len(collapse_points(curve))


def fall_span(record: dict[str, Any]) -> tuple[float, float] | None:
    """
    The steps of the curve's best point and of the rollout where it fell below 50 % in the run's first collapse: the
    updates at ``low <= t < high`` made the policies of the fall; None without a collapse.
    """
    points = collapse_points(record["curve"])
    if not points:
        return None
    best, fell = points[0]
    return record["curve"][best][0], record["curve"][fell][0]


def fall_kl(record: dict[str, Any]) -> dict[str, float] | None:
    """
    The per-update KL (the monitor's exact per-update mean, as a multiple of the run's target) over the fall of the
    run's first collapse: the updates that made the policies of the rollouts after the curve's best point, up to the
    rollout where it fell below 50 % (an update at ``t`` steps trains on the rollout that ended at ``t``, and the
    next rollout acts with its result).

    :return: ``n`` updates, their ``mean`` and ``max`` KL / target, the share ``over`` 2 x target, and the run's
        share over 2 x target over all its updates (``over_run``); None without a collapse or KL records
    """
    span = fall_span(record)
    kl = record.get("kl_updates") or []
    if span is None or not kl:
        return None
    low, high = span
    target = record["target_kl"]
    fall = np.array([u["mean"] for u in kl if low <= u["timesteps"] < high]) / target
    whole = np.array([u["mean"] for u in kl]) / target
    if len(fall) == 0:
        return None
    return dict(
        n=len(fall),
        mean=float(fall.mean()),
        max=float(fall.max()),
        over=float(np.mean(fall > BAND[1])),
        over_run=float(np.mean(whole > BAND[1])),
    )


def summarize(record: dict[str, Any]) -> dict[str, float]:
    kl = record["kl_updates"]
    target = record["target_kl"]
    summary = dict(
        eval_mean=record["eval_mean"],
        auc=area_under_curve(record["curve"], record["budget"]),
        collapses=count_collapses(record["curve"]),
        steps_per_s=record["env_steps_per_second"],
    )
    if kl:
        means = np.array([u["mean"] for u in kl])
        summary["kl_mean"] = float(np.mean(means))
        summary["kl_p99"] = float(np.mean([u["p99"] for u in kl]))
        summary["in_band"] = float(np.mean((means >= BAND[0] * target) & (means <= BAND[1] * target)))
        summary["budget_use"] = float(np.mean(means)) / target
    return summary


def update_share(record: dict[str, Any], low: float, high: float) -> float:
    """Share of a run's updates whose KL lies in [low, high) x target."""
    target = record["target_kl"]
    return float(np.mean([low * target <= u["mean"] < high * target for u in record["kl_updates"]]))


def sb3_kl_collapses(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The runs of sb3-kl algorithms among ``groups`` with a collapse (:func:`count_collapses`), in the groups' order."""
    return [r for (_, algo, _), runs in groups.items() if algo in SB3_KL_ALGOS for r in runs if count_collapses(r["curve"])]


def updates_to_band(record: dict[str, Any]) -> int:
    """Updates a run spent before its first update with KL in band (its warm-up; all of them if none is in band)."""
    target = record["target_kl"]
    in_band = [BAND[0] * target <= u["mean"] <= BAND[1] * target for u in record["kl_updates"]]
    return in_band.index(True) if True in in_band else len(in_band)


def update_mean(record: dict[str, Any], key: str, indices: list[int]) -> float:
    """The mean of ``key`` (e.g. ``mean``, ``drift``) over the record's updates at ``indices``, / its target (NaN without)."""
    wanted = set(indices)
    values = [u.get(key, math.nan) for i, u in enumerate(record["kl_updates"]) if i in wanted]
    if not values or np.all(np.isnan(values)):
        return math.nan
    return float(np.nanmean(values)) / record["target_kl"]


def curve_until(curve: list[list[float]], steps: int) -> list[list[float]]:
    """
    The points of a learning curve up to ``steps``: those taken at or before it, and the first one after it where no
    point falls on it (a run's last rollout ends past its budget, so the points of a run trained to ``steps``).
    """
    before = [point for point in curve if point[0] <= steps]
    after = [point for point in curve if point[0] > steps]
    return before if (before and before[-1][0] == steps) or not after else before + after[:1]
