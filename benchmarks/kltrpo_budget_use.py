"""
How much of its trust region KLTRPO uses: the mean per-update KL(old||new) (summed over action dimensions, KLTRPO's
default convention) divided by ``target_kl``, measured from outside by ``KLMonitorCallback`` on the whole rollout
buffer, on the six environments of the learning grid at rl-zoo's TRPO settings (``settings.py``), over the first
updates of training. Two line searches side by side, same seeds:

- ``grow``: KLTRPO's default, the largest measured-feasible step (``line_search_grow_iter=5``);
- ``backtrack``: ``line_search_grow_iter=0``, TRPO's backtracking from the quadratic model's step (what KLTRPO did
  before the step could grow).

Also counts the updates whose measured mean KL (or p99, when ``tail_kl`` is set) is over its bound (must be 0).
Writes ``benchmarks/results/kltrpo_budget_use.md`` and ``.json`` (each record names the commit that produced it).

    python benchmarks/kltrpo_budget_use.py [--updates 8] [--seeds 0 1] [--envs CartPole-v1 ...]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ENVS = ["CartPole-v1", "Pendulum-v1", "Acrobot-v1", "LunarLanderContinuous-v3", "Hopper-v5", "HalfCheetah-v5"]
VARIANTS = {"grow": {}, "backtrack": {"line_search_grow_iter": 0}}
GOAL = 0.85
# float32 round-off between the line search's forward pass and the monitor's
REL_TOL = 1e-4


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when the package or this script had uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = git("status", "--porcelain", "--", "../sb3_kl", "settings.py", Path(__file__).name)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) if commit else "unknown"


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
    )


def report(records: list[dict[str, Any]], command: str) -> str:
    versions = sorted({r["code_version"] for r in records})
    lines = [
        "# KLTRPO: how much of the trust region each update uses",
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
    args = parser.parse_args(argv)
    command = "python benchmarks/kltrpo_budget_use.py " + " ".join(sys.argv[1:] if argv is None else argv)
    records = []
    json_path = args.out.with_suffix(".json")
    for env_id in args.envs:
        for variant in args.variants:
            for seed in args.seeds:
                record = run(env_id, variant, seed, args.updates)
                records.append(record)
                print(f"{env_id} {variant} seed {seed}: budget use {record['budget_use']:.3f}", flush=True)
                # written as the runs finish
                json_path.write_text(json.dumps(dict(command=command.strip(), records=records), indent=1))
    args.out.write_text(report(records, command.strip()))


if __name__ == "__main__":
    main()
