"""
``benchmarks/record_reproduction.py``: which records it re-runs (this machine's, per commit, the cheapest) and how it
reports them; the re-run itself is a grid run (``learning.train_and_evaluate``), tested with the learning benchmark.
"""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import record_reproduction  # noqa: E402

HERE = {"cpu": "This CPU", "torch": "2.13.0+cpu"}


def _record(algo, commit, seconds, environment=HERE, seed=0, overrides=None):
    return dict(
        algo=algo, env="CartPole-v1", seed=seed, lr_mult=1.0, tier="tiny", code_version=commit, train_seconds=seconds,
        run_environment=environment, overrides=overrides or {},
    )  # fmt: skip


def test_picks_the_cheapest_sb3_kl_records_of_each_commit_made_on_this_machine():
    records = [
        _record("klppo", "bbb", 30.0),
        _record("klppo", "bbb", 10.0, seed=1),
        _record("kltrpo", "aaa", 50.0),
        _record("ppo", "aaa", 1.0),  # stock: runs no sb3-kl code
        _record("klppo", "ccc", 1.0, environment={"cpu": "Other CPU", "torch": "2.13.0+cpu"}),
        _record("klppo", "ccc", 1.0, environment={"cpu": "This CPU", "torch": "2.4.0"}),  # other library versions
        _record("klppo", "ddd", 1.0, overrides={"kl_coef": 0.2}),  # a side experiment, not the grid
        _record("klppo", "unrecorded", 1.0),
    ]
    chosen = record_reproduction.reproducible_records(records, HERE, per_commit=1)
    assert [(r["code_version"], r["algo"], r["seed"]) for r in chosen] == [("aaa", "kltrpo", 0), ("bbb", "klppo", 1)]
    two = record_reproduction.reproducible_records(records, HERE, per_commit=2)
    assert [(r["code_version"], r["seed"]) for r in two] == [("aaa", 0), ("bbb", 1), ("bbb", 0)]


def test_a_simulator_version_counts_only_for_the_tasks_that_run_on_it():
    here = {**HERE, "mujoco": "4.0.1", "box2d": "2.3.10"}
    older_mujoco = {**here, "mujoco": "4.0.0"}
    records = [
        _record("klppo", "aaa", 1.0, environment=older_mujoco),  # CartPole: MuJoCo's version does not enter its run
        {**_record("kltrpo", "bbb", 1.0, environment=older_mujoco), "env": "Hopper-v5"},  # Hopper runs on MuJoCo
        {**_record("kltrpo", "ccc", 1.0, environment=older_mujoco), "env": "LunarLanderContinuous-v3"},
        {**_record("kltrpo", "ddd", 1.0, environment={**here, "box2d": "2.3.2"}), "env": "LunarLanderContinuous-v3"},
        {**_record("klppo", "eee", 1.0, environment={**here, "torch": "2.4.0"}), "env": "Pendulum-v1"},
    ]
    chosen = record_reproduction.reproducible_records(records, here, per_commit=1)
    assert [(r["code_version"], r["env"]) for r in chosen] == [("aaa", "CartPole-v1"), ("ccc", "LunarLanderContinuous-v3")]


def test_table_counts_and_marks_the_runs_that_trained_differently():
    rows = [
        dict(algo="klppo", env="CartPole-v1", seed=0, lr_mult=1.0, record_commit="aaa", identical=True,
             eval_record=500.0, eval_now=500.0),
        dict(algo="kltrpo", env="Pendulum-v1", seed=3, lr_mult=10.0, record_commit="bbb", identical=False,
             eval_record=-150.0, eval_now=-180.25),
    ]  # fmt: skip
    text = record_reproduction.table(rows, "ccc", HERE, "python benchmarks/record_reproduction.py --tier tiny")
    assert "with the checkout of commit `ccc` on This CPU, torch 2.13.0+cpu." in text
    assert "Identical: 1 of 2." in text
    assert "| `aaa` | klppo | CartPole-v1 | x1 | 0 | cheapest of its commit | yes | 500.0 | 500.0 |" in text
    assert "| `bbb` | kltrpo | Pendulum-v1 | x10 | 3 | cheapest of its commit | **no** | -150.0 | -180.2 |" in text


def test_picks_the_band_rule_records_whose_kl_came_close_to_a_band_edge():
    """The default band is (0.8, 1.25) x target: KLs at 1.000005 x 0.8 x target and 0.99999 x 1.25 x target are
    within 1e-4 of an edge; a KLTRPO record (no beta) and a side experiment are never picked."""

    def with_kls(record, *kls):
        return {**record, "target_kl": 0.02, "kl_updates": [{"timesteps": 64 * i, "mean": kl} for i, kl in enumerate(kls)]}

    records = [
        with_kls(_record("klppo", "aaa", 1.0), 0.02, 0.8 * 0.02 * 1.000005),  # near the lower edge
        with_kls(_record("clip_klppo", "aaa", 1.0, seed=1), 1.25 * 0.02 * 0.99999),  # near the upper edge
        with_kls(_record("klppo_noclip", "aaa", 1.0, seed=2), 0.02, 0.8 * 0.02 * 1.01),  # 1 % away
        with_kls(_record("kltrpo", "aaa", 1.0), 0.8 * 0.02),  # KLTRPO has no beta
        with_kls(_record("klppo", "bbb", 1.0, overrides={"kl_coef": 0.2}), 0.8 * 0.02),  # a side experiment
    ]
    chosen = record_reproduction.near_band_edge_records(records, HERE, 1e-4)
    assert sorted((r["algo"], r["seed"]) for r in chosen) == [("clip_klppo", 1), ("klppo", 0)]
    assert len(record_reproduction.near_band_edge_records(records, HERE, 0.02)) == 3
