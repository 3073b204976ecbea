"""
How ``learning_rate="auto"`` adapts, chosen by measurement: three rules that all adapt KLPPO's learning rate from the
exact KL, each from a rate 100x too small, the task's rate and 10x it, on seeds outside the grid's.

- ``step_scale`` (what ``learning_rate="auto"`` does): the update's whole step is scaled onto the target on the exact
  KL over the rollout's states, and the next rate is the last times the scale.
- ``between_updates``: no scale; after each update the rate is multiplied by ``sqrt(target / KL)`` (within 1/4..4).
- ``per_minibatch``: no scale; after every optimizer step the rate is divided by 1.5 when that minibatch's KL (before
  the step) is above 2 x target and multiplied by 1.5 below target / 2 (rsl_rl's "adaptive" schedule).
- ``fixed``: KLPPO at the starting rate, not adapted (the baseline).

Measured from outside by ``KLMonitorCallback`` (exact KL(old||new) summed over action dimensions, each update's mean
over its rollout's states): the share of updates in [0.5, 2] x target, and the deterministic return over 10 episodes.

    python benchmarks/studies/auto_learning_rate.py            # the missing runs, then the page
    python benchmarks/studies/auto_learning_rate.py --report

Records: ``benchmarks/results/auto_learning_rate.json`` (one per run, written as each finishes, each naming its commit
and machine); page ``benchmarks/results/auto_learning_rate.md`` and its figure.
"""

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = run_records.MAIN_RESULTS
RECORDS = RESULTS / "auto_learning_rate.json"
PAGE = RESULTS / "auto_learning_rate.md"
FIGURE = RESULTS / "auto_learning_rate.png"
RULES = ("step_scale", "between_updates", "per_minibatch", "fixed")
MULTIPLIERS = (0.01, 1.0, 10.0)
BAND = (0.5, 2.0)
#: The quickstart's settings (examples/quickstart.py) and rl-zoo's Pendulum-v1 entry
TASKS: dict[str, dict[str, Any]] = {
    "CartPole-v1": dict(
        steps=20_000,
        n_envs=1,
        kwargs=dict(n_steps=256, batch_size=256, n_epochs=10, gamma=0.98, gae_lambda=0.8),
        learning_rate=1e-3,
        seeds=(10, 11, 12, 13, 14),
    ),
    "Pendulum-v1": dict(
        steps=100_000,
        n_envs=4,
        kwargs=dict(n_steps=1024, gae_lambda=0.95, gamma=0.9, n_epochs=10, clip_range=0.2, use_sde=True, sde_sample_freq=4),
        learning_rate=1e-3,
        seeds=(10,),  # one seed: five minutes a run beside the learning-rate sweep
    ),
}


@functools.cache
def code_version() -> str:
    return run_records.code_version("studies/auto_learning_rate.py")


def rule_class(rule: str) -> type:
    """:return: KLPPO adapting its rate by ``rule`` (``step_scale`` is KLPPO itself)"""
    from stable_baselines3.common.utils import update_learning_rate

    from sb3_kl import KLPPO

    def clipped(model: Any, rate: float) -> float:
        return min(max(rate, model.lr_bounds[0]), model.lr_bounds[1])

    class BetweenUpdates(KLPPO):
        def _measure_final_update_kl(self, target_kl: float, measured: Any = None) -> Any:
            self._step_start = None
            per_state, params = measured or self._measure_update_kl()
            kl = float(np.mean(per_state))
            factor = min(max(math.sqrt(target_kl / kl), 0.25), 4.0) if kl > 0 else 4.0
            self.adapted_learning_rate = clipped(self, self.adapted_learning_rate * factor)
            return per_state, params

    class PerMinibatch(KLPPO):
        def _kl_penalty(self, kl: Any, kl_coef: float, target_kl: float) -> Any:
            self._minibatch_kl = (kl.detach(), target_kl)
            return super()._kl_penalty(kl, kl_coef, target_kl)

        def _optimizer_step(self, loss: Any, optimizer: Any = None) -> Any:
            applied = super()._optimizer_step(loss, optimizer)
            kl, target = float(self._minibatch_kl[0]), self._minibatch_kl[1]
            rate = self.adapted_learning_rate
            rate = rate / 1.5 if kl > 2 * target else rate * 1.5 if kl < target / 2 else rate
            self.adapted_learning_rate = clipped(self, rate)
            update_learning_rate(self.policy.optimizer, self.adapted_learning_rate)
            return applied

        def _measure_final_update_kl(self, target_kl: float, measured: Any = None) -> Any:
            self._step_start = None
            return measured or self._measure_update_kl()

    return {"step_scale": KLPPO, "between_updates": BetweenUpdates, "per_minibatch": PerMinibatch, "fixed": KLPPO}[rule]


def run_key(record: dict[str, Any]) -> tuple[str, str, float, int]:
    return record["rule"], record["env"], record["lr_mult"], record["seed"]


def read_records() -> list[dict[str, Any]]:
    return run_records.read_json_list(RECORDS)


def append(record: dict[str, Any]) -> None:
    """Add a finished run to the records file (a run made again replaces its record)."""
    run_records.replace_in_json_list(RECORDS, record, run_key)


def run_one(rule: str, env_id: str, lr_mult: float, seed: int) -> dict[str, Any]:
    """Train one run and return its record."""
    import torch as th
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    from sb3_kl.callbacks import KLMonitorCallback

    th.set_num_threads(1)
    task = TASKS[env_id]
    start = task["learning_rate"] * lr_mult
    rates: list[float] = []

    class Rates(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            if "train/learning_rate" in self.model.logger.name_to_value:
                rates.append(float(self.model.logger.name_to_value["train/learning_rate"]))

    monitor = KLMonitorCallback()
    env = make_vec_env(env_id, n_envs=task["n_envs"], seed=seed)
    learning_rate = start if rule == "fixed" else f"auto_{start:g}"
    model = rule_class(rule)("MlpPolicy", env, learning_rate=learning_rate, seed=seed, device="cpu", **task["kwargs"])
    model.learn(task["steps"], callback=CallbackList([monitor, Rates()]))
    returns, _ = evaluate_policy(
        model,
        make_vec_env(env_id, n_envs=1, seed=10_000 + seed),
        n_eval_episodes=10,
        deterministic=True,
        return_episode_rewards=True,
    )
    target = float(model.target_kl(1.0))
    return dict(
        rule=rule,
        env=env_id,
        lr_mult=lr_mult,
        seed=seed,
        start_learning_rate=start,
        steps=task["steps"],
        target_kl=target,
        kl_ratios=[float(e["mean"]) / target for e in monitor.history],
        learning_rates=rates,
        eval_returns=[float(r) for r in returns],
        code_version=code_version(),
        run_environment=run_records.run_environment(),
    )


def in_band(ratios: list[float], skip: int = 0) -> float:
    later = ratios[skip:]
    return float(np.mean([BAND[0] <= r <= BAND[1] for r in later])) if later else float("nan")


def report() -> str:
    """Write the page and its figure from the records; :return: the page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records()
    cells: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["env"], r["rule"], r["lr_mult"]), []).append(r)
    envs = [e for e in TASKS if any(k[0] == e for k in cells)]
    fig, axes = plt.subplots(1, max(len(envs), 1), figsize=(5 * max(len(envs), 1), 3.6), squeeze=False)
    for ax, env in zip(axes[0], envs, strict=False):
        for rule in RULES:
            for mult, style in zip(MULTIPLIERS, (":", "-", "--"), strict=True):
                for i, r in enumerate(cells.get((env, rule, mult), [])):
                    ax.plot(
                        r["kl_ratios"],
                        style,
                        color=f"C{RULES.index(rule)}",
                        lw=1,
                        alpha=0.8,
                        label=f"{rule} x{mult:g}" if i == 0 else None,
                    )
        ax.axhspan(*BAND, color="grey", alpha=0.15)
        ax.set_yscale("log")
        ax.set_title(env)
        ax.set_xlabel("update")
        ax.set_ylabel("exact KL / target")
    axes[0][0].legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=110)
    plt.close(fig)

    lines = [
        '# How `learning_rate="auto"` adapts: three rules beside the fixed rate',
        "",
        "![KL / target per update, each rule and starting rate](auto_learning_rate.png)",
        "",
        "| task | rule | start (x rate) | in [0.5, 2] x target | after update 5 | return (mean of seeds) | final rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for env in envs:
        for rule in RULES:
            for mult in MULTIPLIERS:
                runs = cells.get((env, rule, mult), [])
                if not runs:
                    continue
                ratios = [x for r in runs for x in r["kl_ratios"]]
                later = [x for r in runs for x in r["kl_ratios"][5:]]
                mean_return = np.mean([np.mean(r["eval_returns"]) for r in runs])
                final = np.mean([r["learning_rates"][-1] for r in runs if r["learning_rates"]])
                lines.append(
                    f"| {env} | `{rule}` | x{mult:g} | {in_band(ratios):.0%} | {in_band(later):.0%} | "
                    f"{mean_return:.1f} | {final:.2g} |"
                )
    overall = {rule: in_band([x for r in records if r["rule"] == rule for x in r["kl_ratios"]]) for rule in RULES}
    lines += [
        "",
        "Over all cells, updates in band: " + ", ".join(f"`{rule}` {overall[rule]:.0%}" for rule in RULES) + ".",
        "",
        "## Setting",
        "",
        "KLPPO with `learning_rate=\"auto_<start>\"` (seeds "
        + "; ".join(f"{', '.join(map(str, task['seeds']))} on {env}" for env, task in TASKS.items())
        + ": outside the grid's), starting"
        f" at x{', x'.join(f'{m:g}' for m in MULTIPLIERS)} of each task's rate: CartPole-v1 with the quickstart's settings"
        " (20k steps, target 0.02), Pendulum-v1 with rl-zoo's entry, its clip included (100k steps, target 0.03)."
        " The KL is measured from outside (`KLMonitorCallback`: exact, forward, summed, mean over the rollout's states)."
        " Returns: 10 deterministic episodes on a separate environment.",
        "",
        run_records.provenance(records),
        "",
        "Made by `python benchmarks/studies/auto_learning_rate.py` (records: `auto_learning_rate.json`).",
    ]
    page = "\n".join(lines) + "\n"
    PAGE.write_text(page)
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--envs", nargs="+", choices=list(TASKS), default=list(TASKS))
    args = parser.parse_args(argv)
    if not args.report:
        done = {run_key(r) for r in read_records()}
        for env in args.envs:
            for mult in MULTIPLIERS:
                for seed in TASKS[env]["seeds"]:
                    for rule in RULES:
                        if (rule, env, mult, seed) in done:
                            continue
                        record = run_one(rule, env, mult, seed)
                        append(record)
                        print(
                            f"done {rule} {env} x{mult:g} seed {seed}: in band {in_band(record['kl_ratios']):.0%}, "
                            f"return {np.mean(record['eval_returns']):.1f}",
                            flush=True,
                        )
    print(report())


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
