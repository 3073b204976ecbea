"""
Measure and control the KL of a *stock* Stable-Baselines3 PPO with the sb3_kl callbacks.

PPO is deliberately given a too-high learning rate (3e-2) on Pendulum-v1. The callbacks:

- KLMonitorCallback measures the exact KL(pi_rollout || pi_updated) of every update on the rollout's states
  (logged as kl/mean, kl/p50, kl/p90, kl/p99, kl/max, kl/tail_ratio, kl/entropy, ...) and keeps the 10 highest-KL
  states of each update in a .npz for drill-down;
- KLAdaptiveLRCallback divides / multiplies the learning rate by 1.5 when that KL leaves [0.5, 2] x target;
- VarianceFloorCallback keeps the Gaussian's std >= 0.05 after every optimizer step;
- KLAlarmCallback warns when the KL runs away, has a heavy tail, or is negative (a bug).

    python examples/callbacks_stock_ppo.py [--steps 40960] [--no-adapt] [--tensorboard DIR] [--states FILE.npz]

The high-KL states go to ``--states`` (default: a new temporary directory). ``SB3_KL_EXAMPLE_STEPS=N`` in the
environment sets the default of ``--steps`` (the tests run every example with a small N).

Run with ``--no-adapt`` to see the KL the same PPO has without the adaptive learning rate.
"""

import argparse
import os
import tempfile

import numpy as np
import torch as th
from stable_baselines3 import PPO

from sb3_kl.callbacks import KLAdaptiveLRCallback, KLAlarmCallback, KLMonitorCallback, VarianceFloorCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--steps", type=int, default=int(os.environ.get("SB3_KL_EXAMPLE_STEPS", 40_960)))
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--target-kl", type=float, default=0.01)
    parser.add_argument("--no-adapt", action="store_true", help="do not attach KLAdaptiveLRCallback")
    parser.add_argument("--tensorboard", default=None, help="TensorBoard log dir (kl/hist histograms are written there)")
    parser.add_argument("--states", default=None, help="where to save the top-k high-KL states (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    th.set_num_threads(1)
    if args.states is None:
        args.states = os.path.join(tempfile.mkdtemp(prefix="sb3_kl_example_"), "high_kl_states.npz")

    model = PPO("MlpPolicy", args.env, learning_rate=args.learning_rate, seed=args.seed, tensorboard_log=args.tensorboard)

    # One monitor measures for everybody: the alarm and the adaptive LR listen to it
    monitor = KLMonitorCallback(top_k=10, top_k_path=args.states, verbose=1)
    callbacks = [monitor, KLAlarmCallback(target_kl=args.target_kl, monitor=monitor)]
    if not args.no_adapt:
        callbacks.append(KLAdaptiveLRCallback(target_kl=args.target_kl, monitor=monitor, verbose=1))
    if model.action_space.__class__.__name__ == "Box":
        callbacks.append(VarianceFloorCallback(min_std=0.05))
    model.learn(args.steps, callback=callbacks)

    print(f"\n{'update':>6} {'steps':>7} {'KL mean':>9} {'KL p99':>9} {'tail':>6} {'lr':>9}")
    for record in monitor.history:
        print(
            f"{record['update']:>6} {record['num_timesteps']:>7} {record['mean']:>9.4f} {record['p99']:>9.4f} "
            f"{record['tail_ratio']:>6.1f} {record.get('learning_rate', args.learning_rate):>9.2e}"
        )
    late = [record["mean"] for record in monitor.history[len(monitor.history) // 2 :]]
    print(f"\nmedian KL over the second half of training: {np.median(late):.4f} (target {args.target_kl})")
    alarms = callbacks[1].alarms  # type: ignore[attr-defined]
    print(f"alarms: {len(alarms)} {sorted({alarm.kind for alarm in alarms})}")
    print(f"high-KL states saved to {args.states} (keys: observations, kl, update, background_observations, ...)")


if __name__ == "__main__":
    main()
