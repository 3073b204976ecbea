"""
Do the learning grid's records still describe the current code? The records of ``benchmarks/results/runs/<tier>/``
were made by many commits; each names its commit, CPU and library versions. A run repeats bit for bit only on one
machine with one set of library versions, so on the machine that made a record, re-running its cell with the current
checkout and getting the same evaluation returns and per-update KLs (:func:`run_records.same_run`) shows that no change
since its commit altered that training.

For every commit that made sb3-kl records on this machine (same CPU model and library versions as
:func:`run_records.run_environment` reports now, a simulator's version counting for its own tasks only), the
``--per-commit`` cheapest of its records (by training time) are re-run with the current checkout; the result,
naming the checkout's commit, goes to ``benchmarks/results/record_reproduction.md`` and ``.json``. Records from other
machines cannot be checked this way (``learning.md``'s replication section compares such cells statistically
instead).

``--near-band-edge REL`` re-runs also every record whose beta is adapted by the band rule (the KLPPO family) and
whose per-update KL (the monitor's exact mean) came within ``REL`` (relative) of a band edge of the controller's
default band: the trainings that a change in how the algorithm rounds its measured KL could steer, as one update's
KL on the other side of an edge changes beta.

    python benchmarks/record_reproduction.py [--tier full] [--per-commit 1] [--near-band-edge 1e-4] [--workers 2]
    python benchmarks/record_reproduction.py --report    # rewrites the page and its figure from the JSON, no re-run
"""

import argparse
import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grid  # noqa: E402
import grid_runs  # noqa: E402
import run_records  # noqa: E402


#: The simulator packages of :func:`run_records.run_environment`: a task's run depends only on the one it runs on
SIMULATORS = ("mujoco", "box2d")


def task_environment(environment: dict[str, str], env_id: str) -> dict[str, str]:
    """
    :param environment: a :func:`run_records.run_environment`
    :param env_id: a registered Gymnasium task
    :return: ``environment`` without the versions of the simulators ``env_id`` does not run on (told by the package
        of its registered entry point: a CartPole run is the same whatever MuJoCo is installed)
    """
    import gymnasium as gym

    try:
        entry_point = str(gym.spec(env_id).entry_point)
    except gym.error.Error:
        return environment
    return {key: value for key, value in environment.items() if key not in SIMULATORS or f".{key}." in entry_point}


def reproducible_records(records: list[dict[str, Any]], environment: dict[str, str], per_commit: int) -> list[dict[str, Any]]:
    """
    :param records: the grid's records
    :param environment: this machine's :func:`run_records.run_environment`
    :param per_commit: records to pick per commit
    :return: for each commit, its ``per_commit`` sb3-kl records with the shortest training time among those made on
        this machine with the versions of the libraries their task runs on (:func:`task_environment`), ordered by
        commit then training time
    """
    by_commit: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record["algo"] in grid.STOCK:
            continue
        made_in = record.get("run_environment")
        if made_in is None or task_environment(made_in, record["env"]) != task_environment(environment, record["env"]):
            continue
        if (record.get("overrides") or {}) or record.get("code_version") in (None, "unrecorded"):
            continue
        by_commit.setdefault(record["code_version"], []).append(record)
    chosen = []
    for commit in sorted(by_commit):
        chosen += sorted(by_commit[commit], key=lambda r: (r.get("train_seconds", float("inf")), run_records.seed_key(r)))[
            :per_commit
        ]
    return chosen


def near_band_edge_records(records: list[dict[str, Any]], environment: dict[str, str], rel: float) -> list[dict[str, Any]]:
    """
    :param records: the grid's records
    :param environment: this machine's :func:`run_records.run_environment`
    :param rel: the relative distance to a band edge
    :return: the reproducible records (as :func:`reproducible_records` admits them) of the algorithms whose beta follows
        the band rule of ``AdaptiveKLController``'s default band, with an update whose KL lies within ``rel`` of
        ``band_lo * target`` or ``band_hi * target``
    """
    import inspect

    from sb3_kl.common.controllers import AdaptiveKLController

    band = inspect.signature(AdaptiveKLController).parameters["kl_band"].default
    chosen = []
    for record in reproducible_records(records, environment, per_commit=len(records)):
        if not grid_runs.algorithm_class(record["algo"]).has_kl_coef:
            continue
        edges = [factor * record["target_kl"] for factor in band]
        if any(abs(update["mean"] - edge) <= rel * edge for update in record["kl_updates"] for edge in edges):
            chosen.append(record)
    return chosen


def rerun(record: dict[str, Any]) -> dict[str, Any]:
    """Re-run a record's cell and seed with the current checkout; :return: the comparison's row"""
    new = grid_runs.train_and_evaluate(grid_runs.rerun_spec(record))
    return dict(
        algo=record["algo"],
        env=record["env"],
        seed=record["seed"],
        lr_mult=record["lr_mult"],
        record_commit=record["code_version"],
        identical=run_records.same_run(record, new),
        eval_record=record["eval_mean"],
        eval_now=new["eval_mean"],
    )


def plot_returns(rows: list[dict[str, Any]], path: Path) -> None:
    """
    Draw each re-run's evaluation return against its record's (identical re-runs lie on the diagonal), to a PNG.

    :param rows: The re-runs, as :func:`rerun` returns them
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    values = [row[key] for row in rows for key in ("eval_record", "eval_now")]
    low, high = min(values), max(values)
    ax.plot([low, high], [low, high], color="0.7", lw=1, zorder=0)
    for identical, marker, color, label in ((True, "o", "tab:green", "identical"), (False, "X", "tab:red", "not identical")):
        group = [row for row in rows if row["identical"] == identical]
        if group:
            ax.scatter([r["eval_record"] for r in group], [r["eval_now"] for r in group], marker=marker, color=color,
                       label=f"{label} ({len(group)})")  # fmt: skip
    ax.set_xscale("symlog", linthresh=100)
    ax.set_yscale("symlog", linthresh=100)
    ax.set_xlabel("evaluation return in the record")
    ax.set_ylabel("evaluation return, re-run now")
    ax.set_title("grid records re-run with the current checkout", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(rows: list[dict[str, Any]]) -> list[str]:
    """:return: the page's opening table: per reason for picking, the re-runs, the identical ones and the commits"""
    lines = ["| picked | re-run | identical | commits of the records |", "|---|---|---|---|"]
    for reason in dict.fromkeys(row.get("picked", "cheapest of its commit") for row in rows):
        group = [row for row in rows if row.get("picked", "cheapest of its commit") == reason]
        commits = len({row["record_commit"] for row in group})
        lines.append(f"| {reason} | {len(group)} | {sum(row['identical'] for row in group)} | {commits} |")
    return lines


def table(
    rows: list[dict[str, Any]], checkout: str, environment: dict[str, str], command: str, figure: str | None = None
) -> str:
    """
    The markdown report of the re-runs.

    :param rows: The re-runs, as :func:`rerun` returns them
    :param checkout: The commit that re-ran them
    :param environment: The machine and library versions that re-ran them
    :param command: The command that re-ran them
    :param figure: The name of the figure (:func:`plot_returns`) the page opens with, if any
    """
    identical = sum(row["identical"] for row in rows)
    lines = [
        "# Do the learning grid's records describe the current code?",
        "",
        *([f"![evaluation returns, record and re-run]({figure})", ""] if figure else []),
        *summary_table(rows),
        "",
        f"Generated by `{command}` with the checkout of commit `{checkout}` on "
        f"{run_records.describe_run_environment(environment)}. For each commit that made sb3-kl records of "
        "`benchmarks/results/runs/` on this machine with these versions of the libraries their task runs on (a "
        "simulator's version counts for its tasks only), its cheapest records were re-run with "
        "this checkout. *identical*: the same evaluation returns and the same per-update KLs, bit for bit, so no change "
        "since the record's commit altered that training. *picked*: why the record was re-run (with "
        "`--near-band-edge`, also the KLPPO-family records with an update whose KL came that close, relative, to an "
        "edge of the band rule's default band, where a change in the rounding of the measured KL could flip beta's "
        "step).",
        "",
        f"Identical: {identical} of {len(rows)}.",
        "",
        "| record's commit | algo | env | lr | seed | picked | identical | eval in the record | eval now |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['record_commit']}` | {row['algo']} | {row['env']} | x{row['lr_mult']:g} | {row['seed']} | "
            f"{row.get('picked', 'cheapest of its commit')} | "
            f"{'yes' if row['identical'] else '**no**'} | {row['eval_record']:.1f} | {row['eval_now']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=list(grid.BUDGETS), default="full")
    parser.add_argument("--per-commit", type=int, default=1, help="records re-run per commit (the cheapest ones)")
    parser.add_argument(
        "--near-band-edge",
        type=float,
        default=None,
        metavar="REL",
        help="also re-run the KLPPO-family records with an update whose KL lies within REL (relative) of a band edge",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=run_records.RESULTS / "record_reproduction.md")
    parser.add_argument("--report", action="store_true", help="only rewrite --out and its figure from the JSON beside it")
    args = parser.parse_args(argv)
    figure = args.out.with_suffix(".png")
    if args.report:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        plot_returns(saved["rows"], figure)
        args.out.write_text(table(saved["rows"], saved["checkout"], saved["run_environment"], saved["command"], figure.name))
        print(args.out.read_text())
        return
    environment = run_records.run_environment()
    records = run_records.load_records(args.tier)
    chosen = reproducible_records(records, environment, args.per_commit)
    reasons = ["cheapest of its commit"] * len(chosen)
    if args.near_band_edge is not None:
        picked = {id(record) for record in chosen}
        near = [r for r in near_band_edge_records(records, environment, args.near_band_edge) if id(r) not in picked]
        chosen += near
        reasons += [f"KL within {args.near_band_edge:g} of a band edge"] * len(near)
    if not chosen:
        raise SystemExit(f"No sb3-kl record of the {args.tier} tier was made on this machine with these library versions.")
    print(f"{len(chosen)} records to re-run", flush=True)
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        rows = pool.map(rerun, chosen)
    for row, reason in zip(rows, reasons, strict=True):
        row["picked"] = reason
    checkout = run_records.code_version("record_reproduction.py", "learning.py", "settings.py")
    command = f"python benchmarks/record_reproduction.py --tier {args.tier} --per-commit {args.per_commit}"
    if args.near_band_edge is not None:
        command += f" --near-band-edge {args.near_band_edge:g}"
    plot_returns(rows, figure)
    args.out.write_text(table(rows, checkout, environment, command, figure.name))
    args.out.with_suffix(".json").write_text(
        json.dumps(dict(command=command, checkout=checkout, run_environment=environment, rows=rows), indent=1) + "\n"
    )
    print(args.out.read_text())


if __name__ == "__main__":
    main()
