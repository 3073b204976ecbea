"""
The learning grid's figures: learning curves and per-update KL timelines, one PNG each per grid, and each side study's
evaluation returns beside the grid's.
"""

from pathlib import Path
from typing import Any

import numpy as np

import run_records
from grid import ALL_ALGOS, BAND, MAIN_ENVS, cell_order
from run_records import group_records


def plot(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str], algos: list[str], suffix: str) -> None:
    """Learning curves with seed bands, and KL timelines on a log scale with the target band, one PNG each per grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ["tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:olive", "tab:red", "tab:purple", "tab:brown"]
    palette += ["tab:pink", "tab:gray"]  # kltrpo_matched's and klppo_auto's, after trpl's brown
    colors = dict(zip(ALL_ALGOS, palette, strict=True))
    for lr_mult in sorted({k[2] for k in groups}):
        grid_envs = [e for e in envs if any((e, a, lr_mult) in groups for a in algos)]
        if not grid_envs:
            continue
        tag = "" if lr_mult == 1.0 else f"_lr{lr_mult:g}"
        for kind in ("curves", "kl"):
            fig, axes = plt.subplots(1, len(grid_envs), figsize=(4.5 * len(grid_envs), 3.6), squeeze=False)
            for ax, env in zip(axes[0], grid_envs, strict=True):
                for algo in algos:
                    runs = groups.get((env, algo, lr_mult), [])
                    series = [
                        r["curve"] if kind == "curves" else [(u["timesteps"], u["mean"]) for u in r["kl_updates"]]
                        for r in runs
                    ]
                    series = [s for s in series if len(s) > 1]
                    if not series:
                        continue
                    grid = np.linspace(max(s[0][0] for s in series), min(s[-1][0] for s in series), 100)
                    values = np.array([np.interp(grid, *np.array(s, dtype=float).T) for s in series])
                    mean = values.mean(axis=0)
                    ax.plot(grid, mean, color=colors[algo], label=algo)
                    ax.fill_between(grid, values.min(axis=0), values.max(axis=0), color=colors[algo], alpha=0.2)
                    if kind == "kl":
                        target = runs[0]["target_kl"]
                        ax.axhspan(BAND[0] * target, BAND[1] * target, color=colors[algo], alpha=0.06)
                if kind == "kl":
                    ax.set_yscale("log")
                    ax.set_ylabel("per-update KL(old||new)")
                else:
                    ax.set_ylabel("episode return")
                ax.set_title(env + ("" if lr_mult == 1.0 else f" (lr x{lr_mult:g})"))
                ax.set_xlabel("timesteps")
                ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(run_records.RESULTS / f"learning_{kind}{tag}{suffix}.png", dpi=90)
            plt.close(fig)


def plot_side_study(
    title: str,
    grid: dict[tuple[str, str, float], list[dict[str, Any]]],
    folders: dict[str, list[dict[str, Any]]],
    path: Path,
    baselines: dict[str, tuple[str, ...] | None] | None = None,
) -> bool:
    """
    A side study's figure: the evaluation return of every seed (dots) and their mean (a bar) in each cell the study's
    records folders hold, the grid's runs of those cells beside them; a panel per environment.

    :param grid: the grid's records, grouped by cell
    :param folders: the records of each of the study's folders, by label
    :param baselines: the folders the study compares against, by label, with the algorithms of theirs it compares
        with on the studied tasks (None: only the cells the other folders have)
    :return: whether there was anything to draw
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"grid": grid, **{label: group_records(records) for label, records in folders.items()}}
    baselines = baselines or {}
    studied = {cell for label, groups in series.items() if label != "grid" and label not in baselines for cell in groups}
    for label, algos in baselines.items():
        tasks = {(env, mult) for env, _, mult in studied}
        studied |= {c for c in series.get(label, {}) if algos and c[1] in algos and (c[0], c[2]) in tasks}
    cells = sorted(studied, key=cell_order)
    envs = [env for env in MAIN_ENVS if any(cell[0] == env for cell in cells)]
    if not envs:
        return False
    fig, axes = plt.subplots(1, len(envs), figsize=(max(7.0, 3.4 * len(envs)), 4.0), squeeze=False)
    colors = plt.get_cmap("tab10")
    width = 0.8 / len(series)
    labelled: set[str] = set()
    for ax, env in zip(axes[0], envs, strict=True):
        env_cells = [cell for cell in cells if cell[0] == env]
        for i, (label, groups) in enumerate(series.items()):
            for x, cell in enumerate(env_cells):
                returns = [r["eval_mean"] for r in groups.get(cell, [])]
                if not returns:
                    continue
                position = x - 0.4 + (i + 0.5) * width
                ax.plot([position] * len(returns), returns, "o", color=colors(i), markersize=3, alpha=0.7)
                name = None if label in labelled else label
                labelled.add(label)
                ax.plot([position], [np.mean(returns)], "_", color=colors(i), markersize=14, markeredgewidth=2, label=name)
        ax.set_xticks(range(len(env_cells)), [f"{algo}\nx{mult:g}" for _, algo, mult in env_cells], fontsize=7)
        ax.set_xlim(-0.5, len(env_cells) - 0.5)
        ax.set_title(env, fontsize=9)
        ax.set_ylabel("evaluation return (dots: seeds, bar: mean)", fontsize=7)
    handles = [h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in axes[0] for lab in ax.get_legend_handles_labels()[1]]
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=min(len(labels), 2))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.02 + 0.05 * ((len(labels) - 1) // 2 + 1), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return True
