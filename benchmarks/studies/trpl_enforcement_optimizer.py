"""
How TRPL's bound enforcement should take its regression steps: with the policy's own Adam (``"shared"``), an Adam
with moments of its own made anew each update (``"fresh"``), a copy of the policy's Adam without momentum
(``"scaled"``), or a line search along the Adam-scaled regression gradient: as it is (``"line_search"``), rescaled to
unit RMS (``"line_search_unit"``), or scaled down where its RMS exceeds 1 (``"line_search_capped"``, the default). Grid runs
(``grid_runs.train_and_evaluate``: the grid's settings and budget) on seeds outside the grid's, with a probe that keeps
TRPL's ``train/`` figures of every update. Writes ``benchmarks/results/trpl_enforcement_optimizer.{json,md,png}``, each
run appended to the JSON as it finishes (a stopped study resumes); ``--report`` rewrites the page from the JSON.

    python benchmarks/studies/trpl_enforcement_optimizer.py [--cells Pendulum-v1:10 HalfCheetah-v5:1] [--seeds 10 11]
        [--variants line_search fresh]
    python benchmarks/studies/trpl_enforcement_optimizer.py --report
"""

import argparse
import json
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_records  # noqa: E402
import trpl_high_learning_rate  # noqa: E402

OUT = HERE / "results" / "trpl_enforcement_optimizer.md"
VARIANTS = ("shared", "fresh", "scaled", "line_search", "line_search_unit", "line_search_capped")
COLORS = {
    "shared": "tab:red",
    "fresh": "tab:blue",
    "scaled": "tab:green",
    "line_search": "tab:purple",
    "line_search_unit": "tab:orange",
    "line_search_capped": "tab:brown",
}


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when the package or this script had uncommitted changes."""
    return run_records.code_version("settings.py", "grid_runs.py", f"studies/{Path(__file__).name}")


def run(job: tuple[str, float, int, str]) -> dict[str, Any]:
    """One grid run of TRPL with ``_enforcement_optimizer = variant``; :return: its eval return and per-update figures"""
    import time

    from sb3_kl import TRPL

    env_id, lr_mult, seed, variant = job
    TRPL._enforcement_optimizer = variant
    start = time.perf_counter()
    result = trpl_high_learning_rate.run(env_id, seed, lr_mult)
    return {**result, "variant": variant, "seconds": time.perf_counter() - start, "code_version": code_version()}


def cell_runs(runs: list[dict[str, Any]], env_id: str, lr_mult: float, variant: str) -> list[dict[str, Any]]:
    return [r for r in runs if (r["env"], r["lr_mult"], r["variant"]) == (env_id, lr_mult, variant)]


def figures(cell: list[dict[str, Any]], env_id: str) -> dict[str, float]:
    """A cell's figures over every update of its runs."""
    ups = [u for r in cell for u in r["updates"]]
    return dict(
        eval_mean=float(np.mean([r["eval_mean"] for r in cell])),
        eval_std=float(np.std([r["eval_mean"] for r in cell])),
        steps=float(np.mean([trpl_high_learning_rate.enforcement_tries(u) for u in ups])),
        capped=float(np.mean([trpl_high_learning_rate.enforcement_tries(u) >= 30 for u in ups])),
        moved_back=float(np.mean([u["enforcement_step_fraction"] < 1 for u in ups])),
        kept=float(np.mean([u["enforcement_step_fraction"] for u in ups])),
        worst=max(u["distance_max"] for u in ups) / trpl_high_learning_rate.bound(env_id),
        kl=float(np.median([u["kl"] for u in ups])),
        fit=float(np.median([u["explained_variance"] for u in ups])),
        seconds=float(np.mean([r["seconds"] for r in cell])),
    )


def table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| task | lr | optimizer | runs | eval return | regression steps per update | at the 30-step cap | moved back "
        "| share of step kept | worst max / bound | median `train/kl` | explained variance | seconds per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for env_id, lr_mult in cells(runs):
        for variant in VARIANTS:
            cell = cell_runs(runs, env_id, lr_mult, variant)
            if not cell:
                continue
            f = figures(cell, env_id)
            lines.append(
                f"| {env_id} | x{lr_mult:g} | {variant} | {len(cell)} | {f['eval_mean']:.1f} ± {f['eval_std']:.1f} |"
                f" {f['steps']:.1f} | {f['capped']:.0%} | {f['moved_back']:.0%} | {f['kept']:.2f} | {f['worst']:.3f} |"
                f" {f['kl']:.4f} | {f['fit']:.2f} | {f['seconds']:.0f} |"
            )
    return lines


def cells(runs: list[dict[str, Any]]) -> list[tuple[str, float]]:
    return sorted({(r["env"], r["lr_mult"]) for r in runs})


#: The comparisons the page states: each variant against the default it would replace
PAIRS = (
    ("fresh", "shared"),
    ("scaled", "shared"),
    ("line_search", "fresh"),
    ("line_search_unit", "line_search"),
    ("line_search_capped", "line_search"),
    ("line_search_capped", "fresh"),
)


def findings(runs: list[dict[str, Any]]) -> list[str]:
    """Per cell, each pair of :data:`PAIRS` (returns: Welch's test, a tie unless p < 0.05), computed from the runs."""
    from significance import verdict

    out = []
    for env_id, lr_mult in cells(runs):
        for variant, baseline in PAIRS:
            base, other = cell_runs(runs, env_id, lr_mult, baseline), cell_runs(runs, env_id, lr_mult, variant)
            if not base or not other:
                continue
            s, f = figures(base, env_id), figures(other, env_id)
            text, result = verdict([r["eval_mean"] for r in other], [r["eval_mean"] for r in base])
            out.append(
                f"- {env_id} x{lr_mult:g}, {variant} against {baseline}: {f['steps']:.1f} regression steps per update"
                f" against {s['steps']:.1f}, at the cap in {f['capped']:.0%} of updates against {s['capped']:.0%},"
                f" the actor moved back in {f['moved_back']:.0%} against {s['moved_back']:.0%}; the bound holds in"
                f" both (worst {f['worst']:.3f} and {s['worst']:.3f} x the bound); return {text} ({result}); a run"
                f" takes {f['seconds']:.0f} s against {s['seconds']:.0f} s."
            )
    return out


#: The commits that changed TRPL's default (``"shared"`` before the first), each with the variant it made the default
CHANGES = (
    ("dd16564", "fresh"),
    ("26f9a9e", "line_search"),
    ("88a1a09", "line_search_unit"),
    ("80b3cd1", "line_search_capped"),
)
#: The grid's variants in the order they were the default
ERAS = ("shared", *(variant for _, variant in CHANGES))


def default_at(commit: str) -> str | None:
    """The enforcement TRPL ran by default at ``commit`` (None: a commit this repository does not know)."""
    import subprocess

    commit = commit.removesuffix("+modified")
    try:
        known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=HERE, capture_output=True)
        if known.returncode != 0:
            return None
        variant = "shared"
        for change, name in CHANGES:
            after = subprocess.run(["git", "merge-base", "--is-ancestor", change, commit], cwd=HERE, capture_output=True)
            if after.returncode == 0:
                variant = name
    except OSError:
        return None
    return variant


def grid_before_and_after(tier: str = "full") -> list[str]:
    """
    The grid's TRPL cells (seeds 0-4) under each default the grid's file holds records of (:data:`ERAS`; it keeps the
    superseded records): evaluation return per cell, and the newest default against the one before it with runs of the cell
    (Welch's test).
    """
    from significance import verdict

    path = run_records.runs_folder(tier) / run_records.RECORDS_FILE
    if not path.exists():
        return []
    latest: dict[tuple[str, float, int, str], dict[str, Any]] = {}
    commits: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("algo") != "trpl" or record.get("overrides"):
            continue
        commit = record.get("code_version", "unknown")
        if commit not in commits:
            commits[commit] = default_at(commit)
        if commits[commit] is None:
            continue
        latest[(record["env"], record["lr_mult"], record["seed"], commits[commit])] = record
    eras = [era for era in ERAS if any(key[3] == era for key in latest)]
    if len(eras) < 2:
        return []
    new = eras[-1]
    lines = [
        "| task | lr | " + " | ".join(f"{era}" for era in eras) + f" | {new} against the default before it |",
        "|---|---|" + "---|" * len(eras) + "---|",
    ]
    from grid import cell_order

    cells_seen = sorted({(env, mult) for env, mult, _, _ in latest}, key=lambda c: cell_order((c[0], "trpl", c[1])))
    for env_id, lr_mult in cells_seen:
        evals = {
            v: [r["eval_mean"] for (e, m, _, var), r in sorted(latest.items()) if (e, m, var) == (env_id, lr_mult, v)]
            for v in eras
        }
        # the default before the newest that has runs of this cell
        old = next((era for era in reversed(eras[:-1]) if evals[era]), None)
        if not evals[new] or old is None:
            continue
        text, result = verdict(evals[new], evals[old])
        text = f"{text} (against {old})"
        shown = " | ".join(
            f"{np.mean(evals[v]):.1f} ± {np.std(evals[v]):.1f} ({len(evals[v])})" if evals[v] else "" for v in eras
        )
        lines.append(f"| {env_id} | x{lr_mult:g} | {shown} | {text}, {result} |")
    return lines if len(lines) > 2 else []


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = cells(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (env_id, lr_mult) in zip(axes[0], panels, strict=True):
        for variant in VARIANTS:
            for r in cell_runs(runs, env_id, lr_mult, variant):
                tries = [trpl_high_learning_rate.enforcement_tries(u) for u in r["updates"]]
                ax.plot(tries, color=COLORS[variant], lw=0.8, alpha=0.8)
            ax.plot([], [], color=COLORS[variant], label=variant)
        ax.set_title(f"{env_id} x{lr_mult:g}", fontsize=9)
        ax.set_xlabel("update")
        ax.set_ylabel("regression steps")
        ax.legend(fontsize=8)
    fig.suptitle("TRPL's bound enforcement: regression steps per update, by the optimizer they step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(record: dict[str, Any]) -> str:
    runs = record["runs"]
    plot(runs, OUT.with_suffix(".png"))
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in runs}))
    cell_args = " ".join(f"{env_id}:{lr_mult:g}" for env_id, lr_mult in cells(runs))
    text = "\n".join(
        [
            "# TRPL's bound enforcement: which optimizer its regression steps take",
            "",
            f"![Regression steps per update, by variant]({OUT.with_suffix('.png').name})",
            "",
            *table(runs),
            "",
            *findings(runs),
            "",
            "After the epochs, TRPL regresses the network onto its projection until the largest per-state distance of"
            " the update's states is within 1.05 x the bound (at most 30 steps, then a move back toward the rollout"
            " policy). *shared*: those steps step the policy's Adam, whose moments hold the surrogate's last steps;"
            " *fresh*: they step an Adam of the same hyperparameters with moments of its own, made anew each update;"
            " *scaled*: a copy of the policy's Adam without momentum that keeps its second moments; *line_search*:"
            " steps along the regression's gradient scaled by the policy Adam's second moments, each step's size"
            " searched from the learning rate (kept and doubled if it lowers the states' summed excess over the bound,"
            " else undone and halved; every try counts as a step); *line_search_unit*: that direction rescaled to RMS 1;"
            " *line_search_capped* (TRPL's default): scaled down only where its RMS exceeds 1. Runs of the grid's"
            " settings and budgets"
            " on seeds outside the grid's (0-4); per update, from TRPL's `train/` keys: `enforcement_steps` plus"
            " `enforcement_rejected_tries` (every try),"
            " `enforcement_step_fraction` (1: no move back), `distance_max` (after the enforcement), `kl`,"
            " `explained_variance`. Seconds: wall-clock time of a run, two runs side by side on two cores.",
            "",
            *(
                [
                    "## The grid's cells under each default",
                    "",
                    "The learning grid's TRPL runs (its seeds, settings and budgets) under each default they were made"
                    " with, from `benchmarks/results/runs/full/records.jsonl`, which keeps the superseded records;"
                    " mean ± std over seeds (runs, in brackets), and the newest default against the latest default"
                    " before it with runs of the cell,"
                    " with Welch's p-value (p ≥ 0.05: a tie):",
                    "",
                    *grid,
                    "",
                ]
                if (grid := grid_before_and_after())
                else []
            ),
            f"Written by `python benchmarks/studies/trpl_enforcement_optimizer.py --cells {cell_args} --seeds {seeds}`"
            f" (variants as `--variants` chose them per cell);"
            f" runs made by sb3-kl {', '.join(sorted({r['code_version'] for r in runs}))}, from"
            f" `benchmarks/results/{OUT.with_suffix('.json').name}`.",
        ]
    )
    OUT.write_text(text + "\n")
    return text


def parse_cell(token: str) -> tuple[str, float]:
    env_id, _, mult = token.partition(":")
    return env_id, float(mult or 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", type=parse_cell, default=[("Pendulum-v1", 10.0), ("HalfCheetah-v5", 1.0)])
    parser.add_argument("--seeds", nargs="+", type=int, default=[10, 11])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    path = OUT.with_suffix(".json")
    record = json.loads(path.read_text()) if path.exists() else None
    if not args.report:
        if record is None:
            record = dict(run_environment=run_records.run_environment(), runs=[])
        done = {(r["env"], r["lr_mult"], r["seed"], r["variant"]) for r in record["runs"]}
        jobs = [
            (env_id, lr_mult, seed, variant)
            for env_id, lr_mult in args.cells
            for seed in args.seeds
            for variant in args.variants
            if (env_id, lr_mult, seed, variant) not in done
        ]
        with Pool(args.workers) as pool:
            for result in pool.imap_unordered(run, jobs):
                record["runs"].append(result)
                path.write_text(json.dumps(record, indent=1))
                print(f"done {result['env']} x{result['lr_mult']:g} seed {result['seed']} {result['variant']}", flush=True)
    if record is None:
        raise SystemExit(f"no {path}: run the study first")
    print(write_report(record))


if __name__ == "__main__":
    main()
