"""
KL diagnostics for people: reading SB3 logs (:mod:`~sb3_kl.diagnostics.logs`), the per-run KL report and the
lead-lag of KL spikes and return drops (:mod:`~sb3_kl.diagnostics.report`, :mod:`~sb3_kl.diagnostics.leadlag`),
and the drill-down into high-KL states (:mod:`~sb3_kl.diagnostics.states`). The command line is ``sb3-kl``
(:mod:`sb3_kl.cli`), the figure is drawn by :mod:`sb3_kl.plot`.
"""

from sb3_kl.diagnostics.leadlag import LeadLagResult, lead_lag
from sb3_kl.diagnostics.logs import KL_KEYS, DiagnosticsError, RunLog, Series, find_runs, load_run, load_runs
from sb3_kl.diagnostics.report import RunReport, summarize_run
from sb3_kl.diagnostics.states import StatesReport, load_states

__all__ = [
    "KL_KEYS",
    "DiagnosticsError",
    "LeadLagResult",
    "RunLog",
    "RunReport",
    "Series",
    "StatesReport",
    "find_runs",
    "lead_lag",
    "load_run",
    "load_runs",
    "load_states",
    "summarize_run",
]
