"""
What ``sb3-kl plot/report`` say about the band and the alarms, and how the command ends when its reader goes away;
the one-time warning about torch threads.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch as th
from stable_baselines3.common.logger import configure

from sb3_kl import KLPPO, KLTRPO
from sb3_kl.common import threads
from sb3_kl.diagnostics.logs import load_run
from sb3_kl.diagnostics.report import DEFAULT_BAND, format_text, resolve_band, summarize_run

ROOT = Path(__file__).resolve().parents[1]


def write_csv(folder: Path, band: tuple[float, float] | None, n: int = 30) -> Path:
    logger = configure(str(folder), ["csv"])
    rng = np.random.default_rng(0)
    for t in range(n):
        logger.record("time/total_timesteps", 256 * (t + 1))
        logger.record("rollout/ep_rew_mean", float(t))
        logger.record("train/kl", float(rng.lognormal(np.log(0.02), 0.5)))
        logger.record("train/target_kl", 0.02)
        if band is not None:
            logger.record("train/kl_band_low", band[0])
            logger.record("train/kl_band_high", band[1])
        logger.dump(step=256 * (t + 1))
    logger.close()
    return folder / "progress.csv"


def test_sb3_kl_algorithms_log_their_band():
    model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, kl_band=(0.4, 1.8), seed=0)
    model.learn(64)
    values = model.logger.name_to_value
    assert (values["train/kl_band_low"], values["train/kl_band_high"]) == (0.4, 1.8)
    # KLTRPO holds the KL by its constraint: no controller band to draw
    trpo = KLTRPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, seed=0).learn(64)
    assert "train/kl_band_low" not in trpo.logger.name_to_value


@pytest.mark.parametrize("logged, given, expected, source", [
    ((0.5, 1.5), None, (0.5, 1.5), "the run's kl_band"),
    (None, None, DEFAULT_BAND, "default: the run logged no band"),
    ((0.5, 1.5), (0.3, 3.0), (0.3, 3.0), "--band"),
])  # fmt: skip
def test_plot_and_report_use_and_name_the_band(tmp_path, logged, given, expected, source):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sb3_kl.plot import _draw_run

    run = load_run("run", str(write_csv(tmp_path, logged)), "csv")
    assert resolve_band(run, given) == (expected, source)
    report = summarize_run(run, band=given)
    assert f"outside the band [{expected[0]:g}, {expected[1]:g}] x target ({source})" in format_text(report)
    kl, target = run.get("kl_mean").values, 0.02
    outside = np.mean((kl > expected[1] * target) | (kl < expected[0] * target))
    assert report.above + report.below == pytest.approx(outside)
    fig, ax = plt.subplots()
    _draw_run({"kl": ax}, run, "C0", given, None, False)
    labels = ax.get_legend_handles_labels()[1]
    assert f"target band [{expected[0]:g}, {expected[1]:g}] x target ({source})" in labels
    (shaded,) = ax.collections
    low_edge, high_edge = shaded.get_paths()[0].vertices[:, 1].min(), shaded.get_paths()[0].vertices[:, 1].max()
    assert (low_edge, high_edge) == pytest.approx((expected[0] * target, expected[1] * target))
    plt.close(fig)


def test_report_names_the_callback_that_writes_alarms(tmp_path):
    run = load_run("run", str(write_csv(tmp_path, None)), "csv")
    assert "alarms: not logged (kl/alarms is written by KLAlarmCallback)" in format_text(summarize_run(run))


def test_report_into_a_closed_pipe_ends_quietly(tmp_path):
    write_csv(tmp_path, (0.5, 1.5))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "sb3_kl.cli", "report", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    process.stdout.close()  # the reader (`| head`) is gone before the first line is written
    _, stderr = process.communicate(timeout=120)
    assert b"Traceback" not in stderr and b"BrokenPipeError" not in stderr, stderr.decode()
    assert process.returncode == 1


def test_threads_warning_once_for_small_policies_on_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_warned", False)
    monkeypatch.setattr(th, "get_num_threads", lambda: 2)
    model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
    with pytest.warns(UserWarning, match=r"torch uses 2 intra-op threads .* torch.set_num_threads\(1\)"):
        model.learn(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.learn(64)  # once per process
    # chosen through the environment, or a large policy: no warning
    monkeypatch.setattr(threads, "_warned", False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not threads.warn_if_many_threads(model.policy, th.device("cpu"))
    monkeypatch.delenv("OMP_NUM_THREADS")
    big = th.nn.Linear(1000, threads.SMALL_POLICY_PARAMETERS // 1000 + 1)
    assert not threads.warn_if_many_threads(big, th.device("cpu"))
    with pytest.warns(UserWarning, match="intra-op threads"):
        assert threads.warn_if_many_threads(model.policy, th.device("cpu"))
