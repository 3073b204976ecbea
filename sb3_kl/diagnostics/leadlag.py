"""
Lead-lag between KL spikes and drops of the episode return.

Method (also printed by ``sb3-kl report`` and described in ``docs/guide/diagnostics.md``):

1. Spike series ``s_t``: the logged mean KL of update ``t`` on a log scale, minus its running median over
   21 updates (so that a slow drift of the KL is not mistaken for spikes), z-scored over the run.
2. Drop series ``d_t = max(0, R_{t-1} - R_t)`` with ``R`` = ``rollout/ep_rew_mean`` at the same dump: how much the
   return fell between the previous dump and this one (rises count as 0).
   In an SB3 log, the KL and the return written at the same dump belong together: the KL is that of the update
   made just before the rollout whose episodes the return summarises. Lag 0 therefore means "the return fell
   right after the update whose KL spiked".
3. Cross-correlation ``r(k) = corr(s_t, d_{t+k})`` (Pearson) for lags ``k = 0 .. max_lag`` updates (10 by default,
   fewer on short logs); the peak ``r* = max_k r(k)`` at lag ``k*``.
4. Significance: the same peak statistic (maximum over all lags, which accounts for having looked at several
   lags) is computed for ``n_null`` (999) block-shuffles of the spike series: the series is cut into blocks of
   ``max_lag + 1`` consecutive updates whose order is permuted. Shuffling blocks rather than single updates keeps
   short-range autocorrelation of the KL. A lead is reported when ``r*`` exceeds the ``confidence`` quantile
   (95 % by default) of this null; the p-value is ``(1 + #{null >= r*}) / (1 + n_null)``.
   Logs with fewer than 20 updates are not tested.
"""

from dataclasses import dataclass

import numpy as np

MIN_UPDATES = 20  # shorter logs are not tested
MIN_BLOCKS = 6  # the null shuffles at least this many blocks (6! = 720 orders)
TREND_WINDOW = 21  # updates in the running median removed from log KL


@dataclass
class LeadLagResult:
    """
    Outcome of :func:`lead_lag`.

    :param n_updates: Number of updates with both a KL and a return
    :param lags: The lags tried (in updates)
    :param correlations: ``r(k)`` for each lag
    :param best_lag: ``k*`` (None when the test could not run)
    :param best_r: ``r*``
    :param threshold: The null's ``confidence`` quantile of the peak correlation
    :param p_value: Block-shuffle p-value of ``r*``: ``(1 + #{null peaks >= r*}) / (1 + n_null)``
    :param n_null: Number of block shuffles in the null (those with a finite peak)
    :param found: Whether ``r* > threshold``
    :param reason: Why the test could not run (empty when it ran)
    :param steps_per_update: Median environment steps between dumps (to state the lag in steps)
    :param confidence: The quantile of the null used as ``threshold``
    :param updates_per_lag: Updates between two points of the series (2 when the KL was measured every other update,
        ``KLMonitorCallback(every=2)``): the lags above count points, the summary states updates
    """

    n_updates: int
    lags: np.ndarray
    correlations: np.ndarray
    best_lag: int | None = None
    best_r: float = float("nan")
    threshold: float = float("nan")
    p_value: float = float("nan")
    n_null: int = 0
    found: bool = False
    reason: str = ""
    steps_per_update: float = float("nan")
    confidence: float = 0.95
    updates_per_lag: int = 1

    def summary(self) -> str:
        """:return: One sentence with the finding."""
        if self.reason:
            return f"lead-lag not tested: {self.reason}"
        strength = f"r={self.best_r:.2f}, {100 * self.confidence:g}% null threshold {self.threshold:.2f}, p={self.p_value:.3f}"
        if not self.found:
            return f"no lead found (peak r={self.best_r:.2f} at lag {self.best_lag}; null threshold {self.threshold:.2f})"
        in_steps = f", ~{self.best_lag * self.steps_per_update:.0f} steps" if np.isfinite(self.steps_per_update) else ""
        if self.best_lag == 0:
            return f"KL spikes coincide with return drops (same update) (correlation {strength})"
        updates = self.best_lag * self.updates_per_lag
        unit = "update" if updates == 1 else "updates"
        sampled = f", the KL measured every {self.updates_per_lag} updates" if self.updates_per_lag > 1 else ""
        return f"KL spikes lead return drops by {updates} {unit}{in_steps}{sampled} (correlation {strength})"


def spike_series(kl: np.ndarray, trend_window: int = TREND_WINDOW) -> np.ndarray:
    """
    :param kl: Mean KL per update
    :param trend_window: Window (updates) of the running median subtracted from log KL
    :return: z-scored detrended log KL (non-positive KLs, e.g. from a sample estimator, are floored at the
        smallest positive one)
    """
    kl = np.asarray(kl, dtype=np.float64)
    positive = kl[kl > 0]
    floor = positive.min() if positive.size else 1e-12
    log_kl = np.log(np.maximum(kl, floor))
    log_kl = log_kl - _running_median(log_kl, trend_window)
    std = log_kl.std()
    return (log_kl - log_kl.mean()) / std if std > 0 else np.zeros_like(log_kl)


def drop_series(returns: np.ndarray) -> np.ndarray:
    """
    :param returns: Mean episode return per update
    :return: ``max(0, R_{t-1} - R_t)`` for ``t = 1 .. n-1``
    """
    return np.maximum(0.0, -np.diff(np.asarray(returns, dtype=np.float64)))


def _block_permutations(series: np.ndarray, block: int, n_perm: int, seed: int) -> np.ndarray:
    """
    Shuffle the order of consecutive blocks of ``series``.

    :param series: The series to shuffle
    :param block: Block length; autocorrelation shorter than this is kept
    :param n_perm: Number of shuffled copies
    :param seed: Random seed
    :return: ``(n_perm, len(series))``
    """
    rng = np.random.default_rng(seed)
    n_blocks = len(series) // block
    # the incomplete last block stays in place: block orders of equal blocks form a group, which keeps the test exact
    # for exchangeable blocks (moving a short block would shift the cuts of later shuffles)
    blocks, tail = series[: n_blocks * block].reshape(n_blocks, block), series[n_blocks * block :]
    return np.stack([np.concatenate([blocks[rng.permutation(n_blocks)].ravel(), tail]) for _ in range(n_perm)])


def _running_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centered running median (the window shrinks at the ends)."""
    half = window // 2
    return np.array([np.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))])


def _lagged_correlations(spikes: np.ndarray, drops: np.ndarray, lags: np.ndarray) -> np.ndarray:
    """
    Pearson correlation of ``spikes[t]`` with ``drops[t + k]`` for each lag, for one or many spike series.

    :param spikes: ``(n,)`` or ``(m, n)``
    :param drops: ``(n,)``
    :param lags: Non-negative lags
    :return: ``(len(lags),)`` or ``(m, len(lags))``
    """
    spikes = np.atleast_2d(spikes)
    n = drops.shape[0]
    out = np.full((spikes.shape[0], len(lags)), np.nan)
    for i, lag in enumerate(lags):
        x = spikes[:, : n - lag]
        y = drops[lag:]
        x = x - x.mean(axis=1, keepdims=True)
        y = y - y.mean()
        denominator = np.sqrt((x**2).sum(axis=1) * (y**2).sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            out[:, i] = np.where(denominator > 0, (x @ y) / denominator, np.nan)
    return out if out.shape[0] > 1 else out[0]


def lead_lag(
    kl: np.ndarray,
    returns: np.ndarray,
    steps: np.ndarray | None = None,
    max_lag: int = 10,
    n_null: int = 999,
    confidence: float = 0.95,
    seed: int = 0,
) -> LeadLagResult:
    """
    Test whether KL spikes precede drops of the return (see the module docstring for the method).

    :param kl: Mean KL per update
    :param returns: ``rollout/ep_rew_mean`` at the same updates
    :param steps: Environment steps of those updates (only used to express the lag in steps)
    :param max_lag: Largest lag tried, in updates (at least 1; reduced on short logs)
    :param n_null: Number of block shuffles of the spike series in the null distribution
    :param confidence: Quantile of the null the peak must exceed, in (0, 1)
    :param seed: Seed of the block shuffles
    :return: The result, with ``reason`` set when the log is too short or has no return drops
    """
    kl = np.asarray(kl, dtype=np.float64)
    returns = np.asarray(returns, dtype=np.float64)
    if kl.shape != returns.shape:
        raise ValueError(f"`kl` and `returns` must have the same shape, got {kl.shape} and {returns.shape}.")
    if max_lag < 1:
        raise ValueError(f"`max_lag` must be at least 1 (lag 0 is always tried), got {max_lag}.")
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence` must be in (0, 1), e.g. 0.95, got {confidence}.")
    spikes = spike_series(kl)[1:]
    drops = drop_series(returns)
    n = drops.shape[0]
    steps_per_update = float(np.median(np.diff(steps))) if steps is not None and len(steps) > 1 else float("nan")
    # the null shuffles blocks of max_lag + 1 updates and needs at least MIN_BLOCKS of them
    max_lag = int(min(max_lag, n // MIN_BLOCKS - 1))
    empty = LeadLagResult(n_updates=len(kl), lags=np.zeros(0, dtype=int), correlations=np.zeros(0), confidence=confidence)
    empty.steps_per_update = steps_per_update
    if len(kl) < MIN_UPDATES or max_lag < 1:
        empty.reason = f"{len(kl)} updates with both KL and return; at least {MIN_UPDATES} are needed"
        return empty
    if not np.any(drops > 0):
        empty.reason = "the return never dropped"
        return empty
    if spikes.std() == 0:
        empty.reason = "the KL is constant"
        return empty
    lags = np.arange(max_lag + 1)
    correlations = _lagged_correlations(spikes, drops, lags)
    best = int(np.nanargmax(correlations))
    best_r = float(correlations[best])

    null_spikes = _block_permutations(spikes, block=max_lag + 1, n_perm=n_null, seed=seed)
    null_peaks = np.nanmax(_lagged_correlations(null_spikes, drops, lags).reshape(len(null_spikes), -1), axis=1)
    null_peaks = null_peaks[np.isfinite(null_peaks)]
    threshold = float(np.quantile(null_peaks, confidence))
    p_value = float((1 + np.sum(null_peaks >= best_r)) / (1 + len(null_peaks)))
    return LeadLagResult(
        n_updates=len(kl),
        lags=lags,
        correlations=correlations,
        best_lag=int(lags[best]),
        best_r=best_r,
        threshold=threshold,
        p_value=p_value,
        n_null=len(null_peaks),
        found=bool(best_r > threshold and best_r > 0),
        steps_per_update=steps_per_update,
        confidence=confidence,
    )


METHOD = (
    "Lead-lag method: spike series = z-scored log of the mean KL per update minus its running median (21 updates); "
    "drop series = max(0, R[t-1] - R[t]) of rollout/ep_rew_mean; Pearson correlation of spike[t] with drop[t+k] for "
    "k = 0..max_lag updates; a lead is reported when the peak exceeds the 95% quantile of the same peak statistic "
    "over 999 shuffles of the spike series in blocks of max_lag+1 updates. Lag 0 = the return fell right after "
    "the update whose KL spiked."
)
