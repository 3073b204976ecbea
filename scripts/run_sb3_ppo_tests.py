"""
Run Stable-Baselines3's own test suite with ``PPO`` replaced by ``sb3_kl.KLPPO``: the evidence that KLPPO is a drop-in.

It downloads the source distribution of the installed SB3 version from PyPI (which ships ``tests/``), extracts its
tests into a cache folder, adds a ``conftest.py`` that rebinds ``stable_baselines3.PPO`` to ``KLPPO`` before the test
modules import it, and runs the tests that exercise PPO (``-k PPO``-style selection by test id).

    python scripts/run_sb3_ppo_tests.py [--cache /tmp/sb3-src] [-- extra pytest args]

Tests listed in ``EXPECTED_DIFFERENCES`` fail by design (documented KLPPO defaults) and are deselected with the reason.
"""

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

import stable_baselines3

# test id substring -> why KLPPO differs by design
EXPECTED_DIFFERENCES: dict[str, str] = {
    "test_ppo_warnings": "PPO-only check of the GPU warning text with `PPO` in it (KLPPO inherits the warning, names itself)",
}

TEST_FILES = [
    "test_run.py",
    "test_save_load.py",
    "test_spaces.py",
    "test_dict_env.py",
    "test_sde.py",
    "test_predict.py",
    "test_callbacks.py",
    "test_cnn.py",
    "test_custom_policy.py",
    "test_deterministic.py",
    "test_identity.py",
    "test_logger.py",
    "test_tensorboard.py",
    "test_train_eval_mode.py",
    "test_vec_envs.py",
    "test_gae.py",
    "test_distributions.py",
]

CONFTEST = '''
# Added by sb3-kl: every `from stable_baselines3 import PPO` in these tests gets sb3_kl.KLPPO
import stable_baselines3
import stable_baselines3.ppo

from sb3_kl import KLPPO

stable_baselines3.PPO = KLPPO
stable_baselines3.ppo.PPO = KLPPO
'''


def fetch_tests(cache: Path) -> Path:
    version = stable_baselines3.__version__
    folder = cache / f"stable_baselines3-{version}"
    if not (folder / "tests").exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"stable-baselines3=={version}", "-d", str(cache)],
            check=True,
        )
        with tarfile.open(cache / f"stable_baselines3-{version}.tar.gz") as archive:
            archive.extractall(cache, filter="data")
    (folder / "tests" / "conftest.py").write_text(CONFTEST)
    return folder / "tests"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sb3-src"))
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    tests = fetch_tests(args.cache)
    deselect = " and ".join(f"not {name}" for name in EXPECTED_DIFFERENCES)
    selection = f"(PPO or ppo) and {deselect}" if deselect else "PPO or ppo"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
               *[str(tests / f) for f in TEST_FILES], *args.pytest_args]
    print(" ".join(command), flush=True)
    return subprocess.run(command, cwd=tests).returncode


if __name__ == "__main__":
    sys.exit(main())
