"""
Run sb3-contrib's own LSTM tests first stock, then with ``RecurrentPPO`` rebound to ``sb3_kl.RecurrentKLPPO``: the
evidence that RecurrentKLPPO is a drop-in for RecurrentPPO.

It downloads the source distribution of the installed sb3-contrib version from PyPI (which ships ``tests/``) into its
own cache folder, and runs ``tests/test_lstm.py`` plus the RecurrentPPO cases of ``test_cnn.py`` and
``test_deterministic.py``, without the ``slow`` marker (as sb3-contrib's ``make pytest`` does). The rebound run adds a
``conftest.py`` that rebinds ``sb3_contrib.RecurrentPPO`` before the test modules import it; it is removed afterwards.
Both results go to ``benchmarks/results/sb3_contrib_lstm_suite.md``.

    python scripts/run_sb3_contrib_lstm_tests.py [--cache /tmp/sb3-contrib-lstm] [-- extra pytest args]

Tests that fail only rebound are listed in ``EXPECTED_DIFFERENCES`` with the reason (a documented, deliberate
difference) and deselected in both runs; there are none at present.
"""

import argparse
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import sb3_contrib

# test id substring -> why RecurrentKLPPO differs by design
EXPECTED_DIFFERENCES: dict[str, str] = {}

TESTS = ["test_lstm.py", "test_cnn.py", "test_deterministic.py"]
SELECTION = "test_lstm or RecurrentPPO or RecurrentKLPPO"

CONFTEST = """
# Added by sb3-kl: every `from sb3_contrib import RecurrentPPO` in these tests gets sb3_kl.RecurrentKLPPO
import sb3_contrib
import sb3_contrib.ppo_recurrent

from sb3_kl import RecurrentKLPPO

sb3_contrib.RecurrentPPO = RecurrentKLPPO
sb3_contrib.ppo_recurrent.RecurrentPPO = RecurrentKLPPO
"""


def fetch_tests(cache: Path) -> Path:
    """:return: the ``tests`` folder of the installed sb3-contrib version's source distribution"""
    version = sb3_contrib.__version__
    folder = cache / f"sb3_contrib-{version}"
    if not (folder / "tests").exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                *[f"sb3-contrib=={version}", "-d", str(cache)],
            ],
            check=True,
        )
        with tarfile.open(cache / f"sb3_contrib-{version}.tar.gz") as archive:
            archive.extractall(cache, filter="data")
    return folder / "tests"


def run(tests: Path, rebound: bool, pytest_args: list[str]) -> tuple[int, list[str]]:
    """Run the selection stock or rebound; :return: pytest's exit code and the summary lines"""
    conftest = tests / "conftest.py"
    if rebound:
        conftest.write_text(CONFTEST)
    elif conftest.exists():
        conftest.unlink()
    selection = SELECTION + "".join(f" and not ({name})" for name in EXPECTED_DIFFERENCES)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rfE", "-k", selection]
    command += [str(tests / name) for name in TESTS] + pytest_args
    print(("rebound: " if rebound else "stock: ") + " ".join(command), flush=True)
    try:
        process = subprocess.run(command, cwd=tests, capture_output=True, text=True)
    finally:
        if rebound and conftest.exists():
            conftest.unlink()
    print(process.stdout[-10_000:], process.stderr[-3_000:], sep="\n")
    lines = process.stdout.splitlines()
    summary = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary += [line for line in lines[-3:] if " in " in line and ("passed" in line or "failed" in line)]
    return process.returncode, summary


def summary_table(runs: dict[str, list[str]]) -> list[str]:
    """
    The page's opening table: per run, the counts of pytest's summary line.

    :param runs: Per run name, its summary lines (``FAILED``/``ERROR`` lines and pytest's last line)
    """
    lines = ["| run | passed | failed | errors | skipped | deselected |", "|---|---|---|---|---|---|"]
    for name, summary in runs.items():
        counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary[-1])}
        counts["errors"] = counts.get("errors", 0) + counts.get("error", 0)
        cells = [str(counts.get(kind, 0)) for kind in ("passed", "failed", "errors", "skipped", "deselected")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sb3-contrib-lstm"))
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sb3_contrib_lstm_suite.md",
    )
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    tests = fetch_tests(args.cache)
    stock_code, stock = run(tests, rebound=False, pytest_args=args.pytest_args)
    rebound_code, rebound = run(tests, rebound=True, pytest_args=args.pytest_args)
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    lines = [
        "# sb3-contrib's LSTM tests, stock and with RecurrentPPO replaced by RecurrentKLPPO",
        "",
        *summary_table({"stock (RecurrentPPO)": stock, "rebound (RecurrentKLPPO)": rebound}),
        "",
        f"Generated by `python scripts/run_sb3_contrib_lstm_tests.py {' '.join(args.pytest_args)}` at sb3-kl commit"
        f" {commit or 'unknown'} against sb3-contrib"
        f" {sb3_contrib.__version__} (its source distribution's `tests/`), files: {', '.join(TESTS)}; selection:"
        " every test of `test_lstm.py` and the RecurrentPPO cases of the others, without `slow` (as sb3-contrib's"
        " `make pytest`).",
        "",
        "Stock (`RecurrentPPO`):",
        "",
        *[f"    {line}" for line in stock],
        "",
        "Rebound (`sb3_contrib.RecurrentPPO = sb3_kl.RecurrentKLPPO`, with RecurrentKLPPO's defaults: no ratio clip,"
        " adaptive KL penalty):",
        "",
        *[f"    {line}" for line in rebound],
        "",
        "Tests failing only rebound (documented, deliberate differences, deselected in both runs):",
        "",
        *([f"- `{name}`: {why}" for name, why in EXPECTED_DIFFERENCES.items()] or ["- none"]),
        "",
    ]
    args.out.write_text("\n".join(lines))
    return stock_code or rebound_code


if __name__ == "__main__":
    sys.exit(main())
