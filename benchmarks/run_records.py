"""
The learning grid's records and how they are stored, found, read and grouped, and the code and machine that made them.

Layout: a records folder (the grid's ``results/runs/<tier>/``, and each side experiment's folder) holds one file,
``records.jsonl``: one JSON record per line, one line per finished run, appended as the run finishes (under a file
lock, so the workers of a grid append to it side by side). A run made again appends its new record: the last line of
a run (its cell and seed, :func:`record_name`) is its record. ``$SB3_KL_BENCHMARK_RESULTS`` reads and writes the grid's
records elsewhere.
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The main results folder: the grid's records (``runs/<tier>/``), its report, and the side experiments' folders
MAIN_RESULTS = HERE / "results"
RESULTS = Path(os.environ.get("SB3_KL_BENCHMARK_RESULTS", MAIN_RESULTS))
#: The file of a records folder
RECORDS_FILE = "records.jsonl"


def record_name(algo: str, env_id: str, lr_mult: float, seed: int) -> str:
    """A run's name in its records folder: its cell and seed."""
    return f"{algo}__{env_id}__lr{lr_mult:g}__s{seed}"


def record_key(record: dict[str, Any]) -> str:
    """:return: the :func:`record_name` of a record's run"""
    return record_name(record["algo"], record["env"], record["lr_mult"], record["seed"])


def runs_folder(tier: str) -> Path:
    """The grid's records folder of a tier."""
    return RESULTS / "runs" / tier


#: The lines of each records file read, with the file's modification time and size when it was read
_read: dict[Path, tuple[tuple[int, int], dict[str, str]]] = {}


def _lines(folder: Path) -> dict[str, str]:
    """The JSON line of each run's record in ``folder`` (the last line of a run wins), ordered by run name."""
    path = folder / RECORDS_FILE
    if not path.exists():
        return {}
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    if path in _read and _read[path][0] == stamp:
        return _read[path][1]
    lines: dict[str, str] = {}
    with open(path) as file:
        for line in file:
            if line.strip():
                lines[record_key(json.loads(line))] = line
    # ordered as the files of the records once were (``<name>.json``), so every report sums in the same order
    lines = dict(sorted(lines.items(), key=lambda item: item[0] + ".json"))
    _read[path] = (stamp, lines)
    return lines


def read_folder(folder: Path) -> list[dict[str, Any]]:
    """The records of a records folder, one per run (its last), ordered by run name; none without the folder."""
    return [json.loads(line) for line in _lines(folder).values()]


def find_record(folder: Path, name: str) -> dict[str, Any] | None:
    """The record of the run ``name`` (:func:`record_name`) in a records folder, or None."""
    line = _lines(folder).get(name)
    return json.loads(line) if line is not None else None


def append_record(folder: Path, record: dict[str, Any], unless: Callable[[dict[str, Any] | None], bool] | None = None) -> bool:
    """
    Append a record to a records folder, under an exclusive lock of its file (concurrent writers wait their turn).

    :param unless: Called under the lock with the run's current record (None: none yet): the record is not appended
        when it returns True (a check and an append that no other writer comes between)
    :return: whether the record was appended
    """
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / RECORDS_FILE, "a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        if unless is not None:
            file.seek(0)
            current = None
            for line in file:
                if line.strip() and record_key(json.loads(line)) == record_key(record):
                    current = json.loads(line)
            if unless(current):
                return False
        file.seek(0, os.SEEK_END)
        file.write(json.dumps(record) + "\n")
        file.flush()
    return True


def read_json_list(path: Path) -> list[dict[str, Any]]:
    """:return: the records of a study's JSON list file (empty when it does not exist yet)"""
    text = path.read_text() if path.exists() else ""
    return json.loads(text) if text.strip() else []


def replace_in_json_list(path: Path, record: dict[str, Any], key: Callable[[dict[str, Any]], Any]) -> None:
    """
    Write a finished run into a study's JSON list file, in place of an earlier run with the same ``key``, under an
    exclusive lock of the file (studies running side by side keep each other's runs); the list is kept sorted by key.
    """
    import fcntl

    with open(path, "a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        text = file.read()
        records = [r for r in (json.loads(text) if text.strip() else []) if key(r) != key(record)] + [record]
        records.sort(key=key)
        file.seek(0)
        file.truncate()
        file.write(json.dumps(records, indent=1) + "\n")


def run_in_pool(function: Callable[[Any], str], cells: list[Any], workers: int, one_process_per_run: bool = False) -> None:
    """
    A study's missing runs: ``function`` on each cell in ``workers`` spawned processes, printing the line each returns as
    it finishes (``function`` writes its record itself, so a run cut off loses only itself).

    :param one_process_per_run: A fresh process for each run (for a variant that patches a module of the algorithm)
    """
    import multiprocessing

    options: dict[str, Any] = dict(maxtasksperchild=1) if one_process_per_run else {}
    with multiprocessing.get_context("spawn").Pool(workers, **options) as pool:
        for line in pool.imap_unordered(function, cells):
            print(line, flush=True)


def grid_record(tier: str, algo: str, env_id: str, lr_mult: float, seed: int) -> dict[str, Any] | None:
    """The grid's record of a run, or None."""
    return find_record(runs_folder(tier), record_name(algo, env_id, lr_mult, seed))


def record_folder(record: dict[str, Any]) -> Path:
    """The grid's records folder of a record (that of its tier)."""
    return runs_folder(record["tier"])


def save_record(record: dict[str, Any]) -> Path:
    """Append a run's record to the grid's records of its tier; :return: the records file"""
    append_record(runs_folder(record["tier"]), record)
    return runs_folder(record["tier"]) / RECORDS_FILE


#: The modules that run a grid cell besides ``learning.py``: a change to one marks the code version ``+modified``
GRID_CODE = ("grid.py", "grid_runs.py", "run_records.py", "measures.py")


#: Characters of a commit hash that records and pages name: fixed, since git's own ``--short`` grows with the
#: repository's object count and so differs between clones
SHORT_HASH = 7


def short_commit(full_hash: str) -> str:
    """:return: ``full_hash`` cut to :data:`SHORT_HASH` characters (empty stays empty)"""
    return full_hash.strip()[:SHORT_HASH]


def code_version(*scripts: str) -> str:
    """
    The commit of the sb3-kl checkout that ran, with ``+modified`` when the package or the benchmark code had
    uncommitted changes (results files do not count), or ``"unknown"`` outside a git checkout.

    :param scripts: The benchmark files (names in ``benchmarks/``) whose changes count; default this script's
    """
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = short_commit(git("rev-parse", "HEAD"))
        scripts = scripts or ("settings.py", "learning.py")
        if "learning.py" in scripts:  # the grid's code: the CLI and the modules that run a cell
            scripts = (*scripts, *GRID_CODE)
        modified = git("status", "--porcelain", "--", "../sb3_kl", *scripts)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) if commit else "unknown"


def made_since(record: dict[str, Any], revision: str) -> bool:
    """Whether a record's run was made by ``revision`` or a later commit on its line (git ancestry of its code_version)."""
    import subprocess

    commit = str(record.get("code_version", "")).split("+")[0]
    if not commit or commit == "unknown":
        return False
    check = subprocess.run(["git", "merge-base", "--is-ancestor", revision, commit], cwd=HERE, capture_output=True)
    return check.returncode == 0


def run_environment() -> dict[str, str]:
    """
    What besides the code decides a run's numbers: the CPU model and the versions of the numerical libraries and of
    the simulators. Runs are bit-for-bit repeatable on one machine with one set of versions, not across them (floating
    point rounding differs between CPUs and library builds), so every record names both.

    :return: ``{"cpu": ..., "python": ..., "<package>": "<version>", ...}`` (packages that are not installed are left out)
    """
    import platform
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    described = {"cpu": cpu, "python": platform.python_version()}
    for package in ("torch", "numpy", "stable-baselines3", "sb3-contrib", "gymnasium", "mujoco", "box2d"):
        try:
            described[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return described


def load_records(tier: str) -> list[dict[str, Any]]:
    """The grid's records of a tier."""
    return read_folder(runs_folder(tier))


def trained_steps(record: dict[str, Any]) -> int | None:
    """
    The environment steps a run trained: ``learn(budget)`` ends with the rollout in which the budget is reached, so up
    to one rollout (``n_steps`` x ``n_envs``, which depends on the algorithm's settings) more than ``budget``.

    :param record: a run's record
    :return: its ``trained_steps`` (the model's ``num_timesteps`` after training) where the record stores it; in
        records made before it was stored, the step count of the last point of the learning curve or of the last KL
        update, whichever is later (both are taken after a rollout, the last ones after the last rollout); None when
        the record holds neither
    """
    if "trained_steps" in record:
        return int(record["trained_steps"])
    points = [point[0] for point in record.get("curve", [])[-1:]]
    points += [update["timesteps"] for update in (record.get("kl_updates") or [])[-1:]]
    return int(max(points)) if points else None


def results_folder_label(path: Path | None = None) -> str:
    """
    :param path: a results folder (default: ``RESULTS``, the one the report reads)
    :return: the folder as the reports name it: ``benchmarks/results[/...]`` where it lies in the main results folder
        (``MAIN_RESULTS``), else its absolute path
    """
    folder, main = (path or RESULTS).resolve(), MAIN_RESULTS.resolve()
    if folder == main or main in folder.parents:
        return (Path("benchmarks") / "results" / folder.relative_to(main)).as_posix()
    return folder.as_posix()


def is_side_folder() -> bool:
    """
    Whether ``RESULTS`` (``$SB3_KL_BENCHMARK_RESULTS``) is a side experiment's folder: one inside the main results
    folder, whose records the main report sets beside the grid's. Its report covers only its own records: the
    sections that compare side experiments with the main grid, and the goals, which are stated over the main grid, are
    left to the main report. (A results folder elsewhere is a grid of its own, reported as the main one is.)
    """
    return MAIN_RESULTS.resolve() in RESULTS.resolve().parents


def group_records(records: list[dict[str, Any]]) -> dict[tuple[str, str, float], list[dict[str, Any]]]:
    """Records grouped by cell: (env, algo, lr_mult)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["env"], record["algo"], record["lr_mult"]), []).append(record)
    return groups


def load_folder(name: str) -> dict[tuple[str, str, float], list[dict[str, Any]]]:
    """Records of a side experiment kept in ``results/<name>/``, grouped by cell."""
    return group_records(read_folder(RESULTS / name))


def kl_update_keys(record: dict[str, Any], until: int | None = None) -> list[tuple[int, float, float]]:
    """
    A record's per-update KLs as ``(timesteps, mean, p99)``, those at or before ``until`` steps where given: what two
    records that trained identically share (records made before the monitor measured the normalization's shift do not
    hold it).
    """
    updates = record.get("kl_updates") or []
    return [(u["timesteps"], u["mean"], u["p99"]) for u in updates if until is None or u["timesteps"] <= until]


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """
    Whether two records of one cell and seed trained identically: same evaluation returns and per-update KLs
    (:func:`kl_update_keys`).
    """
    return a["eval_returns"] == b["eval_returns"] and kl_update_keys(a) == kl_update_keys(b)


def distinct_trainings(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    ``records`` without those that trained identically to an earlier one (:func:`same_run`): KLPPO with PPO's clip and
    ClipKLPPO train identically wherever beta stays at the same value in both, and such a training counts once.
    """
    return [r for i, r in enumerate(records) if not any(same_run(r, q) for q in records[:i])]


def seed_key(record: dict[str, Any]) -> tuple[str, str, float, int]:
    """:return: a record's cell and seed, ``(env, algo, lr_mult, seed)``"""
    return record["env"], record["algo"], record["lr_mult"], record["seed"]


def seed_range(records: list[dict[str, Any]]) -> str:
    """:return: the seeds of ``records`` as :func:`seed_list` reads them (``a..b`` where they are consecutive)"""
    seeds = sorted({r["seed"] for r in records})
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1:
        return f"{seeds[0]}..{seeds[-1]}"
    return " ".join(map(str, seeds))


def code_versions(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many records each code version produced (records from before versions were stored: ``unrecorded``)."""
    counts: dict[str, int] = {}
    for record in records:
        version = record.get("code_version", "unrecorded")
        counts[version] = counts.get(version, 0) + 1
    return counts


def describe_run_environment(described: dict[str, str]) -> str:
    """One line for a :func:`run_environment`: the CPU model, then ``<package> <version>``, comma-separated."""
    return ", ".join(version if name == "cpu" else f"{name} {version}" for name, version in described.items())


def provenance(records: list[dict[str, Any]]) -> str:
    """One sentence for a study's page: the commits (``code_version``) and the machines (``run_environment``) of its runs."""
    commits = ", ".join(sorted({f"`{r['code_version']}`" for r in records}))
    machines = "; ".join(sorted({describe_run_environment(r["run_environment"]) for r in records}))
    return f"Commits: {commits}. Machines: {machines}."


def write_study_page(page: Path, lines: list[str], records: list[dict[str, Any]], command: str) -> str:
    """
    Write a study's page: ``lines``, then its provenance (:func:`provenance`) and the command that made its records.

    :return: the page's text
    """
    text = (
        "\n".join(
            [
                *lines,
                "",
                provenance(records) if records else "",
                "",
                f"Made by `{command}` (records: `{page.with_suffix('.json').name}`).",
            ]
        )
        + "\n"
    )
    page.write_text(text)
    return text


def machine(record: dict[str, Any]) -> str | None:
    """:return: the description of the machine and library versions that made a record (None: unrecorded)"""
    described = record.get("run_environment")
    return describe_run_environment(described) if described else None


def run_environments(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many records each machine and set of library versions produced (see :func:`run_environment`)."""
    counts: dict[str, int] = {}
    for record in records:
        key = machine(record) or "*unrecorded* (made before records named their machine and library versions)"
        counts[key] = counts.get(key, 0) + 1
    return counts
