"""The few-seed aggregate metrics of benchmarks/aggregate.py: IQM, stratified bootstrap, probability of improvement."""

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from aggregate import (
    interquartile_mean,
    pooled_iqm,
    probability_of_improvement,
    probability_of_improvement_ci,
    stratified_bootstrap_ci,
)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 10, 33])
def test_iqm_equals_scipys_quarter_trimmed_mean(n):
    x = np.random.default_rng(n).normal(size=n)
    assert interquartile_mean(x) == pytest.approx(stats.trim_mean(x, 0.25))


def test_iqm_ignores_one_outlying_seed_of_five():
    assert interquartile_mean([1.0, 2.0, 3.0, 4.0, 1e9]) == pytest.approx(3.0)
    assert pooled_iqm([[1.0, 2.0], [3.0, 4.0, 1e9]]) == pytest.approx(3.0)


def test_iqm_refuses_no_scores():
    with pytest.raises(ValueError, match="at least one"):
        interquartile_mean([])


def test_bootstrap_resamples_within_each_task():
    seen = []

    def record(strata):
        seen.append([set(s.tolist()) for s in strata])
        return 0.0

    stratified_bootstrap_ci([[1.0, 2.0, 3.0], [10.0, 20.0]], statistic=record, n_resamples=50)
    assert all(first <= {1.0, 2.0, 3.0} and second <= {10.0, 20.0} for first, second in seen)


def test_bootstrap_interval_brackets_the_estimate_is_seeded_and_narrows_with_runs():
    rng = np.random.default_rng(0)
    small = [rng.normal(size=5), rng.normal(1.0, size=5)]
    large = [rng.normal(size=200), rng.normal(1.0, size=200)]
    low, high = stratified_bootstrap_ci(small)
    assert low <= pooled_iqm(small) <= high
    assert stratified_bootstrap_ci(small) == (low, high)
    assert stratified_bootstrap_ci(small, seed=1) != (low, high)
    low_l, high_l = stratified_bootstrap_ci(large)
    assert high_l - low_l < (high - low) / 2


def test_bootstrap_interval_of_the_mean_covers_the_truth_about_95_percent():
    rng = np.random.default_rng(1)
    covered = 0
    trials = 200
    for _ in range(trials):
        tasks = [rng.normal(0.0, 1.0, size=30), rng.normal(2.0, 1.0, size=30)]
        low, high = stratified_bootstrap_ci(tasks, statistic=lambda s: float(np.mean(np.concatenate(s))), n_resamples=400)
        covered += low <= 1.0 <= high
    assert 0.88 <= covered / trials <= 0.99


def test_probability_of_improvement_counts_ties_half_and_averages_tasks():
    assert probability_of_improvement([[1.0, 2.0]], [[1.0, 2.0]]) == pytest.approx(0.5)
    assert probability_of_improvement([[5.0, 6.0]], [[1.0, 2.0]]) == 1.0
    # task 1: 3 of 4 pairs better; task 2: all worse -> (0.75 + 0) / 2
    assert probability_of_improvement([[2.0, 3.0], [0.0]], [[1.0, 2.5], [1.0]]) == pytest.approx(0.375)


def test_probability_of_improvement_matches_mann_whitney_and_is_complementary():
    rng = np.random.default_rng(2)
    x, y = rng.integers(0, 5, size=9).astype(float), rng.integers(0, 5, size=7).astype(float)
    u = stats.mannwhitneyu(x, y).statistic
    assert probability_of_improvement([x], [y]) == pytest.approx(u / (x.size * y.size))
    assert probability_of_improvement([x], [y]) + probability_of_improvement([y], [x]) == pytest.approx(1.0)


def test_probability_of_improvement_interval_and_task_mismatch():
    rng = np.random.default_rng(3)
    x = [rng.normal(1.0, size=10), rng.normal(1.0, size=10)]
    y = [rng.normal(0.0, size=10), rng.normal(0.0, size=10)]
    low, high = probability_of_improvement_ci(x, y, n_resamples=500)
    assert 0.5 < low <= probability_of_improvement(x, y) <= high <= 1.0
    with pytest.raises(ValueError, match="2 tasks for X but 1 for Y"):
        probability_of_improvement(x, y[:1])
