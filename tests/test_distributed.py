"""
Distributed tuning and the distributed learning grid on a real PostgreSQL server (``postgres_server`` fixture in
``conftest.py``; skipped with the install command where the server binaries or the driver are missing).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_ENV = {
    **os.environ,
    "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    "OMP_NUM_THREADS": "1",
}
# Optuna parameters fixed so that a trial stays cheap (64 steps x 2 envs, 1 epoch, [64] network), as in test_zoo.py
CHEAP_TRIAL = {"n_steps_pow": 6, "batch_size_pow": 6, "n_epochs": 1, "net_arch": "tiny"}
ZOO_OPTIMIZE = [
    "--algo", "klppo", "--env", "CartPole-v1", "-optimize", "--n-evaluations", "1", "--eval-episodes", "2",
    "--sampler", "random", "--pruner", "none", "--no-optim-plots", "--verbose", "0", "--num-threads", "1",
]  # fmt: skip

pytest.importorskip("optuna")

# A worker of the schema-race test: the code path of `python -m sb3_kl.zoo train -optimize --storage postgresql://...`
# after argument parsing (open_storage -> load_or_create_study -> the capped optimize loop), with a one-line objective
# instead of a training run, and the module loaded from its file so that the process starts in a second (no torch)
RACE_WORKER = """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("distributed", {path!r})
    distributed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(distributed)
    url, cap = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()  # every worker reaches the empty database at the same moment
    storage = distributed.open_storage(url, distributed.HeartbeatSettings(interval=1, grace_period=8))
    study = distributed.load_or_create_study(storage, "race", "maximize", study_class=distributed.DistributedStudy)
    study.max_total_trials = cap
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0))
"""


def _states(study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trial in study.trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


@pytest.mark.slow  # four worker interpreters at once: ~90 s of CPU
def test_four_workers_start_together_on_empty_databases(postgres_server):
    import optuna

    code = textwrap.dedent(RACE_WORKER.format(path=str(ROOT / "sb3_kl" / "zoo" / "distributed.py")))
    for attempt in range(5):
        url = postgres_server.create_database(f"race{attempt}")
        workers = [
            subprocess.Popen([sys.executable, "-c", code, url, "6"], env=SUBPROCESS_ENV, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(4)
        ]  # fmt: skip
        for worker in workers:  # all imported and waiting: release them together
            assert worker.stdout.readline().strip() == "ready", worker.communicate(timeout=60)[0]
        for worker in workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
        assert [worker.returncode for worker in workers] == [0, 0, 0, 0], (attempt, outputs)
        study = optuna.load_study(study_name="race", storage=url)
        # every requested trial complete, and exactly the cap: no worker overshot it
        assert _states(study) == {"COMPLETE": 6}, attempt
        import psycopg

        with psycopg.connect(url) as connection:  # the schema was created once, by one worker
            for table in ("alembic_version", "version_info"):
                assert connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 1, table


def _wait_for(condition, timeout: float, what: str, poll: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def _running_trial_of(url: str, study_name: str, workers: list[subprocess.Popen]):
    """:return: (trial, worker process) of a running trial of one of ``workers``, or None"""
    import optuna

    by_pid = {str(worker.pid): worker for worker in workers}
    for trial in optuna.load_study(study_name=study_name, storage=url).trials:
        pid = trial.user_attrs.get("worker", ":").rsplit(":", 1)[1]
        if trial.state.name == "RUNNING" and pid in by_pid:
            return trial, by_pid[pid]
    return None


@pytest.mark.slow  # worker interpreters and a heartbeat's grace period: ~25 s of CPU, ~35 s
def test_killed_worker_trial_is_failed_and_retried(postgres_server, tmp_path):
    import optuna
    import yaml

    url = postgres_server.create_database("killed")
    n_trials = 6
    study = optuna.create_study(study_name="kill", storage=url, direction="maximize")
    for _ in range(n_trials):
        study.enqueue_trial(CHEAP_TRIAL)
    command = [
        sys.executable, "-m", "sb3_kl.zoo", "train", *ZOO_OPTIMIZE, "-n", "1536", "--storage", url, "--study-name", "kill",
        "--max-total-trials", str(n_trials), "--heartbeat-interval", "1", "--heartbeat-grace-period", "8",
        "-params", "n_envs:2", "policy_kwargs:dict(net_arch=[16])",
    ]  # fmt: skip
    workers = [
        subprocess.Popen([*command, "--seed", str(seed), "-f", str(tmp_path / f"worker{seed}")], env=SUBPROCESS_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed in range(3)
    ]  # fmt: skip
    try:
        # kill whichever worker is first seen running a trial, in the middle of it
        running, victim = _wait_for(lambda: _running_trial_of(url, "kill", workers), 180, "a worker to run a trial")
        time.sleep(0.5)  # well inside the trial (a trial takes seconds)
        still = _running_trial_of(url, "kill", [victim])
        assert still is not None and still[0].number == running.number, "the trial ended before the kill: lengthen it"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        survivors = [worker for worker in workers if worker is not victim]
        outputs = [worker.communicate(timeout=300)[0] for worker in survivors]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    assert victim.returncode == -signal.SIGKILL
    assert all(worker.returncode == 0 for worker in survivors), outputs

    study = optuna.load_study(study_name="kill", storage=url)
    trials = study.trials
    # every requested trial complete, the killed one failed, and one retry: nothing run twice, nothing lost
    assert _states(study) == {"COMPLETE": n_trials, "FAIL": 1}
    failed = next(trial for trial in trials if trial.state.name == "FAIL")
    assert failed.number == running.number
    retries = [trial for trial in trials if "failed_trial" in trial.system_attrs]
    assert len(retries) == 1 and retries[0].system_attrs["failed_trial"] == failed.number
    assert retries[0].state.name == "COMPLETE" and retries[0].params == failed.params
    assert not retries[0].user_attrs["worker"].endswith(f":{victim.pid}")
    assert all(trial.params[key] == value for trial in trials for key, value in CHEAP_TRIAL.items())  # the 6 queued

    # the best trial as a zoo config, trained through the zoo
    from sb3_kl.zoo.__main__ import main as zoo_main

    config = tmp_path / "best.yml"
    zoo_main(["export", "--algo", "klppo", "--env", "CartPole-v1", "--storage", url, "--study-name", "kill",
              "-o", str(config)])  # fmt: skip
    entry = yaml.safe_load(config.read_text())["CartPole-v1"]
    best = study.best_trial.params
    assert entry["target_kl"] == pytest.approx(best["target_kl"]) and entry["kl_estimator"] == best["kl_estimator"]
    zoo_main(["train", "--algo", "klppo", "--env", "CartPole-v1", "-conf", str(config), "-n", "128", "--seed", "5",
              "-f", str(tmp_path / "retrain"), "--eval-freq", "-1", "--verbose", "0", "-params", "n_envs:2"])  # fmt: skip
    from sb3_kl import KLPPO

    model = KLPPO.load(tmp_path / "retrain" / "klppo" / "CartPole-v1_1" / "CartPole-v1.zip")
    assert model.target_kl(1.0) == pytest.approx(best["target_kl"]) and model.n_steps == 2 ** best["n_steps_pow"]
    assert model.kl_settings.estimator == best["kl_estimator"]


@pytest.mark.slow  # worker interpreters and a heartbeat's grace period: ~15 s of CPU, ~25 s
def test_learning_grid_over_two_workers_survives_a_killed_worker(postgres_server, tmp_path, monkeypatch):
    import optuna

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distributed_grid
    import learning_report
    import run_records

    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    url = postgres_server.create_database("grid")
    specs = [
        dict(algo=algo, env="CartPole-v1", seed=seed, lr_mult=1.0, tier="tiny") for algo in ("ppo", "klppo") for seed in (0, 1)
    ]
    study = distributed_grid.open_grid(url, "grid", distributed_grid.HeartbeatSettings(interval=1, grace_period=8))
    assert distributed_grid.enqueue(study, specs) == 4
    assert distributed_grid.enqueue(study, specs) == 0  # a second machine queuing the same grid adds nothing
    env = {**SUBPROCESS_ENV, "SB3_KL_BENCHMARK_RESULTS": str(tmp_path)}
    command = [sys.executable, str(ROOT / "benchmarks" / "distributed_grid.py"), url, "grid", "1", "8"]
    workers = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    try:
        killed, victim = _wait_for(lambda: _running_trial_of(url, "grid", workers), 180, "a worker to take a cell", poll=0.1)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        survivor = next(worker for worker in workers if worker is not victim)
        output = survivor.communicate(timeout=300)[0]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    assert victim.returncode == -signal.SIGKILL and survivor.returncode == 0, output

    trials = optuna.load_study(study_name="grid", storage=url).trials
    complete = [trial for trial in trials if trial.state.name == "COMPLETE"]
    # every cell complete exactly once; the killed worker's cell failed and was re-run by the other worker
    assert sorted(trial.user_attrs["cell_key"] for trial in complete) == sorted(map(distributed_grid.cell_key, specs))
    assert [trial.number for trial in trials if trial.state.name == "FAIL"] == [killed.number]
    retry = next(trial for trial in complete if trial.system_attrs.get("failed_trial") == killed.number)
    assert retry.user_attrs["cell_key"] == killed.user_attrs["cell_key"]
    # the surviving worker appended each record once; collecting again appends nothing
    records = run_records.read_folder(tmp_path / "runs" / "tiny")
    lines = (tmp_path / "runs" / "tiny" / run_records.RECORDS_FILE).read_text().splitlines()
    assert len(lines) == 4 and [run_records.record_key(r) for r in records] == sorted(
        run_records.record_key(spec) for spec in specs
    )
    assert output.count("recorded ") == 4
    assert distributed_grid.collect(optuna.load_study(study_name="grid", storage=url), run_records.record_folder) == []
    assert {trial.number for trial in complete} == {record["grid_trial"] for record in records}
    assert "| CartPole-v1 | 1,024 |" in learning_report.report(
        "tiny"
    )  # the report comes from the records, as without a database


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the flag and the fix, no study left behind


def _zoo_start_error(storage: str, study_name: str, tmp_path: Path) -> str:
    """Start a zoo search on ``storage`` in this process; :return: the message it stopped with"""
    pytest.importorskip("rl_zoo3")
    from sb3_kl.zoo.__main__ import main as zoo_main

    with pytest.raises(SystemExit) as stopped:
        zoo_main(["train", *ZOO_OPTIMIZE, "-n", "256", "--n-trials", "1", "--storage", storage, "--study-name", study_name,
                  "-f", str(tmp_path)])  # fmt: skip
    message = str(stopped.value.code)
    assert "\n" not in message and message.startswith("sb3_kl.zoo train: error: "), message
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []  # checked before the zoo writes its logs
    return message


def test_unreachable_database_is_one_line(tmp_path):
    pytest.importorskip("psycopg")
    sys.path.insert(0, str(ROOT / "tests"))
    from postgres_server import free_port

    url = f"postgresql://tuner:secret@127.0.0.1:{free_port()}/tuning"
    message = _zoo_start_error(url, "s", tmp_path)
    assert "--storage" in message and "cannot connect" in message and "Start the server" in message
    assert "secret" not in message  # the password is never printed


def test_missing_driver_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if the postgres extra were not installed
    message = _zoo_start_error("postgresql://tuner:secret@127.0.0.1:5/tuning", "s", tmp_path)
    assert "--storage" in message and 'pip install -e ".[postgres]"' in message


@pytest.mark.parametrize(
    "storage, expected",
    [
        ("postgres://tuner:secret@127.0.0.1:5/tuning", "postgresql://, not postgres://"),
        ("postgres+psycopg://tuner:secret@127.0.0.1:5/tuning", "postgresql://, not postgres://"),
        ("sqlite:////nonexistent/folder/study.db", "folder /nonexistent/folder does not exist"),
        ("mysql://tuner:secret@127.0.0.1:5/tuning", "pip install mysqlclient"),  # the package of the MySQLdb module
    ],
)
def test_unusable_storage_url_names_the_fix(storage, expected, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # as on a machine without the MySQL driver
    message = _zoo_start_error(storage, "s", tmp_path)
    assert "--storage" in message and expected in message and "secret" not in message


def test_wrong_password_is_one_line_and_creates_nothing(postgres_server, tmp_path):
    import optuna

    postgres_server.create_database("password")
    message = _zoo_start_error(postgres_server.url("password", password="wrong"), "s", tmp_path)
    assert "--storage" in message and "wrong or missing password" in message and "wrong" not in message.split("(")[0]
    assert optuna.study.get_all_study_names(storage=postgres_server.url("password")) == []


def test_missing_database_is_one_line(postgres_server, tmp_path):
    message = _zoo_start_error(postgres_server.url("nosuchdb"), "s", tmp_path)
    assert "--storage" in message and "'nosuchdb' does not exist" in message and "createdb nosuchdb" in message


def test_study_with_other_direction_is_one_line_and_untouched(postgres_server, tmp_path):
    import optuna

    url = postgres_server.create_database("direction")
    optuna.create_study(study_name="taken", storage=url, direction="minimize")
    message = _zoo_start_error(url, "taken", tmp_path)
    assert "--study-name 'taken'" in message and "direction minimize" in message and "another --study-name" in message
    summaries = optuna.study.get_all_study_summaries(storage=url)
    assert [(s.study_name, s.direction.name, s.n_trials) for s in summaries] == [("taken", "MINIMIZE", 0)]


def test_heartbeat_flags_are_checked():
    pytest.importorskip("rl_zoo3")
    from sb3_kl.zoo.train import split_heartbeat_flags

    settings, rest = split_heartbeat_flags(["--algo", "klppo", "--heartbeat-interval", "5", "--max-retry", "1", "-optimize"])
    assert (settings.interval, settings.grace_period, settings.max_retry) == (5, None, 1)
    assert rest == ["--algo", "klppo", "-optimize"]
    assert not split_heartbeat_flags(["--heartbeat-interval", "0"])[0].enabled
    for bad in (["--heartbeat-interval", "-1"], ["--heartbeat-interval", "10", "--heartbeat-grace-period", "10"]):
        with pytest.raises(SystemExit):
            split_heartbeat_flags(bad)
    # without a heartbeat a dead worker's trial stays RUNNING and a trial cap would wait on it forever
    for cap in (["--max-total-trials", "4"], ["--max-total-trials=4"]):
        with pytest.raises(SystemExit):
            split_heartbeat_flags(["--heartbeat-interval", "0", *cap])
    assert split_heartbeat_flags(["--heartbeat-interval", "5", "--max-total-trials", "4"])[1] == ["--max-total-trials", "4"]


def test_only_database_urls_take_the_distributed_path():
    pytest.importorskip("rl_zoo3")
    from sb3_kl.zoo.distributed import is_database_url, redact

    assert is_database_url("postgresql://u:p@h/d") and is_database_url("sqlite:///study.db")
    # journal files and no storage stay on the zoo's own code, unchanged
    assert not is_database_url("logs/study.log") and not is_database_url(None)
    assert redact("postgresql://tuner:secret@db:5432/tuning") == "postgresql://tuner:***@db:5432/tuning"


def test_learning_grid_remakes_cells_on_force_and_stale(postgres_server, tmp_path, monkeypatch):
    """
    A grid run with --force re-queues cells the study holds complete and replaces their record files; with --stale
    only the cells without a record of this commit, and a second --stale run finds nothing left (it resumes).
    """
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distributed_grid
    import run_records
    import learning

    monkeypatch.setattr(run_records, "RESULTS", tmp_path)
    url = postgres_server.create_database("remake")
    heartbeat = distributed_grid.HeartbeatSettings(interval=None)
    specs = [dict(algo="klppo", env="CartPole-v1", seed=seed, lr_mult=1.0, tier="tiny") for seed in (0, 1)]
    made: list[str] = []

    def grid_run(version: str, cells: list[dict], **kwargs) -> list[str]:
        def run_cell(spec: dict) -> dict:
            made.append(f"{spec['seed']}@{version}")
            return dict(spec, eval_mean=1.0, code_version=version)

        study = distributed_grid.open_grid(url, "remake", heartbeat)
        first = len(study.get_trials(deepcopy=False))
        distributed_grid.enqueue(study, cells, **kwargs)
        distributed_grid.work(study, run_cell, log=lambda message: None)
        return distributed_grid.collect(study, run_records.record_folder, replace_from=first)

    def versions() -> list[str]:
        return [
            run_records.grid_record(**{k: spec[k] for k in ("tier", "algo", "lr_mult", "seed")}, env_id=spec["env"])[
                "code_version"
            ]
            for spec in specs
        ]

    assert len(grid_run("a", specs)) == 2 and versions() == ["a", "a"]
    assert grid_run("b", specs) == [] and versions() == ["a", "a"]  # nothing to do: the study has both cells
    assert len(grid_run("b", specs[1:], force=True)) == 1 and versions() == ["a", "b"]  # made again, file replaced
    made.clear()

    def is_current(record: dict) -> bool:
        return learning.record_is_current(record, "b", stale=True)

    # --stale at commit b: seed 0 has only a record of commit a in the study; seed 1 has one of b
    assert len(grid_run("b", specs, is_current=is_current)) == 1 and made == ["0@b"] and versions() == ["b", "b"]
    assert grid_run("b", specs, is_current=is_current) == [] and made == ["0@b"]  # resumes: nothing left
