"""
The first epoch's share of the target under ``learning_rate="auto"``: 0.25 (shipped until ``grid.AUTO_RULE_SINCE``)
against ``1 / n_epochs`` (shipped since).

At rl-zoo's CartPole-v1 settings (20 epochs of one minibatch) the first epoch is a single optimizer step, and under the
quarter 4 of 5 grid seeds ended under 475 (``learning.md`` before ``grid.AUTO_RULE_SINCE``). A share of
``1 / n_epochs`` spreads the target evenly over the epochs. Cells from the grid's CartPole-v1 and HalfCheetah-v5 runs
(the quarter's returns read from the grid's and the sweep's records), and CartPole-v1 and Pendulum-v1 (10 epochs) on
seeds 12-14, outside the grid's, both shares run here.

    python benchmarks/studies/first_epoch_share.py --workers 2    # the missing runs, then the page
    python benchmarks/studies/first_epoch_share.py --report

Records: ``benchmarks/results/first_epoch_share.json`` (one per run, each naming its commit and machine); page
``benchmarks/results/first_epoch_share.md``.
"""

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = run_records.MAIN_RESULTS
RECORDS = RESULTS / "first_epoch_share.json"
PAGE = RESULTS / "first_epoch_share.md"
#: (task, learning-rate multiplier, seed): grid cells (seeds 0-1, the quarter's runs read from the grid's and the
#: sweep's records) and cells on seeds outside the grid's (12-14, both shares run here)
CELLS = (
    ("CartPole-v1", 1.0, 0),
    ("CartPole-v1", 1.0, 1),
    ("HalfCheetah-v5", 10.0, 0),
    ("HalfCheetah-v5", 1.0, 1),
    *((env_id, 1.0, seed) for env_id in ("CartPole-v1", "Pendulum-v1") for seed in (12, 13, 14)),
)
#: The shares compared: the earlier quarter, and ``1 / n_epochs`` (shipped since ``grid.AUTO_RULE_SINCE``)
QUARTER, PER_EPOCH = "0.25", "1 / n_epochs"


@functools.cache
def code_version() -> str:
    return run_records.code_version("studies/first_epoch_share.py", "settings.py", "grid_runs.py")


def run_key(record: dict[str, Any]) -> tuple[str, float, int, float]:
    return record["env"], record["lr_mult"], record["seed"], record["share"]


def share_of(variant: str, env_id: str) -> float:
    """The first epoch's share of the target a variant gives on ``env_id``."""
    from settings import n_epochs_for

    from sb3_kl.common.learning_rate import first_epoch_share

    return 0.25 if variant == QUARTER else first_epoch_share(n_epochs_for("klppo_auto", env_id))


def run_one(cell: tuple[str, float, int, str]) -> str:
    """Train one cell with the grid's code and one of the two shares; write its record."""
    import grid_runs
    from measures import summarize

    import sb3_kl.common.on_policy_algorithm as algorithm_module

    env_id, lr_mult, seed, variant = cell
    made_by = code_version()
    share = share_of(variant, env_id)
    if variant == QUARTER:  # (one process per run)
        algorithm_module.first_epoch_share = lambda n_epochs: 0.25  # type: ignore[assignment]
    grid = grid_runs.train_and_evaluate(dict(algo="klppo_auto", env=env_id, seed=seed, lr_mult=lr_mult, tier="full"))
    record = dict(
        env=env_id,
        lr_mult=lr_mult,
        seed=seed,
        share=share,
        eval_mean=grid["eval_mean"],
        in_band=summarize(grid)["in_band"],
        kl_p99_median=float(np.median([u["p99"] for u in grid["kl_updates"]])),
        code_version=made_by,
        run_environment=run_records.run_environment(),
    )
    run_records.replace_in_json_list(RECORDS, record, run_key)
    return f"done {env_id} x{lr_mult:g} seed {seed} share {share:g}: {record['eval_mean']:.1f}"


def _from_grid(cell: tuple[str, float, int]) -> bool:
    return cell[2] < 10


def report() -> str:
    from grid import AUTO_RULE_SINCE, QUARTER_SHARE_SINCE
    from measures import summarize

    records = run_records.read_json_list(RECORDS)
    by_key = {run_key(r): r for r in records}
    from_grid = _quarter_share_records(QUARTER_SHARE_SINCE, AUTO_RULE_SINCE)
    lines = [
        '# The first epoch\'s share of the target under `learning_rate="auto"`',
        "",
        f"| task | lr | seed | {QUARTER}: return | in band | KL p99 | {PER_EPOCH}: return | in band | KL p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for env_id, lr_mult, seed in CELLS:
        cells = []
        for variant in (QUARTER, PER_EPOCH):
            record = by_key.get((env_id, lr_mult, seed, share_of(variant, env_id)))
            if record is None and variant == QUARTER and _from_grid((env_id, lr_mult, seed)):
                grid = from_grid.get((env_id, lr_mult, seed))
                if grid is not None:
                    p99 = float(np.median([u["p99"] for u in grid["kl_updates"]]))
                    record = dict(eval_mean=grid["eval_mean"], in_band=summarize(grid)["in_band"], kl_p99_median=p99)
            cells.append(
                "— | — | —"
                if record is None
                else f"{record['eval_mean']:.1f} | {record['in_band']:.0%} | {record['kl_p99_median']:.3f}"
            )
        lines.append(f"| {env_id} | x{lr_mult:g} | {seed} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        f"{QUARTER} on seeds 0-1: the `klppo_auto` records of the grid (x1) and the sweep (x10) made from commit "
        f"`{QUARTER_SHARE_SINCE}` to `{AUTO_RULE_SINCE}`, which ships {PER_EPOCH}; on seeds 12-14 (outside the grid's) "
        f"both shares run here. {PER_EPOCH}: CartPole-v1 and HalfCheetah-v5 0.05 (20 epochs), Pendulum-v1 0.1. Return: 10 "
        "deterministic episodes (the grid's evaluation); in band: updates with their exact KL in [0.5, 2] x target; KL "
        "p99: median over updates of the per-state KL's 99th percentile.",
    ]
    return run_records.write_study_page(PAGE, lines, records, "python benchmarks/studies/first_epoch_share.py --workers 2")


def _quarter_share_records(since: str, until: str) -> dict[tuple[str, float, int], dict[str, Any]]:
    """
    The grid's and the sweep's ``klppo_auto`` records made by ``since`` or later but before ``until``, by
    :func:`run_key` (the last wins), from every line of the record files (re-made runs append theirs).
    """
    import lr_sweep

    lines = []
    for folder in (lr_sweep.FOLDER, lr_sweep.GRID_FOLDER):
        lines += [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines() if line.strip()]
    return {
        (r["env"], r["lr_mult"], r["seed"]): r
        for r in lines
        if r["algo"] == "klppo_auto" and run_records.made_since(r, since) and not run_records.made_since(r, until)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    if not args.report:
        done = {run_key(r) for r in run_records.read_json_list(RECORDS)}
        cells = [
            (*cell, variant)
            for cell in CELLS
            for variant in (PER_EPOCH, QUARTER)
            if not (variant == QUARTER and _from_grid(cell)) and (*cell, share_of(variant, cell[0])) not in done
        ]
        run_records.run_in_pool(run_one, cells, args.workers, one_process_per_run=True)
    print(report())


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
