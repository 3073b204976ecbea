"""
What the ``sb3-kl`` subcommands share (:mod:`sb3_kl.cli`, and ``python -m sb3_kl.plot``): checks of their options,
reading LOGDIR with each unreadable run reported, the exit statuses, and running a parsed command with its errors
printed as one line on stderr.
"""

import argparse
import math
import os
import sys

from sb3_kl.diagnostics.logs import DiagnosticsError, RunLog, load_runs
from sb3_kl.diagnostics.report import DEFAULT_BAND

EXIT_ERROR = 1  # nothing could be done
EXIT_PARTIAL = 2  # some runs were skipped

#: Help of ``--band`` (``plot`` and ``report``)
BAND_HELP = (
    "target band as multiples of the logged target KL (default: the band the run logged, i.e. sb3_kl's kl_band,"
    f" 0.8 1.25 unless changed; {DEFAULT_BAND[0]:g} {DEFAULT_BAND[1]:g} for runs that logged none)"
)


class Reported(Exception):
    """The problems were already printed."""


def print_error(message: str) -> None:
    """Print ``message`` as the command's one error line on stderr."""
    print(f"sb3-kl: error: {message}", file=sys.stderr)


def positive_pair(values: list[float] | None, option: str, names: tuple[str, str]) -> tuple[float, float] | None:
    """:return: ``values`` as ``(low, high)`` with finite ``0 < low < high`` (None stays None), else DiagnosticsError"""
    if values is None:
        return None
    low, high = (float(value) for value in values)
    if not 0 < low < high < math.inf:
        raise DiagnosticsError(f"{option} needs finite 0 < {names[0]} < {names[1]}, got {low:g} {high:g}")
    return low, high


def check_target(target: float | None) -> None:
    """Refuse a ``--target`` that is not a positive finite KL."""
    if target is not None and not 0 < target < math.inf:
        raise DiagnosticsError(f"--target must be a positive KL (e.g. 0.02), got {target:g}")


def check_writable(path: str, option: str) -> None:
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


def load_logdir(logdir: str) -> tuple[list[RunLog], int]:
    """
    :param logdir: The command's LOGDIR
    :return: The readable runs, and :data:`EXIT_PARTIAL` when some were not (each printed), else 0
    :raises Reported: no run could be read
    """
    runs, problems = load_runs(logdir)
    for problem in problems:
        print_error(problem)
    if not runs and problems:
        raise Reported()
    return runs, EXIT_PARTIAL if problems else 0


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """
    Parse ``argv`` and run the command it names (the parser's ``func`` default).

    :param parser: The command's parser
    :param argv: Arguments (default: ``sys.argv[1:]``)
    :return: Exit status: 0 on success, 1 on an error, 2 when some runs were skipped
    """
    args = parser.parse_args(argv)
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
        print_error(str(error))
    except Reported:
        pass
    return EXIT_ERROR
