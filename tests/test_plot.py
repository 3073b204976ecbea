import shutil
import subprocess
import sys
import warnings

import matplotlib.image
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.logger import configure

from sb3_kl import KLPPO
from sb3_kl.cli import main
from sb3_kl.diagnostics.logs import find_runs, load_run


@pytest.fixture(scope="module")
def klppo_logdir(tmp_path_factory):
    """A real KLPPO run on CartPole logged to TensorBoard (16 updates)."""
    th.set_num_threads(1)
    logdir = tmp_path_factory.mktemp("tb")
    model = KLPPO(
        "MlpPolicy",
        "CartPole-v1",
        n_steps=128,
        n_epochs=2,
        policy_kwargs=dict(net_arch=[16]),
        seed=0,
        tensorboard_log=str(logdir),
    )
    model.learn(2048)
    return logdir


@pytest.fixture(scope="module")
def stock_csv_logdir(tmp_path_factory):
    """A real stock PPO run with KLMonitorCallback and KLAlarmCallback logged to CSV; saves the top-k states too."""
    from sb3_kl.callbacks import KLAlarmCallback, KLMonitorCallback

    th.set_num_threads(1)
    logdir = tmp_path_factory.mktemp("csv")
    model = PPO(
        "MlpPolicy", "CartPole-v1", n_steps=128, n_epochs=2, learning_rate=3e-3, policy_kwargs=dict(net_arch=[16]), seed=0
    )
    model.set_logger(configure(str(logdir / "ppo_csv"), ["csv"]))
    monitor = KLMonitorCallback(top_k=4, top_k_path=str(logdir / "top.npz"))
    # a tiny target so that alarms are raised and drawn
    alarm = KLAlarmCallback(target_kl=1e-4, spike_factor=2.0, patience=1, monitor=monitor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(2048, callback=[monitor, alarm])
    assert len(alarm.alarms) > 0
    return logdir


def _pixels(path) -> tuple[int, int]:
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and np.isfinite(image).all()
    # something was drawn: the image is not a single colour
    assert image[..., :3].std() > 0.01
    return image.shape[1], image.shape[0]


def test_read_tensorboard_run(klppo_logdir):
    runs = find_runs(str(klppo_logdir))
    assert [source for _, _, source in runs] == ["tensorboard"]
    run = load_run(*runs[0])
    assert run.key_for("kl_mean") == "train/kl"
    kl = run.get("kl_mean")
    # the first dump has no train/ keys; 16 rollouts of 128 steps give 15 dumped updates
    assert len(kl) == 15 and kl.steps[0] == 256 and kl.steps[-1] == 2048
    assert np.all(kl.values >= 0)
    assert run.get("kl_coef") is not None and run.get("target_kl") is not None


def test_plot_klppo_tensorboard(klppo_logdir, tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert main(["plot", str(klppo_logdir), "--out", str(out), "--size", "8", "6", "--dpi", "50"]) == 0
    assert out.exists()
    assert _pixels(out) == (400, 300)
    assert "wrote" in capsys.readouterr().out


def test_plot_stock_ppo_csv_with_monitor(stock_csv_logdir, tmp_path):
    run = load_run(*find_runs(str(stock_csv_logdir))[0])
    assert run.source == "csv" and run.key_for("kl_mean") == "kl/mean" and run.get("alarms") is not None
    out = tmp_path / "stock.png"
    assert main(["plot", str(stock_csv_logdir), "--out", str(out)]) == 0
    assert _pixels(out) == (1000, 800)


def test_plot_several_runs(klppo_logdir, stock_csv_logdir, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(klppo_logdir, runs_dir / "tb")
    shutil.copytree(stock_csv_logdir, runs_dir / "csv")
    assert main(["plot", str(runs_dir), "--out", str(tmp_path / "overlay.png"), "--overlay", "--dpi", "40"]) == 0
    assert _pixels(tmp_path / "overlay.png") == (400, 320)
    assert main(["plot", str(runs_dir), "--out", str(tmp_path / "each.png"), "--dpi", "40"]) == 0
    written = sorted(p.name for p in tmp_path.glob("each-*.png"))
    assert written == ["each-csv_ppo_csv.png", "each-tb_KLPPO_1.png"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sb3-kl: error:"), err
    return err[0]


def test_plot_errors(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) != 0
    assert "does not exist" in _one_error_line(capsys)

    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) != 0
    assert "no TensorBoard event files or progress.csv" in _one_error_line(capsys)

    # a real stock PPO log without any KL key
    logger = configure(str(tmp_path / "nokl"), ["csv"])
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, n_epochs=1, policy_kwargs=dict(net_arch=[16]), seed=0)
    model.set_logger(logger)
    model.learn(128)
    assert main(["plot", str(tmp_path / "nokl"), "--out", str(tmp_path / "x.png")]) != 0
    assert "has no KL keys" in _one_error_line(capsys)
    assert not (tmp_path / "x.png").exists()

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "events.out.tfevents.1.host").write_bytes(np.random.default_rng(0).bytes(300))
    assert main(["plot", str(bad)]) != 0
    assert "events.out.tfevents.1.host is corrupt" in _one_error_line(capsys)  # (random bytes, not an event file)

    (bad / "progress.csv").write_bytes(b"\xff\xfe garbage")
    assert main(["report", str(bad / "progress.csv")]) != 0
    assert "cannot read" in _one_error_line(capsys)


def test_module_entry_point_error_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sb3_kl.plot", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"sb3-kl: error: {tmp_path / 'missing'} does not exist"]


def test_partial_exit_status(klppo_logdir, tmp_path, capsys):
    # one good run and one without KL keys: the good one is drawn, the other gets its line, exit status 2
    shutil.copytree(klppo_logdir, tmp_path / "runs" / "tb")
    logger = configure(str(tmp_path / "runs" / "nokl"), ["csv"])
    logger.record("time/total_timesteps", 64)
    logger.record("rollout/ep_rew_mean", 10.0)
    logger.dump(64)
    logger.close()
    assert main(["plot", str(tmp_path / "runs"), "--out", str(tmp_path / "p.png"), "--dpi", "30"]) == 2
    assert "nokl" in _one_error_line(capsys)
    assert _pixels(tmp_path / "p.png") == (300, 240)
