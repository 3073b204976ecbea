"""
The learning grid (``learning.py``) as distributed work: the grid's cells are queued as trials of an Optuna study
on a database server, and any number of worker processes, on any number of machines, take cells from it.

Why an Optuna study and not Ray: the zoo's distributed tuning already needs the database and Optuna
(``sb3_kl.zoo.distributed``), so the grid reuses that engine and its guarantees instead of bringing a cluster
manager: a worker only needs the database URL (no head node, no shared file system), a killed worker's cell is
noticed through Optuna's heartbeat and re-queued for another worker, and a cell's state changes
(waiting -> running -> complete) are the database's transactions.

- Each cell is one trial, enqueued once (under an advisory lock, so N workers starting together queue it once)
  with the cell's spec as the user attribute ``cell``.
- A worker runs a cell and stores the record in the trial (user attribute ``record``) before completing it. A trial
  completes at most once (Optuna refuses to update a finished trial, and a killed worker's trial is failed first),
  so each cell has at most one complete trial, whose record is the cell's record.
- :func:`collect` appends the records of the complete trials to the grid's records file (checked and appended under
  its file lock: a record is never appended twice, by any number of collectors); the report is then generated from
  whatever records exist, as without a database.

Usage (``learning.py`` passes ``--storage`` here)::

    # on each machine, the same command: queue the grid (once), work on it, collect, report
    python benchmarks/learning.py --full --grid main --workers 2 --storage postgresql://USER:PASSWORD@HOST/grid
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from sb3_kl.zoo.distributed import (
    DistributedStudy,
    HeartbeatSettings,
    advisory_lock,
    load_or_create_study,
    open_storage,
    optimize_with_cap,
    study_lock_key,
)

#: Trial states of a cell that is done or in progress (not queued again)
ACTIVE_STATES = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)


def cell_key(spec: dict[str, Any]) -> str:
    """:return: the identity of a grid cell (tier, algorithm, environment, learning-rate multiplier, seed)"""
    return f"{spec['tier']}|{spec['algo']}|{spec['env']}|lr{spec['lr_mult']:g}|s{spec['seed']}"


def open_grid(storage_url: str, study_name: str, heartbeat: HeartbeatSettings | None = None) -> optuna.Study:
    """
    :param storage_url: Database URL
    :param study_name: Name of the study that holds the grid
    :param heartbeat: Heartbeat of the workers' cells (default: 60 s, retried up to 3 times)
    :return: The study (created if missing)
    """
    storage = open_storage(storage_url, heartbeat or HeartbeatSettings())
    return load_or_create_study(storage, study_name, "maximize", study_class=DistributedStudy)


def _backend(study: optuna.Study) -> Any:
    return getattr(study._storage, "_backend", study._storage)


def enqueue(
    study: optuna.Study,
    specs: list[dict[str, Any]],
    force: bool = False,
    is_current: Callable[[dict[str, Any]], bool] | None = None,
) -> int:
    """
    Queue the cells that are not already waiting, running or (unless ``force``) complete in the study.

    :param study: Grid study
    :param specs: Cells (``learning.grid_specs``)
    :param force: Queue cells again even when they completed before (waiting or running cells are never queued twice)
    :param is_current: With it, a complete cell counts as done only when its record passes it (``--stale``,
        ``--other-machines``: made by this commit, on this machine), so such a grid run resumes where it stopped
    :return: Number of cells queued
    """

    def done(trial: optuna.trial.FrozenTrial) -> bool:
        if trial.state != TrialState.COMPLETE:
            return True  # waiting or running
        if force:
            return False
        return is_current is None or is_current(trial.user_attrs.get("record") or {})

    with advisory_lock(_backend(study).engine, study_lock_key(study)):
        present = {
            trial.user_attrs.get("cell_key")
            for trial in study.get_trials(deepcopy=False)
            if trial.state in ACTIVE_STATES and done(trial)
        }
        queued = 0
        for spec in specs:
            key = cell_key(spec)
            if key not in present:
                study.enqueue_trial({}, user_attrs={"cell": json.dumps(spec), "cell_key": key})
                present.add(key)
                queued += 1
    return queued


def work(study: optuna.Study, run_cell: Callable[[dict[str, Any]], dict[str, Any]], log: Callable[[str], None] = print) -> int:
    """
    Take cells from the queue until it is empty and no cell runs elsewhere (a cell whose worker died is re-queued
    and run here). A cell that raises is marked failed (the exception is logged) and the worker goes on.

    :param study: Grid study
    :param run_cell: Runs one cell and returns its record (``grid_runs.train_and_evaluate``)
    :param log: Where to report each finished cell
    :return: Number of cells this worker ran
    """

    def objective(trial: optuna.Trial) -> float:
        spec = json.loads(trial.user_attrs["cell"])
        record = run_cell(spec)
        trial.set_user_attr("record", record)  # stored before the trial completes: complete implies recorded
        log(f"done {cell_key(spec)}: eval {record['eval_mean']:.1f}")
        return float(record["eval_mean"])

    return optimize_with_cap(study, objective, max_total_trials=None, catch=(Exception,))


def collect(
    study: optuna.Study, record_folder: Callable[[dict[str, Any]], Path], replace_from: int | None = None
) -> list[str]:
    """
    Append the record of every complete cell that has none yet to its records folder (the check and the append under
    the folder's file lock: never twice, by any number of collectors), and the record of every cell this grid run made
    again (its trial number is ``replace_from`` or later: ``--force``, ``--stale`` and ``--other-machines`` re-make
    cells that have records), once. Trials are read oldest first, so a cell's newest record is its last line.

    :param study: Grid study
    :param record_folder: The records folder of a record (``run_records.record_folder``)
    :param replace_from: First trial number of this grid run (None: replace nothing)
    :return: The runs whose records this call appended (``run_records.record_name``)
    """
    import run_records

    written = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        record = trial.user_attrs.get("record")
        if record is None:
            continue
        replace = replace_from is not None and trial.number >= replace_from

        def stored(current: dict[str, Any] | None, number: int = trial.number, replace: bool = replace) -> bool:
            return current is not None and (not replace or current.get("grid_trial") == number)

        if run_records.append_record(record_folder(record), {**record, "grid_trial": trial.number}, unless=stored):
            written.append(run_records.record_key(record))
    return written


def _worker(storage_url: str, study_name: str, heartbeat: HeartbeatSettings) -> int:
    """One local worker process (spawned by :func:`run`)."""
    import grid_runs

    return work(
        open_grid(storage_url, study_name, heartbeat), grid_runs.train_and_evaluate, log=lambda m: print(m, flush=True)
    )


def run(
    specs: list[dict[str, Any]],
    storage_url: str,
    study_name: str,
    workers: int,
    heartbeat: HeartbeatSettings,
    record_folder: Callable[[dict[str, Any]], Path],
    force: bool = False,
    is_current: Callable[[dict[str, Any]], bool] | None = None,
) -> list[Path]:
    """
    Queue ``specs``, work on the queue with ``workers`` local processes (each a full worker: other machines may
    run the same command), then collect the records.

    :param force: Queue cells again even when the study holds them complete (``--force``)
    :param is_current: Which complete cells' records still count (``--stale``, ``--other-machines``; see :func:`enqueue`)
    :return: The runs whose records were appended
    """
    import multiprocessing

    study = open_grid(storage_url, study_name, heartbeat)
    first_new = len(study.get_trials(deepcopy=False))  # the trials this run queues come after the existing ones
    queued = enqueue(study, specs, force=force, is_current=is_current)
    print(f"{queued} cells queued in study {study_name!r} ({len(specs)} asked for); {workers} local workers", flush=True)
    if workers > 1:
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=_worker, args=(storage_url, study_name, heartbeat)) for _ in range(workers)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
    else:
        _worker(storage_url, study_name, heartbeat)
    return collect(study, record_folder, replace_from=first_new)


if __name__ == "__main__":  # a bare worker: python benchmarks/distributed_grid.py URL STUDY [HEARTBEAT_S [GRACE_S]]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import grid_runs
    import run_records

    url, name, *times = sys.argv[1:]
    settings = HeartbeatSettings(*map(int, times))  # every worker of a grid must use the same heartbeat settings
    grid = open_grid(url, name, settings)
    work(grid, grid_runs.train_and_evaluate, log=lambda m: print(m, flush=True))
    for written in collect(grid, run_records.record_folder):
        print(f"recorded {written}", flush=True)
