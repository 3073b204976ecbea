"""
The learning benchmark's code (``benchmarks/learning.py``): the significance test its report uses to call a difference
a tie, the stock PPO + ``target_kl`` baseline row, seed ranges, and the report's comparison and goals on records whose
numbers are known.
"""

import json
import math
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import stable_baselines3
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import grid  # noqa: E402
import grid_runs  # noqa: E402
import learning_report  # noqa: E402
import measures  # noqa: E402
import run_records  # noqa: E402
import side_studies  # noqa: E402
import significance  # noqa: E402
import learning  # noqa: E402
import settings  # noqa: E402


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 12.7, -4.0])
def test_t_p_value_matches_closed_forms(t):
    # Student's t with 1 degree of freedom is the Cauchy distribution; with 2 its CDF is elementary
    assert significance.t_two_sided_p(t, 1.0) == pytest.approx(1.0 - 2.0 * math.atan(abs(t)) / math.pi, abs=1e-10)
    assert significance.t_two_sided_p(t, 2.0) == pytest.approx(1.0 - abs(t) / math.sqrt(2.0 + t * t), abs=1e-10)


@pytest.mark.parametrize("t, dof", [(2.776445, 4), (2.228139, 10), (1.959964, 1e6), (4.302653, 2.0)])
def test_t_p_value_at_tabulated_critical_values(t, dof):
    assert significance.t_two_sided_p(t, dof) == pytest.approx(0.05, abs=1e-5)


def test_welch_p_value_against_numerical_integration():
    a, b = [1.0, 2.0, 3.5, 2.2], [4.0, 5.5, 3.1]
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    # two-sided tail of the t density, integrated on a fine grid
    x = np.linspace(abs(t), 2000.0, 2_000_001)
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    density = np.exp(log_norm - (dof + 1) / 2 * np.log1p(x**2 / dof))
    assert significance.welch_p_value(a, b) == pytest.approx(2 * np.trapezoid(density, x), rel=1e-4)
    assert significance.welch_p_value(a, b) == pytest.approx(significance.welch_p_value(b, a))
    assert math.isnan(significance.welch_p_value([1.0], b))
    assert significance.welch_p_value([2.0, 2.0], [2.0, 2.0]) == 1.0
    assert significance.welch_p_value([2.0, 2.0], [3.0, 3.0]) == 0.0


def test_verdict_calls_noise_a_tie():
    assert significance.verdict([1.0, 2.0, 3.0], [1.5, 2.5, 2.0])[1] == "tie"
    assert significance.verdict([10.0, 10.1, 9.9], [1.0, 1.1, 0.9])[1] == "better"
    assert significance.verdict([10.0, 10.1, 9.9], [1.0, 1.1, 0.9], higher_is_better=False)[1] == "worse"


def test_seed_ranges():
    assert learning.seed_list(["0..4"]) == [0, 1, 2, 3, 4]
    assert learning.seed_list(["3", "0..1", "1"]) == [0, 1, 3]
    with pytest.raises(Exception, match=r"0\.\.4"):
        learning.seed_list(["a..b"])


@pytest.mark.parametrize("env_id, target", [("CartPole-v1", 0.02), ("Pendulum-v1", 0.03)])
def test_ppo_target_kl_is_ppo_at_klppo_target_and_clip(env_id, target):
    ppo, baseline = settings.settings_for("ppo", env_id), settings.settings_for("ppo_target_kl", env_id)
    assert baseline["kwargs"].pop("target_kl") == target
    assert baseline == ppo  # everything else, the clip included, is PPO's zoo entry
    assert grid_runs.algorithm_class("ppo_target_kl").__name__ == "PPO"
    assert grid_runs.default_target_kl("klppo", env_id, {}) == target


def test_other_machines_re_runs_the_records_this_machine_did_not_make(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    here = run_records.run_environment()
    # seed 0 made here, seed 1 on another CPU, seed 2 before records named their machine, seed 3 never
    for seed, described in ((0, here), (1, {**here, "cpu": "Another CPU"}), (2, None)):
        record = _record("klppo", "CartPole-v1", seed, 500.0, [0.02], 0.02)
        if described is not None:
            record["run_environment"] = described
        _write(tmp_path / "runs" / "tiny", record)
    args = learning.argparse.Namespace(
        grid="main", algos=["klppo"], envs=["CartPole-v1"], lr_mults=None, seeds=["0..3"], tier="tiny", force=False,
        stale=False, other_machines=True,
    )  # fmt: skip
    assert [s["seed"] for s in learning.grid_specs(args)] == [1, 2, 3]
    # the records they replace that do not name their machine are kept for the replication section, once
    specs = learning.grid_specs(args)
    args.other_machines = False
    assert [s["seed"] for s in learning.grid_specs(args)] == [3]
    assert learning.keep_unrecorded(specs, "tiny") == ["klppo__CartPole-v1__lr1__s2"]
    (copy,) = run_records.read_folder(tmp_path / "unrecorded_machine" / "runs" / "tiny")
    assert copy["seed"] == 2 and "run_environment" not in copy
    assert learning.keep_unrecorded(specs, "tiny") == []


def test_matched_target_stays_that_of_the_cells_records(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    for seed in grid.MATCHED_SEEDS:
        _write(tmp_path / "runs" / "tiny", _record("trpo", "CartPole-v1", seed, 500.0, [0.008, 0.006], 0.01))
    assert grid_runs.matched_target_kl("tiny", "CartPole-v1") == pytest.approx(0.007)
    # once kltrpo_matched has records, re-made TRPO records (another machine) do not move its target
    _write(tmp_path / "runs" / "tiny", _record("kltrpo_matched", "CartPole-v1", 0, 500.0, [0.007], 0.0071))
    assert grid_runs.matched_target_kl("tiny", "CartPole-v1") == 0.0071
    _write(tmp_path / "runs" / "tiny", _record("kltrpo_matched", "CartPole-v1", 1, 500.0, [0.007], 0.0072))
    with pytest.raises(SystemExit, match="different targets"):
        grid_runs.matched_target_kl("tiny", "CartPole-v1")


def test_grid_skips_noclip_where_the_zoo_does_not_clip():
    args = learning.argparse.Namespace(
        grid="main", algos=["klppo_noclip"], envs=["Pendulum-v1", "Acrobot-v1"], lr_mults=None, seeds=["0..1"],
        tier="tiny", force=True,
    )  # fmt: skip
    specs = learning.grid_specs(args)
    assert {(s["env"], s["seed"]) for s in specs} == {("Pendulum-v1", 0), ("Pendulum-v1", 1)}


def test_ppo_target_kl_run_records_the_monitored_kl(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    record = grid_runs.run_one(dict(algo="ppo_target_kl", env="CartPole-v1", seed=0, lr_mult=1.0, tier="tiny"))
    assert record["hyperparameters"]["target_kl"] == 0.02 and record["target_kl"] == 0.02
    assert record["kl_source"].startswith("sb3_kl.callbacks.KLMonitorCallback")
    # CartPole's zoo rollout is 8 x 32 steps: one measured update per rollout of the tiny budget
    assert len(record["kl_updates"]) == 1024 // 256
    assert all(u["mean"] >= 0 and u["p99"] >= 0 for u in record["kl_updates"])
    written = run_records.grid_record("tiny", "ppo_target_kl", "CartPole-v1", 1.0, 0)
    assert written == json.loads(json.dumps(record))
    # the machine and the library versions, which decide the numbers besides the code
    described = record["run_environment"]
    assert described["torch"] == torch.__version__ and described["stable-baselines3"] == stable_baselines3.__version__
    assert described["cpu"] and described["python"] == platform.python_version()


@pytest.mark.parametrize("env_id, kind", [("CartPole-v1", "discrete"), ("Pendulum-v1", "continuous")])
def test_trpl_cell_is_ppo_zoo_entry_without_the_clip_at_the_grid_bounds(env_id, kind):
    trpl, ppo = settings.settings_for("trpl", env_id), settings.settings_for("ppo", env_id)
    for name, value in settings.TRPL_BOUNDS[kind].items():
        assert trpl["kwargs"].pop(name) == value
    ppo["kwargs"].pop("clip_range")
    assert trpl == ppo
    assert grid_runs.algorithm_class("trpl").__name__ == "TRPL"
    assert "trpl" in grid.MAIN_ALGOS and "trpl" in grid.STRESS_ALGOS and "trpl" in grid.SB3_KL_ALGOS
    # the KL band is measured against TRPL's per-state bound on KL(new||old)
    assert grid_runs.default_target_kl("trpl", env_id, settings.TRPL_BOUNDS[kind]) == sum(settings.TRPL_BOUNDS[kind].values())


@pytest.mark.parametrize("algo", ["trpl", "ppo"])
def test_runs_record_the_acting_policies_reverse_kl_per_update(algo, tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    record = grid_runs.run_one(dict(algo=algo, env="Pendulum-v1", seed=0, lr_mult=1.0, tier="tiny"))
    forward, reverse = record["kl_updates"], record["kl_reverse_updates"]
    assert len(reverse) == len(forward) > 0 and [u["timesteps"] for u in reverse] == [u["timesteps"] for u in forward]
    assert all(0 < u["mean"] <= u["p99"] <= u["max"] for u in reverse)
    # the other direction of the same updates: not the forward KL
    assert [u["mean"] for u in reverse] != [u["mean"] for u in forward]
    if algo == "trpl":  # the bound TRPL enforces on the acting policy in every state of the update
        assert max(u["max"] for u in reverse) <= 1.05 * record["target_kl"] * (1 + 1e-6)


def test_override_sets_a_candidate_default_and_is_recorded(tmp_path, monkeypatch):
    assert learning.parse_override("kl_coef=0.2") == ("kl_coef", 0.2)
    assert learning.parse_override("kl_band=[0.5, 2.0]") == ("kl_band", [0.5, 2.0])
    assert learning.parse_override("kl_controller=fixed") == ("kl_controller", "fixed")
    with pytest.raises(Exception, match="NAME=VALUE"):
        learning.parse_override("0.2")
    args = learning.argparse.Namespace(
        grid="main", algos=["klppo"], envs=["CartPole-v1"], lr_mults=None, seeds=["0"], tier="tiny", force=True,
        override={"kl_coef": 0.2},
    )  # fmt: skip
    (spec,) = learning.grid_specs(args)
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    record = grid_runs.run_one(spec)
    assert record["overrides"] == {"kl_coef": 0.2} and record["hyperparameters"]["kl_coef"] == 0.2
    # the same run without the override starts beta at the default and trains differently
    default = grid_runs.train_and_evaluate({**spec, "overrides": {}})
    assert default["overrides"] == {} and "kl_coef" not in default["hyperparameters"]
    assert [u["mean"] for u in default["kl_updates"]] != [u["mean"] for u in record["kl_updates"]]


def test_override_names_the_policy_activation_as_rl_zoo_does():
    import torch.nn as nn

    given = {"gamma": 0.999, "policy_kwargs": {"activation_fn": "nn.ReLU", "net_arch": [8]}}
    resolved = grid_runs.resolve_activation(given)
    assert resolved == {"gamma": 0.999, "policy_kwargs": {"activation_fn": nn.ReLU, "net_arch": [8]}}
    assert given["policy_kwargs"]["activation_fn"] == "nn.ReLU"  # the record keeps the name
    assert (
        grid_runs.resolve_activation({"policy_kwargs": {"activation_fn": "Tanh"}})["policy_kwargs"]["activation_fn"] is nn.Tanh
    )
    with pytest.raises(ValueError, match="activation_fn='relu'"):
        grid_runs.resolve_activation({"policy_kwargs": {"activation_fn": "relu"}})
    spec = dict(algo="kltrpo", env="Pendulum-v1", seed=0, lr_mult=1.0, tier="tiny", overrides={"n_steps": 256, **given})
    record = grid_runs.train_and_evaluate(spec)
    assert record["hyperparameters"]["policy_kwargs"]["activation_fn"] == "ReLU" and record["overrides"] == spec["overrides"]


def _record(algo, env, seed, eval_mean, kls, target, lr_mult=1.0, curve=None):
    return dict(
        algo=algo, env=env, seed=seed, lr_mult=lr_mult, tier="tiny", budget=1000, target_kl=target, eval_mean=eval_mean,
        curve=curve or [[100 * i, eval_mean * i / 10] for i in range(1, 11)], env_steps_per_second=1.0,
        kl_updates=[dict(timesteps=i, mean=k, p99=3 * k) for i, k in enumerate(kls)], code_version="test",
    )  # fmt: skip


def _write(folder: Path, record: dict) -> None:
    """Store a record in a records folder (the last record stored of a run is its record)."""
    run_records.append_record(folder, record)


def _report(tier: str) -> str:
    """
    The grid's report with the side studies' pages it writes: the pages first, in the order of their links, then
    ``learning[_<tier>].md``, as one text.
    """
    text = learning_report.report(tier)
    links = [line for line in text.splitlines() if line.startswith("- [") and "](side_studies/" in line]
    pages = [(run_records.RESULTS / line[line.index("](") + 2 : -1]).read_text() for line in links]
    return "\n".join([*pages, text])


def _section_end(text: str, start: int) -> int:
    """Where the section that begins at ``start`` ends: at the next section's heading or the next page's."""
    return min(text.find(heading, start) % (len(text) + 1) for heading in ("\n## ", "\n# "))


def _page_end(text: str, start: int) -> int:
    """Where the page that begins at ``start`` ends: at the next page's heading (a page's sections are ``## ``)."""
    return text.find("\n# ", start) % (len(text) + 1)


def _row(text: str, start: str) -> str:
    """The table row of a report that starts with ``start``."""
    return next(line for line in text.splitlines() if line.startswith(start))


def _empty(folder: Path) -> None:
    """Remove the records of a results folder (its section must then leave the report)."""
    (folder / run_records.RECORDS_FILE).unlink()


def _remove(folder: Path, name: str) -> None:
    """Remove one run's record from a records folder."""
    kept = [r for r in run_records.read_folder(folder) if run_records.record_key(r) != name]
    _empty(folder)
    for record in kept:
        _write(folder, record)


def test_report_compares_against_ppo_target_kl_and_states_goals(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    folder = tmp_path / "runs" / "tiny"
    records = []
    for seed in range(3):
        # KLPPO: same return as the baseline up to noise, far smaller KL tail; in band on every update at x10
        records.append(_record("ppo_target_kl", "Pendulum-v1", seed, -200.0 + seed, [0.06, 0.07], 0.03))
        records.append(_record("klppo", "Pendulum-v1", seed, -199.0 - seed, [0.03, 0.02], 0.03))
        records.append(_record("klppo", "Pendulum-v1", seed, -210.0, [0.03, 0.02], 0.03, lr_mult=10.0))
        records.append(_record("klppo_noclip", "Pendulum-v1", seed, -205.0, [0.03, 0.1], 0.03, lr_mult=10.0))
        records.append(_record("klppo_noclip", "Pendulum-v1", seed, -150.0, [0.03], 0.03))
    records[0]["run_environment"] = {"cpu": "Test CPU", "torch": "9.9"}
    for record in records:
        _write(folder, record)
    text = _report("tiny")
    assert (tmp_path / "learning_tiny.md").read_text() == text
    row = _row(text, "| x1 | Pendulum-v1 | klppo |")
    assert "tie" in row.split("|")[4] and "better" in row.split("|")[6]
    assert "- klppo on Pendulum-v1 (x1), return: tie" in text
    assert "x10, Pendulum-v1, klppo (3 seeds pooled): updates in band 100% (**met**" in text
    # half of klppo_noclip's x10 updates are at 0.1 > 2 x 0.03, and its return is 37 % below x1
    assert "x10, Pendulum-v1, klppo_noclip (3 seeds pooled): updates in band 50% (**NOT met**" in text
    assert "return -205.0 vs x1 -150.0 on the 3 seeds both have, -36.7% (**NOT met**" in text
    assert "No collapse of any sb3-kl algorithm in the grid (12 runs): **met**" in text
    assert "*unrecorded* (made before records named their machine and library versions): 14; Test CPU, torch 9.9: 1." in text


def test_report_sets_trpl_beside_the_grid_and_tabulates_the_reverse_kl_of_the_records_that_hold_it(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    folder = tmp_path / "runs" / "tiny"
    for seed in range(2):
        _write(folder, _record("ppo", "Pendulum-v1", seed, -200.0, [0.03], 0.03))  # made before kl_reverse_updates
        trpl = _record("trpl", "Pendulum-v1", seed, -190.0, [0.02, 0.02], 0.031)
        trpl["kl_reverse_updates"] = [dict(timesteps=i, mean=0.01, p99=0.02 + 0.004 * seed, max=0.03) for i in range(2)]
        _write(folder, trpl)
    text = learning_report.report("tiny")
    start = text.index("## Per-state KL(new||old) per update")
    assert "| env | budget | ppo | trpl |" in text[:start]  # trpl's column of the grid's tables
    section = text[start:]
    section = section[: _section_end(section, 1)]
    assert "| x1 | Pendulum-v1 | trpl | 2 | grid | 0.0220 | 0.0240 | 0.0300 |" in section and "| ppo |" not in section
    # PPO's row from its re-runs into reverse_kl/ (the grid's records predate the field)
    rerun = _record("ppo", "Pendulum-v1", 0, -200.0, [0.03], 0.03)
    rerun["kl_reverse_updates"] = [dict(timesteps=0, mean=0.05, p99=0.2, max=0.9)]
    _write(tmp_path / "reverse_kl" / "runs" / "tiny", rerun)
    text = learning_report.report("tiny")
    assert "| x1 | Pendulum-v1 | ppo | 1 | reverse_kl/ | 0.2000 | 0.2000 | 0.9000 |" in text
    assert "between acting policies ≤ 1.05 x its bound in ≥ 99% of updates: **met**" in text
    # without a record that holds it, no section
    _empty(folder)
    _empty(tmp_path / "reverse_kl" / "runs" / "tiny")
    _write(folder, _record("ppo", "Pendulum-v1", 0, -200.0, [0.03], 0.03))
    assert "## Per-state KL(new||old) per update" not in learning_report.report("tiny")


def test_stress_return_goal_compares_the_seeds_both_learning_rates_have():
    records = [_record("klppo", "HalfCheetah-v5", seed, 3000.0, [0.03], 0.03, lr_mult=10.0) for seed in range(4)]
    # x1 has seeds 0-2 only; seed 3's x1 run (say, a lucky 9000) must not enter a comparison x10 has no partner for
    records += [_record("klppo", "HalfCheetah-v5", seed, 3600.0, [0.03], 0.03) for seed in range(3)]
    records.append(_record("klppo", "HalfCheetah-v5", 4, 9000.0, [0.03], 0.03))
    (line,) = [g for g in learning_report.goal_stress(run_records.group_records(records)) if "HalfCheetah-v5, klppo " in g]
    assert "(4 seeds pooled): updates in band 100%" in line
    assert "return 3000.0 vs x1 3600.0 on the 3 seeds both have, -16.7% (**met**, goal: within 20%)" in line


def test_baseline_section_names_cells_where_sb3_early_stop_never_fired():
    ppo = [_record("ppo", "Acrobot-v1", seed, -80.0, [0.005], 0.02) for seed in range(2)]
    same = [{**r, "algo": "ppo_target_kl"} for r in ppo]
    stopped = [_record(a, "Pendulum-v1", 0, -200.0, [k], 0.03) for a, k in (("ppo", 0.09), ("ppo_target_kl", 0.04))]
    records = ppo + same + stopped + [_record("klppo", e, 0, -90.0, [0.02], 0.02) for e in ("Acrobot-v1", "Pendulum-v1")]
    for r in records:
        r["eval_returns"] = [r["eval_mean"]]
    text = learning_report.baseline_comparison(run_records.group_records(records), grid.MAIN_ENVS)
    assert "SB3's early stop never fired, so there the baseline is PPO itself): Acrobot-v1 (x1, 2 seeds)." in text


def test_collapses_are_listed_with_their_evaluation_after_training():
    rising = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 990, 1000, 1000, 1000, 1000])]
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    collapsed = _record("klppo", "Hopper-v5", 0, 1040.0, [0.03], 0.03, curve=falling)
    collapsed["eval_returns"] = [1040.0]
    # one update after each rollout; the one after the best rollout (400 steps) is 3 x target
    collapsed["kl_updates"] = [dict(timesteps=100 * i, mean=0.09 if i == 4 else 0.03, p99=0.1) for i in range(10)]
    groups = run_records.group_records([collapsed, _record("klppo", "Hopper-v5", 1, 960.0, [0.03], 0.03, curve=rising)])
    # best at 400 steps (980), below 50 % of the gain at 600 steps (400): the updates at 400 and 500 made the fall
    assert measures.collapse_points(falling) == [(4, 6)]
    assert measures.count_collapses(rising) == 0
    assert measures.fall_kl(collapsed) == dict(n=2, mean=2.0, max=3.0, over=0.5, over_run=0.1)
    table = learning_report.collapse_table(groups)
    assert _row(table, "| Hopper-v5 | x1 | klppo | 0 |") == (
        "| Hopper-v5 | x1 | klppo | 0 | 10.0 | 980.0 | 270.0 | 1040.0 | 1000.0 | 2 | 2.00 | 3.00 | 50% (10%) |"
    )
    assert "| Hopper-v5 | x1 | klppo | 1 |" not in table
    goal = learning_report.goal_collapses(groups)[0]
    assert (
        "**NOT met** (collapsed: 1 runs, 1 distinct trainings: klppo Hopper-v5 x1 s0, evaluation after training 1040.0,"
        " per-update KL in its fall"
        " 2.00 x target on average, at most 3.00;" in goal
    )
    # ClipKLPPO training identically to the collapsed KLPPO run: one more run, not one more training
    twin = run_records.group_records([collapsed, {**collapsed, "algo": "clip_klppo"}])
    assert "(collapsed: 2 runs, 1 distinct trainings: klppo Hopper-v5 x1 s0" in learning_report.goal_collapses(twin)[0]
    quiet = run_records.group_records([_record("klppo", "Hopper-v5", 1, 960.0, [0.03], 0.03, curve=rising)])
    assert "| none |" in learning_report.collapse_table(quiet)


def test_drift_table_sets_the_drift_before_a_collapse_beside_the_cells_healthy_runs():
    rising = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 990, 1000, 1000, 1000, 1000])]
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    collapsed = _record("clip_klppo", "CartPole-v1", 2, 117.0, [0.01] * 10, 0.02, curve=falling)
    # updates 0-4 up to the best point (400 steps) drift by 0.2 (10 x target), the fall's (400, 500) by 0.04
    for i, update in enumerate(collapsed["kl_updates"]):
        update.update(timesteps=100 * i, drift=0.2 if i < 4 else 0.04)
    collapsed["drift_lag"] = 10
    healthy = _record("clip_klppo", "CartPole-v1", 0, 500.0, [0.01] * 10, 0.02, curve=rising)
    for i, update in enumerate(healthy["kl_updates"]):
        update.update(timesteps=100 * i, drift=0.02)
    other = {**healthy, "seed": 1, "kl_updates": [{**u, "drift": 0.04} for u in healthy["kl_updates"]]}
    table = learning_report.drift_table(run_records.group_records([collapsed, healthy, other]))
    # 5 updates up to the best: KL 0.5 x target, drift (4 x 0.2 + 0.04) / 5 / 0.02 = 8.4 x; healthy 1 x and 2 x
    assert _row(table, "| CartPole-v1 | x1 | clip_klppo | 2 |") == (
        "| CartPole-v1 | x1 | clip_klppo | 2 | 10 | 5 | 0.50 | 8.40 | 1.50 | 2.00 | 2 | 2 | 0.50 | 2.00 |"
    )
    # records made before the monitor measured the drift: no section
    no_drift = _record("clip_klppo", "CartPole-v1", 2, 117.0, [0.01] * 10, 0.02, curve=falling)
    assert learning_report.drift_table(run_records.group_records([no_drift, healthy])) == ""


@pytest.mark.parametrize(
    "counts, p",
    # two-sided Fisher exact p-values (R's fisher.test, scipy.stats.fisher_exact)
    [((2, 10, 8, 10), 0.02301413756522116), ((3, 30, 0, 30), 0.23728813559322035), ((0, 10, 0, 10), 1.0)],
)
def test_fisher_exact_p_value(counts, p):
    assert significance.fisher_exact_p(*counts) == pytest.approx(p, rel=1e-12)


def test_collapse_rates_pool_the_grid_and_the_extra_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    grid = [_record(a, "CartPole-v1", s, 500.0, [0.01], 0.02) for a in ("ppo", "clip_klppo") for s in range(2)]
    grid[2] = _record("clip_klppo", "CartPole-v1", 0, 117.0, [0.01], 0.02, curve=falling)
    extra = tmp_path / side_studies.MORE_SEEDS_RUNS["CartPole-v1"][0] / "runs" / "tiny"
    for algo in ("ppo", "clip_klppo"):
        for seed in (10, 11):
            _write(extra, _record(algo, "CartPole-v1", seed, 500.0, [0.01], 0.02))
    text = side_studies.collapse_rates(run_records.group_records(grid), "tiny", "CartPole-v1")
    assert text.startswith("## CartPole-v1 collapses over more seeds")
    assert "--seeds 10..11" in text
    assert _row(text, "| ppo |") == "| ppo | 4 | 0 | - | - | 0 | 500.0 ± 0.0 | - |"
    assert _row(text, "| clip_klppo |") == "| clip_klppo | 4 | 1 | 0 | 117.0 | 1 | 404.2 ± 165.8 | 1.00 |"
    # Hopper's table has no solved line, and only its own environment's records count
    assert side_studies.collapse_rates(run_records.group_records(grid), "tiny", "Hopper-v5") == ""
    hopper = tmp_path / side_studies.MORE_SEEDS_RUNS["Hopper-v5"][0] / "runs" / "tiny"
    _write(hopper, _record("ppo", "Hopper-v5", 10, 900.0, [0.01], 0.03, curve=falling))
    _write(hopper, _record("klppo", "Hopper-v5", 10, 1000.0, [0.01], 0.03))
    text = side_studies.collapse_rates(run_records.group_records([]), "tiny", "Hopper-v5")
    assert "eval < " not in text
    assert _row(text, "| ppo |") == "| ppo | 1 | 1 | 10 | 900.0 | 900.0 ± 0.0 | - |"
    assert _row(text, "| klppo |") == "| klppo | 1 | 0 | - | - | 1000.0 ± 0.0 | 1.00 |"
    _empty(extra)
    assert side_studies.collapse_rates(run_records.group_records(grid), "tiny", "CartPole-v1") == ""


def test_settings_swap_sets_each_environment_of_the_study_beside_the_grid(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    swap = next(swap for swap in side_studies.SETTINGS_SWAPS if swap.algo == "trpl")
    grid = [_record(a, env, s, 100.0, [0.01], 0.02) for a in ("trpl", "trpo") for env in swap.envs for s in range(3)]
    assert side_studies.settings_swap_comparison(run_records.group_records(grid), "tiny", swap) == ""
    folder = tmp_path / swap.folder / "runs" / "tiny"
    for seed in (0, 1):  # one environment only so far: its section alone
        _write(folder, {**_record("trpl", swap.envs[0], seed, 300.0, [0.01], 0.02), "overrides": {"gamma": 0.99}})
    text = side_studies.settings_swap_comparison(run_records.group_records(grid), "tiny", swap)
    assert text.startswith(f"## TRPL on {' and '.join(swap.envs)} with TRPO's")
    assert f"--envs {swap.envs[0]} " in text and f"--envs {swap.envs[1]} " not in text
    assert "--override gamma=0.99" in text
    assert _row(text, "| trpl with TRPO's settings |").startswith("| trpl with TRPO's settings | 0..1 | 0 |")
    assert _row(text, "| trpl (grid) |").startswith("| trpl (grid) | 0..1 |")  # the grid's runs of the same seeds


def test_budget_trains_a_side_experiment_past_the_grid_and_refuses_the_grid_folder(tmp_path, monkeypatch, capsys):
    # the grid's own folder keeps the tier's budgets
    with pytest.raises(SystemExit):
        learning.main(["--tier", "tiny", "--budget", "2048", "--algos", "ppo", "--envs", "CartPole-v1"])
    assert "--budget 2048" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learning.main(["--tier", "tiny", "--budget", "2048", "--storage", "sqlite:///grid.db"])
    assert "--budget with --storage" in capsys.readouterr().err
    # a side folder's runs carry the budget
    args = learning.argparse.Namespace(
        grid="main", algos=["ppo"], envs=["CartPole-v1"], lr_mults=None, seeds=["0"], tier="tiny", force=True, budget=2048
    )
    assert [spec["budget"] for spec in learning.grid_specs(args)] == [2048]
    # a run past the budget repeats the grid's run up to its last step, then goes on (CartPole's zoo schedules decay
    # over the budget: constant here, as in Hopper's settings)
    constant = {"n_steps": 48, "batch_size": 128, "learning_rate": 1e-3, "clip_range": 0.2}
    spec = dict(algo="ppo", env="CartPole-v1", seed=0, lr_mult=1.0, tier="tiny", overrides=constant)
    grid = grid_runs.train_and_evaluate(spec)
    longer = grid_runs.train_and_evaluate({**spec, "budget": 2048})
    assert longer["budget"] == 2048 and longer["trained_steps"] == 6 * 8 * 48
    assert grid_runs.rerun_spec(longer)["budget"] == 2048 and "budget" not in grid_runs.rerun_spec(grid)
    assert side_studies.repeats_grid_run(grid, longer)
    other_seed = grid_runs.train_and_evaluate({**spec, "seed": 1, "budget": 2048})
    assert not side_studies.repeats_grid_run(grid, other_seed)
    # with the zoo's schedules, which decay over the budget, the longer run trains differently from its first update
    decaying = {**spec, "overrides": {"n_steps": 48, "batch_size": 128}}
    assert not side_studies.repeats_grid_run(
        grid_runs.train_and_evaluate(decaying), grid_runs.train_and_evaluate({**decaying, "budget": 2048})
    )


def test_longer_budget_section_says_which_collapses_the_curve_came_back_from(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    env, budget = "Hopper-v5", grid.BUDGETS["tiny"]["Hopper-v5"]  # 1024 steps
    rise = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270], start=1)]
    # seed 0 falls by the grid's budget and comes back above 90 % of its best (980) at step 1400; seed 1 falls by
    # the grid's budget for good; seed 2 stands at the grid's budget and falls later; seed 3 never falls (its dip at
    # 1010, after the grid run's last step 1000 but before the budget 1024, is not the grid's)
    later = {
        0: [[1100, 600.0], [1200, 800.0], [1300, 870.0], [1400, 890.0], [1500, 950.0]],
        1: [[1100, 280.0], [1200, 300.0], [1300, 290.0], [1400, 300.0], [1500, 310.0]],
        2: [[1100, 1000.0], [1200, 1000.0], [1300, 300.0], [1400, 250.0], [1500, 200.0]],
        3: [[1010, 100.0], [1100, 1000.0], [1200, 1000.0], [1300, 1000.0], [1400, 1000.0], [1500, 1000.0]],
    }
    standing = [[100 * i, 100.0 * i] for i in range(1, 11)]
    grid_made, longer = [], tmp_path / side_studies.LONGER_BUDGET_RUNS[env] / "runs" / "tiny"
    for algo in ("ppo", "klppo"):
        for seed, tail in later.items():
            head = rise if seed < 2 else standing
            grid_made.append({**_record(algo, env, seed, 900.0, [0.01] * 3, 0.03, curve=head), "eval_returns": [900.0 + seed]})
            made = _record(algo, env, seed, 950.0, [0.01] * 5, 0.03, curve=head + tail)
            made["budget"] = 1500
            for record in (grid_made[-1], made):  # an update every 300 steps
                record["kl_updates"] = [{**u, "timesteps": 300 * (i + 1)} for i, u in enumerate(record["kl_updates"])]
            _write(longer, made)
    grid_groups = run_records.group_records(grid_made)
    text = side_studies.longer_budget_collapses(grid_groups, "tiny", env)
    assert text.startswith(f"## {env} past the grid's budget")
    assert "--budget 1500" in text and f"instead of the grid's {budget:,}" in text
    # every run repeats its grid run up to the grid run's last step (1000: the curve and the three updates up to it
    # agree); both algorithms have every seed of the grid's cell, so their counts over 1500 steps are compared
    row = "| 0..3 | 4 of 4 | 2: 0, 1 | 1: 0 (1,400) | 2: 1, 2 | 900.0 ± 0.0 | 950.0 ± 0.0 |"
    assert _row(text, "| klppo |") == f"| klppo {row} 1.00 |"
    assert _row(text, "| ppo |") == f"| ppo {row} - |"
    # a grid run that trained differently does not count as repeated
    changed = [dict(r) for r in grid_made]
    changed[7]["kl_updates"] = [{**u, "mean": 0.02} for u in changed[7]["kl_updates"]]
    assert "| 3 of 4 |" in _row(
        side_studies.longer_budget_collapses(run_records.group_records(changed), "tiny", env), "| klppo |"
    )
    # the goal's line says of each collapsed grid run what it did when trained on
    klppo = grid_groups[(env, "klppo", 1.0)]
    assert side_studies.after_the_budget(klppo[0]) == (
        "trained on to 1,500 steps its curve came back above 90% of its best at step 1,400 and stood to the end"
        " (evaluation at 1,500 steps 950.0)"
    )
    assert side_studies.after_the_budget(klppo[1]).startswith("trained on to 1,500 steps its curve did not come back")
    assert side_studies.after_the_budget(klppo[2]) == ""  # did not collapse by the grid's budget
    (line,) = learning_report.goal_collapses(grid_groups)
    assert (
        f"klppo Hopper-v5 x1 s0, evaluation after training 900.0, {side_studies.after_the_budget(klppo[0])}"
        in line.replace(", per-update KL in its fall 0.33 x target on average, at most 0.33", "")
    )
    assert "see *The collapses* and *Hopper-v5 past the grid's budget*)" in line
    swap = tmp_path / side_studies.KLTRPO_PPO_SETTINGS_RUNS[1] / "runs" / "tiny"
    _write(swap, _record("kltrpo", env, 0, 1000.0, [0.01], 0.01))
    (line,) = learning_report.goal_collapses(grid_groups)
    assert line.endswith("past the grid's budget* and *KLTRPO on Hopper-v5 with PPO's discount, GAE and policy network*)")
    _empty(swap)
    # without stock PPO's runs of every seed, no rate is compared: the runs trained on may be the collapsed ones
    _remove(longer, run_records.record_name("ppo", env, 1.0, 3))
    text = side_studies.longer_budget_collapses(grid_groups, "tiny", env)
    assert _row(text, "| klppo |").endswith("| - |") and _row(text, "| ppo |").startswith("| ppo | 0..2 | 3 of 3 |")
    _empty(longer)
    assert side_studies.longer_budget_collapses(grid_groups, "tiny", env) == ""
    assert side_studies.after_the_budget(klppo[0]) == ""
    assert learning_report.goal_collapses(grid_groups)[0].endswith("see *The collapses*)")


def test_settings_swap_sets_kltrpo_with_ppo_settings_beside_the_grid_on_its_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    env, name = side_studies.KLTRPO_PPO_SETTINGS_RUNS
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    folder = tmp_path / name / "runs" / "tiny"
    overrides = {"gamma": 0.999, "policy_kwargs": {"activation_fn": "ReLU"}}
    for seed in range(4):
        made = _record("kltrpo", env, seed, 1000.0 + seed, [0.01], 0.01, curve=falling if seed == 3 else None)
        if seed == 3:  # its fall: the updates from its best at step 400 to step 600, where it is below half its gain
            made["kl_updates"] = [dict(timesteps=t, mean=m, p99=3 * m) for t, m in ((300, 0.02), (450, 0.009), (600, 0.02))]
        _write(folder, {**made, "overrides": overrides})
    # without grid records: the header and its own row
    assert side_studies.settings_swap_comparison(run_records.group_records([]), "tiny").count("\n| ") == 2
    grid = [_record("kltrpo", env, s, 2000.0 + 10 * s, [0.01], 0.01) for s in range(6)]  # seeds 4, 5: not compared
    grid += [_record("klppo", env, s, 990.0, [0.03], 0.03, curve=falling if s < 2 else None) for s in range(4)]
    text = side_studies.settings_swap_comparison(run_records.group_records(grid), "tiny")
    assert text.startswith(f"## KLTRPO on {env} with PPO's discount, GAE and policy network")
    # the command as a shell takes it: the JSON quoted
    assert """--override gamma=0.999 'policy_kwargs={"activation_fn":"ReLU"}'""" in text and "--seeds 0..3" in text
    assert _row(text, "| kltrpo with PPO's settings |") == (
        "| kltrpo with PPO's settings | 0..3 | 1 | 3 | 0.90 | - | 1001.5 ± 1.1 | - | 551.2 ± 1.3 | - |"
    )
    assert _row(text, "| kltrpo (grid) |").startswith("| kltrpo (grid) | 0..3 | 0 | - | - | 1.00 | 2015.0 ± 11.2 | +1013.5")
    # the falls' largest update KL: klppo's one update (at step 0, before its best at 400) is in neither fall
    assert "better" in _row(text, "| kltrpo (grid) |") and "| klppo (grid) | 0..3 | 2 | 0, 1 | n/a, n/a | 1.00 |" in text
    assert "ppo (grid)" not in text.replace("klppo (grid)", "")  # no records of that cell
    _empty(folder)
    assert side_studies.settings_swap_comparison(run_records.group_records(grid), "tiny") == ""


def test_cartpole_standing_check_sets_the_stock_counterparts_seeds_beside():
    def cell(algo, means):
        return [_record(algo, "CartPole-v1", s, m, [0.01], 0.01) for s, m in enumerate(means)]

    groups = run_records.group_records(
        cell("kltrpo_matched", [500.0, 297.5, 500.0]) + cell("trpo", [351.4, 500.0, 470.0]) + cell("klppo", [500.0] * 3)
    )
    lines = learning_report.standing_checks(groups)
    assert (
        "- CartPole-v1, kltrpo_matched: every seed ≥ 475: **NOT met** (min 297.5, 1 of 3 seeds under 475; "
        "trpo: min 351.4, 2 of 3 seeds under 475)"
    ) in lines
    # no stock runs: nothing beside
    assert "- CartPole-v1, klppo: every seed ≥ 475: **met** (min 500.0, 0 of 3 seeds under 475)" in lines


def test_seeds_goal_asks_five_seeds_of_close_cells_in_the_stress_grid_too():
    def cell(algo, means, lr_mult):
        return [_record(algo, "HalfCheetah-v5", s, m, [0.03], 0.03, lr_mult=lr_mult) for s, m in enumerate(means)]

    groups = run_records.group_records(
        # x10: klppo and ppo overlap within two standard deviations on 3 seeds; trpo is far from both
        cell("klppo", [3000.0, 2500.0, 3500.0], 10.0) + cell("ppo", [2800.0, 1800.0, 3600.0], 10.0)
        + cell("trpo", [9000.0, 9001.0, 9002.0, 9003.0, 9004.0], 10.0)
    )  # fmt: skip
    (line,) = learning_report.goal_seeds(groups)
    assert "**NOT met** (2 close cells of the grids' 3; fewer than 5 seeds: klppo on HalfCheetah-v5 x10 (n=3), ppo on" in line
    more = run_records.group_records(
        cell("klppo", [3000.0, 2500.0, 3500.0, 3100.0, 2900.0], 10.0) + cell("ppo", [2800.0, 1800.0, 3600.0, 3000, 2000], 10.0)
    )
    assert "**met** (2 close cells of the grids' 2; fewer than 5 seeds: none)" in learning_report.goal_seeds(more)[0]


def test_report_sets_a_replication_beside_the_records_and_judges_its_goals(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    primary, replica = tmp_path / "runs" / "tiny", tmp_path / "replication" / "runs" / "tiny"
    for seed in range(3):
        # seed 0 trains identically on both machines; the others land elsewhere
        shift = 0.0 if seed == 0 else 7.0
        for folder, delta in ((primary, 0.0), (replica, shift)):
            for record in (
                # TRPO moved by +50 on every seed of the other machine: a significant difference
                _record("trpo", "CartPole-v1", seed, 490.0 + seed + 50.0 * (folder is replica), [0.007], 0.01),
                _record("kltrpo", "CartPole-v1", seed, 400.0 + 10 * seed + delta, [0.0097], 0.01),
            ):
                record["eval_returns"] = [record["eval_mean"]]
                if folder is replica:
                    record["run_environment"] = {"cpu": "Other CPU", "torch": "9.9"}
                _write(folder, record)
        # kltrpo_matched re-made above on the replication's machine: judged with that machine's TRPO, not paired
        record = _record("kltrpo_matched", "CartPole-v1", seed, 530.0 + seed, [0.007], 0.007)
        record["run_environment"] = {"cpu": "Other CPU", "torch": "9.9"}
        _write(primary, record)
        # klppo re-made in the grid on the named machine (--other-machines); the earlier record kept aside
        earlier, record = (_record("klppo", "CartPole-v1", seed, value, [0.02], 0.02) for value in (480.0 + seed, 500.0))
        earlier["eval_returns"], record["eval_returns"] = [earlier["eval_mean"]], [500.0]
        record["run_environment"] = {"cpu": "Other CPU", "torch": "9.9"}
        _write(tmp_path / "unrecorded_machine" / "runs" / "tiny", earlier)
        _write(primary, record)
    text = _report("tiny")
    section = text[text.index("## Records that do not name their machine") :]
    assert "## Goals\n\nThe cells whose earlier records do not name their machine are judged again" in text
    assert "(Other CPU, torch 9.9; the grid's record: 3 runs, else the replication's" in section
    assert "| CartPole-v1 | x1 | kltrpo_matched |" not in section
    assert _row(section, "| CartPole-v1 | x1 | klppo |").startswith("| CartPole-v1 | x1 | klppo | 3 | 0 | 481.0 ± 0.8 | 500.0")
    alone = "on the records of that machine alone (Other CPU, torch 9.9; 6 of the grid's records, and the replication's"
    assert alone in section
    assert "- CartPole-v1: kltrpo_matched 531.0 vs TRPO 541.0 ± 0.8 (n=3/3)" in section
    row = _row(section, "| CartPole-v1 | x1 | kltrpo |")
    # 3 seeds, 1 identical; evaluation 410.0 above vs 414.7 in the replication
    assert row.startswith("| CartPole-v1 | x1 | kltrpo | 3 | 1 | 410.0 ± 8.2 | 414.7 ± 11.1 | +4.7")
    assert "- CartPole-v1: kltrpo 414.7 vs TRPO 541.0 ± 0.8 (n=3/3), within one std of TRPO or better: not measured" in section
    moved = "differ significantly between the two records (p < 0.05): 2 of 3 cells: CartPole-v1 x1 klppo, CartPole-v1 x1 trpo."
    assert moved in section
    # neither a replication nor records kept from the other machine: no section
    _empty(replica)
    _empty(tmp_path / "unrecorded_machine" / "runs" / "tiny")
    assert "## Replication" not in _report("tiny")


def test_report_sets_a_candidate_initial_beta_beside_the_default_on_the_same_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    primary, default, lowered = (tmp_path / name / "runs" / "tiny" for name in (".", "replication", "kl_coef_0.2"))
    for seed in range(3):
        # the default's first two updates undershoot (0.1 and 0.3 x target); the lower start's first only
        for folder, kls, eval_mean in (
            (primary, [0.003, 0.009, 0.03, 0.03], -150.0),
            (default, [0.003, 0.009, 0.03, 0.03], -150.0 - seed),
            (lowered, [0.009, 0.03, 0.03, 0.07], -148.0 - seed),
        ):
            record = _record("klppo", "Pendulum-v1", seed, eval_mean, kls, 0.03)
            record["eval_returns"] = [eval_mean]
            _write(folder, record)
    assert measures.updates_to_band(_record("klppo", "Pendulum-v1", 0, 0.0, [0.003, 0.009, 0.03], 0.03)) == 2
    assert measures.updates_to_band(_record("klppo", "Pendulum-v1", 0, 0.0, [0.003, 0.1], 0.03)) == 2
    text = _report("tiny")
    section = text[text.index("# KLPPO's initial beta") : text.index("## Goals")]
    row = _row(section, "| Pendulum-v1 | x1 | klppo |")
    # 3 seeds: -151.0 at 1.0, -149.0 at 0.2, a difference of +2.0 that the seeds' spread calls a tie
    assert row.startswith("| Pendulum-v1 | x1 | klppo | 3 | -151.0 ± 0.8 | -149.0 ± 0.8 | +2.0 (p=0.07): tie")
    # in band: 2 of 4 updates at 1.0, 2 of 4 at 0.2 (one undershoots, one overshoots); over 2x: 0 vs 1 of 4
    assert "| 50 ± 0% | 50 ± 0% | 0 ± 0% | 25 ± 0% |" in row
    assert "Pendulum-v1 x1 klppo 2.0 -> 1.0" in section
    assert "## Starting at 0.2" in section and "## Starting at 0.0001" not in section
    # a second start, at the floor: its own subsection, with the AUCs' difference tested like the returns'
    floor = tmp_path / "kl_coef_0.0001" / "runs" / "tiny"
    for seed in range(3):
        record = _record("klppo", "Pendulum-v1", seed, -140.0 - seed, [0.03, 0.03, 0.03, 0.03], 0.03)
        # training returns near 0 all along, where the default's curve climbs from -15 to -150
        record["curve"] = [[100 * i, 10.0 * seed] for i in range(1, 11)]
        _write(floor, record)
    section = side_studies.initial_kl_coef_comparison("tiny")
    assert section.startswith("## KLPPO's initial beta (`kl_coef`): 1.0 kept as the default, 0.2 and 0.0001 measured")
    floor_part = section[section.index("## Starting at 0.0001") :]
    assert "Pendulum-v1 x1 klppo 2.0 -> 0.0" in floor_part
    assert "AUC difference (0.0001 - 1.0): Pendulum-v1 x1 klppo +" in floor_part
    assert ": better." in floor_part  # far above the default's AUC on every seed
    # without the candidates' records: no section
    _empty(lowered)
    _empty(floor)
    assert "# KLPPO's initial beta" not in _report("tiny")


def test_report_sets_kltrpo_variants_beside_trpo_on_one_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    _write(tmp_path / "runs" / "tiny", _record("trpo", "CartPole-v1", 0, 500.0, [0.01], 0.01))
    assert "# KLTRPO against TRPO" not in _report("tiny")
    for (_, folder, algo), returns in zip(
        side_studies.KLTRPO_DIRECTION_RUNS[::4], ([100.0, 110.0], [50.0, 60.0]), strict=True
    ):
        for seed, eval_mean in enumerate(returns):
            record = _record(algo, "HalfCheetah-v5", seed, eval_mean, [0.1, 0.12], 0.1)
            record["overrides"] = {"cg_damping": 0.6} if algo == "kltrpo" else {}
            _write(tmp_path / folder / "runs" / "tiny", record)
    text = _report("tiny")
    start = text.index("# KLTRPO against TRPO on HalfCheetah-v5")
    section = text[start : _section_end(text, start)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| sb3-contrib TRPO", "| the same with 6 x `cg_damping`"]
    # the synthetic curve rises linearly to the eval return: AUC 0.55 x 55.0 = 30.2, against TRPO's 0.55 x 105.0
    assert "| `cg_damping=0.6` | 2 | 55.0 ± 5.0 | 30.2 ± 2.8 | -27.5 (p=" in rows[1]
    assert rows[0].split(" | ")[1] == "the grid's"


def test_report_sets_a_lower_target_beside_the_grid_and_counts_the_collapses_at_each(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    folder, env, target = side_studies.LOWER_TARGET_RUNS
    grid, lowered = tmp_path / "runs" / "tiny", tmp_path / folder / "runs" / "tiny"
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    for seed in range(3):
        # at 0.03 seed 0 collapses, and so does stock PPO's seed 1 (not counted: not KL-penalized); at the lower
        # target no seed does
        curve = falling if seed == 0 else None
        _write(grid, _record("klppo_noclip", env, seed, 900.0 + seed, [0.03, 0.03], 0.03, curve=curve))
        _write(grid, _record("clip_klppo", env, seed, 950.0, [0.03], 0.03))
        _write(grid, _record("ppo_target_kl", env, seed, 700.0 - 10 * seed, [0.03], 0.03, curve=falling if seed else None))
        _write(lowered, _record("klppo_noclip", env, seed, 1000.0 + seed, [target, 3 * target], target))
        _write(lowered, _record("ppo_target_kl", env, seed, 800.0 + 10 * seed, [target], target))
    text = _report("tiny")
    start = text.index(f"# KLPPO's target on {env}: {target:g} against the default 0.03")
    section = text[start : _section_end(text, start)]
    assert section.count(f"| {env} | x1 |") == 2  # clip_klppo has no lowered records to pair with
    row = _row(section, f"| {env} | x1 | klppo_noclip |")
    # +100.0 on every seed: a significant gain; in band: all at 0.03, half at the lower target (the other 3 x over)
    assert row.startswith(f"| {env} | x1 | klppo_noclip | 3 | 901.0 ± 0.8 | 1001.0 ± 0.8 | +100.0 (p<0.001): better")
    assert row.endswith("| 100 ± 0% | 50 ± 0% | 0 ± 0% | 50 ± 0% | 1 / 0 |")
    assert _row(section, f"| {env} | x1 | ppo_target_kl |").endswith("| 2 / 0 |")
    assert "The sb3-kl runs of the grid that collapse: klppo_noclip on Hopper-v5." in section
    assert f"--algos klppo_noclip ppo_target_kl --envs {env} --seeds 0..2 --override target_kl={target:g}`" in section
    assert (
        "against PPO with SB3's early stop at the same target (810.0 ± 8.2; differences ours - PPO's): klppo_noclip" in section
    )
    assert (
        f"KL-penalized runs (3 runs): 1 (1 distinct trainings) at 0.03, 0 (0 distinct trainings) at {target:g}. At" in section
    )
    collapsed = _record("clip_klppo", env, 0, 950.0, [target], target, curve=falling)
    collapsed["kl_updates"] = [dict(timesteps=100 * i, mean=target, p99=target) for i in range(10)]
    _write(lowered, collapsed)
    section = side_studies.lower_target_comparison(run_records.group_records(run_records.load_records("tiny")), "tiny")
    assert f"(4 runs): 1 (1 distinct trainings) at 0.03, 1 (1 distinct trainings) at {target:g}. The falls'" in section
    assert f"at {target:g}: clip_klppo s0 1.00 x on average, at most 1.00. A lower target does not end the falls" in section
    # PPO's early stop's own AUC at each target, beside the comparison at the lower one
    assert "losing AUC itself at the lower target (mean " in section
    _empty(lowered)
    assert "# KLPPO's target on" not in _report("tiny")


def test_report_sets_clip_klppo_started_lower_beside_the_grid_and_ppo(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    (folder, coef, _, _), (middle, middle_coef, _, _) = side_studies.CLIP_KLPPO_START_RUNS[:2]
    # the floor re-run on every cell, the middle start on CartPole only
    starts = [(folder, coef, None, ""), (middle, middle_coef, (("CartPole-v1", 1.0),), "What the middle start showed.")]
    monkeypatch.setattr(side_studies, "CLIP_KLPPO_START_RUNS", starts)
    grid, lowered = tmp_path / "runs" / "tiny", tmp_path / folder / "runs" / "tiny"
    for seed in range(3):
        _write(grid, _record("ppo", "Pendulum-v1", seed, -200.0 + seed, [0.03], 0.03))
        _write(grid, _record("clip_klppo", "Pendulum-v1", seed, -300.0 + seed, [0.03], 0.03))
        _write(grid, _record("clip_klppo", "CartPole-v1", seed, 500.0, [0.02], 0.02))
        # the runs from beta's floor: PPO's return on Pendulum (CartPole's cell not re-run yet)
        _write(lowered, _record("clip_klppo", "Pendulum-v1", seed, -200.0 + seed, [0.03, 0.09], 0.03))
    text = _report("tiny")
    start = text.index(f"# ClipKLPPO's initial beta (`kl_coef`): {coef:g} measured against the default 1.0")
    section = text[start : _page_end(text, start)]
    row = _row(section, "| Pendulum-v1 | x1 | clip_klppo |")
    assert row.startswith("| Pendulum-v1 | x1 | clip_klppo | 3 | -299.0 ± 0.8 | -199.0 ± 0.8 | +100.0 (p<0.001): better")
    assert row.endswith("| 100 ± 0% | 50 ± 0% | 0 ± 0% | 50 ± 0% | 0 / 0 |")
    assert "| CartPole-v1 | x1 | clip_klppo |" not in section  # nothing to pair with
    # against PPO: 100 worse at 1.0, the same at the floor (equal returns: a tie)
    against_ppo = _row(section, "| Pendulum-v1 | x1 | 3 |")
    assert against_ppo.startswith("| Pendulum-v1 | x1 | 3 | -100.0 (p<0.001): worse | +0.0 (p=1.00): tie |")
    assert f"not re-run at {coef:g}: CartPole-v1 x1 (3 of 3 seeds)." in section
    assert f"## Starting at {middle_coef:g}" not in section  # no records at the middle start
    assert "## Collapses by initial beta" not in section  # no collapse anywhere, nothing to decide on
    assert side_studies.CLIP_KLPPO_START_VERDICT not in section
    # a second start gets its own table, beside the same grid; its seed 1 collapses
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    for seed in range(2):
        record = _record("clip_klppo", "CartPole-v1", seed, 400.0, [0.02], 0.02, curve=falling if seed else None)
        record["kl_updates"] = [dict(timesteps=100 * i, mean=0.02 * (1 + i % 2), p99=0.06) for i in range(10)]
        _write(tmp_path / middle / "runs" / "tiny", record)
    text = _report("tiny")
    start = text.index(f"# ClipKLPPO's initial beta (`kl_coef`): {coef:g} and {middle_coef:g} measured against")
    section = text[start : _page_end(text, start)]
    middle_part = section[section.index(f"## Starting at {middle_coef:g}") :]
    assert _row(middle_part, "| CartPole-v1 | x1 | clip_klppo |").startswith(
        "| CartPole-v1 | x1 | clip_klppo | 2 | 500.0 ± 0.0 | 400.0 ± 0.0 | -100.0 (p<0.001): worse"
    )
    assert "re-run: CartPole-v1 x1)" in middle_part
    # the collapses of that cell at every start, on the seeds each re-ran, against 1.0's
    assert "| CartPole-v1 | x1 | 1.0 (default) | 3 | 0 | - | - | - |" in section
    assert section.rstrip().endswith(side_studies.CLIP_KLPPO_START_VERDICT)
    # seed 1 fell with its updates at 400 and 500 steps, at 1 and 2 x target
    assert f"| CartPole-v1 | x1 | {middle_coef:g} | 2 | 1 | 1 | s1 1.50 / 2.00 | 1.00 |" in section
    assert "| Pendulum-v1 | x1 |" not in section[section.index("## Collapses by initial beta") :]
    assert f"not re-run at {middle_coef:g}: CartPole-v1 x1 (1 of 3 seeds).\n\nWhat the middle start showed." in middle_part
    # a start that re-runs every cell misses the ones not re-run yet
    monkeypatch.setattr(side_studies, "CLIP_KLPPO_START_RUNS", [(folder, coef, None, ""), (middle, middle_coef, None, "")])
    text = _report("tiny")
    middle_part = text[text.index(f"## Starting at {middle_coef:g}") :]
    assert "re-run: every cell of the grid)" in middle_part
    assert f"not re-run at {middle_coef:g}: CartPole-v1 x1 (1 of 3 seeds), Pendulum-v1 x1 (3 of 3 seeds)." in middle_part
    _empty(lowered)
    _empty(tmp_path / middle / "runs" / "tiny")
    assert "# ClipKLPPO's initial beta" not in _report("tiny")


def test_side_experiments_compare_with_the_grid_record_of_their_own_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    here = {"cpu": "This CPU"}
    earlier = _record("klppo", "Hopper-v5", 0, 900.0, [0.03], 0.03)  # made before records named their machine
    _write(tmp_path / "unrecorded_machine" / "runs" / "full", earlier)
    remade = {**_record("klppo", "Hopper-v5", 0, 990.0, [0.03], 0.03), "run_environment": here}
    other_seed = {**_record("klppo", "Hopper-v5", 1, 995.0, [0.03], 0.03), "run_environment": here}
    groups = run_records.group_records([remade, other_seed])
    # a side record that does not name its machine is compared with the grid's record it was made beside
    side = run_records.group_records([_record("klppo", "Hopper-v5", 0, 905.0, [0.03], 0.03)])
    assert [r["eval_mean"] for r in side_studies.grid_beside(side, groups)[("Hopper-v5", "klppo", 1.0)]] == [900.0, 995.0]
    # one made here, with the grid's record made here
    side = run_records.group_records([{**_record("klppo", "Hopper-v5", 0, 905.0, [0.03], 0.03), "run_environment": here}])
    assert [r["eval_mean"] for r in side_studies.grid_beside(side, groups)[("Hopper-v5", "klppo", 1.0)]] == [990.0, 995.0]


def test_runs_record_the_steps_they_trained_past_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    # CartPole's zoo rollout is 8 envs x n_steps: with n_steps=48, the tiny budget of 1024 ends in the third rollout
    spec = dict(algo="ppo", env="CartPole-v1", seed=0, lr_mult=1.0, tier="tiny", overrides={"n_steps": 48, "batch_size": 128})
    record = grid_runs.train_and_evaluate(spec)
    assert record["budget"] == 1024 and record["trained_steps"] == 3 * 8 * 48 == 1152
    assert record["env_steps_per_second"] == pytest.approx(1152 / record["train_seconds"])
    assert run_records.trained_steps(record) == 1152 == record["curve"][-1][0]


def test_report_states_the_budget_and_the_steps_each_algorithm_trained(tmp_path, monkeypatch):
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    # records made before trained_steps was stored: the steps trained are the last curve point's (or the last KL
    # update's, where later); one made since: its own count
    ppo = [_record("ppo", "CartPole-v1", s, 500.0, [0.01], 0.02, curve=[[512, 20.0], [1024, 400.0]]) for s in range(2)]
    trpo = _record("trpo", "CartPole-v1", 0, 500.0, [0.01], 0.01, curve=[[768, 20.0], [1536, 400.0]])
    trpo["kl_updates"] = [dict(timesteps=t, mean=0.01, p99=0.03) for t in (768, 1536)]
    kltrpo = {**_record("kltrpo", "CartPole-v1", 0, 500.0, [0.01], 0.01), "trained_steps": 1536}
    pendulum = _record("klppo", "Pendulum-v1", 0, -200.0, [0.03], 0.03, curve=[[600, -900.0], [1200, -300.0]])
    assert [run_records.trained_steps(r) for r in (ppo[0], trpo, kltrpo, pendulum)] == [1024, 1536, 1536, 1200]
    assert run_records.trained_steps({**pendulum, "kl_updates": [dict(timesteps=1300, mean=0.03, p99=0.1)]}) == 1300
    for record in [*ppo, trpo, kltrpo, pendulum]:
        _write(tmp_path / "runs" / "tiny", record)
    text = _report("tiny")
    assert "the same for every algorithm" not in text
    assert "Budgets (`total_timesteps` passed to `learn`, one per environment for every algorithm and learning rate):" in text
    assert ": CartPole-v1 1,000, Pendulum-v1 1,000. `learn` does not stop inside a rollout" in text
    assert "or the record's `trained_steps` where it stores it)" in text
    assert "trained them: CartPole-v1 1,024 (+24: ppo), 1,536 (+536: trpo, kltrpo); Pendulum-v1 1,200 (+200: klppo)." in text


def _empty_sections(text: str) -> list[str]:
    """The sections (and tables) of a report with nothing in them: a heading or a table header with no content below."""
    empty = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            body = next((b for b in lines[i + 1 :] if b.strip()), "## end")
            if body.startswith("#") and body.count("#") <= line.count("#"):
                empty.append(line)
        if line.startswith("|---") and not (i + 1 < len(lines) and lines[i + 1].startswith("|")):
            empty.append(lines[i - 1])
    return empty


def test_report_of_a_side_folder_names_it_and_covers_only_its_records(tmp_path, monkeypatch):
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    monkeypatch.setattr(run_records, "MAIN_RESULTS", tmp_path)
    folder, _ = side_studies.MORE_SEEDS_RUNS["Hopper-v5"]
    side = tmp_path / folder
    falling = [[100 * i, float(r)] for i, r in enumerate([10, 400, 900, 950, 980, 700, 400, 250, 260, 270])]
    for seed in (10, 11):
        _write(side / "runs" / "tiny", _record("ppo", "Hopper-v5", seed, 900.0, [0.03], 0.03, curve=falling if seed else None))
        _write(side / "runs" / "tiny", _record("klppo", "Hopper-v5", seed, 950.0 + seed, [0.03], 0.03))
    # the main grid and a side experiment of it beside the folder: its report must not read them
    _write(tmp_path / "runs" / "tiny", _record("trpo", "CartPole-v1", 0, 500.0, [0.01], 0.01))
    _write(tmp_path / "kl_stop_1.5_per_epoch", _record("klppo", "Hopper-v5", 0, 1.0, [0.03], 0.03))
    monkeypatch.setattr(run_records, "RESULTS", side)
    assert run_records.is_side_folder()
    text = _report("tiny")
    assert (side / "learning_tiny.md").read_text() == text and not (tmp_path / "learning_tiny.md").exists()
    assert text.startswith(f"# Learning benchmark (tiny tier): the records of `benchmarks/results/{folder}/` only")
    assert (
        f"Generated by `SB3_KL_BENCHMARK_RESULTS=benchmarks/results/{folder} python benchmarks/learning.py --report --tier"
        f" tiny` from the JSON records in `benchmarks/results/{folder}/runs/tiny/`." in text
    )
    assert "`benchmarks/results/runs/tiny/`." not in text
    assert "This report covers only the 4 records of this side folder (Hopper-v5 x1: ppo, klppo, seeds 10..11)" in text
    assert "which reads these records in *Hopper-v5 collapses over more seeds*." in text
    assert _empty_sections(text) == [] and "code )" not in text
    # no goal is judged on the side folder's records; the single cells' checks are labelled as its own
    assert "## Goals: judged in the main report, not here" in text
    assert "not measured" not in text and "No collapse of any sb3-kl algorithm" not in text
    assert "- x1, Hopper-v5: klppo 960.5 vs ppo 900.0 ± 0.0: within one std of ppo or better: **met**" in text
    for section in ("## Main grid", "## KLTRPO", "## KLPPO's early stop", "## Hopper-v5 collapses over more seeds"):
        assert section not in text
    assert "## Base learning rate" in text and "Every run of this folder's records with a collapse" in text
    assert _row(text, "| Hopper-v5 | x1 | ppo | 11 |")


def test_report_of_the_main_folder_names_it_and_judges_the_goals(tmp_path, monkeypatch):
    monkeypatch.setattr(learning_report, "plot", lambda *args: None)
    monkeypatch.setattr(run_records, "MAIN_RESULTS", tmp_path)
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    _write(tmp_path / "runs" / "tiny", _record("klppo", "Hopper-v5", 0, 950.0, [0.03], 0.03))
    assert not run_records.is_side_folder()
    text = _report("tiny")
    assert text.startswith("# Learning benchmark (tiny tier)\n")
    assert "Generated by `python benchmarks/learning.py --report --tier tiny` from the JSON records in" in text
    assert "`benchmarks/results/runs/tiny/`." in text and "covers only" not in text
    assert "## Main grid (base learning rate)" in text and "\n## Goals\n" in text
    assert _empty_sections(text) == []
    # a results folder outside the main one is a grid of its own: reported as the main one is, under its own path
    elsewhere = tmp_path.parent / f"{tmp_path.name}_elsewhere"
    _write(elsewhere / "runs" / "tiny", _record("klppo", "Hopper-v5", 0, 950.0, [0.03], 0.03))
    monkeypatch.setattr(run_records, "RESULTS", elsewhere)
    assert not run_records.is_side_folder()
    text = _report("tiny")
    assert f"SB3_KL_BENCHMARK_RESULTS={elsewhere.resolve().as_posix()} python" in text and "\n## Goals\n" in text


def test_maskable_report_pairs_the_speeds_by_seed_and_tests_the_differences():
    import maskable_learning

    def run(algo, seed, seconds):
        return {**_record(algo, "InvalidActionMultiDiscrete-v0", seed, 90.0, [0.02], 0.02), "train_seconds": seconds}

    by_algo = {
        "maskable_ppo": [run("maskable_ppo", seed, 10.0) for seed in range(3)],
        # seed 1 ran under load; seed 5 has no MaskablePPO run to pair with
        "maskable_klppo": [run("maskable_klppo", 0, 10.0), run("maskable_klppo", 1, 20.0), run("maskable_klppo", 5, 1.0)],
    }
    assert maskable_learning.paired_speed_ratios(by_algo) == {0: 1.0, 1: 0.5}
    assert maskable_learning.difference_cell([100.0, 99.9, 100.0], [63.1, 91.8, 84.9], True) == "+20.0 (p=0.15): tie"
    assert maskable_learning.difference_cell([0.07, 0.071], [0.02, 0.021], False) == "+0.0500 (p<0.001): **worse**"
    assert maskable_learning.difference_cell([0.07, 0.071], [0.02, 0.021], None).endswith(": differs")


def test_recurrent_report_compares_each_variant_with_recurrent_ppo_on_shared_seeds():
    import recurrent_learning

    kls = [0.03] * 4
    groups = {
        ("PendulumNoVel-v1", 1.0, "recurrent_ppo"): [
            _record("recurrent_ppo", "PendulumNoVel-v1", seed, -200.0 - seed, [0.3] * 4, 0.03) for seed in range(4)
        ],
        # seed 3 has no RecurrentPPO twin here: left out of the comparison
        ("PendulumNoVel-v1", 1.0, "recurrent_klppo"): [
            _record("recurrent_klppo", "PendulumNoVel-v1", seed, -150.0 - seed, kls, 0.03) for seed in (0, 1, 2, 5)
        ],
    }
    lines = recurrent_learning.baseline_comparison(groups)
    row = _row("\n".join(lines), "| PendulumNoVel-v1 | x1 | recurrent_klppo |")
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3] == "3"
    assert cells[4].startswith("+50.0 ") and cells[4].endswith(": better")
    assert cells[6].startswith("+100.0 ") and cells[6].endswith(": better")  # every update in band against none


def test_zoo_config_goal_judges_the_cell_that_ran_at_the_shipped_target(monkeypatch):
    """
    The shipped kltrpo configs' goal reads `target_kl` from `sb3_kl/hyperparams/kltrpo.yml`: the cell whose records ran
    at it (kltrpo_matched's target rounded as the config rounds it, or kltrpo's exactly), or none, which is not met.
    """
    import trpo_joint_kl

    env = "CartPole-v1"
    shipped = learning_report.shipped_kltrpo_target_kl(env)

    def records(algo, target):
        return [dict(algo=algo, env=env, lr_mult=1.0, seed=s, target_kl=target, eval_mean=500.0) for s in range(5)]

    near = shipped * 1.004  # a measured mean that rounds to the shipped target
    assert trpo_joint_kl.round_significant(near) == pytest.approx(shipped)
    groups = {(env, "kltrpo_matched", 1.0): records("kltrpo_matched", near), (env, "kltrpo", 1.0): records("kltrpo", 0.01)}
    assert learning_report.shipped_kltrpo_cell(groups, env) == "kltrpo_matched"
    groups[(env, "kltrpo_matched", 1.0)] = records("kltrpo_matched", shipped * 1.2)
    assert learning_report.shipped_kltrpo_cell(groups, env) is None
    groups[(env, "trpo", 1.0)] = records("trpo", None)
    goal = learning_report.goal_fair_trpo(groups)[-1]
    assert "NOT met" in goal and f"{env}: no cell ran at the shipped target_kl {shipped:g}" in goal
    # a config that keeps TRPO's target: kltrpo's runs, at exactly that target
    monkeypatch.setattr(learning_report, "shipped_kltrpo_target_kl", lambda env_id: 0.01)
    assert learning_report.shipped_kltrpo_cell(groups, env) == "kltrpo"


def test_aggregates_pool_the_normalized_tasks_and_give_the_probability_of_improvement():
    # KLPPO beats PPO on every run of both tasks, by the whole normalized range: IQM 1 against 0, P(better) 1
    records = [
        _record(algo, env, seed, eval_mean, [0.03], 0.03)
        for env, (low, high) in (("Pendulum-v1", (-1000.0, -200.0)), ("HalfCheetah-v5", (100.0, 3000.0)))
        for algo, eval_mean in (("ppo", low), ("klppo", high))
        for seed in range(4)
    ]
    text = learning_report.aggregate_comparison(run_records.group_records(records), grid.MAIN_ENVS)
    assert "| x1 | klppo | ppo | 2 | 1.00 [1.00, 1.00] | 0.00 [0.00, 0.00] | 1.00 [1.00, 1.00] |" in text
    # the same returns on both sides: a tie at one half, whatever the resampling
    tie = [{**r, "algo": "klppo"} for r in records if r["algo"] == "ppo"] + [r for r in records if r["algo"] == "ppo"]
    assert "| 0.50 [0.50, 0.50] |" in learning_report.aggregate_comparison(run_records.group_records(tie), grid.MAIN_ENVS)
    assert learning_report.aggregate_comparison(run_records.group_records(records[:4]), grid.MAIN_ENVS) == ""


def test_speed_goal_is_judged_on_the_unrounded_ratio(tmp_path, monkeypatch):
    """A median ratio shown as 0.800 but below 0.8 (overhead.py's "met" column says NO) does not meet a 0.8 goal."""
    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    header = (
        "| ours | stock | env | steps | ours/s | stock/s | ratio median | min-max | CPU | goal | met (wall) | pairs | commit |"
    )
    rows = [
        "| TRPL | PPO | HalfCheetah-v5 | 8,192 | 559 | 712 | 0.800 | 0.75-0.85 | 0.800 | ≥ 0.8 | NO | 7 | abc1234 |",
        "| TRPL | PPO | CartPole-v1 | 16,384 | 2900 | 3300 | 0.873 | 0.82-0.88 | 0.876 | ≥ 0.8 | yes | 7 | abc1234 |",
    ]
    (tmp_path / "overhead_trpl.md").write_text("\n".join([header, "|---|" * 13, *rows]) + "\n")
    met, detail = learning_report.speed_judgement("TRPL", "PPO", "overhead_trpl.md")
    assert met is False
    assert detail == "HalfCheetah-v5 0.800, CartPole-v1 0.873"
    assert learning_report.speed_judgement("KLTRPO", "TRPO", "overhead_trpl.md") == (None, "no overhead_trpl.md rows")
