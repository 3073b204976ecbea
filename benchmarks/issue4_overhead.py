"""
Overhead of KLMonitorCallback on stock PPO: environment steps per second with the monitor divided by the steps
per second without it, measured in interleaved pairs in one process (one torch thread), so that both sides of a
pair see the same machine load. The order inside a pair alternates to cancel drifts.

    nice -n 10 python benchmarks/issue4_overhead.py [--pairs 5] [--steps 8192] [--out benchmarks/results/issue4_overhead.md]

Goal (issue 4): median ratio >= 0.95.
"""

import argparse
import os
import platform
import time

import numpy as np
import stable_baselines3
import torch as th
from stable_baselines3 import PPO

from sb3_kl.callbacks import KLMonitorCallback


def steps_per_second(env_id: str, steps: int, with_monitor: bool, seed: int) -> tuple[float, int]:
    """:return: env steps per second of ``learn`` (model construction excluded) and the number of measured updates"""
    model = PPO("MlpPolicy", env_id, seed=seed, device="cpu")
    monitor = KLMonitorCallback() if with_monitor else None
    start = time.perf_counter()
    model.learn(steps, callback=monitor)
    elapsed = time.perf_counter() - start
    return model.num_timesteps / elapsed, (len(monitor.history) if monitor is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8192)
    parser.add_argument("--envs", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "issue4_overhead.md"))
    args = parser.parse_args()
    th.set_num_threads(1)
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")

    lines = [
        "# Issue 4: overhead of KLMonitorCallback on stock PPO",
        "",
        f"Command: `nice -n 10 python benchmarks/issue4_overhead.py --pairs {args.pairs} --steps {args.steps}`",
        "",
        f"Setup: PPO defaults (n_steps=2048, batch 64, 10 epochs, MlpPolicy 64x64), {args.steps} steps per run, "
        f"CPU, torch threads=1, {args.pairs} interleaved pairs per env (order alternates), seed = pair index; "
        "ratio = (env steps/s with the monitor) / (env steps/s without), each measured on `learn()` only. "
        "The machine is shared (2 cores), so single runs are noisy; the median of the paired ratios is the figure.",
        f"Versions: python {platform.python_version()}, torch {th.__version__}, stable-baselines3 {stable_baselines3.__version__}.",
        "",
        "| env | pairs | steps/s without (median) | steps/s with (median) | ratio median | ratio min-max | goal >= 0.95 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    details = []
    for env_id in args.envs:
        without, with_, ratios = [], [], []
        for pair in range(args.pairs):
            order = [False, True] if pair % 2 == 0 else [True, False]
            result = {}
            for with_monitor in order:
                result[with_monitor] = steps_per_second(env_id, args.steps, with_monitor, seed=pair)
            without.append(result[False][0])
            with_.append(result[True][0])
            ratios.append(result[True][0] / result[False][0])
            details.append(
                f"| {env_id} | {pair} | {result[False][0]:.0f} | {result[True][0]:.0f} | {ratios[-1]:.3f} | {result[True][1]} |"
            )
            print(details[-1], flush=True)
        median = float(np.median(ratios))
        lines.append(
            f"| {env_id} | {args.pairs} | {np.median(without):.0f} | {np.median(with_):.0f} | {median:.3f} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} | {'yes' if median >= 0.95 else 'no'} |"
        )
    lines += ["", "Per pair:", "", "| env | pair | steps/s without | steps/s with | ratio | measured updates |", "| --- | --- | --- | --- | --- | --- |"]
    lines += details
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
