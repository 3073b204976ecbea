"""
The learning-rate sweep: stock PPO, PPO with ``KLAdaptiveLRCallback``, KLPPO and KLPPO with ``learning_rate="auto"`` at
multiples of rl-zoo's learning rate (``grid.SWEEP_LR_MULTS``) on ``grid.SWEEP_ENVS``, the grid's full budgets.

Each finished run appends its record to ``benchmarks/results/lr_sweep/runs/full/records.jsonl``, except at x1, where
it is a cell of the learning grid and goes to the grid's records; a run the grid already made (``ppo`` and ``klppo``
at x1 and x10, ``klppo_auto`` at x1) is read from the grid's records, not made again. The page
``benchmarks/results/lr_sweep.md`` and its figure are regenerated from the records by ``--report``.

Examples::

    python benchmarks/lr_sweep.py --workers 2                 # every missing run, cheapest task first, then the page
    python benchmarks/lr_sweep.py --algos klppo_auto --seeds 3..4
    python benchmarks/lr_sweep.py --algos klppo_auto --made-since cc032cd   # re-make runs of older code
    python benchmarks/lr_sweep.py --report
"""

import argparse
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402
from grid import SWEEP_ALGOS, SWEEP_ENVS, SWEEP_LR_MULTS  # noqa: E402
from learning import seed_list  # noqa: E402

TIER = "full"
#: The sweep's own records folder (the grid's records of the same cells are read beside it)
FOLDER = run_records.MAIN_RESULTS / "lr_sweep" / "runs" / TIER
#: The learning grid's records folder
GRID_FOLDER = run_records.MAIN_RESULTS / "runs" / TIER


def sweep_records() -> list[dict[str, Any]]:
    """The sweep's records: its own, and the grid's of the sweep's cells that it has not made itself."""
    own = run_records.read_folder(FOLDER)
    made = {run_records.record_key(r) for r in own}
    grid = [
        r
        for r in run_records.read_folder(GRID_FOLDER)
        if r["env"] in SWEEP_ENVS and r["algo"] in SWEEP_ALGOS and r["lr_mult"] in SWEEP_LR_MULTS
    ]
    return own + [r for r in grid if run_records.record_key(r) not in made]


def pending_specs(
    algos: list[str], envs: list[str], mults: list[float], seeds: list[int], made_since: str | None = None
) -> list[dict[str, Any]]:
    """
    The runs without a record, in the order they are made: task by task as listed, then algorithm, then multiplier.

    :param made_since: A commit: a record of older code counts as missing (its run is made again; the new record,
        appended after it, is the one read)
    """
    done = {
        run_records.record_key(r)
        for r in sweep_records()
        if made_since is None or r["algo"] not in algos or run_records.made_since(r, made_since)
    }
    version = run_records.code_version("lr_sweep.py", "learning.py")
    return [
        dict(algo=a, env=e, seed=s, lr_mult=m, tier=TIER, code_version=version)
        for e in envs
        for a in algos
        for m in mults
        for s in seeds
        if run_records.record_name(a, e, m, s) not in done
    ]


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train, evaluate and append the record of one run (in a worker process)."""
    from grid_runs import train_and_evaluate

    record = train_and_evaluate(spec)
    run_records.append_record(GRID_FOLDER if record["lr_mult"] == 1.0 else FOLDER, record)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", choices=SWEEP_ALGOS, default=SWEEP_ALGOS)
    parser.add_argument("--envs", nargs="+", choices=SWEEP_ENVS, default=SWEEP_ENVS)
    parser.add_argument("--lr-mults", nargs="+", type=float, default=SWEEP_LR_MULTS)
    parser.add_argument("--seeds", nargs="+", default=["0..2"], help="seeds, or inclusive ranges such as 0..4")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--made-since", help="re-make the selected runs whose records an older commit made")
    parser.add_argument("--report", action="store_true", help="only regenerate the page and its figure from the records")
    args = parser.parse_args(argv)
    if not args.report:
        specs = pending_specs(args.algos, args.envs, args.lr_mults, seed_list(args.seeds), args.made_since)
        print(f"{len(specs)} runs to do ({args.workers} workers)", flush=True)
        with multiprocessing.get_context("spawn").Pool(max(1, args.workers)) as pool:
            for record in pool.imap_unordered(run_one, specs):
                print(
                    f"done {record['algo']} {record['env']} lr x{record['lr_mult']:g} seed {record['seed']}: "
                    f"eval {record['eval_mean']:.1f} ({record['train_seconds']:.0f} s)",
                    flush=True,
                )
    from lr_sweep_report import report

    print(report(sweep_records()))


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
