"""
Benchmark reports come from JSON records that name the code and the machine that made them: ``overhead.py``'s JSON
beside its markdown, ``adaptive_lr.py``'s per-run records, and ``reference.py``'s records and report-only path.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "studies")]

import adaptive_lr  # noqa: E402
import overhead  # noqa: E402
import reference  # noqa: E402

SIDE_KEYS = {"steps", "trained_steps", "wall_seconds", "cpu_seconds", "steps_per_second", "cpu_steps_per_second", "hook_share"}


def test_overhead_writes_the_measured_pairs_beside_the_markdown(tmp_path):
    out = tmp_path / "overhead_tiny.md"
    overhead.main(
        ["--pairs", "2", "--steps-scale", "0.02", "--comparisons", "monitor", "--envs", "CartPole-v1", "--out", str(out)]
    )
    record = json.loads(out.with_suffix(".json").read_text())
    text = out.read_text()

    assert record["code_version"] and record["code_version"] in text
    assert {"cpu", "python", "torch"} <= set(record["run_environment"])
    assert record["command"].startswith("python benchmarks/overhead.py --pairs 2 --steps-scale 0.02")
    assert f"`{record['command']}`" in text
    assert "`overhead_tiny.json`" in text  # the markdown names its JSON
    (row,) = record["rows"]
    assert (row["comparison"], row["env"], len(row["pairs"])) == ("monitor", "CartPole-v1", 2)
    for pair in row["pairs"]:
        for side in ("ours", "stock"):
            assert set(pair[side]) == SIDE_KEYS
            assert pair[side]["wall_seconds"] > 0 and pair[side]["cpu_seconds"] > 0
            assert pair[side]["steps_per_second"] == pytest.approx(pair[side]["steps"] / pair[side]["wall_seconds"])
        assert pair["ratio"] == pytest.approx(pair["ours"]["steps_per_second"] / pair["stock"]["steps_per_second"])
        assert pair["stock"]["hook_share"] is None and 0 < pair["ours"]["hook_share"] < 1

    # the markdown's ratios are the JSON's
    cells = next(
        [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| PPO + KLMonitor")
    )
    assert cells[6] == f"{row['ratio_median']:.3f}"
    assert cells[7] == f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
    assert cells[8] == f"{row['cpu_ratio_median']:.3f}"
    per_pair = next(line for line in text.splitlines() if line.startswith("- PPO + KLMonitorCallback / PPO"))
    assert per_pair.split(": ", 1)[1] == ", ".join(f"{pair['ratio']:.3f}" for pair in row["pairs"])

    # --report rewrites the same markdown from the JSON alone
    out.write_text("")
    overhead.main(["--report", "--out", str(out)])
    assert out.read_text() == text


def test_adaptive_lr_records_every_run_resumes_and_reports_from_the_records(tmp_path, monkeypatch):
    runs = tmp_path / "adaptive_lr_runs"
    options = ["--steps", "2048", "--target-kl", "0.01", "--seeds", "0", "--runs", str(runs)]
    adaptive_lr.main(options)
    records = [json.loads(path.read_text()) for path in sorted(runs.glob("*.json"))]
    assert sorted(r["callback"] for r in records) == [False, True]
    for record in records:
        assert record["code_version"] and {"cpu", "python", "torch"} <= set(record["run_environment"])
        assert (record["steps"], record["learning_rate"], record["target_kl"], record["seed"]) == (2048, 0.03, 0.01, 0)
        assert record["updates"] == len(record["kl"]) == len(record["learning_rates"]) == 1
        assert record["wall_seconds"] > 0
    text = (tmp_path / "adaptive_lr.md").read_text()
    assert all(record["code_version"] in text for record in records)
    assert "not a measure of speed" in text

    # resume: runs with a record for the same parameters are not trained again; the report is the same
    def no_training(*args, **kwargs):
        raise AssertionError("a run with a record was trained again")

    monkeypatch.setattr(adaptive_lr, "run_one", no_training)
    adaptive_lr.main(options)
    adaptive_lr.main(["--report", "--steps", "2048", "--target-kl", "0.01", "--runs", str(runs)])
    assert (tmp_path / "adaptive_lr.md").read_text() == text
    # other parameters are other runs
    assert adaptive_lr.existing_record(2048, 0.03, 0.02, 0, True, runs) is None


def test_reference_report_names_the_commit_of_records_made_before_they_named_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "RESULTS", str(tmp_path))  # the committed report stays as it is
    args = argparse.Namespace(
        task="action-cost",
        action_cost=0.5,
        spin_bonus=1.5,
        torque_limit=1.0,
        steps=81_920,
        seeds=[0, 1, 2],
        jobs=2,
        ref_target_kl=0.05,
        extra_targets=[],
        report=True,
        plot=False,
    )
    args.task_spec = ("action-cost", 0.5)
    reference.report(args, "nice -n 10 python benchmarks/reference.py " + reference.run_options(args), plot_figure=False)
    text = (tmp_path / "reference_cost0.5.md").read_text()
    added = reference.commit_that_added(reference.record_path("cost0.5_free_s0"))
    if added is None:
        pytest.skip("no git history of the records")
    assert f"made before records named their commit; committed in {added} (7 records)" in text
    assert not list(tmp_path.glob("*.png"))  # the report-only path does not redraw the figure
    committed = (BENCHMARKS / "results" / "reference_cost0.5.md").read_text()
    assert text == committed  # the committed report is the script's output from the records

    # a record that names its code version is reported with it
    assert reference.record_version({"name": "x", "code_version": "abc1234"}) == "abc1234"
    assert set(reference.provenance()) == {"code_version", "run_environment"}
    assert re.fullmatch(r"[0-9a-f]{7,}(\+modified)?|unknown", reference.code_version())
