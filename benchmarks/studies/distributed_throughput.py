"""
Distributed tuning on one PostgreSQL study: trials per hour of ``python -m sb3_kl.zoo train -optimize`` with 1 and
with 2 worker processes on this machine, the database round trips (statements) and transactions per trial, the
server time they cost, and from those figures a paper estimate of how many workers one PostgreSQL server can feed.

One command (it starts its own PostgreSQL server in a temporary directory, like the tests, and stops it)::

    python benchmarks/studies/distributed_throughput.py              # writes benchmarks/results/distributed.md
    python benchmarks/studies/distributed_throughput.py --report     # rewrites it from distributed_runs.json

The measurement (its settings, the commit, the machine's cores and the server's version in ``meta``, each run's
figures in ``runs``) is kept in ``benchmarks/results/distributed_runs.json``; the page and its figure
``distributed.png`` are written from it.

Every trial of a run has the same cost (the expensive dimensions of the search are fixed by queued trials, the
rest is sampled), so the ratio of the two throughputs measures how well the workers share the machine, not luck.
Statements are counted by the server itself (``pg_stat_statements``, every statement the workers sent to that
database), transactions by ``pg_stat_database.xact_commit``.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the throwaway server of the tests
sys.path.insert(0, str(HERE))

from postgres_server import PostgresServer  # noqa: E402
import run_records  # noqa: E402

RESULTS = Path(os.environ.get("SB3_KL_BENCHMARK_RESULTS", HERE / "results"))
# The expensive dimensions of a trial, fixed (queued) so that every trial costs the same
FIXED_TRIAL = {"n_steps_pow": 7, "batch_size_pow": 6, "n_epochs": 5, "net_arch": "small"}


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def measure(server: PostgresServer, n_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.trials`` trials with ``n_workers`` zoo workers on a fresh database; :return: the figures"""
    import optuna
    import psycopg

    database = f"throughput_{n_workers}w_{int(time.time())}"
    url = server.create_database(database)
    study = optuna.create_study(study_name="throughput", storage=url, direction="maximize")
    for _ in range(args.trials):
        study.enqueue_trial(FIXED_TRIAL)
    del study

    # Counters are read from the `postgres` database, so that reading them adds no statement to the measured one
    monitor = psycopg.connect(server.url("postgres"), autocommit=True)
    monitor.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def counters() -> dict[str, float]:
        transactions, backends = monitor.execute(
            "SELECT xact_commit + xact_rollback, numbackends FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
        # a blocked pg_advisory_lock() counts its waiting as execution time: reported apart, not as server work
        calls, exec_ms, heartbeats, lock_ms = monitor.execute(
            "SELECT coalesce(sum(calls), 0), "
            "coalesce(sum(total_exec_time) FILTER (WHERE query NOT ILIKE '%%pg_advisory_lock(%%'), 0), "
            "coalesce(sum(calls) FILTER (WHERE query ILIKE '%%trial_heartbeats%%'), 0), "
            "coalesce(sum(total_exec_time) FILTER (WHERE query ILIKE '%%pg_advisory_lock(%%'), 0) "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s)",
            (database,),
        ).fetchone()
        return dict(
            transactions=transactions,
            backends=backends,
            statements=calls,
            exec_ms=exec_ms,
            heartbeats=heartbeats,
            lock_ms=lock_ms,
        )

    def trials_started() -> int:
        # one statement on the measured database per call: counted in `own_statements` and subtracted
        with psycopg.connect(url, autocommit=True) as connection:
            return connection.execute("SELECT count(*) FROM trials WHERE state <> 'WAITING'").fetchone()[0]

    monitor.execute("SELECT pg_stat_statements_reset()")
    before = counters()
    command = [
        sys.executable, "-m", "sb3_kl.zoo", "train", "--algo", "klppo", "--env", "CartPole-v1", "-n", str(args.timesteps),
        "-optimize", "--max-total-trials", str(args.trials), "--n-evaluations", "2", "--eval-episodes", "5",
        "--sampler", "random", "--pruner", "none", "--no-optim-plots", "--verbose", "0", "--num-threads", "1",
        "--storage", url, "--study-name", "throughput", "--heartbeat-interval", str(args.heartbeat_interval),
        "-params", "n_envs:2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    load_before = load_average()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    workers = [
        subprocess.Popen([*command, "--seed", str(i), "-f", str(server.root / f"logs_{database}_{i}")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n_workers)
    ]  # fmt: skip
    max_connections, own_statements, own_transactions, at_first_trial = 0, 0, 0, None
    while any(worker.poll() is None for worker in workers):
        now = counters()
        max_connections = max(max_connections, int(now["backends"]))
        if at_first_trial is None:
            own_statements, own_transactions = own_statements + 1, own_transactions + 1
            if trials_started() >= n_workers:  # every worker is past its start-up
                at_first_trial = counters()
        time.sleep(1.0)
    wall = time.time() - start
    load_after = load_average()
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers, waited for
    worker_cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    for worker in workers:
        output = worker.stdout.read() if worker.stdout else ""
        if worker.returncode != 0:
            raise RuntimeError(f"a worker failed ({worker.returncode}):\n{output[-3000:]}")
    after = counters()
    monitor.close()

    study = optuna.load_study(study_name="throughput", storage=url)
    complete = [trial for trial in study.trials if trial.state.name == "COMPLETE"]
    if len(complete) != args.trials:
        raise RuntimeError(f"{len(complete)} complete trials instead of {args.trials}")
    span = max(t.datetime_complete for t in complete) - min(t.datetime_start for t in complete)
    trial_seconds = [(t.datetime_complete - t.datetime_start).total_seconds() for t in complete]
    first = at_first_trial or before
    # trials started after the snapshot: all but the first one of each worker
    steady_trials = max(1, len(complete) - n_workers)
    return dict(
        workers=n_workers,
        trials=len(complete),
        span_seconds=span.total_seconds(),
        wall_seconds=wall,
        trials_per_hour=3600.0 * len(complete) / span.total_seconds(),
        trials_per_hour_with_startup=3600.0 * len(complete) / wall,
        mean_trial_seconds=sum(trial_seconds) / len(trial_seconds),
        worker_cpu_seconds=worker_cpu,
        statements=int(after["statements"] - before["statements"] - own_statements),
        heartbeat_statements=int(after["heartbeats"] - before["heartbeats"]),
        transactions=int(after["transactions"] - before["transactions"] - own_transactions),
        server_exec_ms=float(after["exec_ms"] - before["exec_ms"]),
        lock_wait_ms=float(after["lock_ms"] - before["lock_ms"]),
        steady_statements_per_trial=float(after["statements"] - first["statements"]) / steady_trials,
        steady_transactions_per_trial=float(after["transactions"] - first["transactions"]) / steady_trials,
        steady_exec_ms_per_trial=float(after["exec_ms"] - first["exec_ms"]) / steady_trials,
        max_connections=max_connections,
        load_before=load_before,
        load_after=load_after,
    )


def paper_estimate(run: dict[str, Any], server_cores: int, overhead_ms: float, max_connections: int) -> dict[str, float]:
    """
    How many workers one server can feed, from one run's figures after start-up: each worker asks the server for
    ``steady_statements_per_trial`` statements per ``mean_trial_seconds``; each statement costs the server its
    measured execution time plus ``overhead_ms`` (parse, plan, protocol, commit: not in pg_stat_statements'
    execution time).
    """
    per_trial_server_ms = run["steady_exec_ms_per_trial"] + overhead_ms * run["steady_statements_per_trial"]
    demand_per_worker = per_trial_server_ms / 1000.0 / run["mean_trial_seconds"]  # server-seconds per second
    connections_per_worker = max(1.0, run["max_connections"] / run["workers"])
    return dict(
        per_trial_server_ms=per_trial_server_ms,
        demand_per_worker=demand_per_worker,
        by_cpu=server_cores / demand_per_worker,
        connections_per_worker=connections_per_worker,
        by_connections=max_connections / connections_per_worker,
    )


def cpu_sentence(one: dict[str, Any], two: dict[str, Any]) -> str:
    """The workers' CPU time per trial with 1 and 2 workers, and what their ratio says."""
    per_one, per_two = one["worker_cpu_seconds"] / one["trials"], two["worker_cpu_seconds"] / two["trials"]
    ratio = per_two / per_one
    text = (
        f"CPU time the workers used per trial (start-up included): {per_one:.1f} s with 1 worker, {per_two:.1f} s with 2 "
        f"({ratio:.2f}x). "
    )
    if ratio <= 1.1:
        return text + (
            "Within 10%: sharing the study (locks, cap checks, polling) cost the workers little CPU, so with a free core "
            "per worker the throughput would grow with the workers (an inference; the measured ratio is the one above)."
        )
    return text + "More than 10% more CPU per trial with 2 workers: the sharing itself, or the machine's load, costs CPU."


def plot_throughput(runs: list[dict[str, Any]], path: Path) -> None:
    """
    Draw the trials per hour of each run (without and with the workers' start-up) beside perfect scaling, to a PNG.

    :param runs: The runs' figures, by number of workers
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    workers = [run["workers"] for run in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [run["trials_per_hour"] for run in runs], 0.4, label="trials/hour")
    ax.bar(
        [i + 0.2 for i in x],
        [run["trials_per_hour_with_startup"] for run in runs],
        0.4,
        color="tab:gray",
        label="incl. worker start-up",
    )
    ideal = [runs[0]["trials_per_hour"] * n / workers[0] for n in workers]
    ax.hlines(ideal, [i - 0.4 for i in x], list(x), color="tab:red", lw=2, label="1 worker's rate x workers")
    ax.set_xticks(list(x), [f"{n} worker{'s' if n > 1 else ''}" for n in workers])
    ax.set_ylabel("trials per hour")
    ax.set_title("KLPPO tuning on CartPole-v1, workers sharing one PostgreSQL study", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(runs: list[dict[str, Any]]) -> list[str]:
    """:return: the page's opening table: the throughput, CPU and database figures of 1 and 2 workers, and their ratio"""
    one, two = runs[0], runs[1]
    measures = {
        "trials per hour": (lambda run: run["trials_per_hour"], ".0f"),
        "trials per hour incl. worker start-up": (lambda run: run["trials_per_hour_with_startup"], ".0f"),
        "workers' CPU seconds per trial": (lambda run: run["worker_cpu_seconds"] / run["trials"], ".1f"),
        "statements per trial after start-up": (lambda run: run["steady_statements_per_trial"], ".1f"),
    }
    lines = ["| measure | 1 worker | 2 workers | 2 / 1 |", "|---|---|---|---|"]
    for name, (value, spec) in measures.items():
        lines.append(f"| {name} | {value(one):{spec}} | {value(two):{spec}} | {value(two) / value(one):.2f}x |")
    return lines


def write_report(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """
    Write ``distributed.md``, its figure and ``distributed_runs.json`` from a measurement.

    :param meta: The measurement's settings, commit, cores and server version (see :func:`main`)
    :param runs: The runs' figures, 1 worker then 2
    :return: the page's text
    """
    one, two = runs[0], runs[1]
    ratio = two["trials_per_hour"] / one["trials_per_hour"]
    ratio_wall = two["trials_per_hour_with_startup"] / one["trials_per_hour_with_startup"]
    plot_throughput(runs, RESULTS / "distributed.png")
    lines = [
        "# Distributed tuning on PostgreSQL: throughput and database load",
        "",
        "![trials per hour, 1 and 2 workers](distributed.png)",
        "",
        *summary_table(runs),
        "",
        f"Generated by `{meta['command']}` at commit `{meta['commit']}` on a machine with {meta['cpu_count']} CPU cores "
        f"(PostgreSQL {meta['server_version']}, started by the script with its default durability; one torch thread "
        f"per worker). Each run: `python -m sb3_kl.zoo train --algo klppo --env CartPole-v1 -n {meta['timesteps']} "
        f"-optimize --max-total-trials {meta['trials']} --heartbeat-interval {meta['heartbeat_interval']} ...` in every "
        f"worker on a fresh database, the expensive dimensions of every trial fixed ({json.dumps(meta['fixed_trial'])}), "
        "so that all trials cost the same.",
        "",
        "| workers | trials | trials/hour | trials/hour incl. worker start-up | mean trial (s) "
        "| workers' CPU time per trial, start-up included (s) | load average before -> after (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['workers']} | {run['trials']} | {run['trials_per_hour']:.0f} | "
            f"{run['trials_per_hour_with_startup']:.0f} | "
            f"{run['mean_trial_seconds']:.1f} | {run['worker_cpu_seconds'] / run['trials']:.1f} | "
            f"{run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f} |"
        )
    goal = "met" if ratio >= 1.7 else "NOT met"
    lines += [
        "",
        f"**2 workers / 1 worker: {ratio:.2f}x** trials per hour (from the first trial's start to the last one's end in "
        f"the database), {ratio_wall:.2f}x including the workers' start-up; goal >= 1.7x: {goal} on this run.",
        "",
        cpu_sentence(one, two),
        "",
        "Caveat: the load average column is the machine's 1-minute load when each run started and ended. A load "
        "above the core count means other processes were competing for the cores, so the second worker could not "
        "get a core of its own and the ratio says more about the machine's other work than about the workers; "
        "re-run the command on an otherwise idle machine for the figure the goal is about.",
        "",
        "## Database round trips per trial",
        "",
        "| workers | statements / trial | of which heartbeats | transactions / trial | server execution time / trial (ms) | "
        "waiting for advisory locks / trial (ms) | after start-up: statements / trial | after start-up: transactions / trial "
        "| after start-up: server time / trial (ms) | connections per worker (max seen) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['workers']} | {run['statements'] / run['trials']:.1f} | "
            f"{run['heartbeat_statements'] / run['trials']:.1f} | "
            f"{run['transactions'] / run['trials']:.1f} | {run['server_exec_ms'] / run['trials']:.2f} | "
            f"{run['lock_wait_ms'] / run['trials']:.0f} | "
            f"{run['steady_statements_per_trial']:.1f} | {run['steady_transactions_per_trial']:.1f} | "
            f"{run['steady_exec_ms_per_trial']:.2f} | "
            f"{run['max_connections'] / run['workers']:.1f} |"
        )
    lines += [
        "",
        "Statements are every statement the workers sent to the study's database (counted by the server). The first "
        "columns include each worker's start-up (connection checks, schema check, study load, the zoo's study "
        "attributes) and end (the zoo's report of the whole study), spread over the trials; the *after start-up* columns "
        "count from the moment every worker had started its first trial, divided by the trials started after it (the "
        "marginal cost of one more trial). They include the cap checks, each trial's parameters and evaluations, and "
        "the heartbeats (one statement per heartbeat interval of a running trial, so their share grows with the "
        "trial's length). Server time is the execution time the server reports, without the time a worker's "
        "`pg_advisory_lock()` waited for another worker (its own column: the schema lock at start-up, and the study "
        "lock held from a worker's cap check to the start of its trial). Optuna reads the study's trials before each "
        "new trial, so the cost of a trial's statements grows slowly with the number of trials in the study.",
        "",
        "## Paper estimate: workers per PostgreSQL server",
        "",
    ]
    overhead_ms, max_connections = meta["overhead_ms"], meta["max_connections"]
    for cores in (2, 8):
        est = paper_estimate(two, cores, overhead_ms, max_connections)
        lines.append(
            f"- A server with {cores} cores: each trial costs the server {est['per_trial_server_ms']:.1f} ms "
            f"(measured execution time + {overhead_ms} ms per statement for parsing, planning, protocol and commit), "
            f"i.e. {1000 * est['demand_per_worker']:.2f} ms of server time per second of a worker running trials of "
            f"{two['mean_trial_seconds']:.1f} s; CPU bound: about {est['by_cpu']:,.0f} workers at full server load."
        )
    est = paper_estimate(two, 8, overhead_ms, max_connections)
    binding = "connections" if est["by_connections"] < est["by_cpu"] else "server CPU"
    lines += [
        f"- Connections: each worker held up to {est['connections_per_worker']:.1f} connections (storage pool, "
        f"heartbeat thread, advisory lock), so PostgreSQL's default `max_connections={max_connections}` admits about "
        f"{est['by_connections']:.0f} workers; beyond that raise `max_connections` or put PgBouncer (session pooling: the "
        "advisory locks are per session) in front.",
        f"- With these trials of {two['mean_trial_seconds']:.1f} s an 8-core server is bound first by its {binding}. The "
        "server time per second of work falls in proportion as trials get longer (real budgets are 10-1000x this "
        "benchmark's), so for real searches the CPU bound moves up by the same factor while the connection bound stays.",
        "",
    ]
    text = "\n".join(lines)
    (RESULTS / "distributed.md").write_text(text)
    (RESULTS / "distributed_runs.json").write_text(json.dumps(dict(meta=meta, runs=runs), indent=1))
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=6, help="trials per run (the --max-total-trials of the workers)")
    parser.add_argument("--timesteps", type=int, default=4096, help="environment steps per trial")
    parser.add_argument("--heartbeat-interval", type=int, default=10)
    parser.add_argument("--overhead-ms", type=float, default=0.1, help="assumed server cost per statement beyond execution")
    parser.add_argument("--max-connections", type=int, default=100, help="server's max_connections for the estimate")
    parser.add_argument("--report", action="store_true", help="only rewrite the page from distributed_runs.json")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads((RESULTS / "distributed_runs.json").read_text())
        print(write_report(saved["meta"], saved["runs"]))
        return
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python benchmarks/studies/distributed_throughput.py", *given])
    statements = "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"
    server = PostgresServer(durable=True, settings=statements)
    with server:
        import psycopg

        with psycopg.connect(server.url(), autocommit=True) as connection:
            args.server_version = connection.execute("SHOW server_version").fetchone()[0].split()[0]
        runs = []
        for n_workers in (1, 2):
            run = measure(server, n_workers, args)
            print(json.dumps(run), flush=True)
            runs.append(run)
    meta = dict(
        command=command,
        commit=run_records.code_version("studies/distributed_throughput.py"),
        cpu_count=os.cpu_count(),
        server_version=args.server_version,
        timesteps=args.timesteps,
        trials=args.trials,
        heartbeat_interval=args.heartbeat_interval,
        fixed_trial=FIXED_TRIAL,
        overhead_ms=args.overhead_ms,
        max_connections=args.max_connections,
    )
    print(write_report(meta, runs))


if __name__ == "__main__":
    main()
