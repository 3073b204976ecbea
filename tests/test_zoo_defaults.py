"""
What the zoo wrapper does by default: one torch thread unless told otherwise, a ``progress.csv`` in the run's folder
that ``sb3-kl plot``/``report`` read, and one line (no traceback) when the zoo extra is missing.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST_PARAMS = ["-params", "n_envs:2", "n_steps:64", "batch_size:64", "n_epochs:2", "policy_kwargs:dict(net_arch=[16])"]


@pytest.fixture(scope="module")
def zoo():
    pytest.importorskip("rl_zoo3")
    pytest.importorskip("optuna")
    import sb3_kl.zoo

    return sb3_kl.zoo


def test_one_thread_unless_num_threads_or_omp_is_given(zoo, monkeypatch):
    from sb3_kl.zoo.registry import with_default_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert with_default_threads(["--algo", "klppo"]) == ["--algo", "klppo", "--num-threads", "1"]
    assert with_default_threads(["--num-threads", "-1"]) == ["--num-threads", "-1"]
    assert with_default_threads(["--num-threads=4"]) == ["--num-threads=4"]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert with_default_threads(["--algo", "klppo"]) == ["--algo", "klppo"]


def test_zoo_run_writes_progress_csv_that_plot_and_report_read(zoo, tmp_path, capsys):
    """A zoo run without -tb: ``sb3-kl plot logs/klppo/CartPole-v1_1`` works on the run's folder as it is."""
    import sb3_kl.cli
    from sb3_kl.zoo.__main__ import main

    main(
        ["train", "--algo", "klppo", "--env", "CartPole-v1", "-n", "512", "--seed", "0", "-f", str(tmp_path),
         "--eval-freq", "-1", "--verbose", "0", *FAST_PARAMS]
    )  # fmt: skip
    run_dir = tmp_path / "klppo" / "CartPole-v1_1"
    header = (run_dir / "progress.csv").read_text().splitlines()[0].split(",")
    assert {"train/kl", "train/kl_coef", "train/target_kl", "time/total_timesteps"} <= set(header)
    out = tmp_path / "timeline.png"
    assert sb3_kl.cli.main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    capsys.readouterr()
    assert sb3_kl.cli.main(["report", str(run_dir)]) == 0
    report = capsys.readouterr().out
    assert "KL keys: mean=train/kl" in report
    assert "[0.8, 1.25] x target (the run's kl_band)" in report  # KLPPO's default band, read from the run's log


def test_no_progress_csv_during_optimize(zoo):
    from rl_zoo3.exp_manager import ExperimentManager

    from sb3_kl.zoo.registry import ProgressCSVCallback

    manager = ExperimentManager.__new__(ExperimentManager)
    manager.__dict__.update(
        algo="klppo", optimize_hyperparameters=True, callbacks=[], show_progress=False, save_freq=-1, eval_freq=-1
    )
    manager.save_path = "unused"
    manager.create_callbacks()
    assert not any(isinstance(c, ProgressCSVCallback) for c in manager.callbacks)
    manager.optimize_hyperparameters = False
    manager.create_callbacks()
    assert [c.folder for c in manager.callbacks if isinstance(c, ProgressCSVCallback)] == ["unused"]


def test_python_m_sb3_kl_zoo_without_the_extra_prints_one_line(tmp_path):
    # a stand-in rl_zoo3 that fails to import, first on the path: as if the zoo extra were not installed
    (tmp_path / "rl_zoo3.py").write_text("raise ImportError(\"No module named 'rl_zoo3'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "sb3_kl.zoo", "train", "--algo", "klppo"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert 'pip install -e ".[zoo]"' in lines[0] and "rl_zoo3" in lines[0]


def test_plot_of_a_folder_without_logs_names_the_flag(tmp_path, capsys):
    """A zoo run made with rl_zoo3 itself and no -tb: the error says which flag (or which wrapper) writes the log."""
    import sb3_kl.cli

    run_dir = tmp_path / "ppo" / "CartPole-v1_1"
    run_dir.mkdir(parents=True)
    (run_dir / "0.monitor.csv").write_text('#{"t_start": 0, "env_id": "CartPole-v1"}\nr,l,t\n10.0,10,0.1\n')
    assert sb3_kl.cli.main(["plot", str(run_dir), "--out", str(tmp_path / "x.png")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "-tb DIR" in error and "python -m sb3_kl.zoo train" in error
