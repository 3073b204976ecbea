"""
Issue 3 speed benchmark: env-steps/s of KLTRPO vs sb3-contrib's TRPO and ClipKLPPO vs SB3's PPO with the same
settings (rl-zoo3's, from issue3_learning.py; KLTRPO without a tail bound), measured side by side in one process:
paired runs, interleaved and alternating which of the two goes first, same seed within a pair, one torch thread.
The ratio of a pair is ours / stock env-steps/s over the whole ``learn()`` (rollouts + updates); the table gives
the median and range over the pairs, plus the same ratio for the time spent in ``train()`` alone.

    nice -n 10 python benchmarks/issue3_speed.py --pairs 5

writes ``benchmarks/results/issue3_speed.md``.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import sb3_contrib
import stable_baselines3
import torch as th
from stable_baselines3.common.env_util import make_vec_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from issue3_learning import ALGOS, ZOO  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPORT_FILE = RESULTS / "issue3_speed.md"
ROWS_FILE = RESULTS / "issue3_speed_rows.json"

# (stock, ours, env, timesteps per run)
COMPARISONS = (
    ("TRPO", "KLTRPO", "CartPole-v1", 16_384),
    ("TRPO", "KLTRPO", "Pendulum-v1", 16_384),
    ("PPO", "ClipKLPPO", "CartPole-v1", 16_384),
    ("PPO", "ClipKLPPO", "Pendulum-v1", 16_384),
)


def timed_run(algo: str, env_id: str, timesteps: int, seed: int) -> dict[str, float]:
    """One ``learn()``; returns env-steps/s over the whole call and the seconds spent in ``train()``."""
    algo_class, family = ALGOS[algo]
    config = ZOO[family][env_id]
    env = make_vec_env(env_id, n_envs=config["n_envs"], seed=seed)
    model = algo_class("MlpPolicy", env, seed=seed, verbose=0, **config["kwargs"])
    train_seconds = [0.0]
    original_train = model.train

    def train() -> None:
        start = time.perf_counter()
        original_train()
        train_seconds[0] += time.perf_counter() - start

    model.train = train  # type: ignore[method-assign]
    start = time.perf_counter()
    model.learn(timesteps)
    elapsed = time.perf_counter() - start
    return {"sps": model.num_timesteps / elapsed, "train_seconds": train_seconds[0], "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="restrict to these of our algorithms, e.g. KLTRPO")
    parser.add_argument("--env", nargs="*", default=None, help="restrict to these environments")
    args = parser.parse_args()
    th.set_num_threads(1)
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")

    rows: list[dict[str, Any]] = []
    for stock, ours, env_id, timesteps in COMPARISONS:
        if (args.only and ours not in args.only) or (args.env and env_id not in args.env):
            continue
        # Warm-up (imports, first-call overheads) outside the measurement
        for algo in (stock, ours):
            timed_run(algo, env_id, 2 * ZOO[ALGOS[algo][1]][env_id]["n_envs"] * 1024, seed=100)
        ratios, train_ratios, results = [], [], {stock: [], ours: []}
        for pair in range(args.pairs):
            order = (stock, ours) if pair % 2 == 0 else (ours, stock)
            run = {algo: timed_run(algo, env_id, timesteps, seed=pair) for algo in order}
            for algo in (stock, ours):
                results[algo].append(run[algo])
            ratios.append(run[ours]["sps"] / run[stock]["sps"])
            train_ratios.append(run[stock]["train_seconds"] / run[ours]["train_seconds"])
            print(
                f"{env_id} {ours}/{stock} pair {pair}: {run[ours]['sps']:.0f} / {run[stock]['sps']:.0f} steps/s "
                f"= {ratios[-1]:.3f}; train() {run[ours]['train_seconds']:.2f}s / {run[stock]['train_seconds']:.2f}s",
                flush=True,
            )
        rows.append(
            dict(
                env=env_id,
                stock=stock,
                ours=ours,
                timesteps=timesteps,
                ratio=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                train_ratio=statistics.median(train_ratios),
                stock_sps=statistics.median(r["sps"] for r in results[stock]),
                ours_sps=statistics.median(r["sps"] for r in results[ours]),
            )
        )

    # Rows of earlier runs are kept unless re-measured (``--only`` re-runs some comparisons)
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.exists() else []
    measured = {(row["env"], row["ours"]) for row in rows}
    rows = [row for row in stored if (row["env"], row["ours"]) not in measured] + rows
    order = {(env, ours): i for i, (_, ours, env, _) in enumerate(COMPARISONS)}
    rows.sort(key=lambda row: order[(row["env"], row["ours"])])
    for row in rows:
        row.setdefault("pairs", args.pairs)
        row.setdefault("measured_at", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    ROWS_FILE.write_text(json.dumps(rows, indent=1) + "\n")

    lines = [
        "# Issue 3 speed: KLTRPO vs sb3-contrib TRPO, ClipKLPPO vs PPO",
        "",
        "`nice -n 10 python benchmarks/issue3_speed.py --pairs N [--only KLTRPO|ClipKLPPO] [--env ENV]`: N paired runs",
        "per row, interleaved, alternating which goes first, same seed within a pair, rl-zoo3 settings (issue3_learning.py),",
        f"1 torch thread, Python {platform.python_version()}, SB3 {stable_baselines3.__version__}, "
        f"sb3-contrib {sb3_contrib.__version__},",
        f"torch {th.__version__}, CPU ({os.cpu_count()} cores) shared with other jobs. Ratio = ours / stock env-steps/s",
        "over the whole learn(); 'train() speed ratio' = median of stock / ours seconds spent inside train().",
        "",
        "| env | ours / stock | steps per run | pairs | median ratio | min - max | train() speed ratio "
        "| ours steps/s | stock steps/s | measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['env']} | {row['ours']} / {row['stock']} | {row['timesteps']} | {row['pairs']} | {row['ratio']:.3f} | "
            f"{row['ratio_min']:.3f} - {row['ratio_max']:.3f} | {row['train_ratio']:.3f} | {row['ours_sps']:.0f} | "
            f"{row['stock_sps']:.0f} | {row['measured_at']} |"
        )
    lines += ["", "Goals (issue 3): KLTRPO >= 1.0 x TRPO, ClipKLPPO >= 0.95 x PPO."]
    REPORT_FILE.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
