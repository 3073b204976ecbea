"""
Every example in examples/ runs to the end with a small training budget (``SB3_KL_EXAMPLE_STEPS``), from the root of
the checkout as a user would run it, and leaves the repository as it was (``git status --porcelain`` unchanged).
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.py"))
NEEDS_ZOO = {"zoo_train.py"}


def git_status() -> str | None:
    """``git status --porcelain`` of the checkout, or None when this is not a git checkout."""
    try:
        result = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0 or not (ROOT / ".git").exists():
        return None
    return result.stdout


def repository_files() -> dict[str, tuple[int, int]]:
    """
    Every file of the checkout with its size and modification time, ignored ones included (``git status`` does not
    show a write into an ignored folder such as ``logs/``), except caches, virtual environments and the docs site's
    copies of the results pages (``docs/results/``, which the docs build, a test that may run beside, writes).
    """
    skip = {".git", "__pycache__", ".pytest_cache", ".hypothesis"}
    site_copies = ROOT / "docs" / "results"
    files = {}
    for directory, folders, names in os.walk(ROOT):
        folders[:] = [f for f in folders if f not in skip and not f.startswith((".venv", "venv"))]
        if Path(directory) == site_copies.parent:
            folders[:] = [f for f in folders if f != site_copies.name]
        for name in names:
            path = os.path.join(directory, name)
            stat = os.stat(path)
            files[os.path.relpath(path, ROOT)] = (stat.st_size, stat.st_mtime_ns)
    return files


def test_every_example_is_covered():
    assert {"quickstart.py", "plot_kl_timeline.py", "swap_ppo_for_klppo.py", "zoo_train.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.slow  # each example starts an interpreter and trains one rollout
def test_example_runs_and_leaves_the_checkout_clean(example, tmp_path):
    if example in NEEDS_ZOO and importlib.util.find_spec("rl_zoo3") is None:
        pytest.skip("needs the zoo extra")
    before = git_status()
    if before is None:
        pytest.skip("not a git checkout")
    files_before = repository_files()
    env = {
        **os.environ,
        "SB3_KL_EXAMPLE_STEPS": "256",
        "TMPDIR": str(tmp_path),  # the examples' temporary directories land here
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert git_status() == before, f"{example} changed the checkout"
    files_after = repository_files()
    changed = sorted(p for p in files_before.keys() | files_after.keys() if files_before.get(p) != files_after.get(p))
    assert not changed, f"{example} wrote into the checkout: {changed[:10]}"
    assert any(tmp_path.iterdir()) or example == "quickstart.py"  # whatever it wrote went to the temporary directory


def load_example(name: str):
    """The module of an example, imported without running its ``main()``."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("beta", [1e-4, 3.7e-4, 0.04, 1.0, 10.0])
def test_quickstart_prints_beta_readably(beta, capsys):
    # beta's floor is 1e-4: a fixed-point format printed it as 0.000
    callback = load_example("quickstart.py").PrintKL()
    logged = {"train/kl": 0.01, "train/kl_p99": 0.05, "train/target_kl": 0.02, "train/kl_coef": beta}
    callback.model = SimpleNamespace(logger=SimpleNamespace(name_to_value={**logged, "train/kl_convention": "forward"}))
    callback.num_timesteps = 256
    callback._on_rollout_start()
    printed = re.search(r"beta=(\S+)", capsys.readouterr().out).group(1)
    assert float(printed) == pytest.approx(beta, rel=0.01)
