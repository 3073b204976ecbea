"""
KLAlarmCallback's spike and bound rules: a single update far above target alarms at once, a model without a target
is judged against its family's default (and the user is told once), and beta pinned at either bound alarms.
"""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from sb3_contrib import TRPO
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure

from sb3_kl import KLPPO
from sb3_kl.callbacks import KLAlarmCallback
from sb3_kl.common.callbacks_alarm import MAX_KL_FACTOR, SpikeRule, family_default_target_kl

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_steps=64, policy_kwargs=dict(net_arch=[16]), seed=0, device="cpu")


def test_spike_rule_single_and_sustained():
    # the user's run: 79x and 238x the target with 4.6x in between, which the sustained rule alone never flagged
    assert [SpikeRule(None, 5.0, 3).check(r) for r in (79.0, 4.6, 238.0)] == [None, None, None]
    rule = SpikeRule(75.0, 5.0, 3)
    assert [rule.check(r) for r in (79.0, 4.6, 238.0)] == ["single", None, "single"]
    rule = SpikeRule(75.0, 5.0, 3)
    assert [rule.check(r) for r in (6.0, 6.0, 6.0, 6.0, 1.0, 6.0)] == [None, None, "sustained", "sustained", None, None]
    rule = SpikeRule(75.0, 5.0, 3)
    assert rule.check(float("nan")) == "single"


def test_default_factor_is_the_one_the_committed_benchmark_chose():
    result = json.loads((ROOT / "benchmarks" / "results" / "alarm_spike_rule.json").read_text())
    assert result["chosen"]["max_kl_factor"] == MAX_KL_FACTOR
    assert KLAlarmCallback().max_kl_factor == MAX_KL_FACTOR


def _attached(model_class, env_id, **kwargs):
    model = model_class("MlpPolicy", make_vec_env(env_id, n_envs=1, seed=0), **TINY, **kwargs)
    model.set_logger(configure(None, []))
    alarm = KLAlarmCallback(tail_ratio=None, grad_ratio_band=None)
    alarm.init_callback(model)
    alarm._active = True
    return model, alarm


def _measure(alarm, mean: float, update: int = 0) -> None:
    # a monitor measuring in the target's convention (the conversion is tested in test_kl_target_convention.py)
    record = dict(update=update, num_timesteps=64 * (update + 1), mean=mean, min=0.0, mean_in_target_convention=mean)
    record["target_convention"] = "forward/analytic/sum"
    alarm._on_kl_measured(record, np.array([mean]))


@pytest.mark.parametrize(
    "model_class, env_id, expected",
    [(PPO, "CartPole-v1", 0.02), (PPO, "Pendulum-v1", 0.03), (A2C, "CartPole-v1", 0.02)],
)
def test_no_target_uses_family_default_and_says_so_once(model_class, env_id, expected):
    model, alarm = _attached(model_class, env_id)
    assert family_default_target_kl(model)[0] == expected
    with pytest.warns(UserWarning, match="has no KL target; the spike checks use") as caught:
        _measure(alarm, expected)  # at the target: no alarm, but the target in use is announced
    assert len([w for w in caught if "has no KL target" in str(w.message)]) == 1
    assert alarm.alarms == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _measure(alarm, expected * (MAX_KL_FACTOR + 1), update=1)  # one update far above: alarms at once
    assert not [w for w in caught if "has no KL target" in str(w.message)]  # said once only
    assert [a.kind for a in alarm.alarms] == ["kl_spike"] and alarm.alarms[0].update == 1
    assert "in a single update" in alarm.alarms[0].message


def test_trpo_uses_its_own_target():
    _, alarm = _attached(TRPO, "Pendulum-v1", target_kl=0.005, batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no KL target" warning
        _measure(alarm, 0.005 * 50)
    assert alarm.alarms == []
    with pytest.warns(UserWarning, match="kl_spike"):
        _measure(alarm, 0.005 * (MAX_KL_FACTOR + 1), update=1)


def test_real_runaway_ppo_alarms_at_its_first_large_update():
    """Stock PPO at a far too large learning rate and no target: the first update far above 0.03 alarms."""
    model = PPO("MlpPolicy", "Pendulum-v1", learning_rate=0.1, clip_range=100.0, n_epochs=10, batch_size=64, **TINY)
    alarm = KLAlarmCallback(tail_ratio=None, grad_ratio_band=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.learn(4 * 64, callback=alarm)
    history = [record["mean"] for record in alarm.monitor.history]
    first_far = next(i for i, kl in enumerate(history) if kl > MAX_KL_FACTOR * 0.03)
    spikes = [a for a in alarm.alarms if a.kind == "kl_spike"]
    assert spikes and spikes[0].update == first_far and spikes[0].value == pytest.approx(history[first_far])


def test_beta_pinned_at_lower_bound_alarms():
    # beta starts at its lower bound and a tiny learning rate keeps the KL far below the band: it stays there
    model = KLPPO(
        "MlpPolicy", "CartPole-v1", learning_rate=1e-7, batch_size=64, n_epochs=1, kl_coef=1e-4,
        kl_coef_bounds=(1e-4, 10.0), **TINY,
    )  # fmt: skip
    alarm = KLAlarmCallback(patience=2, tail_ratio=None, grad_ratio_band=None)
    with pytest.warns(UserWarning, match="beta_at_lower_bound"):
        model.learn(3 * 64, callback=alarm)
    pinned = [a for a in alarm.alarms if a.kind == "beta_at_lower_bound"]
    assert pinned and pinned[0].update == 1 and pinned[0].value == 1e-4
    assert all(record["coef"] == 1e-4 for record in alarm.monitor.history)
    assert not [a for a in alarm.alarms if a.kind == "beta_at_upper_bound"]


def _spike_rule_benchmark():
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
    return importlib.import_module("alarm_spike_rule")


def _runs(algo: str, env: str, lr_mult: int, peaks: list[float]) -> list[dict]:
    return [
        dict(path=f"{algo}-{env}-{seed}", algo=algo, env=env, seed=seed, lr_mult=lr_mult, ratios=np.array([1.0, peak]))
        for seed, peak in enumerate(peaks)
    ]


def test_spike_factor_criterion_refuses_a_factor_that_alarms_on_most_seeds_of_one_cell():
    bench = _spike_rule_benchmark()
    # 60 quiet normal runs and one cell whose 3 seeds peak at 12, 40 and 60 x target: 3/63 runs is under 5 %
    groups = {
        bench.NORMAL: _runs("klppo", "CartPole-v1", 1, [1.5] * 60) + _runs("ppo", "Hopper-v5", 1, [12.0, 40.0, 60.0]),
        bench.STOCK_STRESS: _runs("ppo", "Pendulum-v1", 10, [300.0, 500.0]),
        bench.CONTROLLED_STRESS: _runs("klppo", "Pendulum-v1", 10, [3.0, 8.0]),
    }
    rows = bench.factor_rows(groups)
    assert rows[1]["max_kl_factor"] == 10.0 and rows[1]["normal_cells_mostly_alarmed"] == ["ppo on Hopper-v5 (3/3)"]
    # the KL-controlled stress runs rule out 5 (1 of 2 alarms); the pooled shares alone then allow 10
    assert bench.choose(rows, groups, 0.05, per_cell=False)["max_kl_factor"] == 10.0
    # at 50 only one seed of the Hopper cell alarms: the first factor no cell mostly alarms at
    assert bench.choose(rows, groups, 0.05, per_cell=True)["max_kl_factor"] == 50.0
    # a stock stress run peaking at 45 x target is missed from 50 on, and below 50 the Hopper cell mostly alarms
    groups[bench.STOCK_STRESS] = _runs("ppo", "Pendulum-v1", 10, [300.0, 45.0])
    rows = bench.factor_rows(groups)
    assert bench.choose(rows, groups, 0.05, per_cell=True) is None
    assert bench.choose(rows, groups, 0.05, per_cell=False)["max_kl_factor"] == 10.0


def test_spike_factor_criterion_runs_without_stress_records():
    bench = _spike_rule_benchmark()
    groups = {bench.NORMAL: _runs("ppo", "CartPole-v1", 1, [1.5, 2.0, 90.0])}
    rows = bench.factor_rows(groups)
    # no stress run to detect: the smallest factor whose false alarms stay within the share (here: none of 3)
    assert bench.choose(rows, groups, 0.05, per_cell=True)["max_kl_factor"] == 100.0


def test_spike_factor_counts_the_sustained_rule_for_detection():
    bench = _spike_rule_benchmark()
    sustained_runaway = [dict(path="slow", algo="ppo", env="Pendulum-v1", seed=0, lr_mult=10, ratios=np.full(6, 8.0))]
    groups = {
        bench.NORMAL: _runs("klppo", "CartPole-v1", 1, [1.5] * 60) + _runs("ppo", "Hopper-v5", 1, [12.0, 40.0, 60.0]),
        bench.STOCK_STRESS: _runs("ppo", "Pendulum-v1", 10, [300.0]) + sustained_runaway,
        bench.CONTROLLED_STRESS: _runs("klppo", "Pendulum-v1", 10, [3.0, 8.0]),
    }
    rows = bench.factor_rows(groups)
    # never above 8 x target in one update, but above 5 x for 6 updates: the sustained rule detects it at any factor
    assert all(row["single"][bench.STOCK_STRESS]["runs_alarmed"] == 1 for row in rows if row["max_kl_factor"] >= 10)
    assert bench.choose(rows, groups, 0.05, per_cell=True)["max_kl_factor"] == 50.0


def test_spike_factor_report_rewrites_the_committed_page_and_its_figure_from_the_json(tmp_path):
    bench = _spike_rule_benchmark()
    results = ROOT / "benchmarks" / "results"
    (tmp_path / "alarm_spike_rule.json").write_text((results / "alarm_spike_rule.json").read_text())
    bench.main(["--report", "--out", str(tmp_path / "alarm_spike_rule")])
    assert (tmp_path / "alarm_spike_rule.md").read_text() == (results / "alarm_spike_rule.md").read_text()
    assert (tmp_path / "alarm_spike_rule.png").read_bytes().startswith(b"\x89PNG")
