"""The learning grid's figures: learning curves and per-update KL timelines, one PNG each per grid."""

from typing import Any

import numpy as np

import run_records
from grid import ALL_ALGOS, BAND


def plot(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str], algos: list[str], suffix: str) -> None:
    """Learning curves with seed bands, and KL timelines on a log scale with the target band, one PNG each per grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ["tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:olive", "tab:red", "tab:purple", "tab:pink"]
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
