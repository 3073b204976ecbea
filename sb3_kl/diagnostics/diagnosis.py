"""
What a run's KL report says to do: the entries of the troubleshooting page whose signs the run shows, each with the
evidence, the fix and the page and section it comes from, so that a person can act on the report and read more.
"""

from dataclasses import dataclass

import numpy as np

from sb3_kl.diagnostics.leadlag import LeadLagResult
from sb3_kl.diagnostics.logs import Series

#: The page the findings come from, and the sections (headings) each rule applies
TROUBLESHOOTING = "docs/guide/troubleshooting.md"
KL_EXPLODES = "The KL explodes"
KL_NEAR_ZERO = "The KL stays near zero, β sits at its floor"
NON_FINITE = "NaN or inf"
RETURN_DROPS = "Return drops after KL spikes"

#: The rule of the algorithms' warning of a stalled KL (``sb3_kl.common.on_policy_algorithm``): this many consecutive
#: updates with the KL below :data:`STALLED_KL_FRACTION` of the target
STALLED_AT_FLOOR_UPDATES = 10
STALLED_KL_FRACTION = 0.1
#: The sustained-spike rule of ``KLAlarmCallback``'s defaults: this many consecutive updates above this many x target
SPIKE_FACTOR = 5.0
SPIKE_PATIENCE = 3


@dataclass
class Finding:
    """
    One entry of the troubleshooting page that applies to the run.

    :param section: The heading of the page's section
    :param evidence: What the run's log shows
    :param fix: What to do
    :param page: The page, relative to the repository root
    """

    section: str
    evidence: str
    fix: str
    page: str = TROUBLESHOOTING

    def summary(self) -> str:
        """:return: One line: the problem, the evidence, the fix and where to read more (ASCII: beta for β)."""
        text = f'{self.section}: {self.evidence}. Fix: {self.fix} (see {self.page}, section "{self.section}")'
        return text.replace("β", "beta")


def values_at(series: Series, steps: np.ndarray) -> np.ndarray:
    """:return: the series' values at ``steps`` (NaN where it has none)"""
    values = np.full(len(steps), np.nan)
    if len(series):
        index = np.minimum(np.searchsorted(series.steps, steps), len(series) - 1)
        found = series.steps[index] == steps
        values[found] = series.values[index[found]]
    return values


def _longest_streak(condition: np.ndarray) -> tuple[int, int]:
    """:return: the length and the first index of the longest run of True in ``condition`` (0, 0 when none)"""
    best, best_start, start = 0, 0, 0
    for index, value in enumerate(np.append(condition, False)):
        if not value:
            if index - start > best:
                best, best_start = index - start, start
            start = index + 1
    return best, best_start


def _kl_near_zero(
    steps: np.ndarray, kl: np.ndarray, target: np.ndarray, coef: np.ndarray | None, coef_floor: float
) -> Finding | None:
    """The KL far below its target for many updates (with beta at its floor, when beta is logged)."""
    stalled = kl < STALLED_KL_FRACTION * target
    if coef is not None:
        stalled &= coef <= coef_floor * (1 + 1e-6)
    length, start = _longest_streak(stalled)
    if length < STALLED_AT_FLOOR_UPDATES:
        return None
    end = start + length - 1
    evidence = (
        f"for {length} consecutive updates (steps {steps[start]}..{steps[end]}) the KL stayed below "
        f"{STALLED_KL_FRACTION:g} x target (last {kl[end]:.3g} against {target[end]:.3g})"
    )
    if coef is None:
        fix = "the learning rate is too small for this target: adapt it with KLAdaptiveLRCallback(target_kl=...)"
    else:
        evidence += f" with beta at its floor {coef_floor:g}"
        fix = (
            'the learning rate, not beta, limits the step: learning_rate="auto" (KLPPO) or '
            "KLAdaptiveLRCallback(target_kl=...) lets it grow toward the target"
        )
    return Finding(KL_NEAR_ZERO, evidence, fix + "; or set a smaller target_kl")


def _kl_explodes(
    steps: np.ndarray, kl: np.ndarray, target: np.ndarray, coef: np.ndarray | None, coef_ceiling: float
) -> Finding | None:
    """The KL many times its target for several updates, or beta pinned at its upper bound."""
    length, start = _longest_streak(~(kl <= SPIKE_FACTOR * target))  # a NaN KL counts as above
    pinned, pinned_start = (0, 0) if coef is None else _longest_streak(coef >= coef_ceiling * (1 - 1e-6))
    evidence = []
    if length >= SPIKE_PATIENCE:
        largest = float(np.nanmax(kl[start : start + length] / target[start : start + length]))
        evidence.append(
            f"the KL exceeded {SPIKE_FACTOR:g} x target for {length} consecutive updates from step {steps[start]} "
            f"(up to {largest:.3g} x)"
        )
    if pinned >= SPIKE_PATIENCE:
        evidence.append(f"beta sat at its upper bound {coef_ceiling:g} for {pinned} updates from step {steps[pinned_start]}")
    if not evidence:
        return None
    fix = (
        "the learning rate (or n_epochs) is too high: lower it, or let KLAdaptiveLRCallback(target_kl) adapt it; "
        "on a stock agent KLAlarmCallback(stop_training=True) stops a runaway KL"
    )
    return Finding(KL_EXPLODES, "; ".join(evidence), fix)


def diagnose(
    steps: np.ndarray,
    kl: np.ndarray,
    target: np.ndarray,
    coef: np.ndarray | None,
    coef_bounds: tuple[float, float],
    nonfinite_steps: list[int],
    lead: LeadLagResult | None,
) -> list[Finding]:
    """
    :param steps: The steps of the updates with a KL and a target
    :param kl: Their mean KL (inf where it was not finite)
    :param target: Their target
    :param coef: Beta at those steps (None when not logged)
    :param coef_bounds: Beta's bounds
    :param nonfinite_steps: Steps of the updates whose KL is NaN or infinite
    :param lead: The lead-lag result (None when not tested)
    :return: The findings, most urgent first
    """
    findings = []
    if nonfinite_steps:
        findings.append(
            Finding(
                NON_FINITE,
                f"the KL is NaN or infinite at {len(nonfinite_steps)} update(s), the first at step {nonfinite_steps[0]}",
                "find the cause with VecCheckNan(env, raise_exception=True) under VecNormalize; lower the learning "
                "rate, set max_grad_norm",
            )
        )
    for rule, bound in ((_kl_explodes, coef_bounds[1]), (_kl_near_zero, coef_bounds[0])):
        finding = rule(steps, kl, target, coef, bound)
        if finding is not None:
            findings.append(finding)
    if lead is not None and lead.found:
        hint = "" if lead.p_value < 0.01 else ": at p >= 0.01 a hint, look at the run with sb3-kl plot"
        findings.append(
            Finding(
                RETURN_DROPS,
                f"KL spikes lead return drops by {lead.best_lag * lead.updates_per_lag} updates (p={lead.p_value:.3f}){hint}",
                "the large updates cost return: hold the KL tighter (a smaller target_kl or learning rate), and look at "
                "the states that moved most (KLMonitorCallback(top_k=...), sb3-kl states)",
            )
        )
    return findings
