"""
How much of its trust region KLTRPO uses: the mean per-update KL(old||new) (summed over action dimensions, KLTRPO's
default convention) divided by ``target_kl``, measured from outside by ``KLMonitorCallback`` on the whole rollout
buffer, on the six environments of the learning grid at rl-zoo's TRPO settings (``settings.py``), over the first
updates of training. Two line searches side by side, same seeds:

- ``grow``: KLTRPO's default, the largest measured-feasible step (``line_search_grow_iter=5``);
- ``backtrack``: ``line_search_grow_iter=0``, TRPO's backtracking from the quadratic model's step (what KLTRPO did
  before the step could grow).

Also counts the updates whose measured mean KL (or p99, when ``tail_kl`` is set) is over its bound (must be 0).
Writes ``benchmarks/results/kltrpo_budget_use.md``, ``.json`` (each record names the commit that produced it) and
``.png``; ``--report`` rewrites the page and its figure from the JSON alone, without training.

    python benchmarks/studies/kltrpo_budget_use.py [--updates 8] [--seeds 0 1] [--envs CartPole-v1 ...]
    python benchmarks/studies/kltrpo_budget_use.py --report
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

ENVS = ["CartPole-v1", "Pendulum-v1", "Acrobot-v1", "LunarLanderContinuous-v3", "Hopper-v5", "HalfCheetah-v5"]
VARIANTS = {"grow": {}, "backtrack": {"line_search_grow_iter": 0}}
GOAL = 0.85
# float32 round-off between the line search's forward pass and the monitor's
REL_TOL = 1e-4


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when the package or this script had uncommitted changes."""
    return run_records.code_version("settings.py", f"studies/{Path(__file__).name}")


def run(env_id: str, variant: str, seed: int, n_updates: int) -> dict[str, Any]:
    """Train KLTRPO for ``n_updates`` updates and return the per-update KL measured by the monitor."""
    import torch as th
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_kl import KLTRPO
    from sb3_kl.callbacks import KLMonitorCallback
    from settings import settings_for

    th.set_num_threads(1)
    setting = settings_for("kltrpo", env_id)
    kwargs = {**setting["kwargs"], **VARIANTS[variant]}
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    if setting["normalize"]:
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    logged: list[dict[str, float]] = []

    class LineSearchLog(BaseCallback):
        """The line search's own figures of each update (read at the start of the next rollout, or at the end)."""

        def _on_step(self) -> bool:
            return True

        def _read(self) -> None:
            values = self.model.logger.name_to_value
            if "train/step_size_ratio" in values and len(logged) < self.model._n_updates:
                logged.append(
                    dict(
                        step_size_ratio=float(values["train/step_size_ratio"]),
                        line_search_steps=int(values["train/line_search_steps"]),
                    )
                )

        def _on_rollout_start(self) -> None:
            self._read()

        def _on_training_end(self) -> None:
            self._read()

    monitor = KLMonitorCallback()
    model = KLTRPO("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    steps = n_updates * model.n_steps * env.num_envs
    start = time.perf_counter()
    model.learn(steps, callback=CallbackList([monitor, LineSearchLog()]))
    seconds = time.perf_counter() - start
    target_kl = float(model.target_kl(1.0))
    updates = [dict(mean=float(entry["mean"]), p99=float(entry["p99"])) for entry in monitor.history]
    for update, line_search in zip(updates, logged, strict=False):
        update.update(line_search)
    return dict(
        env=env_id,
        variant=variant,
        line_search_grow_iter=model.line_search_grow_iter,
        seed=seed,
        target_kl=target_kl,
        kl_convention=model.kl_settings.convention,
        monitor_convention=monitor.settings.convention,
        n_envs=env.num_envs,
        n_steps=model.n_steps,
        updates=updates,
        budget_use=float(np.mean([u["mean"] for u in updates]) / target_kl),
        over_target=int(sum(u["mean"] > target_kl * (1 + REL_TOL) for u in updates)),
        train_seconds=seconds,
        env_steps_per_second=steps / seconds,
        code_version=code_version(),
        run_environment=run_records.run_environment(),
    )


def plot_budget_use(records: list[dict[str, Any]], path: Path) -> None:
    """
    Draw each environment's budget use per line search (mean over seeds, and each seed) with the goal, to a PNG.

    :param records: The runs' records
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = [env_id for env_id in ENVS if any(r["env"] == env_id for r in records)]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / len(VARIANTS)
    for k, (variant, color) in enumerate(zip(VARIANTS, ("tab:blue", "tab:gray"), strict=True)):
        for i, env_id in enumerate(envs):
            uses = [r["budget_use"] for r in records if r["env"] == env_id and r["variant"] == variant]
            if not uses:
                continue
            x = i + (k - (len(VARIANTS) - 1) / 2) * width
            ax.bar(x, np.mean(uses), width, color=color, label=variant if i == 0 else None)
            ax.plot([x] * len(uses), uses, ".", color="black", ms=3)
    ax.axhline(GOAL, color="tab:red", lw=1, ls="--", label=f"goal {GOAL:g} (grow)")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(envs)), [env_id.replace("Continuous", "Cont.") for env_id in envs], fontsize=8)
    ax.set_ylabel("mean update KL / target_kl")
    ax.set_title("KLTRPO: share of the trust region each update uses (bar: mean over seeds, dot: a seed)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(records: list[dict[str, Any]]) -> list[str]:
    """:return: the page's opening table: per line search, the budget use over environments and the updates over target"""
    lines = [
        "| line search | environments | budget use (mean of the environments, min to max) | updates over target | "
        "environments meeting the goal |",
        "|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        group = [r for r in records if r["variant"] == variant]
        envs = [env_id for env_id in ENVS if any(r["env"] == env_id for r in group)]
        if not envs:
            continue
        uses = [float(np.mean([r["budget_use"] for r in group if r["env"] == env_id])) for env_id in envs]
        over = sum(r["over_target"] for r in group)
        met = sum(
            use >= GOAL and sum(r["over_target"] for r in group if r["env"] == env_id) == 0
            for env_id, use in zip(envs, uses, strict=True)
        )
        lines.append(
            f"| {variant} | {len(envs)} | {np.mean(uses):.3f} ({min(uses):.3f} to {max(uses):.3f}) | {over} | "
            + (f"{met}/{len(envs)} (≥ {GOAL:g})" if variant == "grow" else "-")
            + " |"
        )
    return lines


def report(records: list[dict[str, Any]], command: str, figure: str | None = None) -> str:
    """
    The page, from the runs' records.

    :param records: The runs' records
    :param command: The command that made them
    :param figure: The name of the figure (:func:`plot_budget_use`) the page opens with, if any
    :return: the page's text
    """
    versions = sorted({r["code_version"] for r in records})
    lines = [
        "# KLTRPO: how much of the trust region each update uses",
        "",
        *([f"![budget use per environment]({figure})", ""] if figure else []),
        *summary_table(records),
        "",
        f"Generated by `{command}` (code: {', '.join(f'`{v}`' for v in versions)}).",
        "",
        "Budget use = mean over updates of the per-update mean KL(old||new), summed over action dimensions, measured "
        "from outside by `KLMonitorCallback` on the whole rollout buffer, divided by `target_kl` (KLTRPO's constraint, "
        "same convention). rl-zoo TRPO settings from `benchmarks/settings.py`, first updates of training. `grow`: "
        "KLTRPO's line search (the largest measured-feasible step along the natural gradient, "
        "`line_search_grow_iter=5`); `backtrack`: `line_search_grow_iter=0`, TRPO's backtracking from the quadratic "
        f"model's step. Goal: budget use >= {GOAL} with `grow` on every environment, 0 updates over `target_kl`.",
        "",
        "| env | target_kl | line search | seeds | updates | budget use (mean over seeds) | min per-update KL / target "
        "| updates over target | step / quadratic step (median) | candidates per update (mean) | goal met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for env_id in ENVS:
        for variant in VARIANTS:
            group = [r for r in records if r["env"] == env_id and r["variant"] == variant]
            if not group:
                continue
            target = group[0]["target_kl"]
            per_update = [u for r in group for u in r["updates"]]
            use = float(np.mean([r["budget_use"] for r in group]))
            ratios = [u["step_size_ratio"] for u in per_update if "step_size_ratio" in u]
            candidates = [u["line_search_steps"] for u in per_update if "line_search_steps" in u]
            over = sum(r["over_target"] for r in group)
            met = "yes" if use >= GOAL and over == 0 else "no"
            lines.append(
                f"| {env_id} | {target:g} | {variant} | {len(group)} | {len(per_update)} | {use:.3f} | "
                f"{min(u['mean'] for u in per_update) / target:.3f} | {over} | "
                f"{np.median(ratios) if ratios else float('nan'):.2f} | "
                f"{np.mean(candidates) if candidates else float('nan'):.1f} | {met if variant == 'grow' else '-'} |"
            )
    lines += [
        "",
        "Step / quadratic step > 1: the accepted step grew past the quadratic model's step (the model overestimated "
        "the KL); < 1: it was shrunk. Candidates per update: forward passes of the line search (two per candidate "
        "with `sub_sampling_factor > 1`). The speed against sb3-contrib TRPO is measured by `benchmarks/overhead.py`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--envs", nargs="+", choices=ENVS, default=ENVS)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kltrpo_budget_use.md")
    parser.add_argument("--report", action="store_true", help="only rewrite --out and its figure from the JSON beside it")
    args = parser.parse_args(argv)
    json_path = args.out.with_suffix(".json")
    figure = args.out.with_suffix(".png")
    if args.report:
        saved = json.loads(json_path.read_text())
        plot_budget_use(saved["records"], figure)
        args.out.write_text(report(saved["records"], saved["command"], figure.name))
        return
    command = "python benchmarks/studies/kltrpo_budget_use.py " + " ".join(sys.argv[1:] if argv is None else argv)
    records = []
    for env_id in args.envs:
        for variant in args.variants:
            for seed in args.seeds:
                record = run(env_id, variant, seed, args.updates)
                records.append(record)
                print(f"{env_id} {variant} seed {seed}: budget use {record['budget_use']:.3f}", flush=True)
                # written as the runs finish
                json_path.write_text(json.dumps(dict(command=command.strip(), records=records), indent=1))
    plot_budget_use(records, figure)
    args.out.write_text(report(records, command.strip(), figure.name))


if __name__ == "__main__":
    main()
