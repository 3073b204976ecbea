"""
Drill-down into the states where the KL was high: which observation dimensions separate the monitor's saved
top-k high-KL states from ordinary ones.

The ``.npz`` file holds ``observations`` (k, *obs_shape), ``kl`` (k,), ``update`` (k,) and, when the monitor saved
a background sample, ``background_observations`` (m, *obs_shape) and ``background_kl`` (m,).
Without a background, the highest-KL half of the saved states is compared with the lowest-KL half.
"""

import zipfile
from dataclasses import dataclass, field

import numpy as np

from sb3_kl.diagnostics.logs import DiagnosticsError

MIN_GROUP = 2  # states needed in each group for a comparison


@dataclass
class DimensionComparison:
    """
    One observation dimension, high-KL states against reference states.

    :param name: ``obs[i]`` (or ``obs[i,j]`` for multi-dimensional observations)
    :param high_mean: Mean over the high-KL states
    :param ref_mean: Mean over the reference states
    :param high_quantiles: 10 %, 50 %, 90 % quantiles over the high-KL states
    :param ref_quantiles: Same over the reference states
    :param std_diff: Standardized difference ``(high_mean - ref_mean) / pooled std`` (Cohen's d: the pooled variance
        weights each group's sample variance by its ``n - 1``)
    :param auc: Probability that a high-KL state has the larger value than a reference state (0.5 = no separation)
    :param ks: Two-sample Kolmogorov-Smirnov distance (largest gap between the two empirical CDFs, 0..1): catches
        a difference of spread (e.g. high-KL states at both extremes of a dimension) that ``std_diff`` misses
    :param std_ratio: Standard deviation over the high-KL states / over the reference states
    """

    name: str
    high_mean: float
    ref_mean: float
    high_quantiles: np.ndarray
    ref_quantiles: np.ndarray
    std_diff: float
    auc: float
    ks: float
    std_ratio: float


@dataclass
class StatesReport:
    """
    :param dims: Per-dimension comparisons, most separated first
    :param n_high: Number of high-KL states
    :param n_ref: Number of reference states
    :param reference: Description of the reference group
    :param high_kl: KL of the high-KL states
    :param ref_kl: KL of the reference states (may be empty)
    :param updates: Update indices of the high-KL states (may be empty)
    :param convention: The KL convention the monitor saved (e.g. ``forward/analytic/sum``), None when the file has none
    :param nonfinite_dims: Dimensions with a NaN or infinite value in either group (their statistics mean nothing)
    :param normalized: Whether the observations are VecNormalize's normalized ones (the policy's input, in units whose
        statistics moved during training), None when the file does not say
    """

    dims: list[DimensionComparison]
    n_high: int
    n_ref: int
    reference: str
    high_kl: np.ndarray
    ref_kl: np.ndarray
    updates: np.ndarray
    convention: str | None = None
    nonfinite_dims: list[str] = field(default_factory=list)
    normalized: bool | None = None


def _auc(high: np.ndarray, ref: np.ndarray) -> float:
    """Mann-Whitney probability P(high > ref) + P(high == ref) / 2."""
    greater = (high[:, None] > ref[None, :]).mean()
    equal = (high[:, None] == ref[None, :]).mean()
    return float(greater + 0.5 * equal)


def _ks(high: np.ndarray, ref: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov distance."""
    grid = np.concatenate([high, ref])
    cdf_high = np.searchsorted(np.sort(high), grid, side="right") / len(high)
    cdf_ref = np.searchsorted(np.sort(ref), grid, side="right") / len(ref)
    return float(np.max(np.abs(cdf_high - cdf_ref)))


def _dimension_names(obs_shape: tuple[int, ...], prefix: str = "obs") -> list[str]:
    return [f"{prefix}[" + ",".join(str(i) for i in index) + "]" for index in np.ndindex(*obs_shape)]


def _flatten(arrays: dict[str, np.ndarray], name: str, path: str) -> tuple[np.ndarray, list[str]] | None:
    """
    The observations stored under ``name`` (a plain array, or ``name/<key>`` arrays for Dict observation spaces),
    flattened to ``(n, n_dims)`` with a name per dimension.
    """
    if name in arrays:
        obs = arrays[name]
        obs = obs[:, None] if obs.ndim == 1 else obs
        return obs.reshape(len(obs), int(np.prod(obs.shape[1:]))).astype(np.float64), _dimension_names(obs.shape[1:])
    keys = sorted(key for key in arrays if key.startswith(f"{name}/"))
    if not keys:
        return None
    parts, names = [], []
    for key in keys:
        obs = arrays[key]
        obs = obs[:, None] if obs.ndim == 1 else obs
        parts.append(obs.reshape(len(obs), int(np.prod(obs.shape[1:]))).astype(np.float64))
        names += _dimension_names(obs.shape[1:], prefix=key.split("/", 1)[1])
    if len({len(part) for part in parts}) != 1:
        raise DiagnosticsError(f"{path}: the '{name}/<key>' arrays have different numbers of rows")
    return np.concatenate(parts, axis=1), names


def compare(high: np.ndarray, ref: np.ndarray, names: list[str] | None = None) -> list[DimensionComparison]:
    """
    Compare high-KL observations with reference observations dimension by dimension.

    :param high: ``(k, *obs_shape)``
    :param ref: ``(m, *obs_shape)``
    :param names: One name per flattened dimension (default ``obs[i]``)
    :return: One comparison per dimension, sorted by the KS distance then ``|std_diff|``, largest first
    """
    names = names or _dimension_names(high.shape[1:])
    high2 = high.reshape(len(high), -1).astype(np.float64)
    ref2 = ref.reshape(len(ref), -1).astype(np.float64)
    quantiles = (0.1, 0.5, 0.9)
    dims = []
    for i, name in enumerate(names):
        h, r = high2[:, i], ref2[:, i]
        # Cohen's pooled standard deviation: each group's variance weighted by its degrees of freedom
        pooled = np.sqrt(((len(h) - 1) * h.var(ddof=1) + (len(r) - 1) * r.var(ddof=1)) / (len(h) + len(r) - 2))
        difference = h.mean() - r.mean()
        if pooled > 0:
            std_diff = float(difference / pooled)
        else:
            std_diff = 0.0 if difference == 0 else float(np.sign(difference) * np.inf)
        ref_std = r.std(ddof=1)
        std_ratio = float(h.std(ddof=1) / ref_std) if ref_std > 0 else float("nan")
        dims.append(
            DimensionComparison(
                name,
                float(h.mean()),
                float(r.mean()),
                np.quantile(h, quantiles),
                np.quantile(r, quantiles),
                std_diff,
                _auc(h, r),
                _ks(h, r),
                std_ratio,
            )
        )
    return sorted(dims, key=lambda d: (d.ks, abs(d.std_diff)), reverse=True)


def load_states(path: str) -> StatesReport:
    """
    Read a monitor's ``.npz`` file and compare its high-KL states with the background (or, without one, with the
    lower-KL half of the saved states).

    :param path: The ``.npz`` file
    :return: The comparison
    """
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise DiagnosticsError(f"{path} is a single array, not an .npz archive of the KL monitor")
        with data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise DiagnosticsError(f"{path} does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        # the cause in a few words (numpy's own text for a non-.npz file advises allow_pickle, which does not apply)
        cause = getattr(error, "strerror", None) or type(error).__name__
        raise DiagnosticsError(
            f"cannot read {path} as .npz ({cause}): give the file that KLMonitorCallback(top_k_path=...) wrote"
        ) from None
    top = _flatten(arrays, "observations", path)
    if top is None or "kl" not in arrays:
        missing = "observations" if top is None else "kl"
        raise DiagnosticsError(f"{path} has no '{missing}' array (found: {', '.join(sorted(arrays)) or 'none'})")
    observations, names = top
    kl = np.asarray(arrays["kl"], dtype=np.float64).ravel()
    if len(observations) != len(kl):
        raise DiagnosticsError(f"{path}: 'observations' has {len(observations)} rows but 'kl' has {len(kl)}")
    updates = np.asarray(arrays.get("update", np.zeros(0))).ravel()

    if len(observations) == 0:
        raise DiagnosticsError(f"{path} holds no high-KL states (its 'observations' array has no rows)")
    background = _flatten(arrays, "background_observations", path)
    if background is not None and len(background[0]) >= MIN_GROUP:
        if background[1] != names:
            raise DiagnosticsError(f"{path}: background observations do not have the shape of the high-KL ones")
        ref_kl = np.asarray(arrays.get("background_kl", np.zeros(0)), dtype=np.float64).ravel()
        high, ref, high_kl, reference = observations, background[0], kl, "random background states"
    else:
        if len(observations) < 2 * MIN_GROUP:
            raise DiagnosticsError(
                f"{path} has no background states and only {len(observations)} high-KL states: nothing to compare with"
            )
        order = np.argsort(kl)[::-1]
        half = len(order) // 2
        high, ref = observations[order[:half]], observations[order[half:]]
        high_kl, ref_kl = kl[order[:half]], kl[order[half:]]
        saved = 0 if background is None else len(background[0])
        reference = (
            "no background saved" if saved == 0 else f"only {saved} background state(s) saved, fewer than {MIN_GROUP}"
        ) + ": the lower-KL half of the saved top states (a weaker contrast)"
    convention = str(arrays["convention"]) if "convention" in arrays else None
    normalized = bool(arrays["obs_normalized"]) if "obs_normalized" in arrays else None
    finite = np.isfinite(high).all(axis=0) & np.isfinite(ref).all(axis=0)
    nonfinite = [name for name, ok in zip(names, finite, strict=True) if not ok]
    return StatesReport(
        compare(high, ref, names), len(high), len(ref), reference, high_kl, ref_kl, updates, convention, nonfinite,
        normalized,
    )  # fmt: skip


def format_states(report: StatesReport, top: int = 20) -> str:
    """
    :param report: The comparison
    :param top: Number of dimensions printed
    :return: A text table, most separated dimension first
    """

    def q(values: np.ndarray) -> str:
        return "/".join(f"{v:.3g}" for v in values)

    lines = [
        f"high-KL states: {report.n_high} (KL {np.nanmin(report.high_kl):.3g}..{np.nanmax(report.high_kl):.3g}, "
        f"{report.convention or 'convention not saved'}"
        + (f", updates {int(report.updates.min())}..{int(report.updates.max())}" if len(report.updates) else "")
        + ")",
        "observations: "
        + {
            True: "normalized by VecNormalize (the policy's input, not the env's raw values; its statistics moved "
            "during training)",
            False: "as the env returned them (no VecNormalize of observations)",
            None: "as the rollout buffer stored them (normalized if the run used VecNormalize; the file does not say)",
        }[report.normalized],
        f"reference: {report.n_ref} {report.reference}"
        + (f" (KL median {np.median(report.ref_kl):.3g})" if len(report.ref_kl) else ""),
        "dimensions sorted by separation (KS = largest gap between the two empirical CDFs); "
        "d = (mean_high - mean_ref) / pooled std; AUC = P(high-KL value > reference value); "
        "sd ratio = std_high / std_ref; quantiles are 10%/50%/90%",
        f"{'dim':<12}{'KS':>6}{'d':>8}{'AUC':>7}{'sd ratio':>9}{'mean high':>12}{'mean ref':>12}{'q high':>26}{'q ref':>26}",
    ]
    for dim in report.dims[:top]:
        lines.append(
            f"{dim.name:<12}{dim.ks:>6.2f}{dim.std_diff:>8.2f}{dim.auc:>7.2f}{dim.std_ratio:>9.2f}{dim.high_mean:>12.3g}"
            f"{dim.ref_mean:>12.3g}"
            f"{q(dim.high_quantiles):>26}{q(dim.ref_quantiles):>26}"
        )
    if len(report.dims) > top:
        lines.append(f"... {len(report.dims) - top} more dimensions (use --top)")
    if report.nonfinite_dims:
        lines.append(
            f"note: NaN or infinite observations in {', '.join(report.nonfinite_dims)}: their statistics mean nothing"
        )
    return "\n".join(lines)
