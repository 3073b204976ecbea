"""
Stock PPO with a too-high learning rate (3e-2) on Pendulum-v1, with and without KLAdaptiveLRCallback: the exact KL of
every update (KLMonitorCallback) and the learning rate, and the median KL over the second half of training.

    nice -n 10 python benchmarks/adaptive_lr.py [--steps 40960] [--target-kl 0.01] [--seeds 0]

Goal: with the callback, the late-training median KL is within ~3x the target.
"""

import argparse
import os
import time

import numpy as np
import torch as th
from stable_baselines3 import PPO

from sb3_kl.callbacks import KLAdaptiveLRCallback, KLMonitorCallback


def run(steps: int, learning_rate: float, target_kl: float, adapt: bool, seed: int) -> tuple[list[dict], float]:
    """:return: the monitor's history and the wall-clock time"""
    model = PPO("MlpPolicy", "Pendulum-v1", learning_rate=learning_rate, seed=seed, device="cpu")
    monitor = KLMonitorCallback()
    callbacks = [monitor] + ([KLAdaptiveLRCallback(target_kl=target_kl, monitor=monitor)] if adapt else [])
    start = time.perf_counter()
    model.learn(steps, callback=callbacks)
    return monitor.history, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40_960)
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--target-kl", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "adaptive_lr.md"))
    args = parser.parse_args()
    th.set_num_threads(1)
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")

    lines = [
        "# KLAdaptiveLRCallback on stock PPO with a too-high learning rate",
        "",
        f"Command: `nice -n 10 python benchmarks/adaptive_lr.py --steps {args.steps} --target-kl {args.target_kl} "
        f"--seeds {' '.join(map(str, args.seeds))}`",
        "",
        f"PPO defaults on Pendulum-v1 except learning_rate={args.learning_rate}; KL = exact mean per-state "
        "KL(pi_rollout || pi_updated) of each update on the rollout's states (KLMonitorCallback, forward/analytic/sum); "
        f"callback defaults (factor 1.5, band (0.5, 2) x target, lr bounds (1e-6, 0.1)), target_kl={args.target_kl}. "
        "Late = second half of the updates.",
        "",
        "| seed | callback | updates | late median KL | late median / target | final learning rate | time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    traces = []
    for seed in args.seeds:
        for adapt in (False, True):
            history, elapsed = run(args.steps, args.learning_rate, args.target_kl, adapt, seed)
            kl = [record["mean"] for record in history]
            late = float(np.median(kl[len(kl) // 2 :]))
            final_lr = history[-1].get("learning_rate", args.learning_rate)
            name = "KLAdaptiveLRCallback" if adapt else "none"
            lines.append(
                f"| {seed} | {name} | {len(kl)} | {late:.4f} | {late / args.target_kl:.2f} | {final_lr:.2e} | {elapsed:.0f} |"
            )
            traces.append(f"- seed {seed}, {name}: KL per update " + ", ".join(f"{x:.3g}" for x in kl))
            print(lines[-1], flush=True)
    lines += ["", "KL of every update:", "", *traces]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
