"""The learning-rate sweep's page (``benchmarks/lr_sweep_report.py``) on synthetic records: no training."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import lr_sweep_report

RANDOM = {"Pendulum-v1": -1200.0, "LunarLanderContinuous-v3": -200.0, "HalfCheetah-v5": -300.0}


def record(algo: str, env: str, lr_mult: float, seed: int, eval_mean: float, kls: list[float]) -> dict:
    return dict(
        algo=algo,
        env=env,
        seed=seed,
        lr_mult=lr_mult,
        budget=1000,
        eval_returns=[eval_mean] * 10,
        eval_mean=eval_mean,
        curve=[[100, eval_mean - 10], [1000, eval_mean]],
        kl_updates=[dict(timesteps=100 * (i + 1), mean=kl, p99=2 * kl) for i, kl in enumerate(kls)],
        target_kl=0.03,
        env_steps_per_second=1000.0,
        code_version="abc1234",
        run_environment={"cpu": "Test CPU", "python": "3.11"},
    )


@pytest.fixture
def results(tmp_path, monkeypatch):
    """The page's results folder in ``tmp_path``, with the random policy's returns already cached."""
    monkeypatch.setattr(lr_sweep_report, "RESULTS", tmp_path)
    cache = {
        env: dict(mean=mean, returns={"0": [mean]}, code_version="abc1234", run_environment={"cpu": "Test CPU"})
        for env, mean in RANDOM.items()
    }
    (tmp_path / "lr_sweep").mkdir()
    (tmp_path / "lr_sweep" / "random_returns.json").write_text(json.dumps(cache))
    return tmp_path


def test_random_returns_computes_only_the_missing_tasks(results, monkeypatch):
    path = results / "lr_sweep" / "random_returns.json"
    cache = json.loads(path.read_text())
    del cache["HalfCheetah-v5"]
    path.write_text(json.dumps(cache))
    computed = []

    def fake(env_id):
        computed.append(env_id)
        return {0: [1.0, 3.0], 1: [5.0]}

    monkeypatch.setattr(lr_sweep_report, "random_policy_returns", fake)
    assert lr_sweep_report.random_returns(list(RANDOM)) == {**RANDOM, "HalfCheetah-v5": 3.0}
    assert computed == ["HalfCheetah-v5"]
    assert json.loads(path.read_text())["HalfCheetah-v5"]["code_version"]
    lr_sweep_report.random_returns(list(RANDOM))
    assert computed == ["HalfCheetah-v5"]


def test_random_policy_returns_runs_the_evaluation_episodes():
    returns = lr_sweep_report.random_policy_returns("Pendulum-v1", seeds=(0,), episodes=1)
    assert list(returns) == [0] and len(returns[0]) == 1 and -2000 < returns[0][0] < 0
    assert returns == lr_sweep_report.random_policy_returns("Pendulum-v1", seeds=(0,), episodes=1)


def test_normalization_robust_range_and_in_band_share():
    env = "Pendulum-v1"
    records = [
        record("ppo", env, 1.0, s, -200.0, [0.03, 0.03, 0.5, 0.001])
        for s in (0, 1, 2)  # best cell: normalized 1
    ] + [record("ppo", env, 10.0, s, -1000.0 + 10 * s, [0.03]) for s in (0, 1, 2)]
    groups = lr_sweep_report.sweep_groups(records, [0, 1, 2])
    scores = lr_sweep_report.cell_scores(groups, RANDOM)
    assert scores[(env, "ppo", 1.0)] == pytest.approx(1.0)
    assert scores[(env, "ppo", 10.0)] == pytest.approx((-990.0 + 1200.0) / 1000.0)
    np.testing.assert_allclose(lr_sweep_report.run_scores(groups, RANDOM, (env, "ppo", 10.0)), [0.2, 0.21, 0.22])
    assert lr_sweep_report.robust_range(scores, env, "ppo") == [1.0]
    assert lr_sweep_report.in_band_shares(groups[(env, "ppo", 1.0)]) == [0.5, 0.5, 0.5]
    assert lr_sweep_report.normalized(5.0, 10.0, 10.0) != lr_sweep_report.normalized(5.0, 10.0, 10.0)  # NaN


def test_the_grids_further_seeds_are_left_out_until_the_sweep_runs_them():
    records = [
        record(a, "Pendulum-v1", m, s, -200.0, [0.03]) for a in ("ppo", "klppo_auto") for m in (1.0, 10.0) for s in range(6)
    ]
    assert lr_sweep_report.sweep_seeds(records) == [0, 1, 2]
    records.append(record("klppo_auto", "Pendulum-v1", 0.3, 4, -200.0, [0.03]))
    assert lr_sweep_report.sweep_seeds(records) == [0, 1, 2, 4]
    groups = lr_sweep_report.sweep_groups(records, [0, 1, 2, 4])
    assert sorted(r["seed"] for r in groups[("Pendulum-v1", "ppo", 1.0)]) == [0, 1, 2, 4]


def test_report_writes_the_page_and_figure_and_lists_the_missing_cells(results):
    env = "Pendulum-v1"
    records = []
    for s in (0, 1, 2):
        records += [
            record("klppo_auto", env, 1.0, s, -150.0 - s, [0.03] * 9 + [0.2]),
            record("ppo", env, 1.0, s, -300.0 - 50 * s, [0.03, 0.2]),
            record("ppo_adaptive_lr", env, 1.0, s, -160.0 + s, [0.03]),
        ]
    records.append(record("klppo_auto", env, 3.0, 0, -180.0, [0.03]))
    text = lr_sweep_report.report(records)
    page = (results / "lr_sweep.md").read_text()
    assert page == text
    lines = page.splitlines()
    assert lines[2].startswith("![") and lines[2].endswith("(lr_sweep.png)") and lines[4].startswith("| ")
    assert (results / "lr_sweep.png").read_bytes().startswith(b"\x89PNG")
    assert "Cells with records: 4 of 60 (3 with all of seeds 0..2)" in page
    assert "- Pendulum-v1, klppo_auto: x0.1, x0.3, x10 (no records); x3 seeds 1, 2" in page
    assert "- HalfCheetah-v5, klppo: x0.1, x0.3, x1, x3, x10 (no records)" in page
    assert "| Pendulum-v1 | klppo_auto | — | — | 90 ± 0% | 100 ± 0% (n=1) | — |" in page  # in-band shares
    assert "| Pendulum-v1 | klppo_auto | — | — | **1.00** | **0.97** (n=1) | — |" in page  # normalized returns
    assert "R_best -151.0 (klppo_auto x1)" in page
    # klppo_auto beats ppo in every run of the one stratum both have: P = 1, but the sweep is not complete yet
    assert "- P(klppo_auto > ppo) with its 95 % CI above 0.5: not yet measured (1.00 [1.00, 1.00] on 1 of 15 strata)" in page
    assert "- ≥ 80% of klppo_auto's updates in band in every cell: not yet measured" in page


def test_a_goal_is_judged_once_its_cells_have_every_seed():
    a, b = ("Pendulum-v1", "klppo_auto", 1.0), ("Pendulum-v1", "klppo_auto", 3.0)
    assert lr_sweep_report.judge({a: True}, {a}, {a, b}) is None
    assert lr_sweep_report.judge({a: False, b: True}, {b}, {a, b}) is None
    assert lr_sweep_report.judge({a: False, b: True}, {a, b}, {a, b}) is False
    assert lr_sweep_report.judge({a: True, b: True}, {a, b}, {a, b}) is True


def test_made_since_re_makes_only_the_chosen_algorithms_runs_of_older_code(monkeypatch):
    """``lr_sweep.py --made-since REV``: a record of code older than REV counts as missing for the chosen algorithms."""
    import subprocess

    import lr_sweep

    commits = subprocess.run(["git", "rev-list", "--max-count=2", "HEAD"], capture_output=True, text=True, cwd=lr_sweep.HERE)
    head, parent = commits.stdout.split()
    old, new = (record(algo, "Pendulum-v1", 0.1, 0, -200.0, [0.03]) for algo in ("klppo_auto", "ppo"))
    old["code_version"], new["code_version"] = parent[:7], parent[:7] + "+modified"
    monkeypatch.setattr(lr_sweep, "sweep_records", lambda: [old, new])
    args = (["klppo_auto", "ppo"], ["Pendulum-v1"], [0.1], [0])
    assert lr_sweep.pending_specs(*args) == []
    assert {s["algo"] for s in lr_sweep.pending_specs(*args, made_since=parent)} == set()
    assert {s["algo"] for s in lr_sweep.pending_specs(*args, made_since=head)} == {"klppo_auto", "ppo"}
    assert {s["algo"] for s in lr_sweep.pending_specs(["klppo_auto"], *args[1:], made_since=head)} == {"klppo_auto"}
