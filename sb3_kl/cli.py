"""
The ``sb3-kl`` command:

- ``sb3-kl plot LOGDIR [--out FILE.png] [--overlay]``: KL/return timeline per run (or all runs in one figure)
- ``sb3-kl report LOGDIR [--markdown FILE]``: KL summary per run, with the lead-lag of KL spikes and return drops
- ``sb3-kl states FILE.npz``: which observation dimensions separate the monitor's high-KL states from the rest

Problems with the input (missing or empty LOGDIR, a run without KL keys, an unreadable file) are printed as one
line on stderr and give a non-zero exit status.
"""

import argparse
import math
import os
import sys

from sb3_kl.diagnostics.logs import DiagnosticsError, RunLog, load_runs
from sb3_kl.diagnostics.report import DEFAULT_BAND, DEFAULT_COEF_BOUNDS

EXIT_ERROR = 1  # nothing could be done
EXIT_PARTIAL = 2  # some runs were skipped


def _error(message: str) -> None:
    print(f"sb3-kl: error: {message}", file=sys.stderr)


def _positive_pair(values: list[float] | None, option: str, names: tuple[str, str]) -> tuple[float, float] | None:
    if values is None:
        return None
    low, high = (float(value) for value in values)
    if not 0 < low < high < math.inf:
        raise DiagnosticsError(f"{option} needs finite 0 < {names[0]} < {names[1]}, got {low:g} {high:g}")
    return low, high


def _check_target(target: float | None) -> None:
    if target is not None and not 0 < target < math.inf:
        raise DiagnosticsError(f"--target must be a positive KL (e.g. 0.02), got {target:g}")


def _check_writable(path: str, option: str) -> None:
    """Fail before any work when ``path`` cannot be written (a missing folder, or a folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise DiagnosticsError(f"cannot write {option} {path}: it is a directory, give a file name")
    if os.path.exists(path):  # an existing file (or /dev/stdout): its own permission decides
        if not os.access(path, os.W_OK):
            raise DiagnosticsError(f"cannot write {option} {path}: the file is not writable")
        return
    if not os.path.isdir(folder):
        raise DiagnosticsError(f"cannot write {option} {path}: folder {folder} does not exist, create it first")
    if not os.access(folder, os.W_OK):
        raise DiagnosticsError(f"cannot write {option} {path}: folder {folder} is not writable")


def _load(logdir: str) -> tuple[list[RunLog], int]:
    runs, problems = load_runs(logdir)
    for problem in problems:
        _error(problem)
    if not runs and problems:
        raise _Reported()
    return runs, EXIT_PARTIAL if problems else 0


class _Reported(Exception):
    """The problems were already printed."""


def _cmd_plot(args: argparse.Namespace) -> int:
    from sb3_kl.plot import draw_timeline, output_paths

    band = _positive_pair(args.band, "--band", ("LOW", "HIGH"))
    _check_target(args.target)
    size = (float(args.size[0]), float(args.size[1]))
    if min(size) <= 0 or args.dpi <= 0:
        raise DiagnosticsError("--size and --dpi must be positive")
    if args.out.endswith(("/", os.sep)) or os.path.isdir(args.out):
        folder = args.out.rstrip("/" + os.sep)
        raise DiagnosticsError(f"cannot write --out {args.out}: it is a directory, give a file name (e.g. {folder}/kl.png)")
    runs, status = _load(args.logdir)
    groups = [runs] if args.overlay else [[run] for run in runs]
    paths = output_paths(args.out, runs, args.overlay)
    for path in paths:
        _check_writable(path, "--out")
    for group, path in zip(groups, paths, strict=True):
        try:
            draw_timeline(group, path, band=band, size=size, dpi=args.dpi, target_kl=args.target)
        except OSError as error:
            raise DiagnosticsError(f"cannot write {path}: {error.strerror or error}") from None
        except ValueError as error:  # e.g. an image format matplotlib does not know
            raise DiagnosticsError(f"cannot write {path}: {error}") from None
        print(f"wrote {path} ({', '.join(run.name for run in group)})")
    return status


def _cmd_report(args: argparse.Namespace) -> int:
    from sb3_kl.diagnostics.leadlag import METHOD
    from sb3_kl.diagnostics.report import format_markdown, format_text, summarize_run

    band = _positive_pair(args.band, "--band", ("LOW", "HIGH"))
    bounds = _positive_pair(args.coef_bounds, "--coef-bounds", ("MIN", "MAX"))
    assert bounds is not None
    _check_target(args.target)
    if args.max_lag < 1:
        raise DiagnosticsError(f"--max-lag must be at least 1 update (lag 0 is always tried), got {args.max_lag}")
    if args.seed < 0:
        raise DiagnosticsError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.markdown:
        _check_writable(args.markdown, "--markdown")
    runs, status = _load(args.logdir)
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
    band_help = (
        "target band as multiples of the logged target KL (default: the band the run logged, i.e. sb3_kl's kl_band,"
        f" 0.8 1.25 unless changed; {DEFAULT_BAND[0]:g} {DEFAULT_BAND[1]:g} for runs that logged none)"
    )

    plot = sub.add_parser("plot", help="draw the KL/return timeline of each run")
    plot.add_argument("logdir", help="TensorBoard log directory, run directory, event file or progress.csv")
    plot.add_argument("--out", default="kl_timeline.png", help="image file (several runs: one file per run, suffixed)")
    plot.add_argument("--overlay", action="store_true", help="draw all runs in one figure")
    plot.add_argument("--band", nargs=2, type=float, default=None, metavar=("LOW", "HIGH"), help=band_help)
    plot.add_argument("--target", type=float, help="target KL for runs that did not log one (draws their band)")
    plot.add_argument("--size", nargs=2, type=float, default=[10.0, 8.0], metavar=("W", "H"), help="inches (default 10 8)")
    plot.add_argument("--dpi", type=int, default=100, help="pixels per inch (default 100: a 1000x800 image)")
    plot.set_defaults(func=_cmd_plot)

    report = sub.add_parser("report", help="print a KL summary of each run")
    report.add_argument("logdir", help="TensorBoard log directory, run directory, event file or progress.csv")
    report.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    report.add_argument("--band", nargs=2, type=float, default=None, metavar=("LOW", "HIGH"), help=band_help)
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
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that closed the pipe is handled below, not at interpreter exit
        return status
    except BrokenPipeError:
        # the reader stopped early (``sb3-kl report ... | head``): stop quietly, as cat or grep do. Python's own
        # flush at exit would fail again on the closed pipe: point stdout at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except DiagnosticsError as error:
        _error(str(error))
    except _Reported:
        pass
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
