"""
The collapse probe (``benchmarks/studies/collapse_probe.py``): it leaves the training as it was, takes the normalization's
own KL from the monitor, and splits a collapsed run into the rollouts before its best point and those of its fall.
"""

import copy
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "studies")]

import collapse_probe  # noqa: E402
import grid_runs  # noqa: E402
import measures  # noqa: E402
import run_records  # noqa: E402


def test_probe_leaves_the_training_unchanged_and_takes_the_monitors_normalization_shift():
    # Acrobot's zoo entry normalizes observations; its rollout is 16 x 256 steps: the tiny budget takes one
    spec = dict(algo="klppo", env="Acrobot-v1", seed=3, lr_mult=1.0, tier="tiny")
    record = grid_runs.train_and_evaluate(spec)
    probed = collapse_probe.probe_run(record)
    assert probed["same_run"]
    assert [row["timesteps"] for row in probed["rollouts"]] == [4096.0]
    # the normalization's own KL is the monitor's (checked against torch.distributions in test_normalization_shift.py)
    shifts = [u["normalization_shift"] for u in record["kl_updates"]]
    assert [row["normalization_kl"] for row in probed["rollouts"]] == shifts
    for row in probed["rollouts"]:
        assert row["normalization_kl"] > 0.0 and math.isfinite(row["normalization_kl"])
        assert row["kl_coef"] > 0.0 and row["kl_coef_at_floor"] in (0.0, 1.0)
        assert math.isnan(row["velocity"])  # Acrobot reports no forward velocity
    # a record made before the monitor measured the shift is still the same training
    older = copy.deepcopy(record)
    for update in older["kl_updates"]:
        del update["normalization_shift"]
    assert run_records.same_run(older, record)


def test_phases_split_a_collapse_at_its_best_point(tmp_path):
    # 40 rollouts of 100 steps: the curve climbs to 1000 at rollout 29, then falls below half its gain at rollout 33
    times = [100.0 * (i + 1) for i in range(40)]
    returns = [10.0 + 33.0 * i for i in range(31)] + [900.0, 700.0, 400.0, 200.0] + [150.0] * 5
    curve = [[t, r] for t, r in zip(times, returns, strict=True)]
    assert measures.collapse_points(curve) == [(30, 33)]
    # the rollouts after the best one fall; beta, recorded before each update, leaves its floor at the best point
    # the fall's falls: 4, 1, 1 (half of them in one rollout); after it, one fall per rollout
    falls = {31: 4.0, 32: 1.0, 33: 1.0}
    rollouts = [
        dict(timesteps=t, velocity=0.0 if i <= 30 else -0.5, terminated=falls.get(i, 0.0 if i <= 30 else 1.0),
             normalization_kl=0.0003, kl_coef_at_floor=1.0 if i < 30 else 0.0,
             last_update_kl_here=0.03 if i <= 30 else 0.6)
        for i, t in enumerate(times)
    ]  # fmt: skip
    kl_updates = [dict(timesteps=t, mean=0.015 if i < 30 else 0.06) for i, t in enumerate(times)]
    probed = dict(curve=curve, rollouts=rollouts, kl_updates=kl_updates, target_kl=0.03)
    before, fall, after = collapse_probe.phases(probed).values()
    assert before["rollouts"] == 20 and fall["rollouts"] == 3 and after["rollouts"] == 6
    assert before["velocity"] == 0.0 and fall["velocity"] == -0.5
    assert before["falls_per_1000_steps"] == 0.0 and fall["falls_per_1000_steps"] == pytest.approx(20.0)
    assert after["falls_per_1000_steps"] == pytest.approx(10.0)
    assert fall["rollouts_with_half_the_falls"] == 1 and before["rollouts_with_half_the_falls"] == 0
    assert before["update_kl"] == pytest.approx(0.5) and fall["update_kl"] == pytest.approx(2.0)
    assert before["update_kl_where_it_acted"] == pytest.approx(1.0) and fall["update_kl_where_it_acted"] == pytest.approx(20.0)
    assert before["normalization_kl"] == pytest.approx(0.01)
    assert before["kl_coef_at_floor"] == 1.0 and fall["kl_coef_at_floor"] == 0.0
    # over the whole run: the first rollout has no update before it; 9 rollouts at 20 x target, none with 5 falls
    del rollouts[0]["last_update_kl_here"]
    acted = collapse_probe.where_it_acted(probed)
    assert acted["flagged"] == 9 and acted["flagged_falling"] == 0 and acted["falling"] == 0
    assert acted["max"] == pytest.approx(20.0) and acted["median"] == pytest.approx(1.0)
    rollouts[31]["terminated"] = 5.0
    assert collapse_probe.where_it_acted(probed)["flagged_falling"] == 1
    # the page opens with the figure and a row per collapsed run: the fall's rollouts, falls and KL before / in it
    probed.update(env="Hopper-v5", algo="klppo_noclip", seed=3)
    collapse_probe.plot_collapses([probed], tmp_path / "collapses.png")
    assert (tmp_path / "collapses.png").read_bytes().startswith(b"\x89PNG")
    # (the fall now holds 5 + 1 + 1 falls over 300 steps)
    assert collapse_probe.summary_table([probed])[2] == "| Hopper-v5 | klppo_noclip | 3 | 3 | 0.00 / 23.33 | 0.50 / 2.00 |"
