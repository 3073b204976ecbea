"""
MaskableKLPPO beside sb3-contrib's MaskablePPO on a masked task: returns, exact per-update KL, KL-band share and
collapses, on the same seeds, settings and machine (the same measures as ``learning.py``, whose helpers are reused).

Task: ``InvalidActionMultiDiscrete-v0`` (sb3-contrib's identity task with invalid actions: 3 sub-actions of 10 choices,
15 of the 30 invalid at each step, registered by ``sb3_kl.zoo.registry.MASKED_ENVS``). Settings: the shipped zoo config
``sb3_kl/hyperparams/klppo_mask.yml`` for both algorithms; MaskablePPO keeps its own ``clip_range=0.2`` and has no KL
options, MaskableKLPPO uses the config as is (no ratio clip, ``target_kl`` 0.02). The KL of both is measured by
``KLMonitorCallback`` (exact forward KL between the masked rollout and updated policies, summed over sub-actions).
Evaluation: sb3-contrib's ``evaluate_policy`` with the env's masks, deterministic.

Each finished run writes ``benchmarks/results/maskable_runs/<algo>__s<seed>.json``; ``--report`` regenerates
``benchmarks/results/maskable_learning.md`` and ``maskable_learning.png`` from them.

    nice -n 5 python benchmarks/maskable_learning.py --seeds 0 1 2 --workers 2
    python benchmarks/maskable_learning.py --report
"""

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from grid import BAND  # noqa: E402
from aggregate import probability_of_improvement, probability_of_improvement_ci  # noqa: E402
from measures import count_collapses, summarize  # noqa: E402
from run_records import code_version, run_environment, trained_steps  # noqa: E402
from significance import SIGNIFICANCE, fmt, verdict  # noqa: E402

RESULTS = HERE / "results"
RUNS = RESULTS / "maskable_runs"
ENV_ID = "InvalidActionMultiDiscrete-v0"
ALGOS = ("maskable_ppo", "maskable_klppo")
N_EVAL_EPISODES = 10
CONFIG = HERE.parent / "sb3_kl" / "hyperparams" / "klppo_mask.yml"
#: Keys of the zoo config that are not constructor arguments
ZOO_KEYS = ("n_envs", "n_timesteps", "policy", "normalize")
#: MaskableKLPPO options MaskablePPO does not have (its ``target_kl`` would be an early stop: left at None)
KL_ONLY_KEYS = ("target_kl",)


def settings() -> tuple[dict[str, Any], int, int]:
    """The shipped config of the task: constructor arguments, number of envs, budget."""
    config = yaml.safe_load(CONFIG.read_text())[ENV_ID]
    kwargs = {key: value for key, value in config.items() if key not in ZOO_KEYS}
    return kwargs, int(config["n_envs"]), int(config["n_timesteps"])


def register_env() -> None:
    import gymnasium as gym

    from sb3_kl.zoo.registry import MASKED_ENVS  # the zoo's registration, without importing rl_zoo3's scripts

    entry_point, env_kwargs = MASKED_ENVS[ENV_ID]
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point=entry_point, kwargs=env_kwargs)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """
    Train, evaluate and write the record of one run (executed in a worker process).

    :param spec: the run: ``algo`` and ``seed``
    :return: its record; ``trained_steps`` is the steps it trained (``learn`` ends with the rollout in which the budget
        is reached, so up to one rollout more than ``budget``) and ``env_steps_per_second`` is ``trained_steps /
        train_seconds`` (records made before ``trained_steps`` was stored hold ``budget / train_seconds`` there; the
        report reads the steps trained with ``run_records.trained_steps``)
    """
    import torch as th

    th.set_num_threads(1)
    from sb3_contrib import MaskablePPO
    from sb3_contrib.common.maskable.evaluation import evaluate_policy
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_kl import MaskableKLPPO
    from sb3_kl.callbacks import KLMonitorCallback

    register_env()
    algo, seed = spec["algo"], spec["seed"]
    kwargs, n_envs, budget = settings()
    if algo == "maskable_ppo":
        kwargs = {key: value for key, value in kwargs.items() if key not in KL_ONLY_KEYS}
    target_kl = float(kwargs.get("target_kl", 0.02))  # MaskablePPO: the discrete family default
    env = make_vec_env(ENV_ID, n_envs=n_envs, seed=seed)
    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            if len(self.model.ep_info_buffer) > 0:
                curve.append((self.num_timesteps, float(np.mean([info["r"] for info in self.model.ep_info_buffer]))))

    monitor = KLMonitorCallback()
    algorithm = MaskablePPO if algo == "maskable_ppo" else MaskableKLPPO
    model = algorithm("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    start = time.perf_counter()
    model.learn(budget, callback=CallbackList([Curve(), monitor]))
    train_seconds = time.perf_counter() - start
    steps = int(model.num_timesteps)  # past the budget: learn() ends with the rollout in which it is reached

    eval_env = make_vec_env(ENV_ID, n_envs=1, seed=10_000 + seed)
    returns, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=N_EVAL_EPISODES, deterministic=True, return_episode_rewards=True, warn=False
    )
    record = dict(
        algo=algo,
        env=ENV_ID,
        seed=seed,
        lr_mult=1.0,
        budget=budget,
        trained_steps=steps,
        n_envs=n_envs,
        hyperparameters={key: repr(value) for key, value in kwargs.items()},
        target_kl=target_kl,
        eval_returns=[float(r) for r in returns],
        eval_mean=float(np.mean(returns)),
        curve=curve,
        kl_updates=[
            dict(timesteps=int(entry["num_timesteps"]), mean=float(entry["mean"]), p99=float(entry["p99"]))
            for entry in monitor.history
        ],
        kl_source="sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed over sub-actions, masked)",
        train_seconds=train_seconds,
        env_steps_per_second=steps / train_seconds,
        torch_threads=1,
        code_version=code_version(),
        run_environment=run_environment(),
    )
    RUNS.mkdir(parents=True, exist_ok=True)
    (RUNS / f"{algo}__s{seed}.json").write_text(json.dumps(record, indent=1))
    print(f"{algo} seed {seed}: eval {record['eval_mean']:.1f}, {train_seconds:.0f} s", flush=True)
    return record


def load_records() -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(RUNS.glob("*.json"))] if RUNS.exists() else []


#: The report's measures: (label, key of ``measures.summarize``, digits, percent, whether higher is better; None: a
#: measure without a better side, whose significant differences are called ``differs``)
MEASURES = [
    ("evaluation return (10 masked deterministic episodes)", "eval_mean", 1, False, True),
    ("area under the learning curve (mean training return)", "auc", 1, False, True),
    ("per-update KL, mean", "kl_mean", 4, False, None),
    ("per-update KL, p99 (mean over updates)", "kl_p99", 4, False, False),
    ("updates with KL in [0.5, 2] x 0.02", "in_band", 1, True, True),
    ("collapses", "collapses", 1, False, False),
]


def difference_cell(ours: list[float], theirs: list[float], higher_is_better: bool | None) -> str:
    """
    :return: ``significance.verdict``'s difference of the means (ours - theirs) with its Welch p-value and *better* /
        *worse* (in bold, as ``learning.py`` marks it) only when p < ``SIGNIFICANCE``, *tie* otherwise; ``differs`` for
        a significant difference of a measure without a better side
    """
    text, result = verdict(ours, theirs, bool(higher_is_better))
    if higher_is_better is None and result != "tie":
        result = "differs"
    return f"{text}: {'**' + result + '**' if result == 'worse' else result}"


def steps_per_second(record: dict[str, Any]) -> float:
    """A run's env-steps/s: the steps it trained (``run_records.trained_steps``) over its training time."""
    return (trained_steps(record) or record["budget"]) / record["train_seconds"]


def paired_speed_ratios(by_algo: dict[str, list[dict[str, Any]]]) -> dict[int, float]:
    """
    :return: per seed that both algorithms have, MaskableKLPPO's env-steps/s over MaskablePPO's (the runs are queued
        seed by seed, so a seed's two runs train close in time, under a similar load of the machine)
    """
    ppo = {r["seed"]: r for r in by_algo["maskable_ppo"]}
    return {
        r["seed"]: steps_per_second(r) / steps_per_second(ppo[r["seed"]])
        for r in sorted(by_algo["maskable_klppo"], key=lambda r: r["seed"])
        if r["seed"] in ppo
    }


def report() -> None:
    """Write ``results/maskable_learning.md`` and ``maskable_learning.png`` from the records in ``RUNS``."""
    records = load_records()
    by_algo = {algo: [r for r in records if r["algo"] == algo] for algo in ALGOS}
    summaries = {algo: [summarize(r) for r in runs] for algo, runs in by_algo.items()}
    kwargs, n_envs, budget = settings()
    versions = sorted({r["code_version"] for r in records})
    trained = sorted({trained_steps(r) or r["budget"] for r in records})
    header = [
        "# MaskableKLPPO beside MaskablePPO on a masked task",
        "",
        "![curves and KL](maskable_learning.png)",
        "",
    ]
    lines = [
        "## Method",
        "",
        "Generated by `python benchmarks/maskable_learning.py --report` from the JSON records in"
        f" `benchmarks/results/maskable_runs/` (commit of sb3-kl that produced them: {', '.join(versions)}).",
        "",
        f"Task: `{ENV_ID}`, sb3-contrib's `InvalidActionEnvMultiDiscrete(dims=[10, 10, 10], n_invalid_actions=15)`"
        " (reward 1 when the action equals the observed state, 100 steps per episode, half of the 30 choices masked at"
        f" each step). {n_envs} envs, a budget of {budget:,} steps per run (`learn` ends with the rollout in which it is"
        f" reached: the runs trained {', '.join(f'{steps:,}' for steps in trained)} steps, from their records),"
        " settings of the shipped zoo config `sb3_kl/hyperparams/klppo_mask.yml` for both:"
        f" {', '.join(f'{k}={v}' for k, v in kwargs.items())}."
        " MaskablePPO keeps its `clip_range=0.2` and its `target_kl=None` (no early stop); MaskableKLPPO runs with"
        " no ratio clip and the KL target. KL: exact forward KL(old||new) between the masked rollout and updated"
        f" policies after every update (`KLMonitorCallback`); in-band: share of updates within [{BAND[0]}, {BAND[1]}] x"
        " 0.02 (MaskablePPO's band is the discrete family default). Collapses: `measures.count_collapses`."
        " Values: mean ± std over seeds (n per column below). Difference: the seed means' (maskable_klppo -"
        " maskable_ppo) with the two-sided Welch p-value (`significance.verdict`); *better* / *worse* only when"
        f" p < {SIGNIFICANCE}, *tie* otherwise (a difference inside the seed noise is a tie; lower is better for the KL"
        " tail and collapses; the mean KL has no better side: *differs*); shares differ in percentage points.",
    ]
    table = [
        "| measure | " + " | ".join(f"{algo} (n={len(by_algo[algo])})" for algo in ALGOS) + " | difference |",
        "|---|" + "---|" * (len(ALGOS) + 1),
    ]
    for label, key, digits, percent, higher_is_better in MEASURES:
        values = {algo: [s[key] for s in summaries[algo] if key in s] for algo in ALGOS}
        cells = [fmt(values[algo], digits, percent) for algo in ALGOS]
        scale = 100.0 if percent else 1.0  # a share's difference in percentage points
        difference = (
            difference_cell(
                [scale * v for v in values["maskable_klppo"]], [scale * v for v in values["maskable_ppo"]], higher_is_better
            )
            if all(values.values())
            else "n/a"
        )
        table.append(f"| {label} | " + " | ".join(cells) + f" | {difference} |")
    a, b = ([[s["eval_mean"] for s in summaries[algo]]] for algo in ("maskable_klppo", "maskable_ppo"))
    low, high = probability_of_improvement_ci(a, b)
    table += [
        "",
        f"Probability that a MaskableKLPPO run ends with a higher evaluation return than a MaskablePPO run (Agarwal et al.,"
        f" 2021, `aggregate.py`): {probability_of_improvement(a, b):.2f} (95 % bootstrap interval {low:.2f} to {high:.2f}).",
    ]
    lines = [*header, *table, "", *lines]
    ratios = paired_speed_ratios(by_algo)
    if ratios:
        lines += [
            "",
            "Speed (both with the KL monitor attached; the runs were queued seed by seed to 2 workers on 2 shared cores,"
            " so a seed's two runs trained close in time, under a similar load, and are compared with each other):"
            " MaskableKLPPO's env-steps/s (steps trained / training time) over MaskablePPO's, per seed: "
            + ", ".join(f"s{seed} {ratio:.2f}" for seed, ratio in ratios.items())
            + f"; median {np.median(list(ratios.values())):.2f} x (from {min(ratios.values()):.2f} to"
            f" {max(ratios.values()):.2f} over {len(ratios)} seeds: the load of a shared machine makes this a rough"
            " figure).",
        ]
    lines += ["", "Per seed (evaluation return, collapses):", ""]
    for algo in ALGOS:
        per_seed = ", ".join(f"s{r['seed']}: {r['eval_mean']:.1f} / {count_collapses(r['curve'])}" for r in by_algo[algo])
        lines.append(f"- {algo}: {per_seed}")
    lines.append("")
    (RESULTS / "maskable_learning.md").write_text("\n".join(lines))
    plot(by_algo)


def plot(by_algo: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"maskable_ppo": "tab:blue", "maskable_klppo": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, ax in zip(("curves", "kl"), axes, strict=True):
        for algo, runs in by_algo.items():
            series = [r["curve"] if kind == "curves" else [(u["timesteps"], u["mean"]) for u in r["kl_updates"]] for r in runs]
            series = [s for s in series if len(s) > 1]
            if not series:
                continue
            grid = np.linspace(max(s[0][0] for s in series), min(s[-1][0] for s in series), 100)
            values = np.array([np.interp(grid, *np.array(s, dtype=float).T) for s in series])
            ax.plot(grid, values.mean(axis=0), color=colors[algo], label=f"{algo} (n={len(series)})")
            ax.fill_between(grid, values.min(axis=0), values.max(axis=0), color=colors[algo], alpha=0.2)
        if kind == "kl":
            ax.axhspan(BAND[0] * 0.02, BAND[1] * 0.02, color="grey", alpha=0.15, label="band around 0.02")
            ax.set_yscale("log")
            ax.set_ylabel("per-update KL(old||new), masked")
        else:
            ax.set_ylabel("training episode return")
        ax.set_xlabel("timesteps")
        ax.set_title(ENV_ID)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "maskable_learning.png", dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only regenerate the table and figure from the records")
    args = parser.parse_args()
    if not args.report:
        # interleaved (seed-major), so that both algorithms see the same machine load
        specs = [dict(algo=algo, seed=seed) for seed in args.seeds for algo in args.algos]
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for _ in pool.imap_unordered(run_one, specs):
                pass
    report()


if __name__ == "__main__":
    main()
