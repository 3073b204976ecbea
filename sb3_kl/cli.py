"""
The ``sb3-kl`` command:

- ``sb3-kl plot LOGDIR [--out FILE.png] [--overlay]``: KL/return timeline per run (or all runs in one figure)
- ``sb3-kl report LOGDIR [--markdown FILE]``: KL summary per run, with the lead-lag of KL spikes and return drops
- ``sb3-kl states FILE.npz``: which observation dimensions separate the monitor's high-KL states from the rest

Problems with the input (missing or empty LOGDIR, a run without KL keys, an unreadable file) are printed as one
line on stderr and give a non-zero exit status.
"""

import argparse
import sys

from sb3_kl.diagnostics.command import (
    BAND_HELP,
    EXIT_ERROR,
    EXIT_PARTIAL,
    check_target,
    check_writable,
    load_logdir,
    positive_pair,
    run_command,
)
from sb3_kl.diagnostics.logs import DiagnosticsError
from sb3_kl.diagnostics.report import DEFAULT_COEF_BOUNDS
from sb3_kl.plot import add_plot_arguments

__all__ = ["EXIT_ERROR", "EXIT_PARTIAL", "build_parser", "main"]


def _cmd_report(args: argparse.Namespace) -> int:
    from sb3_kl.diagnostics.leadlag import METHOD
    from sb3_kl.diagnostics.report import format_markdown, format_text, summarize_run

    band = positive_pair(args.band, "--band", ("LOW", "HIGH"))
    bounds = positive_pair(args.coef_bounds, "--coef-bounds", ("MIN", "MAX"))
    assert bounds is not None
    check_target(args.target)
    if args.max_lag < 1:
        raise DiagnosticsError(f"--max-lag must be at least 1 update (lag 0 is always tried), got {args.max_lag}")
    if args.seed < 0:
        raise DiagnosticsError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.markdown:
        check_writable(args.markdown, "--markdown")
    runs, status = load_logdir(args.logdir)
    reports = [
        summarize_run(run, band=band, coef_bounds=bounds, target_kl=args.target, max_lag=args.max_lag, seed=args.seed)
        for run in runs
    ]
    for report in reports:
        print(format_text(report, bounds))
        print()
    print(METHOD)
    if args.markdown:
        try:
            with open(args.markdown, "w") as file_handler:
                file_handler.write(format_markdown(reports, bounds))
        except OSError as error:
            raise DiagnosticsError(f"cannot write {args.markdown}: {error.strerror or error}") from None
        print(f"wrote {args.markdown}")
    return status


def _cmd_states(args: argparse.Namespace) -> int:
    from sb3_kl.diagnostics.states import format_states, load_states

    if args.top < 1:
        raise DiagnosticsError(f"--top must be at least 1 dimension, got {args.top}")
    print(format_states(load_states(args.file), top=args.top))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """:return: The argument parser of ``sb3-kl``"""
    parser = argparse.ArgumentParser(prog="sb3-kl", description="KL diagnostics for Stable-Baselines3 runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plot_arguments(sub.add_parser("plot", help="draw the KL/return timeline of each run"))

    report = sub.add_parser("report", help="print a KL summary of each run")
    report.add_argument("logdir", help="TensorBoard log directory, run directory, event file or progress.csv")
    report.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    report.add_argument("--band", nargs=2, type=float, default=None, metavar=("LOW", "HIGH"), help=BAND_HELP)
    report.add_argument(
        "--coef-bounds",
        nargs=2,
        type=float,
        default=list(DEFAULT_COEF_BOUNDS),
        metavar=("MIN", "MAX"),
        help="bounds of the KL coefficient beta (default: sb3_kl's 1e-4 10)",
    )
    report.add_argument("--target", type=float, help="target KL for runs that did not log one")
    report.add_argument("--max-lag", type=int, default=10, help="largest lag (updates) of the lead-lag test (default 10)")
    report.add_argument("--seed", type=int, default=0, help="seed of the lead-lag null distribution")
    report.set_defaults(func=_cmd_report)

    states = sub.add_parser("states", help="compare the monitor's saved high-KL states with ordinary ones")
    states.add_argument("file", help=".npz file saved by the KL monitor")
    states.add_argument("--top", type=int, default=20, help="number of dimensions printed (default 20)")
    states.set_defaults(func=_cmd_states)
    return parser


def main(argv: list[str] | None = None) -> int:
    """
    Run ``sb3-kl``.

    :param argv: Arguments (default: ``sys.argv[1:]``)
    :return: Exit status: 0 on success, 1 on an error, 2 when some runs were skipped
    """
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
