"""
TRPL's bounds for the learning grid, chosen once by a small sweep on seeds outside the grid's (the grid uses 0..9).

CartPole-v1 (a categorical policy: ``mean_bound`` bounds its whole per-state KL) and Pendulum-v1 (a Gaussian:
``mean_bound`` x ``cov_bound``), seeds 100 and 101, each run a grid run of the ``full`` tier (its budget, its settings:
``settings.settings_for("trpl", env)``) with the bounds as overrides. Records: ``results/trpl_bounds/records.jsonl``,
one line per (bounds, task, seed), appended as each run finishes (the grid's run names do not hold the bounds, so this
script reads the lines itself). Page: ``results/trpl_bounds.md`` and ``trpl_bounds.png``.

The rule, fixed before any record existed: on each task, the score of a candidate is its mean evaluation return over
its 2 seeds x 10 episodes, and its standard error is the episodes' standard deviation / sqrt(20). The chosen bounds
are the smallest joint bound (``mean_bound + cov_bound``; a tie goes to the smaller ``mean_bound``) whose score is
below the best candidate's by at most twice the standard error of the difference, sqrt(se_best^2 + se^2).

Examples::

    python benchmarks/trpl_bounds.py --workers 2   # the missing runs, then the page
    python benchmarks/trpl_bounds.py --report      # the page only
"""

import argparse
import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measures import area_under_curve  # noqa: E402
from run_records import MAIN_RESULTS, RECORDS_FILE, append_record, code_version  # noqa: E402

FOLDER = MAIN_RESULTS / "trpl_bounds"
PAGE = MAIN_RESULTS / "trpl_bounds.md"
FIGURE = MAIN_RESULTS / "trpl_bounds.png"
SEEDS = (100, 101)
CANDIDATES: dict[str, list[dict[str, float]]] = {
    "CartPole-v1": [dict(mean_bound=m) for m in (0.01, 0.03, 0.1)],
    "Pendulum-v1": [dict(mean_bound=m, cov_bound=c) for m in (0.01, 0.03, 0.1) for c in (0.001, 0.01)],
}
COMMAND = "python benchmarks/trpl_bounds.py --workers 2"


def bounds_name(bounds: dict[str, float]) -> str:
    """``mean 0.03, cov 0.001`` for a candidate's bounds."""
    return ", ".join(f"{name.removesuffix('_bound')} {value:g}" for name, value in sorted(bounds.items(), reverse=True))


def joint_bound(bounds: dict[str, float]) -> float:
    """The bound on the per-state KL(new||old) a candidate sets: ``mean_bound + cov_bound``."""
    return bounds["mean_bound"] + bounds.get("cov_bound", 0.0)


def read_records() -> list[dict[str, Any]]:
    """Every record of the sweep, the last of each (bounds, task, seed)."""
    path = FOLDER / RECORDS_FILE
    if not path.exists():
        return []
    records: dict[tuple, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[(record["env"], json.dumps(record["overrides"], sort_keys=True), record["seed"])] = record
    return list(records.values())


def run(spec: dict[str, Any]) -> None:
    """Train and evaluate one run, and append its record (in a worker process)."""
    from grid_runs import train_and_evaluate

    append_record(FOLDER, train_and_evaluate(spec))
    print(f"done {spec['env']} {bounds_name(spec['overrides'])} seed {spec['seed']}", flush=True)


def missing_specs() -> list[dict[str, Any]]:
    """The sweep's runs without a record, the cheaper task first."""
    done = {(r["env"], json.dumps(r["overrides"], sort_keys=True), r["seed"]) for r in read_records()}
    version = code_version()
    return [
        dict(algo="trpl", env=env, seed=seed, lr_mult=1.0, tier="full", overrides=bounds, code_version=version)
        for env, candidates in CANDIDATES.items()
        for seed in SEEDS
        for bounds in candidates
        if (env, json.dumps(bounds, sort_keys=True), seed) not in done
    ]


def summarize(records: list[dict[str, Any]], env: str) -> list[dict[str, Any]]:
    """Per candidate of a task with records: its episodes' mean return and standard error, and its per-state KLs."""
    rows = []
    for bounds in CANDIDATES[env]:
        runs = [r for r in records if r["env"] == env and r["overrides"] == bounds]
        if not runs:
            continue
        episodes = np.array([x for r in runs for x in r["eval_returns"]])
        reverse = [u for r in runs for u in r.get("kl_reverse_updates", [])]
        rows.append(
            dict(
                bounds=bounds,
                seeds=sorted(r["seed"] for r in runs),
                score=float(episodes.mean()),
                se=float(episodes.std(ddof=1) / np.sqrt(len(episodes))) if len(episodes) > 1 else float("nan"),
                seed_means=[r["eval_mean"] for r in sorted(runs, key=lambda r: r["seed"])],
                auc=float(np.mean([area_under_curve(r["curve"], r["budget"]) for r in runs])),
                p99=float(np.median([u["p99"] for u in reverse])) if reverse else float("nan"),
                max=float(np.max([u["max"] for u in reverse])) if reverse else float("nan"),
                seconds=float(np.mean([r["train_seconds"] for r in runs])),
            )
        )
    return rows


def choose(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rule of the module docstring, on the candidates that have all the seeds (None unless all of them do)."""
    complete = [row for row in rows if row["seeds"] == list(SEEDS)]
    if not complete or len(complete) < len(rows) or len(rows) == 0:
        return None
    best = max(complete, key=lambda row: row["score"])
    close = [r for r in complete if best["score"] - r["score"] <= 2 * np.hypot(best["se"], r["se"])]
    return min(close, key=lambda row: (joint_bound(row["bounds"]), row["bounds"]["mean_bound"]))


def plot(summaries: dict[str, list[dict[str, Any]]]) -> None:
    """Each task's candidates: mean evaluation return (2 SE bars) and the median over updates of the per-state p99 KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = [env for env in CANDIDATES if summaries.get(env)]
    fig, axes = plt.subplots(2, len(envs), figsize=(5.5 * len(envs), 6), squeeze=False)
    for column, env in enumerate(envs):
        rows = summaries[env]
        labels = [bounds_name(row["bounds"]).replace(", ", "\n") for row in rows]
        x = np.arange(len(rows))
        axes[0, column].errorbar(x, [r["score"] for r in rows], yerr=[2 * r["se"] for r in rows], fmt="o", capsize=3)
        for row, position in zip(rows, x, strict=True):
            axes[0, column].plot([position] * len(row["seed_means"]), row["seed_means"], "x", color="gray")
        axes[0, column].set_title(f"{env}: evaluation return (2 SE; x: seeds)")
        axes[1, column].bar(x, [r["p99"] for r in rows], color="tab:brown", label="p99 (median over updates)")
        axes[1, column].plot(x, [r["max"] for r in rows], "k_", markersize=14, label="max over all updates")
        axes[1, column].plot(x, [1.05 * joint_bound(r["bounds"]) for r in rows], "r.", label="1.05 x bound")
        axes[1, column].set_yscale("log")
        axes[1, column].set_title("per-state KL(new||old) per update")
        axes[1, column].legend(fontsize=7)
        for ax in axes[:, column]:
            ax.set_xticks(x, labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=90)
    plt.close(fig)


def report() -> None:
    """Write the page and its figure from the records."""
    import settings

    records = read_records()
    summaries = {env: summarize(records, env) for env in CANDIDATES}
    lines = [
        "# TRPL's bounds for the learning grid",
        "",
        f"![evaluation return and per-state KL of each candidate]({FIGURE.name})",
        "",
        "| task | bounds | seeds | eval return (mean ± SE, 20 episodes) | AUC | per-state KL p99 (median over updates) |"
        " max per-state KL | seconds per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    choices = {}
    for env, rows in summaries.items():
        chosen = choose(rows)
        choices[env] = chosen
        for row in rows:
            mark = " **(chosen)**" if row is chosen else ""
            lines.append(
                f"| {env} | {bounds_name(row['bounds'])}{mark} | {', '.join(map(str, row['seeds']))} | "
                f"{row['score']:.1f} ± {row['se']:.1f} | {row['auc']:.1f} | {row['p99']:.4f} | {row['max']:.4f} | "
                f"{row['seconds']:.0f} |"
            )
    versions = sorted({r["code_version"] for r in records})
    lines += [
        "",
        f"Written by `python benchmarks/trpl_bounds.py --report` from `{FOLDER.relative_to(MAIN_RESULTS.parent.parent)}/"
        f"{RECORDS_FILE}` ({len(records)} runs, made by `{COMMAND}`; commits: {', '.join(f'`{v}`' for v in versions)}).",
        "Each run is a grid run of the `full` tier (its budget and settings: PPO's zoo entry without the clip) with the",
        f"bounds as overrides, on seeds {', '.join(map(str, SEEDS))} (the grid uses 0..9). The KL is the acting policy's",
        "per-state KL(new||old), summed over action dimensions, on every state of the rollout the update trained on.",
        "AUC: the mean return of the last 100 training episodes averaged over training (`measures.area_under_curve`),",
        "shown beside the rule's return, not part of it.",
        "",
        "Rule (stated before the runs): per task, the smallest joint bound (`mean_bound + cov_bound`; a tie to the",
        "smaller `mean_bound`) whose mean evaluation return is below the best candidate's by at most twice the standard",
        "error of the difference (each candidate's SE: its 20 episodes' standard deviation / sqrt(20)).",
        "",
    ]
    for env, chosen in choices.items():
        kind = "discrete" if env in settings.DISCRETE_ENVS else "continuous"
        in_grid = settings.TRPL_BOUNDS[kind]
        if chosen is None:
            lines.append(f"- {env}: not all candidates have both seeds yet: no choice. The grid's {kind} tasks use {in_grid}.")
        else:
            agrees = "as the grid's settings hold" if chosen["bounds"] == in_grid else f"NOT what the grid holds ({in_grid})"
            lines.append(f"- {env}: **{bounds_name(chosen['bounds'])}** for the grid's {kind} tasks, {agrees}.")
    PAGE.write_text("\n".join(lines) + "\n")
    if any(summaries.values()):
        plot(summaries)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each)")
    parser.add_argument("--report", action="store_true", help="only write the page from the records")
    args = parser.parse_args(argv)
    if not args.report:
        specs = missing_specs()
        print(f"{len(specs)} runs to make", flush=True)
        with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
            pool.map(run, specs, chunksize=1)
    report()


if __name__ == "__main__":
    main()
