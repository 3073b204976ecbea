"""
Per-run KL summary: KL statistics by training phase, time outside the target band, beta at its bounds,
alarms, and the lead-lag between KL spikes and return drops (see :mod:`sb3_kl.diagnostics.leadlag`).
"""

from dataclasses import dataclass, field

import numpy as np

from sb3_kl.diagnostics.diagnosis import TROUBLESHOOTING, Finding, diagnose, values_at
from sb3_kl.diagnostics.leadlag import METHOD, LeadLagResult, lead_lag
from sb3_kl.diagnostics.logs import RunLog, Series, align

#: Band (as multiples of the target) used for runs that did not log their own (``train/kl_band_low/high``), e.g. a
#: stock agent watched by ``KLMonitorCallback``; sb3-kl's adaptive controller logs its ``kl_band`` (default (0.8, 1.25))
DEFAULT_BAND = (0.5, 2.0)
DEFAULT_COEF_BOUNDS = (1e-4, 10.0)
PHASES = ("early", "middle", "late")


@dataclass
class PhaseStats:
    """
    KL statistics over one third of the run's updates.

    :param name: ``early``, ``middle`` or ``late``
    :param first_step: First environment step of the phase
    :param last_step: Last environment step of the phase
    :param n_updates: Updates with a logged KL
    :param kl_mean: Mean of the per-update mean KL
    :param kl_median: Median of the per-update mean KL
    :param kl_max: Largest per-update mean KL (the statistics are of the finite KLs)
    :param kl_p99_max: Largest logged 99th percentile of the per-state KL (nan if not logged)
    :param target: Mean target KL (nan if not logged)
    :param above: Share of updates with KL above the band (nan without a target)
    :param below: Share of updates with KL below the band (nan without a target)
    :param n_nonfinite: Updates of the phase whose KL is NaN or infinite (left out of the statistics above)
    """

    name: str
    first_step: int
    last_step: int
    n_updates: int
    kl_mean: float
    kl_median: float
    kl_max: float
    kl_p99_max: float = float("nan")
    target: float = float("nan")
    above: float = float("nan")
    below: float = float("nan")
    n_nonfinite: int = 0


@dataclass
class RunReport:
    """
    Everything ``sb3-kl report`` prints for one run.

    :param run: The run
    :param band: Target band, as multiples of the target
    :param band_source: Where the band comes from (the run's logged ``kl_band``, ``--band`` or the default)
    :param phases: Statistics per third of training
    :param n_updates: Updates with a logged KL
    :param above: Share of all updates with KL above the band (nan without a target)
    :param below: Share of all updates with KL below the band
    :param coef: Summary of beta (empty if not logged)
    :param alarm_steps: Steps at which the alarm count increased
    :param n_alarms: Number of alarms
    :param lead: Lead-lag result (None without ``rollout/ep_rew_mean``)
    :param normalization: Summary of ``kl/normalization_shift`` (empty if not logged): ``mean``, ``max``, the
        ``step_of_max``, ``n`` rollouts, and ``above_update``: the rollouts whose shift exceeds the KL of the update
        that trained on them (``kl/mean``, the same monitor's convention)
    :param nonfinite_steps: Steps of the updates whose logged KL is NaN or infinite (a diverged update; counted
        above the band where a target is known at that step)
    :param nonfinite_judged: How many of them have a target, and so count above the band
    :param notes: Remarks on missing keys
    :param findings: The troubleshooting entries the run shows (:func:`~sb3_kl.diagnostics.diagnosis.diagnose`)
    """

    run: RunLog
    band: tuple[float, float]
    band_source: str
    phases: list[PhaseStats]
    n_updates: int
    above: float = float("nan")
    below: float = float("nan")
    coef: dict[str, float] = field(default_factory=dict)
    alarm_steps: list[int] = field(default_factory=list)
    n_alarms: int | None = None
    lead: LeadLagResult | None = None
    normalization: dict[str, float] = field(default_factory=dict)
    nonfinite_steps: list[int] = field(default_factory=list)
    nonfinite_judged: int = 0
    notes: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def resolve_band(run: RunLog, band: tuple[float, float] | None = None) -> tuple[tuple[float, float], str]:
    """
    The band a run is judged and drawn with.

    :param run: The run
    :param band: A band given by the user (``--band``), or None for the run's own
    :return: ``(low, high)`` and where it comes from: ``band`` if given, else the band the run logged
        (``train/kl_band_low/high``, its controller's ``kl_band`` at the last update), else :data:`DEFAULT_BAND`
    """
    if band is not None:
        return (float(band[0]), float(band[1])), "--band"
    low, high = run.get("kl_band_low"), run.get("kl_band_high")
    if low is not None and high is not None and len(low) and len(high):
        return (float(low.values[-1]), float(high.values[-1])), "the run's kl_band"
    return DEFAULT_BAND, "default: the run logged no band"


def alarm_events(alarms: Series) -> tuple[np.ndarray, int]:
    """
    Steps at which alarms were raised. ``kl/alarms`` is ``KLAlarmCallback``'s running count, which starts again from
    zero with each new callback (a run resumed with ``learn(..., reset_num_timesteps=False)`` into the same log): a
    drop of the count is such a restart, after which the new count is the new alarms.

    :param alarms: The ``kl/alarms`` series
    :return: The steps with new alarms and the total number of alarms
    """
    values = np.nan_to_num(alarms.values)
    previous = np.concatenate([[0.0], values[:-1]])
    increments = np.where(values >= previous, values - previous, values)
    return alarms.steps[increments > 0], int(np.rint(increments[increments > 0].sum()))


def _band_shares(kl: np.ndarray, target: np.ndarray, band: tuple[float, float]) -> tuple[float, float]:
    if len(kl) == 0:
        return float("nan"), float("nan")
    return float(np.mean(kl > band[1] * target)), float(np.mean(kl < band[0] * target))


def summarize_run(
    run: RunLog,
    band: tuple[float, float] | None = None,
    coef_bounds: tuple[float, float] = DEFAULT_COEF_BOUNDS,
    target_kl: float | None = None,
    max_lag: int = 10,
    seed: int = 0,
) -> RunReport:
    """
    Compute the report of one run.

    :param run: A run that logged a mean KL
    :param band: ``(low, high)``: the KL is "in band" when ``low * target <= KL <= high * target``; None: the band
        the run logged, else :data:`DEFAULT_BAND` (:func:`resolve_band`)
    :param coef_bounds: Known bounds of beta (sb3_kl's default ``kl_coef_bounds``)
    :param target_kl: Target used when the run did not log one (None: no band statistics then)
    :param max_lag: Largest lag tried by the lead-lag test, in updates
    :param seed: Seed of the lead-lag null distribution
    :return: The report
    """
    kl = run.get("kl_mean")
    assert kl is not None, "summarize_run needs a run with KL keys (filter with RunLog.has_kl)"
    notes: list[str] = list(run.notes)
    band, band_source = resolve_band(run, band)
    p99 = run.get("kl_p99")
    target_series = run.get("target_kl")
    if target_series is None and target_kl is not None:
        target_series = Series(kl.steps, np.full(len(kl), float(target_kl)))
        notes.append(f"no target KL logged: using --target {target_kl}")
    elif target_series is None:
        notes.append("no target KL logged: band statistics skipped (pass --target)")
    notes += _convention_notes(run)

    if target_series is not None:
        # a non-finite KL (a diverged update) is kept and counted above the band: align() would drop it
        finite_target = Series(
            target_series.steps[np.isfinite(target_series.values)],
            target_series.values[np.isfinite(target_series.values)],
        )
        steps_t = np.intersect1d(kl.steps, finite_target.steps)
        kl_t = kl.values[np.searchsorted(kl.steps, steps_t)]
        kl_t = np.where(np.isfinite(kl_t), kl_t, np.inf)
        target_t = finite_target.values[np.searchsorted(finite_target.steps, steps_t)]
    else:
        steps_t, kl_t, target_t = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
    above, below = _band_shares(kl_t, target_t, band)

    phases = []
    for name, indices in zip(PHASES, np.array_split(np.arange(len(kl)), len(PHASES)), strict=True):
        if len(indices) == 0:
            continue
        values, first, last = kl.values[indices], int(kl.steps[indices[0]]), int(kl.steps[indices[-1]])
        finite = values[np.isfinite(values)]
        phase = PhaseStats(name, first, last, len(indices), float("nan"), float("nan"), float("nan"))
        if len(finite):
            phase.kl_mean, phase.kl_median, phase.kl_max = map(float, (finite.mean(), np.median(finite), finite.max()))
        phase.n_nonfinite = len(values) - len(finite)
        if p99 is not None:
            in_phase = p99.values[(p99.steps >= first) & (p99.steps <= last)]
            in_phase = in_phase[np.isfinite(in_phase)]  # (of the finite values, as the KL max)
            phase.kl_p99_max = float(np.max(in_phase)) if len(in_phase) else float("nan")
        in_phase = (steps_t >= first) & (steps_t <= last)
        if np.any(in_phase):
            phase.target = float(np.mean(target_t[in_phase]))
            phase.above, phase.below = _band_shares(kl_t[in_phase], target_t[in_phase], band)
        phases.append(phase)

    report = RunReport(
        run=run, band=band, band_source=band_source, phases=phases, n_updates=len(kl), above=above, below=below, notes=notes
    )
    report.nonfinite_steps = [int(step) for step in kl.steps[~np.isfinite(kl.values)]]
    report.nonfinite_judged = int(np.sum(np.isin(report.nonfinite_steps, steps_t)))

    coef = run.get("kl_coef")
    if coef is not None and not np.any(np.isfinite(coef.values)):
        notes.append(f"the KL coefficient ({run.key_for('kl_coef')}) is NaN or infinite at every update")
    elif coef is not None:
        values = coef.values[np.isfinite(coef.values)]
        low, high = coef_bounds
        report.coef = {
            "first": float(values[0]),
            "last": float(values[-1]),
            "min": float(values.min()),
            "max": float(values.max()),
            "n": float(len(values)),
            "at_upper_bound": float(np.sum(values >= high * (1 - 1e-6))),
            "at_lower_bound": float(np.sum(values <= low * (1 + 1e-6))),
            "at_max_seen": float(np.sum(values >= values.max() * (1 - 1e-6))),
            "at_min_seen": float(np.sum(values <= values.min() * (1 + 1e-6))),
        }
    else:
        notes.append("no KL coefficient logged (train/kl_coef or kl/coef)")

    alarms = run.get("alarms")
    if alarms is not None:
        steps, count = alarm_events(alarms)
        report.alarm_steps, report.n_alarms = [int(s) for s in steps], count

    report.normalization = _normalization_summary(run)

    returns = run.get("ep_rew_mean")
    if returns is None:
        notes.append("no rollout/ep_rew_mean logged: lead-lag skipped")
    else:
        steps, (kl_r, returns_r) = align(kl, returns)
        report.lead = lead_lag(kl_r, returns_r, steps=steps, max_lag=max_lag, seed=seed)
        # a KL measured every n-th update (KLMonitorCallback(every=n)) keeps every n-th dump: one lag is n updates
        dump_steps, kept_steps = np.diff(returns.steps), np.diff(steps)
        if len(dump_steps) and len(kept_steps) and np.median(dump_steps) > 0:
            report.lead.updates_per_lag = max(1, round(float(np.median(kept_steps) / np.median(dump_steps))))
    coef_t = None if coef is None else values_at(coef, steps_t)
    report.findings = diagnose(steps_t, kl_t, target_t, coef_t, coef_bounds, report.nonfinite_steps, report.lead)
    return report


def _normalization_summary(run: RunLog) -> dict[str, float]:
    """The summary of the monitor's ``kl/normalization_shift`` (:attr:`RunReport.normalization`), empty without it."""
    shift = run.get("normalization_shift")
    if shift is None or not np.any(np.isfinite(shift.values)):
        return {}
    finite = np.isfinite(shift.values)
    values, steps = shift.values[finite], shift.steps[finite]
    summary = {
        "mean": float(values.mean()),
        "max": float(values.max()),
        "step_of_max": float(steps[np.argmax(values)]),
        "n": float(len(values)),
    }
    update_kl = run.get("monitor_kl_mean")
    if update_kl is not None:
        _, (shift_aligned, update_aligned) = align(Series(steps, values), update_kl)
        summary["above_update"] = float(np.sum(shift_aligned > update_aligned))
        summary["n_compared"] = float(len(shift_aligned))
    return summary


def _normalization_line(report: RunReport) -> list[str]:
    c = report.normalization
    if not c:
        return []
    line = (
        f"observation normalization alone (kl/normalization_shift, exact, per rollout): mean {c['mean']:.3g}, "
        f"max {c['max']:.3g} at step {int(c['step_of_max'])}"
    )
    if "above_update" in c:
        line += f"; larger than the update's KL (kl/mean) in {int(c['above_update'])}/{int(c['n_compared'])} rollouts"
    return [line]


def _convention_notes(run: RunLog) -> list[str]:
    """What the report could not put in one convention (a monitor's p99, or a target of unknown convention)."""
    notes = []
    if run.kl_prefix == "kl/" and run.key_for("kl_p99") is None and "kl/p99" in run.scalars:
        notes.append(
            "kl/p99 is in the monitor's convention, not in the target's (kl/mean_in_target_convention): p99 not shown"
        )
    if run.key_for("kl_mean") == "kl/mean" and run.key_for("target_kl") == "kl/target":
        notes.append(
            "kl/target is compared with kl/mean, and this log (sb3-kl before kl/mean_in_target_convention) does not say "
            "whether they share a convention: they do for SB3's PPO and a default monitor, not for sb3-contrib's TRPO"
        )
    return notes


def keys_line(run: RunLog) -> str:
    """The logger keys the report reads, each KL key with the convention the run logged for it when it did."""

    def described(canonical: str) -> str:
        key = run.key_for(canonical)
        convention = run.convention_of(key)
        return f"{key}" + (f" ({convention})" if convention else "")

    conventions_known = run.convention_of(run.key_for("kl_mean")) is not None
    return (
        f"KL keys: mean={described('kl_mean')}, p99={described('kl_p99')}, target={described('target_kl')}, "
        f"coef={run.key_for('kl_coef')}" + ("" if conventions_known else "; KL convention not in the log")
    )


def _pct(share: float) -> str:
    return "n/a" if not np.isfinite(share) else f"{100 * share:.0f}%"


def _num(value: float) -> str:
    return "n/a" if np.isnan(value) else f"{value:.3g}"


def _nonfinite_line(report: RunReport) -> list[str]:
    steps = report.nonfinite_steps
    if not steps:
        return []
    shown = ", ".join(str(s) for s in steps[:10]) + (", ..." if len(steps) > 10 else "")
    judged = report.nonfinite_judged
    if judged == len(steps):
        band = "counted above the band"
    elif judged == 0:
        band = "not judged against the band (no target at those steps)"
    else:
        band = f"{judged} of them counted above the band (the others have no target)"
    return [
        f"non-finite KL (NaN or inf: the update diverged) at {len(steps)} update(s), steps {shown}: left out of the "
        f"phase statistics, {band}"
    ]


def _coef_lines(report: RunReport, coef_bounds: tuple[float, float]) -> list[str]:
    if not report.coef:
        return []
    c = report.coef
    n = int(c["n"])
    return [
        f"beta (kl_coef): first {c['first']:.3g}, last {c['last']:.3g}, range [{c['min']:.3g}, {c['max']:.3g}]",
        f"beta at its bounds: upper {coef_bounds[1]:g}: {int(c['at_upper_bound'])}/{n} updates, "
        f"lower {coef_bounds[0]:g}: {int(c['at_lower_bound'])}/{n}; at the largest value seen: {int(c['at_max_seen'])}, "
        f"at the smallest: {int(c['at_min_seen'])}",
    ]


def _alarm_line(report: RunReport) -> str:
    if report.n_alarms is None:
        return "alarms: not logged (kl/alarms is written by KLAlarmCallback)"
    if report.n_alarms == 0:
        return "alarms: none"
    shown = ", ".join(str(s) for s in report.alarm_steps[:10]) + (", ..." if len(report.alarm_steps) > 10 else "")
    return f"alarms: {report.n_alarms} (at steps {shown})"


def diagnosis_lines(report: RunReport, header: str = "diagnosis", bullet: str = "- ") -> list[str]:
    """
    :return: the header and one line per finding, or one line saying there is none (and why the KL was not judged)
    """
    if not report.findings:
        unjudged = "" if np.isfinite(report.above) else " (no target KL: the KL was not judged, pass --target)"
        return [f"{header}: nothing found that {TROUBLESHOOTING} lists{unjudged}"]
    return [f"{header}:", *(f"{bullet}{finding.summary()}" for finding in report.findings)]


def format_text(report: RunReport, coef_bounds: tuple[float, float] = DEFAULT_COEF_BOUNDS) -> str:
    """
    :param report: The report of one run
    :param coef_bounds: Known bounds of beta, as given to :func:`summarize_run`
    :return: A plain-text summary
    """
    run = report.run
    lo, hi = report.band
    lines = [
        f"== {run.name} ({run.source}: {run.path})",
        f"updates with KL: {report.n_updates}, steps {report.phases[0].first_step}..{report.phases[-1].last_step}",
        keys_line(run),
        f"{'phase':<8}{'steps':>22}{'n':>6}{'KL mean':>11}{'median':>11}{'max':>11}{'p99 max':>11}{'target':>11}"
        f"{'above':>8}{'below':>8}",
    ]
    for p in report.phases:
        lines.append(
            f"{p.name:<8}{f'{p.first_step}..{p.last_step}':>22}{p.n_updates:>6}{_num(p.kl_mean):>11}{_num(p.kl_median):>11}"
            f"{_num(p.kl_max):>11}{_num(p.kl_p99_max):>11}{_num(p.target):>11}{_pct(p.above):>8}{_pct(p.below):>8}"
        )
    lines.append(
        f"outside the band [{lo:g}, {hi:g}] x target ({report.band_source}): {_pct(report.above + report.below)} of "
        "updates "
        f"(above {_pct(report.above)}, below {_pct(report.below)})"
    )
    lines += _nonfinite_line(report)
    lines += _coef_lines(report, coef_bounds)
    lines += _normalization_line(report)
    lines.append(_alarm_line(report))
    if report.lead is not None:
        lines.append("lead-lag: " + report.lead.summary())
    lines += [f"note: {note}" for note in report.notes]
    lines += diagnosis_lines(report)
    return "\n".join(lines)


def format_markdown(reports: list[RunReport], coef_bounds: tuple[float, float] = DEFAULT_COEF_BOUNDS) -> str:
    """
    :param reports: The reports of all runs
    :param coef_bounds: Known bounds of beta
    :return: A markdown document with one section per run and the method at the end
    """
    out = ["# KL report", ""]
    for report in reports:
        run = report.run
        lo, hi = report.band
        out += [
            f"## {run.name}",
            "",
            f"Source: {run.source} `{run.path}`; {report.n_updates} updates with KL. {keys_line(run)}.",
            "",
            "| phase | steps | updates | KL mean | KL median | KL max | p99 max | target | above band | below band |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in report.phases:
            out.append(
                f"| {p.name} | {p.first_step}..{p.last_step} | {p.n_updates} | {_num(p.kl_mean)} | {_num(p.kl_median)} | "
                f"{_num(p.kl_max)} | {_num(p.kl_p99_max)} | {_num(p.target)} | {_pct(p.above)} | {_pct(p.below)} |"
            )
        out += [
            "",
            f"- Outside the band [{lo:g}, {hi:g}] x target ({report.band_source}): {_pct(report.above + report.below)} "
            "of updates",
        ]
        out += [
            f"- {line}" for line in _nonfinite_line(report) + _coef_lines(report, coef_bounds) + _normalization_line(report)
        ]
        out.append(f"- {_alarm_line(report)}")
        if report.lead is not None:
            out.append(f"- Lead-lag: {report.lead.summary()}")
        out += [f"- Note: {note}" for note in report.notes]
        out += diagnosis_lines(report, header="- Diagnosis", bullet="  - ")
        out.append("")
    out += ["## Method", "", METHOD, ""]
    return "\n".join(out)
