"""
The learning grid's records: one JSON record per run under ``results/runs/<tier>/`` (``$SB3_KL_BENCHMARK_RESULTS``
to read and write elsewhere), how they are found, read and grouped, and the code and machine that made them.
"""

import json
import os
from pathlib import Path
from typing import Any


HERE = Path(__file__).resolve().parent
#: The main results folder: the grid's records (``runs/<tier>/``), its report, and the side experiments' folders
MAIN_RESULTS = HERE / "results"
RESULTS = Path(os.environ.get("SB3_KL_BENCHMARK_RESULTS", MAIN_RESULTS))


def record_path(tier: str, algo: str, env_id: str, lr_mult: float, seed: int) -> Path:
    return RESULTS / "runs" / tier / f"{algo}__{env_id}__lr{lr_mult:g}__s{seed}.json"


def record_file(record: dict[str, Any]) -> Path:
    """:return: the path of a record's file"""
    return record_path(record["tier"], record["algo"], record["env"], record["lr_mult"], record["seed"])


#: The modules that run a grid cell besides ``learning.py``: a change to one marks the code version ``+modified``
GRID_CODE = ("grid.py", "grid_runs.py", "run_records.py", "measures.py")


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
        commit = git("rev-parse", "--short", "HEAD")
        scripts = scripts or ("settings.py", "learning.py")
        if "learning.py" in scripts:  # the grid's code: the CLI and the modules that run a cell
            scripts = (*scripts, *GRID_CODE)
        modified = git("status", "--porcelain", "--", "../sb3_kl", *scripts)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) if commit else "unknown"


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
    folder = RESULTS / "runs" / tier
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


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
    folder = RESULTS / name
    return group_records([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else [])


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
