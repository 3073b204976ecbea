"""
Distributed Optuna studies on a database server (PostgreSQL, also MySQL and SQLite): N workers of
``python -m sb3_kl.zoo train ... -optimize --storage postgresql://... --study-name NAME`` share one study.

What this module adds to the zoo's ``-optimize`` for database URLs (``dialect://...``; journal files and
no storage are left to the zoo unchanged):

- **One storage per worker, built with Optuna's heartbeat**: a worker records a heartbeat every
  ``heartbeat_interval`` seconds while it runs a trial; a trial whose worker stopped beating for
  ``grace_period`` seconds (killed, machine lost) is marked ``FAIL`` by the next worker that looks at the study, and
  re-queued with the same parameters (Optuna's retry callback, at most ``max_retry`` times).
- **Schema creation without a race**: on PostgreSQL the tables are created under an advisory lock, so N workers
  started at once on an empty database all start (without it some die with ``IntegrityError`` on
  ``pg_type_typname_nsp_index``). On other databases creation is retried on that error.
- **Checked before anything is written**: the driver (the ``postgres`` extra), the connection, the password, and
  an existing study's direction. Each problem is a one-line :class:`StorageError` naming the flag and the fix, and
  no study is created by a start that fails.
- **``--max-total-trials`` counted exactly**: a worker starts a trial only while the study holds fewer than the cap
  in ``COMPLETE``, ``PRUNED``, ``RUNNING`` or ``WAITING`` (re-queued) trials; a failed trial does not count, its
  retry does. The check and the start of the trial happen under an advisory lock (PostgreSQL), so N workers never
  overshoot. When the remaining trials are all running elsewhere, a worker waits (polling every heartbeat
  interval) until they finish or one of them goes stale and is re-queued, so a killed worker's last trial is
  still run.
"""

import contextlib
import functools
import hashlib
import inspect
import os
import socket
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.study import MaxTrialsCallback, StudyDirection
from optuna.trial import FrozenTrial, TrialState
from rl_zoo3 import exp_manager
from rl_zoo3.hyperparams_opt import HYPERPARAMS_CONVERTER

from sb3_kl.common.user_warnings import warn_at_user_frame
from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_SAMPLER, possible_parameter_names, trial_controller
from sb3_kl.zoo.patching import install_patch, is_patched

#: Trial states that count toward ``--max-total-trials``: finished ones, and those that will finish
COUNTED_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
#: Advisory-lock key under which Optuna's tables are created (any 64-bit number, the same in every worker)
SCHEMA_LOCK_KEY = int.from_bytes(hashlib.sha256(b"sb3_kl.zoo: optuna schema").digest()[:8], "big", signed=True)
#: The extra that brings the PostgreSQL driver
POSTGRES_EXTRA = 'pip install -e ".[postgres]" in the sb3-kl checkout (the extra\'s driver: pip install "psycopg[binary]")'
#: The PyPI package of a SQLAlchemy driver whose import name is not its package's name
DRIVER_PACKAGES = {
    "mysqldb": "mysqlclient",  # SQLAlchemy's default MySQL driver (mysql://)
    "pymysql": "PyMySQL",
    "mysqlconnector": "mysql-connector-python",
    "psycopg2": "psycopg2-binary",
    "psycopg": "psycopg[binary]",
    "pg8000": "pg8000",
    "asyncpg": "asyncpg",
}


class StorageError(ValueError):
    """A study storage that cannot be used; the message is one line that names the flag and the fix."""


@dataclass
class HeartbeatSettings:
    """
    Heartbeat of the trials of a database storage (flags ``--heartbeat-interval``, ``--heartbeat-grace-period``,
    ``--max-retry`` of ``python -m sb3_kl.zoo train``).

    :param interval: Seconds between two heartbeats of a running trial; 0 or None turns the heartbeat (and the
        retry of killed workers' trials) off
    :param grace_period: Seconds without a heartbeat after which a running trial is failed and retried
        (None: Optuna's default, twice the interval)
    :param max_retry: How many times one trial is re-queued after its worker died (None: without limit)
    """

    interval: int | None = 60
    grace_period: int | None = None
    max_retry: int | None = 3

    def __post_init__(self) -> None:
        for name, value in (("interval", self.interval), ("grace_period", self.grace_period)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"`{name}` must be a non-negative integer number of seconds, got {value!r}.")
        if self.max_retry is not None and (not isinstance(self.max_retry, int) or self.max_retry < 0):
            raise ValueError(f"`max_retry` must be a non-negative integer or None, got {self.max_retry!r}.")
        if self.grace_period is not None and self.interval and self.grace_period <= self.interval:
            raise ValueError(
                f"`grace_period`={self.grace_period} must exceed the heartbeat interval ({self.interval} s), "
                "or every trial is failed between two heartbeats; use at least twice the interval."
            )

    @property
    def enabled(self) -> bool:
        """:return: whether trials record heartbeats (and stale trials are retried)"""
        return bool(self.interval)


def is_database_url(storage: Any) -> bool:
    """:return: whether ``storage`` is an SQLAlchemy URL (``postgresql://``, ``mysql://``, ``sqlite:///``...)"""
    return isinstance(storage, str) and "://" in storage and not storage.endswith(".log")


def redact(url: str) -> str:
    """:return: the URL with its password hidden, for messages"""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy understands: say so later, never print a password
        return url.split("@")[-1]


def _retry_callback(max_retry: int | None) -> Callable[[optuna.Study, FrozenTrial], None]:
    # Optuna >= 4.9 renamed RetryFailedTrialCallback to RetryHeartbeatStaleTrialCallback
    callback_class = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if callback_class is None:  # pragma: no cover - older Optuna
        callback_class = optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return callback_class(max_retry=max_retry)


def _heartbeat_kwargs(heartbeat: HeartbeatSettings) -> dict[str, Any]:
    if not heartbeat.enabled:
        return {}
    kwargs: dict[str, Any] = dict(heartbeat_interval=heartbeat.interval, grace_period=heartbeat.grace_period)
    parameters = inspect.signature(RDBStorage.__init__).parameters
    name = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in parameters else "failed_trial_callback"
    kwargs[name] = _retry_callback(heartbeat.max_retry)
    return kwargs


def _explain_connection_error(url: str, error: Exception) -> StorageError:
    """Turn a driver's connection error into a one-line message that names ``--storage`` and the fix."""
    from sqlalchemy.engine import make_url

    text = str(getattr(error, "orig", None) or error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    lowered = " ".join(text).lower()
    shown = redact(url)
    try:
        parsed = make_url(url)
        user, database, host = parsed.username, parsed.database, f"{parsed.host or 'localhost'}:{parsed.port or ''}"
    except Exception:
        user, database, host = None, None, "?"
    if "password authentication failed" in lowered or "access denied" in lowered or "no password supplied" in lowered:
        return StorageError(
            f"--storage {shown}: the server refused user {user!r} (wrong or missing password). "
            "Fix the user and password in --storage (dialect://USER:PASSWORD@HOST:PORT/DATABASE)."
        )
    if "does not exist" in lowered and database and f'"{database}"' in " ".join(text):
        return StorageError(
            f"--storage {shown}: database {database!r} does not exist on the server. "
            f"Create it first (PostgreSQL: createdb {database}) or name an existing database in --storage."
        )
    return StorageError(
        f"--storage {shown}: cannot connect to the database server at {host} ({first}). "
        "Start the server, or fix the host and port in --storage."
    )


@contextlib.contextmanager
def advisory_lock(engine: Any, key: int) -> Iterator[Callable[[], None]]:
    """
    Hold PostgreSQL's session-level advisory lock ``key`` (other databases: a lock of this process only).
    The lock is released on exit, or earlier by calling the yielded function; a killed process loses its
    connection and with it the lock.

    :param engine: SQLAlchemy engine of the storage
    :param key: 64-bit lock key
    """
    if engine.dialect.name != "postgresql":
        lock = _PROCESS_LOCKS.setdefault(key, threading.Lock())
        lock.acquire()
        released = threading.Event()

        def release_local() -> None:
            if not released.is_set():
                released.set()
                lock.release()

        try:
            yield release_local
        finally:
            release_local()
        return

    from sqlalchemy import text

    with engine.connect() as connection:
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
        connection.commit()
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                connection.commit()

        try:
            yield release
        finally:
            release()


_PROCESS_LOCKS: dict[int, threading.Lock] = {}


def _serialize_sqlite_transactions(engine: Any) -> None:
    """
    Make every transaction on an SQLite ``engine`` start with ``BEGIN IMMEDIATE``. Optuna hands a waiting (enqueued
    or re-queued) trial to one worker by reading its state and setting it to RUNNING under ``SELECT ... FOR UPDATE``,
    which SQLite ignores: two workers could both read WAITING and run the same trial (the second then fails with
    "Cannot tell a COMPLETE trial"). With the write lock taken at the start of the transaction the read and the
    write are one step across processes (SQLAlchemy's documented recipe for pysqlite's transactions).

    :param engine: The storage's SQLAlchemy engine
    """
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # pysqlite would otherwise BEGIN (deferred) on its own

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners (table creation) are replaced


def _check_sqlite_file(url: str) -> None:
    """
    Check, without creating it, that an SQLite URL's file can be opened or created: its folder exists and the file
    (or, when it does not exist yet, the folder) is writable.

    :raises StorageError: otherwise
    """
    from sqlalchemy.engine import make_url

    path = make_url(url).database
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if os.path.exists(path):
        usable, problem = os.access(path, os.R_OK | os.W_OK), "is not readable and writable"
    elif not os.path.isdir(folder):
        usable, problem = False, f"cannot be created: its folder {folder} does not exist"
    else:
        usable, problem = os.access(folder, os.W_OK), f"cannot be created: its folder {folder} is not writable"
    if not usable:
        raise StorageError(
            f"--storage {redact(url)}: the SQLite database file {path} {problem}. Fix the path "
            "(sqlite:///relative/path.db, sqlite:////absolute/path.db)."
        )


def check_storage(url: str) -> tuple[str, dict[str, Any]]:
    """
    Check that a database URL can be used, without creating anything: the URL, its driver, and for a server the
    connection and the credentials, for SQLite that the file can be opened or created.

    :param url: SQLAlchemy URL (the value of ``--storage``)
    :return: the URL's dialect and the keyword arguments of SQLAlchemy's ``create_engine`` to use with it
    :raises StorageError: malformed URL, missing driver, unreachable server, refused credentials, missing database
    """
    import sqlalchemy
    from sqlalchemy.engine import make_url

    # postgres:// (Heroku's and libpq's spelling) is not SQLAlchemy's name for the dialect, with or without a driver
    postgres_scheme = url.split("://", 1)[0].split("+")[0] == "postgres"
    scheme_hint = " SQLAlchemy names PostgreSQL postgresql://, not postgres://." if postgres_scheme else ""
    try:
        dialect, driver = make_url(url).get_backend_name(), make_url(url).get_driver_name()
    except sqlalchemy.exc.ArgumentError as e:
        raise StorageError(f"--storage {url.split('@')[-1]!r} is not a database URL ({e}).{scheme_hint}") from e
    engine_kwargs: dict[str, Any] = {}
    if dialect == "postgresql":
        # fail in seconds, not after the operating system's TCP timeout, when the host does not answer
        engine_kwargs["connect_args"] = {"connect_timeout": 10}
    elif dialect == "sqlite":
        # workers queue for SQLite's write lock (BEGIN IMMEDIATE, below) instead of failing after pysqlite's 5 s
        engine_kwargs["connect_args"] = {"timeout": 60}
    try:
        engine = sqlalchemy.create_engine(url, **engine_kwargs)
    except ImportError as e:
        if dialect == "postgresql" and driver in ("", "psycopg"):  # SQLAlchemy 2.1: bare postgresql:// is psycopg 3
            fix = POSTGRES_EXTRA
        else:
            name = driver or dialect  # for a bare dialect:// the driver SQLAlchemy picks, e.g. mysqldb for mysql://
            fix = f"install the {name} driver that the URL names (pip install {DRIVER_PACKAGES.get(name, name)})"
        raise StorageError(f"--storage {redact(url)}: the database driver is not installed ({e}). Fix: {fix}.") from e
    except sqlalchemy.exc.ArgumentError as e:  # e.g. sqlite://study.db (a host where the path should be)
        sqlite_hint = " SQLite takes sqlite:///relative.db or sqlite:////absolute/path.db." if dialect == "sqlite" else ""
        raise StorageError(f"--storage {redact(url)} is not a valid {dialect} URL ({e}).{sqlite_hint or scheme_hint}") from e
    if dialect == "sqlite":
        _check_sqlite_file(url)
        return dialect, engine_kwargs
    try:
        with engine.connect():
            pass
    except sqlalchemy.exc.DBAPIError as e:
        raise _explain_connection_error(url, e) from e
    finally:
        engine.dispose()
    return dialect, engine_kwargs


def open_storage(url: str, heartbeat: HeartbeatSettings | None = None) -> RDBStorage:
    """
    Build Optuna's ``RDBStorage`` for ``url`` with the heartbeat and retry of ``heartbeat``, after checking the
    driver, the connection and the credentials (:func:`check_storage`); create Optuna's tables if the database is
    empty, safely when several workers do it at the same moment.

    :param url: SQLAlchemy URL (the value of ``--storage``)
    :param heartbeat: Heartbeat settings (default: :class:`HeartbeatSettings` ``()``)
    :return: The storage
    :raises StorageError: malformed URL, missing driver, unreachable server, refused credentials, missing database
    """
    import sqlalchemy

    heartbeat = heartbeat or HeartbeatSettings()
    dialect, engine_kwargs = check_storage(url)
    kwargs = dict(url=url, engine_kwargs=engine_kwargs, **_heartbeat_kwargs(heartbeat))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if dialect == "postgresql":
            # Optuna creates its tables (and types, and the alembic stamp) with CREATE statements that race when N
            # workers start on an empty database; one worker at a time creates or finds them
            engine = sqlalchemy.create_engine(url, **engine_kwargs)
            try:
                with advisory_lock(engine, SCHEMA_LOCK_KEY):
                    return RDBStorage(**kwargs)
            finally:
                engine.dispose()
        for attempt in range(5):
            try:
                storage = RDBStorage(**kwargs)
                if dialect == "sqlite":
                    _serialize_sqlite_transactions(storage.engine)
                return storage
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError):
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def check_study_direction(storage: RDBStorage, study_name: str | None, direction: str = "maximize") -> bool:
    """
    Check that the study ``study_name``, if the storage holds it, has the single direction ``direction``.

    :param storage: Storage from :func:`open_storage`
    :param study_name: Name (``--study-name``); None: a new study, nothing to check
    :param direction: ``"maximize"`` (the zoo's) or ``"minimize"``
    :return: whether the storage holds the study
    :raises StorageError: a study of that name exists with another direction (or is multi-objective)
    """
    existing = {summary.study_name: summary for summary in storage.get_all_studies()} if study_name else {}
    if study_name not in existing:
        return False
    directions = existing[study_name].directions
    if list(directions) != [StudyDirection[direction.upper()]]:
        found = "/".join(d.name.lower() for d in directions)
        raise StorageError(
            f"--study-name {study_name!r} already exists in --storage {redact(storage.url)} with direction {found}, "
            f"but this run would {direction} it. Use another --study-name, or delete the old study: "
            f"optuna delete-study --storage URL --study-name {study_name}."
        )
    return True


def load_or_create_study(
    storage: RDBStorage,
    study_name: str | None,
    direction: str = "maximize",
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    study_class: type[optuna.Study] = optuna.Study,
) -> optuna.Study:
    """
    Load the study ``study_name`` (checking its direction) or create it; then fail the stale trials of workers
    that died, so that they are re-queued before this worker counts the trials.

    :param storage: Storage from :func:`open_storage`
    :param study_name: Name (``--study-name``); None creates a study with a generated name, as Optuna does
    :param direction: ``"maximize"`` (the zoo's) or ``"minimize"``
    :param sampler: Sampler of this worker
    :param pruner: Pruner of this worker
    :param study_class: ``optuna.Study`` or a subclass to instantiate
    :return: The study
    :raises StorageError: a study of that name exists with another direction (or is multi-objective)
    """
    wanted = StudyDirection[direction.upper()]
    if check_study_direction(storage, study_name, direction):
        study_id = storage.get_study_id_from_name(study_name)
    else:
        try:
            study_id = storage.create_new_study([wanted], study_name)
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it in between
            return load_or_create_study(storage, study_name, direction, sampler, pruner, study_class)
    study = study_class(study_name=storage.get_study_name_from_id(study_id), storage=storage, sampler=sampler, pruner=pruner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return study


def count_trials(study: optuna.Study) -> dict[TrialState, int]:
    """:return: number of trials of the study in each state"""
    counts = dict.fromkeys(TrialState, 0)
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state] += 1
    return counts


def study_lock_key(study: optuna.Study) -> int:
    """:return: the advisory-lock key of a study (derived from its name)"""
    return int.from_bytes(hashlib.sha256(f"sb3_kl.zoo study {study.study_name}".encode()).digest()[:8], "big", signed=True)


def worker_name() -> str:
    """:return: ``host:pid`` of this process, recorded on each trial it runs (user attribute ``worker``)"""
    return f"{socket.gethostname()}:{os.getpid()}"


def optimize_with_cap(
    study: optuna.Study,
    func: Callable[[optuna.Trial], float],
    max_total_trials: int | None,
    callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = (),
    gc_after_trial: bool = False,
    poll_seconds: float | None = None,
    catch: tuple[type[Exception], ...] = (),
) -> int:
    """
    Run trials of ``study`` in this worker until the study holds ``max_total_trials`` finished (``COMPLETE`` or
    ``PRUNED``) trials, counting the trials of every worker (see the module docstring).

    With ``max_total_trials=None`` the study is a work queue: the worker only runs the trials waiting in it
    (``study.enqueue_trial``, and the retries of killed workers' trials), never creates one, and returns when none
    is waiting or running.

    :param study: Study on a storage from :func:`open_storage`
    :param func: Objective
    :param max_total_trials: The cap (``--max-total-trials``), or None for a work queue
    :param callbacks: Called after each trial of this worker, as in ``study.optimize``
    :param gc_after_trial: As in ``study.optimize``
    :param poll_seconds: How often a worker that waits for the other workers' trials looks at the study
        (default: the heartbeat interval, or 5 s without heartbeat)
    :param catch: Exceptions of ``func`` that fail the trial without stopping the worker, as in ``study.optimize``
    :return: Number of trials this worker ran
    """
    storage = study._storage
    storage = getattr(storage, "_backend", storage)  # Optuna wraps RDBStorage in a cache
    engine = storage.engine
    interval = storage.get_heartbeat_interval() if hasattr(storage, "get_heartbeat_interval") else None
    poll = poll_seconds if poll_seconds is not None else float(interval or 5)
    key = study_lock_key(study)
    ran = 0
    while True:
        with advisory_lock(engine, key) as release:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
            counts = count_trials(study)
            if max_total_trials is None:  # work queue
                if counts[TrialState.WAITING] == 0 and counts[TrialState.RUNNING] == 0:
                    return ran
                start = counts[TrialState.WAITING] > 0
            else:
                if counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] >= max_total_trials:
                    return ran
                total = sum(counts[state] for state in COUNTED_STATES)
                start = counts[TrialState.WAITING] > 0 or total < max_total_trials
            if start:

                current: list[optuna.Trial] = []
                objective = functools.partial(_run_released, func, release, current)
                # ask() inside pops a re-queued trial first, or creates a new one, while this worker holds the lock
                try:
                    optuna.Study.optimize(
                        study, objective, n_trials=1, callbacks=list(callbacks), gc_after_trial=gc_after_trial, catch=catch
                    )
                except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
                    if not current or not _failed_as_stale(study, current[0]):
                        raise
                    warn_at_user_frame(
                        f"Trial {current[0].number} was failed (no heartbeat for the grace period) while this worker "
                        "was running it, and re-queued for another worker: its result is dropped. If this worker was "
                        "only slow, raise --heartbeat-grace-period."
                    )
                ran += 1
                continue
        # the remaining trials run in other workers: wait until they finish or one is found stale and re-queued
        time.sleep(poll)


def _run_released(
    func: Callable[[optuna.Trial], float], release: Callable[[], None], started: list[optuna.Trial], trial: optuna.Trial
) -> float:
    """Objective wrapper of :func:`optimize_with_cap`: release the lock, remember the trial, record the worker, run."""
    release()  # the trial exists (and holds its place in the count): let the next worker decide
    started.append(trial)
    trial.set_user_attr("worker", worker_name())
    return func(trial)


def _failed_as_stale(study: optuna.Study, trial: optuna.Trial) -> bool:
    """:return: whether the trial was failed by another worker (stale heartbeat) before this one could finish it"""
    frozen = study._storage.get_trial(trial._trial_id)
    return frozen.state == TrialState.FAIL


class DistributedStudy(optuna.Study):
    """
    An ``optuna.Study`` whose ``optimize`` honours ``--max-total-trials`` across workers with
    :func:`optimize_with_cap` (and drops the zoo's ``MaxTrialsCallback``, which would stop a worker while a
    re-queued trial waits). Without a cap, ``optimize`` is Optuna's.
    """

    max_total_trials: int | None = None

    def optimize(  # type: ignore[override]
        self,
        func: Callable[[optuna.Trial], float],
        n_trials: int | None = None,
        timeout: float | None = None,
        n_jobs: int = 1,
        catch: Any = (),
        callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
        gc_after_trial: bool = False,
        show_progress_bar: bool = False,
    ) -> None:
        if self.max_total_trials is None:

            def tagged(trial: optuna.Trial) -> float:
                trial.set_user_attr("worker", worker_name())
                return func(trial)

            return super().optimize(tagged, n_trials, timeout, n_jobs, catch, callbacks, gc_after_trial, show_progress_bar)
        callbacks = [callback for callback in callbacks or [] if not isinstance(callback, MaxTrialsCallback)]
        cap = self.max_total_trials
        if n_jobs == 1:
            optimize_with_cap(self, func, cap, callbacks, gc_after_trial)
            return None
        with ThreadPoolExecutor(max_workers=n_jobs) as pool:
            futures = [pool.submit(optimize_with_cap, self, func, cap, callbacks, gc_after_trial) for _ in range(n_jobs)]
            for future in futures:
                future.result()
        return None


def load_study(storage: str, study_name: str) -> optuna.Study:
    """
    :param storage: ``--storage`` value (database URL or journal ``.log`` file)
    :param study_name: ``--study-name``
    :return: The study, read without heartbeat
    :raises StorageError: unusable storage, unknown study
    """
    if is_database_url(storage):
        opened: Any = open_storage(storage, HeartbeatSettings(interval=None))
    elif storage.endswith(".log"):
        opened = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))
    else:
        raise StorageError(f"--storage {storage!r} is neither a database URL nor a journal file (*.log).")
    try:
        return optuna.load_study(study_name=study_name, storage=opened)
    except KeyError as e:
        raise StorageError(
            f"--study-name {study_name!r} is not in --storage {redact(storage)}. "
            "Check the name (optuna studies --storage URL lists them)."
        ) from e


def check_params_match_algo(params: dict[str, Any], trial: str, study_name: str, algo: str) -> None:
    """
    :param params: A trial's raw Optuna parameters (``trial.params``)
    :param trial: Which trial, for the message (``"trial 3"``)
    :param study_name: Its study's name (for the message)
    :param algo: The ``--algo`` it is used for (exported, or reloaded by the zoo's ``--trial-id``)
    :raises StorageError: the trial was not drawn by ``algo``'s sampler (a study tuned for another
        algorithm: its hyperparameters would be refused, or silently missing, when the entry trains)
    """
    if set(params) in possible_parameter_names(algo):
        return
    # the message compares with the closest variant (the KL penalty's samplers draw beta's options as the tuned
    # config's kl_controller uses them)
    expected = min(possible_parameter_names(algo), key=lambda names: len(names ^ set(params)))
    extra, missing = sorted(set(params) - expected), sorted(expected - set(params))
    if extra or missing:
        found = [name for name in HYPERPARAMS_SAMPLER if set(params) in possible_parameter_names(name)]
        raise StorageError(
            f"study {study_name!r} was not tuned for --algo {algo}: its {trial} has "
            + ", ".join(
                part
                for part in (
                    f"parameters {algo}'s sampler does not draw ({', '.join(extra)})" if extra else "",
                    f"none of {', '.join(missing)}" if missing else "",
                )
                if part
            )
            + (f". Pass the --algo it was tuned with ({' or '.join(found)})." if found else ".")
        )


# ----------------------------------------------------------------------------------------------------------------------
# The zoo's ExperimentManager


#: Heartbeat settings of the current ``python -m sb3_kl.zoo train`` (set by :func:`sb3_kl.zoo.train.train`)
CURRENT_HEARTBEAT = HeartbeatSettings()


def _zoo_optuna(manager: Any) -> types.ModuleType:
    """
    A stand-in for the ``optuna`` module as ``rl_zoo3.exp_manager`` sees it during ``hyperparameters_optimization``:
    everything is Optuna's except ``create_study``, which builds the study on a checked storage with heartbeat.
    """
    proxy = types.ModuleType("optuna")
    proxy.__dict__.update({name: getattr(optuna, name) for name in dir(optuna) if not name.startswith("__")})

    def create_study(**kwargs: Any) -> optuna.Study:
        storage = open_storage(kwargs["storage"], CURRENT_HEARTBEAT)
        study = load_or_create_study(
            storage,
            kwargs.get("study_name"),
            kwargs.get("direction") or "minimize",
            kwargs.get("sampler"),
            kwargs.get("pruner"),
            study_class=DistributedStudy,
        )
        assert isinstance(study, DistributedStudy)
        study.max_total_trials = manager.max_total_trials
        return study

    proxy.create_study = create_study  # type: ignore[attr-defined]
    return proxy


class TrialNumber(int):
    """A trial number that is true even when it is 0 (the zoo tests ``--trial-id`` for truth before reloading it)."""

    def __bool__(self) -> bool:
        return True


def patch_experiment_manager() -> None:
    """
    Route the zoo's ``-optimize`` on database URLs through this module (``hyperparameters_optimization``), check the
    storage and the trial number of ``--trial-id`` reloads (``load_trial``), and make ``--trial-id 0`` reload trial 0
    (``__init__``; the zoo took 0 for no trial). Idempotent.
    """
    manager_class = exp_manager.ExperimentManager
    original = manager_class.hyperparameters_optimization
    if is_patched(original):
        return

    def hyperparameters_optimization(self: Any) -> None:
        if not is_database_url(self.storage):
            return original(self)
        saved = exp_manager.optuna
        exp_manager.optuna = _zoo_optuna(self)  # type: ignore[attr-defined]
        try:
            return original(self)
        finally:
            exp_manager.optuna = saved  # type: ignore[attr-defined]

    original_load_trial = manager_class.load_trial

    def load_trial(self: Any, storage: str, study_name: str, trial_id: int | None = None, convert: bool = True) -> Any:
        if is_database_url(storage):
            opened = open_storage(storage, HeartbeatSettings(interval=None))
            if study_name not in {summary.study_name for summary in opened.get_all_studies()}:
                raise StorageError(
                    f"--study-name {study_name!r} is not in --storage {redact(storage)}. "
                    "Check the name (optuna studies --storage URL lists them)."
                )
        if self.algo not in HYPERPARAMS_SAMPLER:  # not an sb3_kl algorithm: the zoo's own reload
            try:
                return original_load_trial(self, storage, study_name, trial_id, convert)
            except IndexError as e:
                raise StorageError(f"--trial-id {trial_id}: study {study_name!r} has no trial with that number.") from e
        # the whole trial, read once: its params and the kl_controller its beta options were drawn for
        study = load_study(storage, study_name)
        try:
            frozen = study.best_trial if trial_id is None else study.trials[trial_id]
        except IndexError as e:
            raise StorageError(f"--trial-id {trial_id}: study {study_name!r} has no trial with that number.") from e
        # a study tuned for another algorithm: its hyperparameters would be refused, or silently missing
        which = "best trial" if trial_id is None else f"trial {trial_id}"
        check_params_match_algo(frozen.params, which, study_name, self.algo)
        if not convert:
            return frozen.params
        hyperparams = HYPERPARAMS_CONVERTER[self.algo](frozen.params)
        controller, _ = trial_controller(frozen.user_attrs)
        if controller is not None:  # re-train with the trial's controller (-params still overrides)
            hyperparams = {**hyperparams, "kl_controller": controller}
        return hyperparams

    original_init = manager_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.trial_id == 0:  # the zoo reloads a trial only when ``self.trial_id`` is true: 0 would be ignored
            self.trial_id = TrialNumber(0)

    for function, name in (
        (hyperparameters_optimization, "hyperparameters_optimization"),
        (load_trial, "load_trial"),
        (__init__, "__init__"),
    ):
        install_patch(manager_class, name, function)
