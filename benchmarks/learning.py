"""
Returns and KL stability of KLPPO, ClipKLPPO and KLTRPO beside stock SB3 PPO and sb3-contrib TRPO,
on the same seeds, hyperparameters (rl-zoo's, see ``settings.py``) and machine.

Each finished run appends its JSON record to ``benchmarks/results/runs/<tier>/records.jsonl`` (``run_records.py``); the tables
(``benchmarks/results/learning*.md``) and figures (``benchmarks/results/*.png``) are regenerated from the records
by ``--report``, so a grid can be completed over several sessions. No number in the results is typed by hand.

Examples::

    # the main grid at the full budgets, 2 worker processes, then the report
    python benchmarks/learning.py --tier full --grid main --workers 2
    # a subset
    python benchmarks/learning.py --tier full --algos ppo klppo --envs CartPole-v1 Pendulum-v1 --seeds 0 1 2
    # the stress grid (learning rate x3 and x10)
    python benchmarks/learning.py --tier full --grid stress
    # five seeds ("a..b" is an inclusive range) on the environments where algorithms are close
    python benchmarks/learning.py --tier full --seeds 0..4 --envs Pendulum-v1 LunarLanderContinuous-v3
    # a side experiment in its own folder: the grid's Hopper runs trained on past the grid's budget
    SB3_KL_BENCHMARK_RESULTS=benchmarks/results/hopper_budget_300k \\
        python benchmarks/learning.py --tier full --algos klppo --envs Hopper-v5 --seeds 0..9 --budget 300000
    # only regenerate tables and figures from the records
    python benchmarks/learning.py --report --tier full
    # spread the grid over machines: the same command on each (cells queued once in a database-backed Optuna study,
    # a killed worker's cell re-run by another; see distributed_grid.py and docs/distributed.md)
    python benchmarks/learning.py --tier full --grid main --workers 2 --storage postgresql://USER:PASSWORD@HOST/grid

Records and results go to ``benchmarks/results/`` (``$SB3_KL_BENCHMARK_RESULTS`` to write elsewhere).
"""

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402
from grid import ALL_ALGOS, BUDGETS, MAIN_ALGOS, MAIN_ENVS, STRESS_ALGOS, STRESS_ENVS, STRESS_LR_MULTS  # noqa: E402
from grid_runs import run_one  # noqa: E402
from learning_report import report  # noqa: E402
from run_records import (  # noqa: E402
    append_record,
    code_version,
    grid_record,
    is_side_folder,
    record_folder,
    record_key,
    run_environment,
)


def seed_list(tokens: list[str]) -> list[int]:
    """Seeds from the command line: integers, or inclusive ranges ``a..b`` (``0..4`` = 0 1 2 3 4)."""
    seeds: list[int] = []
    for token in tokens:
        first, _, last = token.partition("..")
        try:
            seeds += list(range(int(first), int(last) + 1)) if last else [int(first)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seeds takes integers or ranges like 0..4, got {token!r}") from None
    return sorted(set(seeds))


def parse_override(token: str) -> tuple[str, Any]:
    """:return: ``(name, value)`` of a ``--override NAME=VALUE`` (VALUE read as JSON, else kept as a string)"""
    name, sep, text = token.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--override takes NAME=VALUE such as kl_coef=0.2, got {token!r}")
    try:
        return name, json.loads(text)
    except json.JSONDecodeError:
        return name, text


def grid_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    from settings import clips

    if args.grid == "main":
        algos, envs, mults = MAIN_ALGOS, MAIN_ENVS, [1.0]
    else:
        algos, envs, mults = STRESS_ALGOS, STRESS_ENVS, STRESS_LR_MULTS
    algos, envs = args.algos or algos, args.envs or envs
    mults = args.lr_mults or mults
    version = code_version()
    specs = [
        dict(
            algo=a,
            env=e,
            seed=s,
            lr_mult=m,
            tier=args.tier,
            code_version=version,
            overrides=getattr(args, "override", {}),
            **({"budget": args.budget} if getattr(args, "budget", None) else {}),
        )
        for e in envs
        for a in algos
        for m in mults
        for s in seed_list(args.seeds)
        # where PPO's zoo entry does not clip, klppo is already KLPPO without clipping
        if not (a == "klppo_noclip" and not clips(e))
    ]
    if not args.force:
        here = run_environment() if args.other_machines else None
        specs = [
            s
            for s in specs
            if not up_to_date(grid_record(args.tier, s["algo"], s["env"], s["lr_mult"], s["seed"]), version, args.stale, here)
        ]
    return specs


def keep_unrecorded(specs: list[dict[str, Any]], tier: str) -> list[str]:
    """
    Before ``--other-machines`` re-makes them: copy the existing records of ``specs`` that do not name their machine to
    ``results/unrecorded_machine/runs/<tier>/`` (unless a copy is there), where the report's replication section sets
    them beside the re-made runs. A record that names another machine is replaced (git keeps it).

    :return: the names of the runs whose records were copied (:func:`run_records.record_name`)
    """
    kept = run_records.RESULTS / "unrecorded_machine" / "runs" / tier
    written = []
    for spec in specs:
        record = grid_record(tier, spec["algo"], spec["env"], spec["lr_mult"], spec["seed"])
        if record is None or "run_environment" in record:
            continue
        if append_record(kept, record, unless=lambda current: current is not None):
            written.append(record_key(record))
    return written


def up_to_date(record: dict[str, Any] | None, version: str, stale: bool, here: dict[str, str] | None = None) -> bool:
    """
    :param record: a run's record (None: the run has none)
    :param version: the commit this checkout would record
    :param stale: whether a record made by another commit counts as missing (re-run it)
    :param here: this machine's :func:`run_environment`, to count a record that another machine or set of library
        versions made, or that does not name its machine, as missing (None: the machine does not matter)
    :return: whether the run can be skipped
    """
    return record is not None and record_is_current(record, version, stale, here)


def record_is_current(record: dict[str, Any], version: str, stale: bool, here: dict[str, str] | None = None) -> bool:
    """:func:`up_to_date` for a record already read (the grid's, or a distributed grid's complete cell's)."""
    if stale and record.get("code_version") != version:
        return False
    return here is None or record.get("run_environment") == here


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--quick", dest="tier", action="store_const", const="quick", help="the whole grid at short budgets")
    tier.add_argument("--full", dest="tier", action="store_const", const="full", help="the budgets the results report")
    tier.add_argument("--tier", choices=list(BUDGETS), help="budget tier")
    parser.add_argument("--grid", choices=["main", "stress"], default="main")
    parser.add_argument("--algos", nargs="+", choices=ALL_ALGOS)
    parser.add_argument("--envs", nargs="+", choices=MAIN_ENVS)
    parser.add_argument("--seeds", nargs="+", default=["0", "1", "2"], help="seeds, or inclusive ranges such as 0..4")
    parser.add_argument("--lr-mults", nargs="+", type=float)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="re-run runs that already have a record")
    parser.add_argument(
        "--stale",
        action="store_true",
        help="re-run the runs whose record another commit made (resumable, unlike --force)",
    )
    parser.add_argument(
        "--other-machines",
        action="store_true",
        help="re-run the runs whose record another machine or set of library versions made, or that does not name its "
        "machine (resumable); the replaced records that do not name theirs are kept in results/unrecorded_machine/",
    )
    parser.add_argument(
        "--override",
        nargs="+",
        type=parse_override,
        default=[],
        metavar="NAME=VALUE",
        help="constructor keyword arguments set on top of the settings (VALUE is JSON, e.g. kl_coef=0.2), for measuring a "
        "candidate default: write such runs to their own results folder (SB3_KL_BENCHMARK_RESULTS)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        help="environment steps per run instead of the tier's (a side experiment: only with SB3_KL_BENCHMARK_RESULTS set "
        "to a folder inside benchmarks/results/, so that no grid cell mixes budgets)",
    )
    parser.add_argument("--report", action="store_true", help="only regenerate tables and figures from the records")
    parser.add_argument(
        "--storage", help="database URL: queue the cells in an Optuna study there and work on them (distributed_grid.py)"
    )
    parser.add_argument("--study-name", help="study that holds the grid (default: learning-grid-<tier>)")
    parser.add_argument("--heartbeat-interval", type=int, default=60, help="seconds; a cell silent 2x this long is re-run")
    args = parser.parse_args(argv)
    args.tier = args.tier or "quick"
    args.override = dict(args.override)
    if args.budget is not None and args.storage:
        parser.error("--budget with --storage: the distributed grid's cells do not carry a budget; run it without --storage")
    if args.budget is not None and (args.budget <= 0 or not is_side_folder()):
        parser.error(
            f"--budget {args.budget}: give a positive number of steps, and set SB3_KL_BENCHMARK_RESULTS to a folder inside"
            f" {run_records.MAIN_RESULTS} (e.g. {run_records.MAIN_RESULTS}/hopper_budget_300k) so that the grid's records"
            " keep the tier's budgets"
        )
    if args.storage and not args.report:
        import distributed_grid

        heartbeat = distributed_grid.HeartbeatSettings(interval=args.heartbeat_interval)
        study_name = args.study_name or f"learning-grid-{args.tier}"
        specs = grid_specs(args)
        if args.other_machines:
            keep_unrecorded(specs, args.tier)
        is_current = None
        if args.stale or args.other_machines:  # the study's complete cells count as the files do (up_to_date)
            version, here = code_version(), run_environment() if args.other_machines else None

            def is_current(record: dict[str, Any]) -> bool:
                return record_is_current(record, version, args.stale, here)

        written = distributed_grid.run(
            specs, args.storage, study_name, args.workers, heartbeat, record_folder, args.force, is_current
        )
        print(f"{len(written)} records appended from study {study_name!r}", flush=True)
    elif not args.report:
        specs = grid_specs(args)
        if args.other_machines:
            keep_unrecorded(specs, args.tier)
        print(f"{len(specs)} runs to do ({args.tier} tier, {args.workers} workers)", flush=True)
        if args.workers > 1 and len(specs) > 1:
            with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
                for record in pool.imap_unordered(run_one, specs):
                    print(
                        f"done {record['algo']} {record['env']} lr x{record['lr_mult']:g} seed {record['seed']}: "
                        f"eval {record['eval_mean']:.1f}",
                        flush=True,
                    )
        else:
            for spec in specs:
                record = run_one(spec)
                print(
                    f"done {record['algo']} {record['env']} seed {record['seed']}: eval {record['eval_mean']:.1f}", flush=True
                )
    print(report(args.tier))


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
