"""
Run a peer library's own tests twice: first stock, then with some of its algorithm classes rebound to sb3-kl's
drop-ins (e.g. ``sb3_contrib.MaskablePPO`` -> ``sb3_kl.MaskableKLPPO``), and write a per-test comparison.

The library's source distribution (which ships ``tests/``) is downloaded from PyPI for the installed version with
``pip download``, and extracted into a cache folder. For the rebound run a ``conftest.py`` replaces the classes in the
library's modules before the test modules import them. Each run's outcomes are read from pytest's JUnit XML report;
a test that passes stock and fails rebound is either a defect or a deliberate difference, explained in the suite's
``differences`` (listed in the results file, never deselected).

    python scripts/run_peer_tests_rebound.py --suite maskable [-- extra pytest args]
    python scripts/run_peer_tests_rebound.py --package sb3-contrib --rebind sb3_contrib.MaskablePPO=sb3_kl.MaskableKLPPO \\
        --files test_invalid_actions.py -k "test_invalid_actions" --out results.md

Presets (``--suite``) live in :data:`SUITES`; any of their fields can be overridden on the command line.
"""

import argparse
import importlib
import importlib.metadata
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Named test selections: the peer package (PyPI name), the classes rebound (stock -> sb3-kl, dotted paths), its test
#: files, a ``-k`` selection, the results file, and the tests that fail rebound by design, with the reason
SUITES: dict[str, dict[str, Any]] = {
    "maskable": dict(
        package="sb3-contrib",
        rebind=["sb3_contrib.MaskablePPO=sb3_kl.MaskableKLPPO"],
        files=["test_invalid_actions.py", "test_run.py", "test_cnn.py", "test_train_eval_mode.py"],
        select="test_invalid_actions or MaskablePPO or MaskableKLPPO or ppo_mask or advantage_normalization",
        out="benchmarks/results/sb3_contrib_maskable_suite.md",
        differences={},
    ),
}


def fetch_tests(package: str, cache: Path) -> Path:
    """Download and extract the source distribution of the installed ``package``; return its ``tests`` folder."""
    version = importlib.metadata.version(package)
    stem = f"{package.replace('-', '_')}-{version}"
    folder = cache / stem
    if not (folder / "tests").exists():
        cache.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"{package}=={version}", "-d", str(cache)], check=True)
        with tarfile.open(cache / f"{stem}.tar.gz") as archive:
            archive.extractall(cache, filter="data")
    return folder / "tests"


def conftest_text(rebind: list[str]) -> str:
    """A conftest.py that rebinds each ``stock=replacement`` pair in every loaded module of the stock package."""
    lines = [
        "# Written by sb3-kl's scripts/run_peer_tests_rebound.py: stock classes rebound before the tests import them",
        "import importlib",
        "import sys",
        "",
    ]
    for pair in rebind:
        stock, replacement = pair.split("=")
        stock_module, stock_name = stock.rsplit(".", 1)
        new_module, new_name = replacement.rsplit(".", 1)
        lines += [
            f"_stock = getattr(importlib.import_module({stock_module!r}), {stock_name!r})",
            f"_new = getattr(importlib.import_module({new_module!r}), {new_name!r})",
            f"_top = {stock_module.split('.')[0]!r}",
            "for _module in [m for name, m in list(sys.modules.items()) if name.split('.')[0] == _top]:",
            # the defining module keeps its class (the replacement may reuse its methods)
            f"    if getattr(_module, {stock_name!r}, None) is _stock and _module.__name__ != _stock.__module__:",
            f"        setattr(_module, {stock_name!r}, _new)",
            "",
        ]
    return "\n".join(lines)


def run_pytest(tests: Path, files: list[str], select: str, report: Path, extra: list[str]) -> dict[str, str]:
    """Run pytest on ``files`` with ``-k select``; return ``{test id: passed|failed|error|skipped}``."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-k", select, f"--junitxml={report}", *[str(tests / f) for f in files], *extra]
    print(" ".join(command), flush=True)
    process = subprocess.run(command, cwd=tests, capture_output=True, text=True)
    print(process.stdout[-5_000:], process.stderr[-2_000:], sep="\n", flush=True)
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = (
            "failed" if "failure" in kinds else "error" if "error" in kinds else "skipped" if "skipped" in kinds else "passed"
        )
        outcomes[test_id] = outcome
    return outcomes


def normalize_ids(outcomes: dict[str, str], rebind: list[str]) -> dict[str, str]:
    """Parametrized ids name classes: write the replacement's name back as the stock one so both runs line up."""
    names = [(pair.split("=")[1].rsplit(".", 1)[1], pair.split("=")[0].rsplit(".", 1)[1]) for pair in rebind]
    normalized = {}
    for test_id, outcome in outcomes.items():
        for new, stock in names:
            test_id = test_id.replace(new, stock)
        normalized[test_id] = outcome
    return normalized


def summary_table(stock: dict[str, str], rebound: dict[str, str]) -> list[str]:
    """The page's opening table: the outcomes of each run, and the tests failing only when rebound."""
    kinds = ("passed", "failed", "error", "skipped")
    rebound_only = [t for t in rebound if rebound[t] in ("failed", "error") and stock.get(t) == "passed"]
    lines = ["| run | " + " | ".join(kinds) + " | failing only here |", "|---|---|---|---|---|---|"]
    for name, outcomes, only in (("stock", stock, "-"), ("rebound", rebound, str(len(rebound_only)))):
        lines.append(f"| {name} | " + " | ".join(str(sum(o == k for o in outcomes.values())) for k in kinds) + f" | {only} |")
    return lines


def report_lines(
    args: argparse.Namespace, stock: dict[str, str], rebound: dict[str, str], version: str, differences: dict[str, str]
) -> list[str]:
    def count(outcomes: dict[str, str]) -> str:
        kinds = ("passed", "failed", "error", "skipped")
        return ", ".join(f"{sum(o == k for o in outcomes.values())} {k}" for k in kinds)

    rebound_only = [t for t in rebound if rebound[t] in ("failed", "error") and stock.get(t) == "passed"]
    lines = [
        f"# {args.package}'s own tests, stock and with {', '.join(args.rebind)}",
        "",
        *summary_table(stock, rebound),
        "",
        f"Generated by `python scripts/run_peer_tests_rebound.py {' '.join(sys.argv[1:])}` at sb3-kl commit"
        f" `{code_version()}` against {args.package} {version} (its source distribution's `tests/`), files:"
        f" {', '.join(args.files)}; selection `-k \"{args.select}\"`.",
        "",
        f"- stock: {count(stock)}",
        f"- rebound: {count(rebound)}",
        f"- failing only when rebound: {len(rebound_only)}",
        "",
        "| test | stock | rebound |",
        "|---|---|---|",
        *[f"| `{t}` | {stock.get(t, 'absent')} | {rebound.get(t, 'absent')} |" for t in sorted(set(stock) | set(rebound))],
        "",
    ]
    if rebound_only:
        lines += ["Failing only when rebound:", ""]
        for test_id in rebound_only:
            reason = next((why for key, why in differences.items() if key in test_id), "**not explained: a defect**")
            lines.append(f"- `{test_id}`: {reason}")
        lines.append("")
    return lines


def code_version() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sb3_kl"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return commit.strip()[:7] + ("+modified" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default=None, help="a preset (fields below override it)")
    parser.add_argument("--package", help="PyPI name of the peer library, e.g. sb3-contrib")
    parser.add_argument("--rebind", nargs="+", help="stock=replacement class paths, e.g. sb3_contrib.X=sb3_kl.Y")
    parser.add_argument("--files", nargs="+", help="test files of the peer's tests/ folder")
    parser.add_argument("-k", dest="select", help="pytest -k selection")
    parser.add_argument("--out", help="results file (markdown), relative to the repository")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sb3-kl-peer-tests"))
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    preset = SUITES.get(args.suite, {}) if args.suite else {}
    for field in ("package", "rebind", "files", "select", "out"):
        if getattr(args, field) is None:
            if field not in preset:
                parser.error(f"--{field} is required without a --suite that sets it")
            setattr(args, field, preset[field])
    differences = preset.get("differences", {})

    tests = fetch_tests(args.package, args.cache)
    conftest = tests / "conftest.py"
    conftest.unlink(missing_ok=True)
    stock = run_pytest(tests, args.files, args.select, args.cache / "stock.xml", args.pytest_args)
    conftest.write_text(conftest_text(args.rebind))
    try:
        rebound = normalize_ids(
            run_pytest(tests, args.files, args.select, args.cache / "rebound.xml", args.pytest_args), args.rebind
        )
    finally:
        conftest.unlink()
    version = importlib.metadata.version(args.package)
    out = ROOT / args.out
    out.write_text("\n".join(report_lines(args, stock, rebound, version, differences)))
    print(f"wrote {out}")
    failed_rebound_only = [t for t in rebound if rebound[t] in ("failed", "error") and stock.get(t) == "passed"]
    return 1 if any(not any(key in t for key in differences) for t in failed_rebound_only) else 0


if __name__ == "__main__":
    sys.exit(main())
