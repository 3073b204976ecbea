"""
Aggregate metrics for few-seed RL results: the interquartile mean (IQM), stratified-bootstrap confidence intervals and
the probability of improvement, as recommended by Agarwal et al., "Deep Reinforcement Learning at the Edge of the
Statistical Precipice", NeurIPS 2021 (https://arxiv.org/abs/2108.13264).

Scores are given per task (a "stratum"): a list with one 1-D array of run scores (one per seed) for each task. The
bootstrap resamples runs with replacement *within* each task, so every resample keeps the number of runs per task.
"""

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

ScoresByTask = Sequence[ArrayLike]


def interquartile_mean(scores: ArrayLike) -> float:
    """
    Mean of the middle 50 % of the scores: ``floor(n / 4)`` scores are cut from each end (as ``scipy.stats.trim_mean``
    with ``proportiontocut=0.25``). Robust to one outlying seed, less noisy than the median.

    :param scores: Run scores (any shape; flattened)
    :return: The interquartile mean
    """
    values = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    if values.size == 0:
        raise ValueError("interquartile_mean needs at least one score")
    cut = values.size // 4
    return float(values[cut : values.size - cut].mean())


def pooled_iqm(scores_by_task: ScoresByTask) -> float:
    """
    IQM of the runs of all tasks pooled together (scores should be normalized so tasks are comparable).

    :param scores_by_task: One array of run scores per task
    :return: The interquartile mean over all runs
    """
    return interquartile_mean(np.concatenate([np.asarray(s, dtype=np.float64).ravel() for s in scores_by_task]))


def _as_strata(scores_by_task: ScoresByTask, name: str) -> list[np.ndarray]:
    strata = [np.asarray(s, dtype=np.float64).ravel() for s in scores_by_task]
    if not strata or any(s.size == 0 for s in strata):
        raise ValueError(f"{name} needs at least one task and at least one run per task")
    return strata


def _resample(strata: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    return [s[rng.integers(0, s.size, size=s.size)] for s in strata]


def _percentile_interval(estimates: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(estimates, [alpha, 1.0 - alpha])
    return float(low), float(high)


def stratified_bootstrap_ci(
    scores_by_task: ScoresByTask,
    statistic: Callable[[list[np.ndarray]], float] = pooled_iqm,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """
    Percentile confidence interval of ``statistic`` by the stratified bootstrap: runs are resampled with replacement
    within each task.

    :param scores_by_task: One array of run scores per task
    :param statistic: Function of the per-task arrays returning a number (default: the pooled IQM)
    :param n_resamples: Number of bootstrap resamples
    :param confidence: Confidence level of the interval
    :param seed: Seed of the resampling, so a report regenerates the same interval
    :return: (low, high)
    """
    strata = _as_strata(scores_by_task, "stratified_bootstrap_ci")
    rng = np.random.default_rng(seed)
    estimates = np.array([statistic(_resample(strata, rng)) for _ in range(n_resamples)])
    return _percentile_interval(estimates, confidence)


def _pairwise_improvement(x: np.ndarray, y: np.ndarray) -> float:
    # P(X > Y) over all pairs of runs, a tie counting one half (the Mann-Whitney U statistic divided by n * m)
    diff = x[:, None] - y[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def probability_of_improvement(x_by_task: ScoresByTask, y_by_task: ScoresByTask) -> float:
    """
    Probability that a run of algorithm X scores higher than a run of algorithm Y on a task drawn at random from the
    tasks given: the mean over tasks of P(X_m > Y_m), ties counting one half. 0.5 means neither is better.

    :param x_by_task: One array of run scores of X per task
    :param y_by_task: One array of run scores of Y per task, tasks in the same order
    :return: The probability of improvement of X over Y
    """
    xs = _as_strata(x_by_task, "probability_of_improvement")
    ys = _as_strata(y_by_task, "probability_of_improvement")
    if len(xs) != len(ys):
        raise ValueError(f"probability_of_improvement: {len(xs)} tasks for X but {len(ys)} for Y")
    return float(np.mean([_pairwise_improvement(x, y) for x, y in zip(xs, ys, strict=True)]))


def probability_of_improvement_ci(
    x_by_task: ScoresByTask,
    y_by_task: ScoresByTask,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """
    Stratified-bootstrap percentile interval of :func:`probability_of_improvement`: the runs of X and of Y are
    resampled independently within each task.

    :param x_by_task: One array of run scores of X per task
    :param y_by_task: One array of run scores of Y per task, tasks in the same order
    :param n_resamples: Number of bootstrap resamples
    :param confidence: Confidence level of the interval
    :param seed: Seed of the resampling
    :return: (low, high)
    """
    xs = _as_strata(x_by_task, "probability_of_improvement_ci")
    ys = _as_strata(y_by_task, "probability_of_improvement_ci")
    if len(xs) != len(ys):
        raise ValueError(f"probability_of_improvement_ci: {len(xs)} tasks for X but {len(ys)} for Y")
    rng = np.random.default_rng(seed)
    estimates = np.array(
        [probability_of_improvement(_resample(xs, rng), _resample(ys, rng)) for _ in range(n_resamples)]
    )
    return _percentile_interval(estimates, confidence)
