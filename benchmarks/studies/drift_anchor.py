"""
Does a bound on the drift stop the collapses that no per-update KL sees? The learning grid's collapses of sb3-kl
algorithms fall with every update inside its KL target (``learning.md``, *The collapses*); what moved was the policy
over many updates (``KLMonitorCallback``'s ``kl/drift``, *Drift before the collapses*). Here the policy is anchored to
itself ``lag`` updates before: the algorithm's reference-policy KL (``ref_kl_coef``, ``ref_target_kl``: the
penalty ``beta_ref * KL(pi || pi_ref)`` in the loss, beta_ref adapted so that the KL to the reference tracks
``ref_target_kl``) with a reference that, at the start of every rollout, is set to the weights of the policy that
acted ``lag`` rollouts earlier (the initial policy until then). Same settings and seeds as the grid's cells
(``grid_runs.train_and_evaluate``, rl-zoo's hyperparameters), the drift target a multiple of the run's ``target_kl``.

    python benchmarks/studies/drift_anchor.py --algos klppo_noclip clip_klppo --envs Hopper-v5 --seeds 0..9 \\
        --lag 10 --multiple 10
    python benchmarks/studies/drift_anchor.py --report

Records go to ``benchmarks/results/drift_anchor/lag<lag>_x<multiple>/`` (resumable: a run with a record is skipped),
the table, beside the grid's records of the same cells and seeds, to ``benchmarks/results/drift_anchor.md``.
"""

import argparse
import multiprocessing
import sys
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import grid  # noqa: E402
import grid_runs  # noqa: E402
import run_records  # noqa: E402
import side_studies  # noqa: E402
import significance  # noqa: E402
import learning  # noqa: E402
import measures  # noqa: E402

FOLDER = run_records.RESULTS / "drift_anchor"
#: the benchmark's classes, before run_one makes them anchored
_ALGORITHM_CLASS = grid_runs.algorithm_class
#: beta_ref at the start: small, so that the anchor only weighs once the drift exceeds its target
INITIAL_REF_KL_COEF = 0.1


def anchored_class(algo: str) -> type:
    """The benchmark's class of ``algo`` with its own initial policy as the reference (moved by :func:`make_anchor`)."""
    base = _ALGORITHM_CLASS(algo)

    class Anchored(base):  # type: ignore[misc,valid-type]
        def _setup_model(self) -> None:
            super()._setup_model()
            self.ref_policy = self.policy  # a frozen copy is made by _setup_reference
            self._setup_reference()

    Anchored.__name__ = f"Anchored{base.__name__}"
    return Anchored


def make_anchor(lag: int) -> Any:
    """:return: a callback that, at each rollout start, sets the reference to the policy of ``lag`` rollouts before"""
    from stable_baselines3.common.callbacks import BaseCallback

    class LaggedAnchor(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.weights: deque[dict[str, Any]] = deque(maxlen=lag)

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            self.weights.append({k: v.detach().clone() for k, v in self.model.policy.state_dict().items()})
            self.model.ref_policy.load_state_dict(self.weights[0])

    return LaggedAnchor()


def records_folder(lag: int, multiple: float, tier: str) -> Path:
    """The records folder of the runs anchored ``lag`` updates back with a drift target ``multiple`` x target_kl."""
    return FOLDER / f"lag{lag}_x{multiple:g}" / "runs" / tier


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train and evaluate one anchored run and write its record (in a worker process)."""
    lag, multiple = spec.pop("lag"), spec.pop("multiple")
    grid_runs.algorithm_class = anchored_class  # the worker process trains anchored classes only
    record = grid_runs.train_and_evaluate(spec, probes=[make_anchor(lag)])
    record["anchor"] = dict(lag=lag, multiple=multiple)
    run_records.append_record(records_folder(lag, multiple, spec["tier"]), record)
    return record


def target_of(algo: str, env_id: str) -> float:
    """The run's ``target_kl`` (the grid's), of which the drift target is a multiple."""
    from settings import settings_for

    kwargs = settings_for(algo, env_id)["kwargs"]
    return grid_runs.default_target_kl(algo, env_id, kwargs)


def drift_rows(
    grid: dict[tuple[str, str, float], list[dict[str, Any]]],
    side: dict[tuple[str, str, float], list[dict[str, Any]]],
    multiple: float,
) -> list[str]:
    """Per cell: the mean drift / target over each run's updates, and the share of updates over ``multiple``."""
    rows = []
    for (env, algo, mult), old, new in side_studies.paired_runs(grid, side):

        def stats(records: list[dict[str, Any]]) -> tuple[str, str]:
            runs = [np.array([u.get("drift", np.nan) for u in r["kl_updates"]]) / r["target_kl"] for r in records]
            runs = [d[~np.isnan(d)] for d in runs]
            runs = [d for d in runs if len(d)]
            if not runs:
                return "-", "-"
            return significance.fmt([float(d.mean()) for d in runs]), significance.fmt(
                [float(np.mean(d > multiple)) for d in runs], digits=0, percent=True
            )

        (grid_drift, grid_over), (new_drift, new_over) = stats(old), stats(new)
        rows.append(f"| {env} | x{mult:g} | {algo} | {len(new)} | {grid_drift} | {new_drift} | {grid_over} | {new_over} |")
    return rows


def plot_pairs(studies: list[tuple[str, list[tuple[Any, list[dict], list[dict]]]]], path: Path) -> None:
    """
    Draw, per anchor setting and cell, each seed's evaluation return in the grid and anchored (a line per seed; a cross
    marks a run with a collapse), to a PNG.

    :param studies: Per anchor setting, its label and its paired cells (:func:`side_studies.paired_runs`)
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(label, cell, old, new) for label, pairs in studies for cell, old, new in pairs]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), squeeze=False)
    for ax, (label, (env, algo, mult), old, new) in zip(axes[0], panels, strict=True):
        for before, after in zip(old, new, strict=True):
            values = [before["eval_mean"], after["eval_mean"]]
            ax.plot([0, 1], values, "-", color="0.6", lw=0.8)
            for x, record in zip((0, 1), (before, after), strict=True):
                collapsed = measures.count_collapses(record["curve"]) > 0
                ax.plot(x, record["eval_mean"], "x" if collapsed else "o", color="tab:red" if collapsed else "tab:blue", ms=5)
        ax.set_xticks([0, 1], ["grid", "anchored"])
        ax.set_xlim(-0.3, 1.3)
        ax.set_title(f"{algo}, {env} x{mult:g}\n{label}", fontsize=8)
    axes[0][0].set_ylabel("evaluation return (a line per seed, x: collapsed)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def report(tier: str = "full") -> str:
    grid = run_records.group_records(run_records.load_records(tier))
    sections: list[str] = []
    studies = []
    summary = [
        "| anchor | env | lr | algo | seeds | eval return grid / anchored (mean) | collapses grid / anchored |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(p for p in FOLDER.glob("lag*_x*") if p.is_dir()):
        side = run_records.group_records(run_records.read_folder(path / "runs" / tier))
        if not side:
            continue
        lag, multiple = path.name[3:].split("_x")
        label = f"lag {lag}, drift target {multiple} x target_kl"
        pairs = side_studies.paired_runs(grid, side)
        studies.append((label, pairs))
        for (env, algo, mult), old, new in pairs:
            collapses = [sum(measures.count_collapses(r["curve"]) for r in records) for records in (old, new)]
            means = [np.mean([r["eval_mean"] for r in records]) for records in (old, new)]
            summary.append(
                f"| {label} | {env} | x{mult:g} | {algo} | {len(new)} | {means[0]:.1f} / {means[1]:.1f} "
                f"| {collapses[0]} / {collapses[1]} |"
            )
        versions = sorted({r.get("code_version", "?") for rs in side.values() for r in rs})
        # the monitor's lag, not the anchor's
        drift_lags = sorted({r.get("drift_lag") for rs in side.values() for r in rs if r.get("drift_lag") is not None})
        sections += [
            f"## lag {lag} updates, drift target {multiple} x target_kl (code {', '.join(f'`{v}`' for v in versions)})",
            "",
            "| env | lr | algo | n " + side_studies.PAIRED_HEADER.format(a="grid", b="anchored"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *side_studies.paired_rows(grid, side),
            "",
            f"The drift (`kl/drift`, lag {', '.join(map(str, drift_lags))} updates, / target; mean over the run's updates)"
            " and the share of updates whose drift"
            f" exceeds the anchor's target ({multiple} x target_kl), in the grid's runs (where their records hold it)"
            " and in the anchored ones:",
            "",
            "| env | lr | algo | n | drift grid | drift anchored | over the anchor's target grid | anchored |",
            "|---|---|---|---|---|---|---|---|",
            *drift_rows(grid, side, float(multiple)),
            "",
        ]
    name = "drift_anchor" if tier == "full" else f"drift_anchor_{tier}"
    figure = []
    if any(pairs for _, pairs in studies):
        plot_pairs(studies, run_records.RESULTS / f"{name}.png")
        figure = [f"![evaluation returns, grid and anchored]({name}.png)", "", *summary, ""]
    lines = [
        "# Anchoring the policy to itself some updates before: does it stop the collapses?",
        "",
        *figure,
        "Generated by `python benchmarks/studies/drift_anchor.py --report` from the records in"
        " `benchmarks/results/drift_anchor/` (see the script's docstring for the method). *anchored*: the run with the"
        " anchor, *grid*: the grid's record of"
        " the same cell and seed (`benchmarks/results/runs/<tier>/`). Evaluation, AUC, in band, over 2x and collapses as"
        " in `learning.md`; difference of the evaluation returns (anchored - grid) with its Welch p-value: tie when"
        f" p ≥ {significance.SIGNIFICANCE}. The drift target is `multiple` x the run's target_kl; beta_ref starts at"
        f" {INITIAL_REF_KL_COEF}.",
        "",
        *sections,
    ]
    text = "\n".join(lines)
    (run_records.RESULTS / f"{name}.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", choices=list(grid.KL_PENALIZED_ALGOS), default=["klppo_noclip"])
    parser.add_argument("--envs", nargs="+", choices=grid.MAIN_ENVS, default=["Hopper-v5"])
    parser.add_argument("--seeds", nargs="+", default=["0..9"], help="seeds, or inclusive ranges such as 0..4")
    parser.add_argument("--lag", type=int, default=10, help="updates between the policy and its anchor")
    parser.add_argument("--multiple", type=float, default=10.0, help="drift target, as a multiple of target_kl")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--tier", choices=list(grid.BUDGETS), default="full", help="budget tier (as learning.py's)")
    parser.add_argument("--report", action="store_true", help="only rewrite the table from the records")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.tier))
        return
    if args.lag < 1 or not args.multiple > 0:
        parser.error("--lag must be >= 1 and --multiple > 0")
    seeds = learning.seed_list(args.seeds)
    version = run_records.code_version("settings.py", "learning.py", f"studies/{Path(__file__).name}")
    specs = []
    for env_id in args.envs:
        for algo in args.algos:
            for seed in seeds:
                folder = records_folder(args.lag, args.multiple, args.tier)
                if run_records.find_record(folder, run_records.record_name(algo, env_id, 1.0, seed)) is not None:
                    continue
                overrides = dict(ref_kl_coef=INITIAL_REF_KL_COEF, ref_target_kl=args.multiple * target_of(algo, env_id))
                specs.append(
                    dict(algo=algo, env=env_id, seed=seed, lr_mult=1.0, tier=args.tier, overrides=overrides,
                         code_version=version, lag=args.lag, multiple=args.multiple)
                )  # fmt: skip
    print(f"{len(specs)} runs to do ({args.workers} workers)", flush=True)
    with multiprocessing.Pool(args.workers, maxtasksperchild=1) as pool:
        for record in pool.imap_unordered(run_one, specs):
            print(f"done {record['algo']} {record['env']} seed {record['seed']}: eval {record['eval_mean']:.1f}", flush=True)
    report(args.tier)


if __name__ == "__main__":
    main()
