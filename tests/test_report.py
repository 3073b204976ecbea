import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.logger import configure

from sb3_kl import KLPPO, KLAdaptiveLRCallback, KLAlarmCallback
from sb3_kl.cli import main
from sb3_kl.common import on_policy_algorithm
from sb3_kl.diagnostics import diagnosis
from sb3_kl.diagnostics.leadlag import lead_lag
from sb3_kl.diagnostics.logs import find_runs, load_run
from sb3_kl.diagnostics.report import summarize_run
from sb3_kl.diagnostics.states import load_states

ROOT = Path(__file__).resolve().parents[1]
N_UPDATES = 150
LAG = 3


def planted_log(n: int = N_UPDATES, lag: int = LAG, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KL with a spike now and then; the return drops ``lag`` updates after each spike, otherwise climbs."""
    rng = np.random.default_rng(seed)
    kl = np.exp(rng.normal(np.log(0.01), 0.3, n))
    spikes = rng.choice(np.arange(5, n - lag - 1), size=n // 12, replace=False)
    kl[spikes] *= 10
    change = rng.normal(1.0, 1.0, n)
    change[spikes + lag] -= 15
    return kl, np.cumsum(change), spikes


def write_log(folder: str, kl: np.ndarray, returns: np.ndarray, formats: list[str]) -> None:
    """Write a log the way SB3 does (its own logger), one dump per update of 2048 steps."""
    logger = configure(folder, formats)
    for t, (kl_t, return_t) in enumerate(zip(kl, returns, strict=True)):
        logger.record("time/total_timesteps", 2048 * (t + 1))  # the CSV's x-axis, as OnPolicyAlgorithm.dump_logs writes it
        logger.record("rollout/ep_rew_mean", float(return_t))
        logger.record("train/kl", float(kl_t))
        logger.record("train/target_kl", 0.01)
        logger.record("train/kl_coef", 10.0 if t % 10 == 0 else 1.0)
        logger.dump(step=2048 * (t + 1))
    logger.close()


@pytest.mark.parametrize("lag", [0, 1, LAG, 6])
def test_lead_lag_finds_planted_lag(lag):
    kl, returns, _ = planted_log(lag=lag)
    result = lead_lag(kl, returns, steps=2048 * np.arange(1, N_UPDATES + 1))
    assert result.found and result.best_lag == lag
    assert result.best_r > 0.8 and result.p_value < 0.01
    assert result.steps_per_update == 2048


def test_lead_lag_false_positive_rate():
    # independent series (i.i.d. log-normal KL, random-walk return): a 95 % test should rarely fire
    found = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        found += lead_lag(rng.lognormal(size=120), np.cumsum(rng.normal(size=120)), n_null=199).found
    assert found <= 6  # expected 2; P(>6) < 1 % for a correct 5 % test


def test_lead_lag_short_log():
    result = lead_lag(np.ones(10) * 0.01, np.arange(10.0))
    assert not result.found and "at least 20" in result.summary()


def test_report_finds_planted_lead(tmp_path, capsys):
    kl, returns, _ = planted_log()
    write_log(str(tmp_path / "planted"), kl, returns, ["tensorboard"])
    markdown = tmp_path / "report.md"
    assert main(["report", str(tmp_path / "planted"), "--markdown", str(markdown)]) == 0
    out = capsys.readouterr().out
    assert f"KL spikes lead return drops by {LAG} updates, ~{LAG * 2048} steps" in out
    assert "Lead-lag method" in out
    text = markdown.read_text()
    assert f"KL spikes lead return drops by {LAG} updates" in text and "## Method" in text
    # 15 of 150 logged coefficients sit at the known upper bound 10
    assert "upper 10: 15/150 updates" in out


def test_report_no_lead_on_shuffled_data(tmp_path, capsys):
    kl, returns, _ = planted_log()
    shuffled = np.random.default_rng(1).permutation(kl)
    write_log(str(tmp_path / "shuffled"), shuffled, returns, ["csv"])
    assert main(["report", str(tmp_path / "shuffled")]) == 0
    out = capsys.readouterr().out
    assert "no lead found" in out and "KL spikes lead" not in out


def test_report_real_klppo_run(tmp_path, capsys):
    th.set_num_threads(1)
    model = KLPPO(
        "MlpPolicy",
        "CartPole-v1",
        n_steps=64,
        n_epochs=2,
        policy_kwargs=dict(net_arch=[16]),
        seed=0,
        tensorboard_log=str(tmp_path),
    )
    model.learn(64 * 25)
    run = load_run(*find_runs(str(tmp_path))[0])
    report = summarize_run(run)
    assert [p.name for p in report.phases] == ["early", "middle", "late"]
    assert sum(p.n_updates for p in report.phases) == report.n_updates == 24
    kl = run.get("kl_mean").values
    assert report.phases[0].kl_mean == pytest.approx(np.mean(kl[:8]))
    target = run.get("target_kl").values
    expected_outside = np.mean((kl > 2 * target) | (kl < 0.5 * target))
    assert report.above + report.below == pytest.approx(expected_outside)
    assert report.coef["min"] <= model.kl_coef <= report.coef["max"]
    assert report.lead is not None and report.lead.n_updates == 24

    assert main(["report", str(tmp_path), "--band", "0.5", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "KL keys: mean=train/kl" in out and "outside the band [0.5, 1.5] x target" in out and "beta (kl_coef)" in out


def test_states_from_real_monitor(tmp_path, capsys):
    from sb3_kl.callbacks import KLMonitorCallback

    th.set_num_threads(1)
    path = str(tmp_path / "top.npz")
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=128, n_epochs=2, policy_kwargs=dict(net_arch=[16]), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(512, callback=KLMonitorCallback(top_k=4, top_k_path=path))
    assert main(["states", path]) == 0
    out = capsys.readouterr().out
    assert "random background states" in out and "forward/analytic/sum," in out.splitlines()[0]
    assert sum(line.startswith("obs[") for line in out.splitlines()) == 4  # CartPole has 4 observation dimensions


def test_states_finds_separating_dimension(tmp_path, capsys):
    rng = np.random.default_rng(0)
    high, background = rng.normal(size=(40, 6)), rng.normal(size=(200, 6))
    high[:, 4] += 2.0  # high-KL states sit at large values of dimension 4
    high[:, 1] *= 4.0  # ... and at both extremes of dimension 1 (same mean)
    path = tmp_path / "top.npz"
    np.savez(path, observations=high, kl=rng.uniform(1, 2, 40), update=np.arange(40), background_observations=background)
    report = load_states(str(path))
    assert [d.name for d in report.dims[:2]] == ["obs[4]", "obs[1]"]
    assert report.dims[0].std_diff > 1.5 and report.dims[0].auc > 0.85
    assert abs(report.dims[1].std_diff) < 0.5 and report.dims[1].std_ratio > 2.5

    np.savez(path, observations=high, kl=rng.uniform(1, 2, 40))
    assert main(["states", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "no background saved" in out and "3 more dimensions" in out


def test_states_errors(tmp_path, capsys):
    np.savez(tmp_path / "nokl.npz", observations=np.zeros((4, 2)))
    (tmp_path / "text.npz").write_text("not an archive")
    for name, message in [("missing.npz", "does not exist"), ("nokl.npz", "no 'kl' array"), ("text.npz", "cannot read")]:
        assert main(["states", str(tmp_path / name)]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_report_shows_the_normalizations_own_shift_beside_the_update_kl(tmp_path, capsys):
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_kl.callbacks import KLMonitorCallback

    th.set_num_threads(1)
    env = VecNormalize(make_vec_env("Pendulum-v1", n_envs=2, seed=0))
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=2, policy_kwargs=dict(ortho_init=False), seed=0)
    model.set_logger(configure(str(tmp_path / "run"), ["csv"]))
    monitor = KLMonitorCallback()
    model.learn(64 * 2 * 8, callback=monitor)
    report = summarize_run(load_run(*find_runs(str(tmp_path))[0]), target_kl=0.03)
    # the values of update u reach the log at the next dump: the last update's stay in memory (as SB3's train/ keys)
    logged = [record["normalization_shift"] for record in monitor.history[:-1]]
    logged_kl = [record["mean"] for record in monitor.history[:-1]]
    assert report.normalization["n"] == len(logged) == 7
    assert report.normalization["mean"] == pytest.approx(np.mean(logged), rel=1e-6)
    assert report.normalization["max"] == pytest.approx(max(logged), rel=1e-6)
    assert report.normalization["above_update"] == sum(s > k for s, k in zip(logged, logged_kl, strict=True))
    assert main(["report", str(tmp_path / "run"), "--target", "0.03"]) == 0
    out = capsys.readouterr().out
    assert "observation normalization alone (kl/normalization_shift, exact, per rollout): mean" in out
    assert f"/{len(logged)} rollouts" in out


def test_alarm_count_that_starts_again_counts_each_alarm_once():
    # KLAlarmCallback's running count starts from 0 with each new callback (a resumed run logging into the same file)
    from sb3_kl.diagnostics.logs import Series
    from sb3_kl.diagnostics.report import alarm_events

    counts = np.array([1, 1, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 3, 4, 5, 5, 6, 7], dtype=float)
    steps, total = alarm_events(Series(np.arange(1, len(counts) + 1) * 64, counts))
    assert total == 14
    assert list(steps) == [64, 256, 320, 384, 448, 512, 576, 640, 704, 768, 896, 960, 1088, 1152]
    steps, total = alarm_events(Series(np.arange(10), np.array([0, 1, 1, 2, 2, 0, 0, 1, 1, 1], dtype=float)))
    assert total == 3 and list(steps) == [1, 3, 7]


@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_report_counts_a_diverged_update_above_the_band(tmp_path, capsys, bad):
    rows = ["time/total_timesteps,train/kl,train/target_kl"]
    rows += [f"{100 * (t + 1)},{bad if t == 4 else 0.01},0.01" for t in range(9)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    report = summarize_run(load_run("run", str(tmp_path / "progress.csv"), "csv"))
    assert report.nonfinite_steps == [500]
    assert report.above == pytest.approx(1 / 9) and report.below == 0
    assert report.phases[1].kl_max == pytest.approx(0.01) and report.phases[1].n_nonfinite == 1
    assert main(["report", str(tmp_path / "progress.csv")]) == 0
    out = capsys.readouterr().out
    assert "non-finite KL (NaN or inf: the update diverged) at 1 update(s), steps 500" in out
    assert "11% of updates (above 11%, below 0%)" in out


def test_report_of_a_constant_or_non_finite_beta(tmp_path, capsys):
    rows = ["time/total_timesteps,train/kl,train/target_kl,train/kl_coef"]
    rows += [f"{100 * (t + 1)},0.01,0.01,1.0" for t in range(5)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    report = summarize_run(load_run("run", str(tmp_path / "progress.csv"), "csv"))
    assert report.coef["at_max_seen"] == report.coef["at_min_seen"] == 5
    rows = ["time/total_timesteps,train/kl,train/target_kl,train/kl_coef"]
    rows += [f"{100 * (t + 1)},0.01,0.01,nan" for t in range(5)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    assert main(["report", str(tmp_path / "progress.csv")]) == 0
    assert "is NaN or infinite at every update" in capsys.readouterr().out


def test_csv_with_appended_logs_reads_each_with_its_own_header(tmp_path, capsys):
    first = ["time/total_timesteps,train/kl,train/target_kl"] + [f"{100 * (t + 1)},0.01,0.01" for t in range(3)]
    # a second log appended, its columns in another order, and its timesteps starting again
    second = ["train/target_kl,rollout/ep_rew_mean,time/total_timesteps,train/kl"]
    second += [f"0.02,{-t},{100 * (t + 1)},0.03" for t in range(2)]
    (tmp_path / "progress.csv").write_text("\n".join(first + second) + "\n")
    run = load_run("run", str(tmp_path / "progress.csv"), "csv")
    assert list(run.scalars["train/kl"].values) == [0.03, 0.03, 0.01]
    assert list(run.scalars["train/target_kl"].values) == [0.02, 0.02, 0.01]
    assert list(run.scalars["rollout/ep_rew_mean"].values) == [0.0, -1.0]
    assert any("2 logs appended" in note for note in run.notes)
    assert any("go back 1 time(s)" in note for note in run.notes)
    assert main(["report", str(tmp_path / "progress.csv")]) == 0
    assert "go back 1 time(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "{log}", "--max-lag", "0"], "--max-lag must be at least 1"),
        (["report", "{log}", "--seed", "-1"], "--seed must be a non-negative integer"),
        (["report", "{log}", "--target", "-1"], "--target must be a positive KL"),
        (["report", "{log}", "--target", "nan"], "--target must be a positive KL"),
        (["plot", "{log}", "--target", "0"], "--target must be a positive KL"),
        (["report", "{log}", "--coef-bounds", "1", "0.1"], "--coef-bounds needs finite 0 < MIN < MAX"),
        (["report", "{log}", "--markdown", "{missing}/report.md"], "does not exist, create it first"),
        (["states", "{log}", "--top", "0"], "--top must be at least 1"),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    rows = ["time/total_timesteps,train/kl,train/target_kl"] + [f"{100 * (t + 1)},0.01,0.01" for t in range(3)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    argv = [a.format(log=tmp_path / "progress.csv", missing=tmp_path / "missing") for a in argv]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed before the error
    assert captured.err.startswith("sb3-kl: error: ") and message in captured.err and captured.err.count("\n") == 1


def test_lead_lag_states_its_confidence_and_refuses_a_lag_below_one():
    kl, returns, _ = planted_log()
    assert "99% null threshold" in lead_lag(kl, returns, confidence=0.99).summary()
    with pytest.raises(ValueError, match="max_lag"):
        lead_lag(kl, returns, max_lag=0)


def test_states_effect_size_is_cohens_d_and_empty_or_unreadable_files_are_one_line_errors(tmp_path, capsys):
    from sb3_kl.diagnostics.states import compare

    rng = np.random.default_rng(0)
    high, ref = rng.normal(1.0, 2.0, (40, 1)), rng.normal(0.0, 1.0, (160, 1))
    pooled = np.sqrt((39 * high.var(ddof=1) + 159 * ref.var(ddof=1)) / 198)
    assert compare(high, ref)[0].std_diff == pytest.approx((high.mean() - ref.mean()) / pooled)
    np.savez(tmp_path / "empty.npz", observations=np.zeros((0, 3)), kl=np.zeros(0), background_observations=np.ones((5, 3)))
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    for name, message in [("empty.npz", "holds no high-KL states"), ("table.csv", "KLMonitorCallback(top_k_path=...)")]:
        assert main(["states", str(tmp_path / name)]) == 1
        err = capsys.readouterr().err
        assert message in err and "allow_pickle" not in err and err.count("\n") == 1


def test_a_diverged_update_without_a_target_is_not_claimed_above_the_band(tmp_path, capsys):
    rows = ["time/total_timesteps,train/kl"] + [f"{100 * (t + 1)},{'nan' if t == 4 else 0.01}" for t in range(9)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    assert main(["report", str(tmp_path / "progress.csv"), "--markdown", os.devnull]) == 0  # an existing file
    assert "not judged against the band (no target at those steps)" in capsys.readouterr().out


def test_a_nan_p99_leaves_the_phase_p99_max_of_the_finite_values(tmp_path):
    rows = ["time/total_timesteps,train/kl,train/kl_p99,train/target_kl"]
    rows += [f"{100 * (t + 1)},{'nan' if t == 1 else 0.01},{'nan' if t == 1 else 0.02 + t / 100},0.01" for t in range(9)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    report = summarize_run(load_run("run", str(tmp_path / "progress.csv"), "csv"))
    assert report.phases[0].kl_p99_max == pytest.approx(0.04)  # updates 0..2 of 9, the NaN at update 1 left out


def test_lead_lag_states_its_lag_in_updates_when_the_kl_is_measured_every_other_update(tmp_path):
    """The same planted log (return falls 2 updates after each KL spike), the KL logged at every dump or every other."""
    rng = np.random.default_rng(0)
    n = 120
    kl = np.exp(rng.normal(-4.0, 0.2, n))
    spikes = rng.choice(np.arange(10, n - 5), 12, replace=False)
    kl[spikes] *= 20
    returns = 100 + rng.normal(0, 1, n)
    returns[spikes + 2] -= 30
    for every in (1, 2):
        rows = ["time/total_timesteps,train/kl,train/target_kl,rollout/ep_rew_mean"]
        rows += [
            f"{256 * (t + 1)},{kl[t] if t % every == 0 else ''},{0.02 if t % every == 0 else ''},{returns[t]}"
            for t in range(n)
        ]
        (tmp_path / f"every{every}.csv").write_text("\n".join(rows) + "\n")
        lead = summarize_run(load_run("run", str(tmp_path / f"every{every}.csv"), "csv")).lead
        assert lead.found and lead.updates_per_lag == every, (every, lead.summary())
        assert lead.best_lag * every == 2 and "by 2 updates, ~512 steps" in lead.summary()


def test_states_say_whether_the_observations_are_normalized(tmp_path, capsys):
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_kl.callbacks import KLMonitorCallback

    for normalize in (False, True):
        env = make_vec_env("Pendulum-v1", n_envs=1, seed=0)
        env = VecNormalize(env) if normalize else env
        path = tmp_path / f"top_{normalize}.npz"
        PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=1, seed=0).learn(
            128, callback=KLMonitorCallback(top_k=8, top_k_path=path)
        )
        assert load_states(str(path)).normalized is normalize
        assert main(["states", str(path)]) == 0
        out = capsys.readouterr().out
        assert ("normalized by VecNormalize" in out) is normalize


def test_plot_writes_and_names_the_png_matplotlib_writes(tmp_path, capsys):
    rows = ["time/total_timesteps,train/kl,train/target_kl"] + [f"{100 * (t + 1)},0.01,0.01" for t in range(5)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    assert main(["plot", str(tmp_path / "progress.csv"), "--out", str(tmp_path / "kl")]) == 0
    assert (tmp_path / "kl.png").exists() and f"wrote {tmp_path / 'kl.png'}" in capsys.readouterr().out
    (tmp_path / "figures").mkdir()
    for out in (tmp_path / "figures", f"{tmp_path / 'figures'}/"):
        assert main(["plot", str(tmp_path / "progress.csv"), "--out", str(out)]) == 1
        assert "it is a directory, give a file name" in capsys.readouterr().err
    assert not list((tmp_path / "figures").iterdir())


def test_a_damaged_tensorboard_event_file_is_one_clear_error(tmp_path, capsys):
    """TensorBoard's reader stops quietly at a record whose checksum fails: the report must not read the run short."""
    model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, seed=0)
    model.set_logger(configure(str(tmp_path / "run"), ["tensorboard"]))
    model.learn(64 * 12)
    model.logger.close()
    (event_file,) = (tmp_path / "run").glob("events.out.tfevents.*")
    assert main(["report", str(tmp_path / "run")]) == 0
    assert "updates with KL: 11" in capsys.readouterr().out  # (the last update is dumped by the next rollout)
    data = bytearray(event_file.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 50] = b"\xff" * 50
    event_file.write_bytes(bytes(data))
    assert main(["report", str(tmp_path / "run")]) == 1
    assert f"{event_file} is corrupt" in capsys.readouterr().err


@pytest.mark.parametrize("callback_class", [KLAlarmCallback, KLAdaptiveLRCallback])
def test_report_reads_the_target_of_a_kl_callback_on_a_stock_agent(tmp_path, capsys, callback_class):
    # stock PPO has no target of its own (target_kl=None): the callback's is the one the report judges with
    th.set_num_threads(1)
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=2, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.set_logger(configure(str(tmp_path), ["csv"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # alarms are not what is tested
        model.learn(64 * 6, callback=callback_class(target_kl=0.02))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "target=kl/target_kl (forward/analytic/sum)" in out and "pass --target" not in out
    report = summarize_run(load_run(*find_runs(str(tmp_path))[0]))
    assert report.phases[0].target == pytest.approx(0.02) and np.isfinite(report.above)


def test_the_callbacks_target_does_not_stand_in_for_an_algorithms(tmp_path):
    model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=64, target_kl=0.05, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.set_logger(configure(str(tmp_path), ["csv"]))
    model.learn(64 * 4, callback=KLAlarmCallback(target_kl=0.02))
    run = load_run(*find_runs(str(tmp_path))[0])
    assert run.key_for("target_kl") == "train/target_kl" and np.all(run.get("target_kl").values == 0.05)


def write_csv(folder, kl: np.ndarray, target: float, coef: np.ndarray) -> str:
    rows = ["time/total_timesteps,train/kl,train/target_kl,train/kl_coef"]
    rows += [f"{1024 * (t + 1)},{kl_t},{target},{coef_t}" for t, (kl_t, coef_t) in enumerate(zip(kl, coef, strict=True))]
    (folder / "progress.csv").write_text("\n".join(rows) + "\n")
    return str(folder / "progress.csv")


def test_report_diagnoses_a_learning_rate_too_small_for_the_target(tmp_path, capsys):
    # beta at its floor and a KL a hundredth of the target for 20 updates: the page's "KL stays near zero" entry
    path = write_csv(tmp_path, np.full(20, 0.005), 0.5, np.full(20, 1e-4))
    assert main(["report", path]) == 0
    out = capsys.readouterr().out
    diagnosis = out[out.index("diagnosis:") :]
    assert "The KL stays near zero, beta sits at its floor: for 20 consecutive updates" in diagnosis
    assert 'learning_rate="auto"' in diagnosis and "KLAdaptiveLRCallback" in diagnosis
    assert 'docs/guide/troubleshooting.md, section "The KL stays near zero, beta sits at its floor"' in diagnosis
    assert "The KL explodes" not in diagnosis


def test_report_diagnoses_an_exploding_kl_and_says_when_nothing_applies(tmp_path, capsys):
    kl = np.full(20, 0.02)
    kl[10:15] = 0.3
    assert main(["report", write_csv(tmp_path, kl, 0.02, np.full(20, 10.0))]) == 0
    out = capsys.readouterr().out
    assert "The KL explodes: the KL exceeded 5 x target for 5 consecutive updates" in out
    assert "beta sat at its upper bound 10 for 20 updates" in out
    assert main(["report", write_csv(tmp_path, np.full(20, 0.02), 0.02, np.full(20, 1.0))]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("diagnosis")]
    assert line == "diagnosis: nothing found that docs/guide/troubleshooting.md lists"


def test_each_diagnosis_names_a_section_of_its_page():
    headings = set(re.findall(r"^## (.+)$", (ROOT / diagnosis.TROUBLESHOOTING).read_text(), flags=re.MULTILINE))
    sections = {diagnosis.KL_EXPLODES, diagnosis.KL_NEAR_ZERO, diagnosis.NON_FINITE, diagnosis.RETURN_DROPS}
    assert sections <= headings
    # the report's stalled-KL rule is the algorithms' warning's
    assert diagnosis.STALLED_AT_FLOOR_UPDATES == on_policy_algorithm.STALLED_AT_FLOOR_UPDATES
    assert diagnosis.STALLED_KL_FRACTION == on_policy_algorithm.STALLED_KL_FRACTION
