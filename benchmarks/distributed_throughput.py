"""
Distributed tuning on one PostgreSQL study: trials per hour of ``python -m sb3_kl.zoo train -optimize`` with 1 and
with 2 worker processes on this machine, the database round trips (statements) and transactions per trial, the
server time they cost, and from those figures a paper estimate of how many workers one PostgreSQL server can feed.

One command (it starts its own PostgreSQL server in a temporary directory, like the tests, and stops it)::

    python benchmarks/distributed_throughput.py              # writes benchmarks/results/distributed.md

Every trial of a run has the same cost (the expensive dimensions of the search are fixed by queued trials, the
rest is sampled), so the ratio of the two throughputs measures how well the workers share the machine, not luck.
Statements are counted by the server itself (``pg_stat_statements``, every statement the workers sent to that
database), transactions by ``pg_stat_database.xact_commit``.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the throwaway server of the tests

from postgres_server import PostgresServer  # noqa: E402

RESULTS = Path(os.environ.get("SB3_KL_BENCHMARK_RESULTS", HERE / "results"))
# The expensive dimensions of a trial, fixed (queued) so that every trial costs the same
FIXED_TRIAL = {"n_steps_pow": 7, "batch_size_pow": 6, "n_epochs": 5, "net_arch": "small"}


def git_version() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    modified = git("status", "--porcelain", "--", "sb3_kl", "benchmarks/distributed_throughput.py")
    return commit + ("+modified" if modified else "") if commit else "unknown"


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def measure(server: PostgresServer, n_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.trials`` trials with ``n_workers`` zoo workers on a fresh database; :return: the figures"""
    import optuna
    import psycopg

    database = f"throughput_{n_workers}w_{int(time.time())}"
    url = server.create_database(database)
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    study = optuna.create_study(study_name="throughput", storage=url, direction="maximize")
    for _ in range(args.trials):
        study.enqueue_trial(FIXED_TRIAL)
    del study

    def database_counters() -> tuple[int, int]:
        with psycopg.connect(url, autocommit=True) as connection:
            row = connection.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
            statements = connection.execute(
                "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0), "
                "coalesce(sum(calls) FILTER (WHERE query ILIKE '%trial_heartbeats%'), 0) "
                "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchone()
        return int(row[0]), statements

    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("SELECT pg_stat_statements_reset()")
    transactions_before, _ = database_counters()
    command = [
        sys.executable, "-m", "sb3_kl.zoo", "train", "--algo", "klppo", "--env", "CartPole-v1", "-n", str(args.timesteps),
        "-optimize", "--max-total-trials", str(args.trials), "--n-evaluations", "2", "--eval-episodes", "5",
        "--sampler", "random", "--pruner", "none", "--no-optim-plots", "--verbose", "0", "--num-threads", "1",
        "--storage", url, "--study-name", "throughput", "--heartbeat-interval", str(args.heartbeat_interval),
        "-params", "n_envs:2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    load_before = load_average()
    start = time.time()
    workers = [
        subprocess.Popen([*command, "--seed", str(i), "-f", str(server.root / f"logs_{database}_{i}")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n_workers)
    ]  # fmt: skip
    max_connections = 0
    while any(worker.poll() is None for worker in workers):
        with psycopg.connect(url, autocommit=True) as connection:
            row = connection.execute("SELECT numbackends FROM pg_stat_database WHERE datname = current_database()").fetchone()
        max_connections = max(max_connections, int(row[0]) - 1)  # minus this connection
        time.sleep(1.0)
    wall = time.time() - start
    load_after = load_average()
    for worker in workers:
        output = worker.stdout.read() if worker.stdout else ""
        if worker.returncode != 0:
            raise RuntimeError(f"a worker failed ({worker.returncode}):\n{output[-3000:]}")
    transactions_after, (statements, exec_ms, heartbeat_statements) = database_counters()

    study = optuna.load_study(study_name="throughput", storage=url)
    complete = [trial for trial in study.trials if trial.state.name == "COMPLETE"]
    if len(complete) != args.trials:
        raise RuntimeError(f"{len(complete)} complete trials instead of {args.trials}")
    span = max(t.datetime_complete for t in complete) - min(t.datetime_start for t in complete)
    trial_seconds = [(t.datetime_complete - t.datetime_start).total_seconds() for t in complete]
    return dict(
        workers=n_workers,
        trials=len(complete),
        span_seconds=span.total_seconds(),
        wall_seconds=wall,
        trials_per_hour=3600.0 * len(complete) / span.total_seconds(),
        trials_per_hour_with_startup=3600.0 * len(complete) / wall,
        mean_trial_seconds=sum(trial_seconds) / len(trial_seconds),
        statements=int(statements),
        heartbeat_statements=int(heartbeat_statements),
        transactions=transactions_after - transactions_before,
        server_exec_ms=float(exec_ms),
        max_connections=max_connections,
        load_before=load_before,
        load_after=load_after,
    )


def paper_estimate(run: dict[str, Any], server_cores: int, overhead_ms: float, max_connections: int) -> dict[str, float]:
    """
    How many workers one server can feed, from one run's figures: each worker asks the server for
    ``statements_per_trial`` statements per ``trial_seconds``; each statement costs the server its measured
    execution time plus ``overhead_ms`` (parse, plan, protocol, commit: not in pg_stat_statements' execution time).
    """
    per_trial_server_ms = (run["server_exec_ms"] + overhead_ms * run["statements"]) / run["trials"]
    demand_per_worker = per_trial_server_ms / 1000.0 / run["mean_trial_seconds"]  # server-seconds per second
    by_cpu = server_cores / demand_per_worker
    connections_per_worker = max(1.0, run["max_connections"] / run["workers"])
    by_connections = max_connections / connections_per_worker
    return dict(
        per_trial_server_ms=per_trial_server_ms,
        demand_per_worker=demand_per_worker,
        by_cpu=by_cpu,
        connections_per_worker=connections_per_worker,
        by_connections=by_connections,
    )


def write_report(runs: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    one, two = runs[0], runs[1]
    ratio = two["trials_per_hour"] / one["trials_per_hour"]
    ratio_wall = two["trials_per_hour_with_startup"] / one["trials_per_hour_with_startup"]
    lines = [
        "# Distributed tuning on PostgreSQL: throughput and database load",
        "",
        f"Generated by `{command}` at commit `{git_version()}` on a machine with {os.cpu_count()} CPU cores "
        f"(PostgreSQL {args.server_version}, started by the script with its default durability; one torch thread "
        f"per worker). Each run: `python -m sb3_kl.zoo train --algo klppo --env CartPole-v1 -n {args.timesteps} "
        f"-optimize --max-total-trials {args.trials} --heartbeat-interval {args.heartbeat_interval} ...` in every "
        f"worker on a fresh database, the expensive dimensions of every trial fixed ({json.dumps(FIXED_TRIAL)}), "
        "so that all trials cost the same.",
        "",
        "| workers | trials | trials/hour | trials/hour incl. worker start-up | mean trial (s) "
        "| load average before -> after (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['workers']} | {run['trials']} | {run['trials_per_hour']:.0f} | "
            f"{run['trials_per_hour_with_startup']:.0f} | "
            f"{run['mean_trial_seconds']:.1f} | {run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f} |"
        )
    goal = "met" if ratio >= 1.7 else "NOT met"
    lines += [
        "",
        f"**2 workers / 1 worker: {ratio:.2f}x** trials per hour (from the first trial's start to the last one's end in "
        f"the database), {ratio_wall:.2f}x including the workers' start-up; goal >= 1.7x: {goal} on this run.",
        "",
        "Caveat: the load average column is the machine's 1-minute load when each run started and ended. A load "
        "above the core count means other processes were competing for the cores, so the second worker could not "
        "get a core of its own and the ratio says more about the machine's other work than about the workers; "
        "re-run the command on an otherwise idle machine for the figure the goal is about.",
        "",
        "## Database round trips per trial",
        "",
        "| workers | statements / trial | of which heartbeats | transactions / trial | server execution time / trial (ms) | "
        "connections per worker (max seen) |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['workers']} | {run['statements'] / run['trials']:.1f} | "
            f"{run['heartbeat_statements'] / run['trials']:.1f} | "
            f"{run['transactions'] / run['trials']:.1f} | {run['server_exec_ms'] / run['trials']:.2f} | "
            f"{run['max_connections'] / run['workers']:.1f} |"
        )
    lines += [
        "",
        "Statements include each worker's start-up (schema check, study load) spread over its trials, the cap checks "
        "and the heartbeats (one statement per heartbeat interval of a running trial, so their share grows with the "
        "trial's length). Optuna reads the study's trials before each new trial, so the cost of a statement grows "
        "slowly with the number of trials in the study.",
        "",
        "## Paper estimate: workers per PostgreSQL server",
        "",
    ]
    for cores in (2, 8):
        est = paper_estimate(two, cores, args.overhead_ms, args.max_connections)
        lines.append(
            f"- A server with {cores} cores: each trial costs the server {est['per_trial_server_ms']:.1f} ms "
            f"(measured execution time + {args.overhead_ms} ms per statement for parsing, planning, protocol and commit), "
            f"i.e. {1000 * est['demand_per_worker']:.2f} ms of server time per second of a worker running trials of "
            f"{two['mean_trial_seconds']:.1f} s; CPU bound: about {est['by_cpu']:,.0f} workers at full server load."
        )
    est = paper_estimate(two, 2, args.overhead_ms, args.max_connections)
    lines += [
        f"- Connections bind first: each worker held up to {est['connections_per_worker']:.1f} connections (storage pool, "
        f"heartbeat thread, advisory lock), so PostgreSQL's default `max_connections={args.max_connections}` admits about "
        f"{est['by_connections']:.0f} workers; beyond that raise `max_connections` or put PgBouncer (session pooling: the "
        "advisory locks are per session) in front.",
        "- Longer trials (real budgets are 10-1000x this benchmark's) divide the server time per second accordingly: the "
        "database is not what limits a tuning run at these scales; the connection count is.",
        "",
    ]
    text = "\n".join(lines)
    (RESULTS / "distributed.md").write_text(text)
    (RESULTS / "distributed_runs.json").write_text(json.dumps(runs, indent=1))
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8, help="trials per run (the --max-total-trials of the workers)")
    parser.add_argument("--timesteps", type=int, default=8192, help="environment steps per trial")
    parser.add_argument("--heartbeat-interval", type=int, default=10)
    parser.add_argument("--overhead-ms", type=float, default=0.1, help="assumed server cost per statement beyond execution")
    parser.add_argument("--max-connections", type=int, default=100, help="server's max_connections for the estimate")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python benchmarks/distributed_throughput.py", *given])
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
    print(write_report(runs, args, command))


if __name__ == "__main__":
    main()
