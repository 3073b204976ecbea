"""
Cost of KL control: environment steps per second of each sb3-kl algorithm against its stock counterpart, measured
side by side in one process, in pairs of runs that take turns one rollout and its update at a time (:class:`Turns`;
which side starts alternates from pair to pair), one torch thread, same seed and same hyperparameters (rl-zoo's,
``settings.py``; both sides get the same keyword arguments, except that KLPPO keeps its documented default
``clip_range=None``: the KL penalty replaces the ratio clip).

Pairs: KLPPO vs PPO, ClipKLPPO vs PPO, KLTRPO vs sb3-contrib TRPO (also both with sub_sampling_factor=8), PPO +
KLMonitorCallback vs PPO,
on CartPole-v1 and Pendulum-v1; sb3-contrib RecurrentPPO + KLMonitorCallback vs RecurrentPPO (``monitor_lstm``) on
their velocity-masked variants with rl-zoo's ``ppo_lstm`` settings. Writes ``benchmarks/results/overhead.md``
(median ratio, min-max, per-pair ratios).
For the monitor, a third figure that other load on the machine does not disturb: the share of ``learn()``'s wall-clock
time spent inside the monitor's own hooks (snapshot and measurement, and on the recurrent tasks, which ``VecNormalize``
wraps, the raw observations kept at each step and the normalization shift), whose complement is the steps/s ratio it
implies.

    python benchmarks/overhead.py [--pairs 5] [--steps-scale 1.0] [--comparisons klppo clip_klppo kltrpo monitor]
"""

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ENVS = ["CartPole-v1", "Pendulum-v1"]
# environment steps per timed run (at least a few updates of each algorithm's rl-zoo settings)
STEPS = {"CartPole-v1": 16_384, "Pendulum-v1": 16_384}
# TRPO's zoo rollouts are long (2,048 steps on Pendulum, 1,024 on CartPole, against PPO's 256 on CartPole): its pairs
# run 3x the steps, so that they take at least 24 turns each (:class:`Turns`) and the KLTRPO goal's small margin is
# not left to a handful of turns
STEPS_SCALE = {"kltrpo": 3, "kltrpo_subsampled": 3}
GOALS = {"klppo": 0.95, "clip_klppo": 0.95, "kltrpo": 1.0, "kltrpo_subsampled": 1.0, "monitor": 0.95, "monitor_lstm": 0.95}
# The recurrent pair runs on the velocity-masked task of each env, with the zoo's ppo_lstm settings for it
RECURRENT_ENVS = {"CartPole-v1": "CartPoleNoVel-v1", "Pendulum-v1": "PendulumNoVel-v1"}
LABELS = {
    "klppo": ("KLPPO", "PPO"),
    "clip_klppo": ("ClipKLPPO", "PPO"),
    # The same pairs with stock PPO also given the fused Adam kernel the sb3-kl algorithms use by default: what the
    # KL itself costs, without the optimizer's speed-up (informational, no goal)
    "klppo_fused_adam": ("KLPPO", "PPO with fused Adam"),
    "clip_klppo_fused_adam": ("ClipKLPPO", "PPO with fused Adam"),
    "kltrpo": ("KLTRPO", "TRPO (sb3-contrib)"),
    # Both with sub_sampling_factor=8: KLTRPO's line search still checks every candidate on the whole buffer
    "kltrpo_subsampled": ("KLTRPO, sub_sampling_factor=8", "TRPO (sb3-contrib), sub_sampling_factor=8"),
    "monitor": ("PPO + KLMonitorCallback", "PPO"),
    "monitor_lstm": ("RecurrentPPO + KLMonitorCallback", "RecurrentPPO"),
}


def timed_monitor() -> Any:
    """:return: a ``KLMonitorCallback`` that adds up the wall-clock time spent in its hooks (``hook_time``)"""
    from sb3_kl.callbacks import KLMonitorCallback

    class TimedKLMonitor(KLMonitorCallback):
        hook_time = 0.0

        def _timed(self, hook: Any) -> Any:
            start = time.perf_counter()
            result = hook()
            self.hook_time += time.perf_counter() - start
            return result

        def _on_rollout_start(self) -> None:
            self._timed(super()._on_rollout_start)

        def _on_rollout_end(self) -> None:
            self._timed(super()._on_rollout_end)

        def _on_step(self) -> bool:
            # keeps the raw observations when VecNormalize wraps the env (kl/normalization_shift)
            return self._timed(super()._on_step)

        def _on_training_end(self) -> None:
            self._timed(super()._on_training_end)

    return TimedKLMonitor()


def build_recurrent(side: str, env_id: str, seed: int) -> tuple[Any, Any]:
    """:return: (RecurrentPPO with the zoo's ppo_lstm settings for the masked task, monitor or None)"""
    import rl_zoo3.import_envs  # noqa: F401  (registers the NoVel tasks)
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from recurrent_learning import ZOO_ONLY, zoo_settings

    entry = zoo_settings(RECURRENT_ENVS[env_id])
    kwargs = {key: value for key, value in entry.items() if key not in ZOO_ONLY}
    env = make_vec_env(RECURRENT_ENVS[env_id], n_envs=entry["n_envs"], seed=seed)
    if entry.get("normalize"):
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    callback = timed_monitor() if side == "ours" else None
    return RecurrentPPO(entry["policy"], env, seed=seed, device="cpu", **kwargs), callback


def env_label(comparison: str, env_id: str) -> str:
    """The task a comparison ran on ``env_id``'s row (the recurrent comparison runs its velocity-masked version)."""
    return RECURRENT_ENVS[env_id] if comparison == "monitor_lstm" else env_id


def build(comparison: str, side: str, env_id: str, seed: int) -> tuple[Any, Any]:
    """:return: (model, callback) for one side ("ours" or "stock") of a comparison"""
    if comparison == "monitor_lstm":
        return build_recurrent(side, env_id, seed)
    from sb3_contrib import TRPO
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    import sb3_kl
    from settings import KLPPO_DROPPED, PPO_SETTINGS, TRPO_SETTINGS

    if comparison == "kltrpo_subsampled":
        comparison = "kltrpo"
        sub_sampling = dict(sub_sampling_factor=8)
    else:
        sub_sampling = {}
    family = TRPO_SETTINGS if comparison == "kltrpo" else PPO_SETTINGS
    setting = family[env_id]
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    kwargs = {**setting["kwargs"], **sub_sampling}
    if comparison.endswith("_fused_adam"):
        if side == "stock":
            # SB3's Adam settings (eps=1e-5) plus the fused kernel
            kwargs["policy_kwargs"] = {**kwargs.get("policy_kwargs", {}), "optimizer_kwargs": dict(eps=1e-5, fused=True)}
        comparison = comparison.removesuffix("_fused_adam")
    if comparison == "klppo" and side == "ours":
        # KLPPO as users run it: PPO's settings with KLPPO's own default of no ratio clipping
        for name in KLPPO_DROPPED:
            kwargs.pop(name, None)
    if comparison in ("klppo", "clip_klppo") and side == "ours":
        # every epoch runs on both sides (PPO's zoo entries set no target_kl): the cost of the same work, not the
        # time an early stop saves
        kwargs["kl_stop_factor"] = None
    callback = None
    if side == "stock":
        cls = TRPO if comparison == "kltrpo" else PPO
    elif comparison == "monitor":
        cls, callback = PPO, timed_monitor()
    else:
        cls = getattr(sb3_kl, LABELS[comparison][0])
    return cls("MlpPolicy", env, seed=seed, device="cpu", **kwargs), callback


class Turns:
    """
    Two ``learn()`` calls, each in its own thread, that take turns one rollout at a time: a side runs one rollout and
    the update that follows it, then waits while the other side does the same. Each side's clock (wall and thread CPU
    time) runs only while it holds the turn, so a slower or faster stretch of the machine (on a shared host the same
    code's speed drifts by 10-20 % over seconds) falls on both sides alike instead of on whichever run it happened in.
    Only one thread runs at any time.
    """

    def __init__(self, first: str) -> None:
        self.turn = first
        self.finished: set[str] = set()
        self.condition = threading.Condition()

    def callback(self, side: str, other: str) -> Any:
        """:return: the callback that makes ``side``'s ``learn()`` take its turns (pass it first in a CallbackList)"""
        from stable_baselines3.common.callbacks import BaseCallback

        turns = self

        class TakeTurns(BaseCallback):
            wall = 0.0
            cpu = 0.0

            def _take(self) -> None:
                with turns.condition:
                    turns.condition.wait_for(lambda: turns.turn == side or other in turns.finished)
                self._start, self._start_cpu = time.perf_counter(), time.thread_time()

            def _give(self) -> None:
                self.wall += time.perf_counter() - self._start
                self.cpu += time.thread_time() - self._start_cpu
                with turns.condition:
                    turns.turn = other
                    turns.condition.notify_all()

            def _on_training_start(self) -> None:
                self._take()
                self._first_rollout = True

            def _on_rollout_start(self) -> None:
                if self._first_rollout:  # its turn began with the training
                    self._first_rollout = False
                    return
                self._give()
                self._take()

            def _on_step(self) -> bool:
                return True

            def _on_training_end(self) -> None:
                self._give()

        return TakeTurns()

    def finish(self, side: str) -> None:
        """Release the other side for good (also when ``side``'s ``learn()`` raised)."""
        with self.condition:
            self.finished.add(side)
            self.condition.notify_all()


def timed_pair(comparison: str, env_id: str, seed: int, steps: int, first: str) -> dict[str, tuple[float, float, float]]:
    """
    Train both sides of a pair at once, taking turns one rollout (and its update) at a time (:class:`Turns`).

    :param first: The side ("ours" or "stock") whose rollout comes first in each round
    :return: per side: environment steps per second over its turns (model construction and ``learn()``'s setup
        before the first rollout excluded), by wall clock and by its thread's CPU time, and the share of that
        wall-clock time spent in the KL monitor's hooks (``nan`` without a monitor)
    """
    from stable_baselines3.common.callbacks import CallbackList

    sides = ("ours", "stock")
    turns = Turns(first)
    built = {side: build(comparison, side, env_id, seed) for side in sides}
    clocks = {side: turns.callback(side, other) for side, other in zip(sides, reversed(sides), strict=True)}
    errors: list[BaseException] = []

    def run(side: str) -> None:
        model, monitor = built[side]
        try:
            model.learn(steps, callback=CallbackList([clocks[side]] + ([monitor] if monitor is not None else [])))
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)
        finally:
            turns.finish(side)

    threads = [threading.Thread(target=run, args=(side,)) for side in sides]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    result = {}
    for side in sides:
        clock, monitor = clocks[side], built[side][1]
        share = monitor.hook_time / clock.wall if hasattr(monitor, "hook_time") else float("nan")
        result[side] = (steps / clock.wall, steps / clock.cpu, share)
    return result


def main(argv: list[str] | None = None) -> None:
    import torch as th

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply the per-run step counts")
    parser.add_argument("--comparisons", nargs="+", choices=list(LABELS), default=list(LABELS))
    parser.add_argument("--envs", nargs="+", choices=ENVS, default=ENVS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "overhead.md")
    args = parser.parse_args(argv)
    th.set_num_threads(1)
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    import learning

    version = learning.code_version("overhead.py", "settings.py")  # the checkout the runs start from

    rows = []
    for comparison in args.comparisons:
        for env_id in args.envs:
            steps = int(STEPS[env_id] * STEPS_SCALE.get(comparison, 1) * args.steps_scale)
            ratios, cpu_ratios, ours_sps, stock_sps, shares = [], [], [], [], []
            for pair in range(args.pairs):
                first = "ours" if pair % 2 == 0 else "stock"
                result = timed_pair(comparison, env_id, seed=pair, steps=steps, first=first)
                ours_sps.append(result["ours"][0])
                stock_sps.append(result["stock"][0])
                ratios.append(result["ours"][0] / result["stock"][0])
                cpu_ratios.append(result["ours"][1] / result["stock"][1])
                shares.append(result["ours"][2])
                print(
                    f"{comparison} {env_id} pair {pair}: ours {ours_sps[-1]:.0f} steps/s, stock {stock_sps[-1]:.0f} "
                    f"steps/s, ratio {ratios[-1]:.3f} (CPU-time ratio {cpu_ratios[-1]:.3f})",
                    flush=True,
                )
            rows.append((comparison, env_id, steps, ratios, cpu_ratios, ours_sps, stock_sps, shares))

    lines = [
        "# Overhead of KL control",
        "",
        f"Generated by `python benchmarks/overhead.py --pairs {args.pairs}"
        + (f" --steps-scale {args.steps_scale:g}" if args.steps_scale != 1.0 else "")
        + (f" --comparisons {' '.join(args.comparisons)}" if args.comparisons != list(LABELS) else "")
        + (f" --envs {' '.join(args.envs)}" if args.envs != ENVS else "")
        + f"` on the code of commit {version}. Paired runs in one process that take turns one rollout (and the update"
        " after it) at a time, each side's clock running only during its turns, so that the machine's speed drifts"
        " (10-20 % over seconds on this shared host, for the same code) fall on both sides alike; which side starts"
        " alternates from pair to pair. One torch thread, same seed and"
        " the same keyword arguments per pair (rl-zoo settings from `benchmarks/settings.py`), except that KLPPO keeps its"
        " documented default `clip_range=None` (ClipKLPPO gets PPO's clip range) and that KLPPO and ClipKLPPO run with"
        " `kl_stop_factor=None`, so that, like PPO without `target_kl`, they run every epoch: the ratio compares the"
        " same work, not the time an early stop saves. Ratio = ours / stock env-steps/s."
        " The sb3-kl algorithms step Adam with PyTorch's fused kernel by default (same update rule, see"
        " `KLOnPolicyAlgorithm._use_fused_adam`); the rows against *PPO with fused Adam* give stock PPO that kernel too,"
        " so they show what the KL machinery itself costs.",
        "",
        f"Machine: {os.cpu_count()} cores; " + learning.describe_run_environment(learning.run_environment()) + ".",
        "",
        f"Load average when the run ended: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (wall-clock ratios are only"
        " meaningful on an otherwise idle machine; the CPU-time ratio divides each side's thread CPU seconds instead)."
        " Steps/s count the time from the first rollout to the end of training (model construction and `learn()`'s"
        " setup excluded).",
        "",
        "| ours | stock | env | steps per run | ours steps/s (median) | stock steps/s (median) | ratio median | ratio min-max "
        "| CPU-time ratio median | goal | met (wall) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for comparison, env_id, steps, ratios, cpu_ratios, ours_sps, stock_sps, _ in rows:
        ours, stock = LABELS[comparison]
        env_id = env_label(comparison, env_id)
        median = float(np.median(ratios))
        goal = GOALS.get(comparison)
        goal_text, met = (f"≥ {goal}", "yes" if median >= goal else "NO") if goal is not None else ("-", "-")
        lines.append(
            f"| {ours} | {stock} | {env_id} | {steps:,} | {np.median(ours_sps):.0f} | {np.median(stock_sps):.0f} | "
            f"{median:.3f} | {min(ratios):.3f}-{max(ratios):.3f} | {np.median(cpu_ratios):.3f} | {goal_text} | {met} |"
        )
    monitor_rows = [row for row in rows if row[0] in ("monitor", "monitor_lstm")]
    if monitor_rows:
        lines += [
            "",
            "KLMonitorCallback's own cost, insensitive to other load: the share of `learn()`'s wall-clock time spent"
            " inside its hooks (snapshot of the rollout policy and the KL measurement; where VecNormalize wraps the env,"
            " as on the recurrent tasks, also the raw observations kept at each step and the normalization's own KL,"
            " `kl/normalization_shift`) in the monitored runs above, and"
            " the steps/s ratio it implies (1 - share).",
            "",
            "| monitored | env | runs | hook share median | implied ratio median | implied ratio min-max | goal | met |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for comparison, env_id, _, _, _, _, _, shares in monitor_rows:
            implied = [1.0 - share for share in shares]
            goal = GOALS[comparison]
            lines.append(
                f"| {LABELS[comparison][1]} | {env_label(comparison, env_id)} | {len(shares)} | {np.median(shares):.4f} | "
                f"{np.median(implied):.3f} | {min(implied):.3f}-{max(implied):.3f} | ≥ {goal} | "
                f"{'yes' if np.median(implied) >= goal else 'NO'} |"
            )
    lines += ["", "Per-pair ratios:", ""]
    for comparison, env_id, _, ratios, _, _, _, _ in rows:
        lines.append(
            f"- {LABELS[comparison][0]} / {LABELS[comparison][1]}, {env_label(comparison, env_id)}: "
            + ", ".join(f"{r:.3f}" for r in ratios)
        )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
