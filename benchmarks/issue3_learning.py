"""
Issue 3 learning benchmark: ClipKLPPO beside PPO and KLTRPO beside sb3-contrib's TRPO, on CartPole-v1 and
Pendulum-v1 with rl-zoo3's tuned hyperparameters (rl_zoo3/hyperparams/{ppo,trpo}.yml, copied below; ``lin_x``
becomes SB3's ``LinearSchedule(x, 0, 1)``, i.e. ``x * progress_remaining``), 3 seeds, 10 deterministic
evaluation episodes after training.

Each (env, algorithm, seed) run appends one JSON line to ``benchmarks/results/issue3_learning_runs.jsonl``
(runs already there are skipped, so the script can be restarted or split across processes with ``--env``/``--algo``;
``--force`` runs them again). Each record names the sb3-kl commit that made it (``code_version``); the report uses the
newest record of each (env, algorithm, seed), and the older ones stay in the file as history.
``--report`` writes the markdown table ``benchmarks/results/issue3_learning.md`` from those lines.

    nice -n 10 python benchmarks/issue3_learning.py --env CartPole-v1
    nice -n 10 python benchmarks/issue3_learning.py --env Pendulum-v1
    python benchmarks/issue3_learning.py --report
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import sb3_contrib
import stable_baselines3
import torch as th
from sb3_contrib import TRPO
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

from sb3_kl import KLTRPO, ClipKLPPO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import code_version
from settings import PPO_SETTINGS, TRPO_SETTINGS

RESULTS = Path(__file__).resolve().parent / "results"
RUNS_FILE = RESULTS / "issue3_learning_runs.jsonl"
REPORT_FILE = RESULTS / "issue3_learning.md"
SEEDS = (0, 1, 2)
N_EVAL_EPISODES = 10


# rl_zoo3 2.9.2 hyperparams/ppo.yml and trpo.yml (CartPole-v1, Pendulum-v1): the one table in benchmarks/settings.py
ZOO: dict[str, dict[str, dict[str, Any]]] = {
    "ppo": {env: PPO_SETTINGS[env] for env in ("CartPole-v1", "Pendulum-v1")},
    "trpo": {env: TRPO_SETTINGS[env] for env in ("CartPole-v1", "Pendulum-v1")},
}

# name -> (class, zoo family); the sb3_kl classes run with their own defaults for the KL options
ALGOS = {
    "PPO": (PPO, "ppo"),
    "ClipKLPPO": (ClipKLPPO, "ppo"),
    "TRPO": (TRPO, "trpo"),
    "KLTRPO": (KLTRPO, "trpo"),
}
PAIRS = (("PPO", "ClipKLPPO"), ("TRPO", "KLTRPO"))


def run_one(env_id: str, algo: str, seed: int) -> dict[str, Any]:
    algo_class, family = ALGOS[algo]
    config = ZOO[family][env_id]
    env = make_vec_env(env_id, n_envs=config["n_envs"], seed=seed)
    model = algo_class("MlpPolicy", env, seed=seed, verbose=0, **config["kwargs"])
    start = time.perf_counter()
    model.learn(config["n_timesteps"])
    elapsed = time.perf_counter() - start
    eval_env = make_vec_env(env_id, n_envs=1, seed=10_000 + seed)
    returns, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=N_EVAL_EPISODES, deterministic=True, return_episode_rewards=True
    )
    return {
        "env": env_id,
        "algo": algo,
        "seed": seed,
        "n_timesteps": config["n_timesteps"],
        "eval_mean": float(np.mean(returns)),
        "eval_std": float(np.std(returns)),
        "train_seconds": elapsed,
        "env_steps_per_second": config["n_timesteps"] / elapsed,
        "code_version": code_version(),
    }


def load_all_runs() -> list[dict[str, Any]]:
    """Every record of the runs file, in the order they were made."""
    if not RUNS_FILE.exists():
        return []
    return [json.loads(line) for line in RUNS_FILE.read_text().splitlines() if line.strip()]


def load_runs() -> list[dict[str, Any]]:
    """The newest record of each (env, algorithm, seed)."""
    newest = {(r["env"], r["algo"], r["seed"]): r for r in load_all_runs()}
    return list(newest.values())


def table_rows(lines: list[str], runs: list[dict[str, Any]], only_complete_pairs: bool = False) -> None:
    """One markdown row per (env, algorithm) present in ``runs``."""
    for env_id in ("CartPole-v1", "Pendulum-v1"):
        for pair in PAIRS:
            if only_complete_pairs and not all(len(_scores(runs, env_id, a)) > len(SEEDS) for a in pair):
                continue
            for algo in pair:
                rows = sorted((r for r in runs if r["env"] == env_id and r["algo"] == algo), key=lambda r: r["seed"])
                if not rows:
                    continue
                scores = [r["eval_mean"] for r in rows]
                lines.append(
                    f"| {env_id} | {algo} | {rows[0]['n_timesteps']} | {', '.join(str(r['seed']) for r in rows)} | "
                    f"{', '.join(f'{s:.1f}' for s in scores)} | {np.mean(scores):.1f} | {np.min(scores):.1f} |"
                )


def _scores(runs: list[dict[str, Any]], env_id: str, algo: str) -> list[float]:
    return [r["eval_mean"] for r in runs if r["env"] == env_id and r["algo"] == algo]


def checks(lines: list[str], runs: list[dict[str, Any]], only_complete_pairs: bool = False) -> None:
    """The issue's pass/fail lines: CartPole >= 475 on every seed; Pendulum seed mean >= the stock algorithm's."""
    for env_id in ("CartPole-v1", "Pendulum-v1"):
        for stock, ours in PAIRS:
            ours_scores, stock_scores = _scores(runs, env_id, ours), _scores(runs, env_id, stock)
            if only_complete_pairs and not (len(ours_scores) > len(SEEDS) and len(stock_scores) > len(SEEDS)):
                continue
            if len(ours_scores) < len(SEEDS) or len(stock_scores) < len(SEEDS):
                lines.append(f"- {env_id} {ours} vs {stock}: incomplete ({len(ours_scores)} / {len(stock_scores)} seeds)")
                continue
            if env_id == "CartPole-v1":
                ok = min(ours_scores) >= 475
                lines.append(f"- {env_id} {ours}: every seed >= 475: {'yes' if ok else 'NO'} (min {min(ours_scores):.1f})")
            else:
                ok = np.mean(ours_scores) >= np.mean(stock_scores)
                by_seed = {(r["algo"], r["seed"]): r["eval_mean"] for r in runs if r["env"] == env_id}
                seeds = sorted(seed for algo, seed in by_seed if algo == ours and (stock, seed) in by_seed)
                paired = np.array([by_seed[ours, seed] - by_seed[stock, seed] for seed in seeds])
                differences = ", ".join(f"s{seed} {d:+.1f}" for seed, d in zip(seeds, paired, strict=True))
                spread = f" ± {np.std(paired, ddof=1) / np.sqrt(len(paired)):.1f} (standard error)" if len(paired) > 1 else ""
                lines.append(
                    f"- {env_id} {ours} seed mean {np.mean(ours_scores):.2f} >= "
                    f"{stock} seed mean {np.mean(stock_scores):.2f} ({len(ours_scores)} seeds): {'yes' if ok else 'NO'} "
                    f"(per seed, {ours} - {stock}: {differences}; mean paired difference {np.mean(paired):+.1f}{spread})"
                )


def write_report() -> None:
    runs = load_runs()
    lines = [
        "# Issue 3 learning benchmark: ClipKLPPO vs PPO, KLTRPO vs sb3-contrib TRPO",
        "",
        "rl-zoo3 2.9.2 tuned hyperparameters for each family (ppo.yml for PPO/ClipKLPPO, trpo.yml for TRPO/KLTRPO;",
        "`lin_x` as `LinearSchedule(x, 0, 1)`); sb3_kl options at their defaults (ClipKLPPO: target_kl 0.02 discrete /",
        "0.03 Box, kl_stop_factor 2; KLTRPO: target_kl 0.01 on forward KL summed over action dims, no tail bound).",
        f"Score: mean return of {N_EVAL_EPISODES} deterministic evaluation episodes after training, per seed.",
        f"Produced by `python benchmarks/issue3_learning.py` (Python {platform.python_version()},",
        f"SB3 {stable_baselines3.__version__}, "
        f"sb3-contrib {sb3_contrib.__version__}, torch {th.__version__}, 1 torch thread). Speed is not compared here: the",
        "runs shared the CPU with other jobs; the paired speed ratios are in overhead.md (`python benchmarks/overhead.py`).",
        "",
        "On Pendulum-v1 (one action dimension) KLTRPO in its default convention differs from sb3-contrib's TRPO only in",
        "the KL its line search measures (forward KL(old||new) instead of reverse): on the same seed both draw the same",
        "random numbers, so their per-seed scores are expected to be close, and a small difference is a tie, not a lead.",
        "",
        "| env | algorithm | steps | seeds | score per seed | seed mean | min seed |",
        "|---|---|---|---|---|---|---|",
    ]
    main_runs = [r for r in runs if r["seed"] in SEEDS]
    extra_runs = [r for r in runs if r["seed"] not in SEEDS]
    table_rows(lines, main_runs)
    versions: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: (r["env"], r["algo"], r["seed"])):
        if r["algo"] not in ("PPO", "TRPO"):  # the stock algorithms do not run sb3-kl code
            versions.setdefault(r.get("code_version", "unrecorded"), []).append(f"{r['algo']} {r['env']} s{r['seed']}")
    lines += [
        "",
        "sb3-kl commit of each sb3-kl record (*unrecorded*: made before records stored it, at commit d9fd1be or earlier):",
        "",
    ]
    lines += [f"- `{version}`: {', '.join(names)}" for version, names in versions.items()]
    superseded = len(load_all_runs()) - len(runs)
    if superseded:
        lines.append(f"- {superseded} older records of the same runs (earlier code) stay in the runs file, superseded.")
    lines += ["", f"Checks (issue 3, seeds {', '.join(map(str, SEEDS))}):", ""]
    checks(lines, main_runs)
    if extra_runs:
        lines += [
            "",
            "Supplementary seeds (run after the main table, to see whether a failed check is seed noise):",
            "",
            "| env | algorithm | steps | seeds | score per seed | seed mean | min seed |",
            "|---|---|---|---|---|---|---|",
        ]
        table_rows(lines, extra_runs)
        lines += [
            "",
            "All seeds together:",
            "",
            "| env | algorithm | steps | seeds | score per seed | seed mean | min seed |",
            "|---|---|---|---|---|---|---|",
        ]
        table_rows(lines, runs, only_complete_pairs=True)
        lines.append("")
        checks(lines, runs, only_complete_pairs=True)
    REPORT_FILE.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", nargs="*", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--algo", nargs="*", default=list(ALGOS))
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    parser.add_argument("--force", action="store_true", help="run again the runs that already have a record")
    parser.add_argument("--report", action="store_true", help="only write the markdown table from the runs file")
    args = parser.parse_args()
    if not args.report:
        th.set_num_threads(1)
        os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")
        RESULTS.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for env_id in args.env:
                for algo in args.algo:
                    done = {(r["env"], r["algo"], r["seed"]) for r in load_runs()}
                    if (env_id, algo, seed) in done and not args.force:
                        continue
                    result = run_one(env_id, algo, seed)
                    print(json.dumps(result), flush=True)
                    with RUNS_FILE.open("a") as handle:
                        handle.write(json.dumps(result) + "\n")
    write_report()


if __name__ == "__main__":
    main()
