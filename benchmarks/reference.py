"""
Reference-policy KL (anchoring a fine-tuned policy to a pretrained one). Pretrain on Pendulum-v1, fine-tune on a
modified task (an action cost) with and without the anchor to the pretrained policy, over several seeds; measure the
new-task return, the original-task return after fine-tuning (forgetting) and the KL to the reference over training.

    nice -n 10 python benchmarks/reference.py --task action-cost --action-cost 0.5 [--steps 81920] [--seeds 0 1 2]
        [--jobs 2] [--ref-target-kl 0.05]
    nice -n 10 python benchmarks/reference.py --task torque-limit --torque-limit 1.0 ...
    nice -n 10 python benchmarks/reference.py --task spin-bonus --spin-bonus 1.5 ...

Stages (each run is recorded as JSON under benchmarks/results/reference_runs/, and skipped when its record exists,
so an interrupted benchmark resumes where it stopped):

1. pretrain: SB3 PPO on Pendulum-v1, 100k steps, rl-zoo settings (n_envs 4, n_steps 1024, gamma 0.9,
   gae_lambda 0.95, lr 1e-3, n_epochs 10, use_sde, sde_sample_freq 4, clip 0.2), seed 0; saved as a zip.
2. fine-tune: KLPPO (same settings, target_kl 0.03) starting from the pretrained weights, on a modified
   Pendulum-v1: ``action-cost`` (reward ``r - action_cost * a^2``), ``torque-limit`` (torque clipped to
   +/- ``torque_limit`` instead of 2) or ``spin-bonus`` (reward ``r + spin_bonus * |angular velocity|``, a hackable
   shaping term); ``free``: ``ref_kl_coef=0`` (KL to the reference measured and logged, not
   penalized), ``anchored``: ``ref_target_kl`` with the adaptive controller (beta_ref from 1.0); with
   ``--extra-targets x ...`` also ``anchored_t<x>`` runs with ``ref_target_kl=x``.
3. report: benchmarks/results/reference_<task>.md (table) and reference_<task>.png (KL to the reference, beta_ref and
   training returns over fine-tuning), where <task> is e.g. ``cost0.5`` or ``limit1.0``.

Every record names the commit of sb3-kl that made it (``code_version``, ``+modified`` with uncommitted changes of the
package or of this script) and the machine and library versions (``run_environment``); the report names them. Records
made before records named their commit are reported with the commit that added them to the repository (``git log``).
``--report`` only rewrites the markdown from the records of the given task, steps, seeds and targets (no training;
``--plot`` redraws the figure too):

    python benchmarks/reference.py --report --task action-cost --action-cost 0.5 --steps 81920 --seeds 0 1 2

Evaluation: 20 deterministic episodes per task with fixed reset seeds (1000..1019), same for every policy.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env

from sb3_kl import KLPPO

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS = os.path.join(RESULTS, "reference_runs")
PRETRAINED = os.path.join(RUNS, "pretrained_ppo_pendulum.zip")
ZOO_SETTINGS: dict[str, Any] = dict(
    n_steps=1024, gae_lambda=0.95, gamma=0.9, n_epochs=10, ent_coef=0.0, learning_rate=1e-3, use_sde=True, sde_sample_freq=4
)
EVAL_SEEDS = list(range(1000, 1020))


@functools.cache
def code_version() -> str:
    """
    The commit that ran, ``+modified`` when the package or this script had uncommitted changes, read once when the
    benchmark starts (before its worker processes fork: later edits of the checkout do not change the runs).
    """
    return run_records.code_version("reference.py")


def provenance() -> dict[str, Any]:
    """What every new record holds about what made it: ``code_version`` and ``run_environment``."""
    return dict(code_version=code_version(), run_environment=run_records.run_environment())


def commit_that_added(path: str) -> str | None:
    """:return: the (short) commit that added ``path`` to the repository, None if no commit has"""
    try:
        out = subprocess.run(
            ["git", "log", "--diff-filter=A", "--format=%H", "--", os.path.abspath(path)],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return run_records.short_commit(out[0]) if out else None  # the latest addition, if the file was ever deleted and added again


def record_version(record: dict[str, Any]) -> str:
    """
    The code version of a record: its ``code_version``, or for records made before records named their commit, that
    fact and the commit that added the record's file (found with ``git log``).
    """
    if "code_version" in record:
        return record["code_version"]
    added = commit_that_added(record_path(record["name"]))
    return "made before records named their commit; " + (f"committed in {added}" if added else "not committed")


class ActionCost(gym.Wrapper):
    """
    The modified task: Pendulum's reward minus ``coef * |a|^2`` (``a`` clipped to the torque limit, as applied).

    :param env: The environment
    :param coef: Cost per unit of squared torque
    """

    def __init__(self, env: gym.Env, coef: float):
        super().__init__(env)
        self.coef = coef

    def step(self, action: np.ndarray) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        applied = np.clip(action, self.action_space.low, self.action_space.high)
        return obs, float(reward) - self.coef * float(np.sum(np.square(applied))), terminated, truncated, info


class SpinBonus(gym.Wrapper):
    """
    The modified task: Pendulum's reward plus ``coef * |angular velocity|``, a misspecified shaping term that can be
    hacked: above ``coef ~ 1.2`` spinning the pendulum round and round earns more than balancing it upright.

    :param env: The environment
    :param coef: Bonus per unit of angular speed
    """

    def __init__(self, env: gym.Env, coef: float):
        super().__init__(env)
        self.coef = coef

    def step(self, action: np.ndarray) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, float(reward) + self.coef * abs(float(obs[2])), terminated, truncated, info


class TorqueLimit(gym.ActionWrapper):
    """
    The modified task: the torque is clipped to +/- ``limit`` (Pendulum's own limit is 2).

    :param env: The environment
    :param limit: The new torque limit
    """

    def __init__(self, env: gym.Env, limit: float):
        super().__init__(env)
        self.limit = limit

    def action(self, action: np.ndarray) -> np.ndarray:
        return np.clip(action, -self.limit, self.limit)


def task_wrapper(task: tuple[str, float] | None) -> tuple[type[gym.Wrapper] | None, dict[str, float]]:
    """:param task: ``("action-cost", coef)``, ``("torque-limit", limit)`` or None (the original task)"""
    if task is None:
        return None, {}
    name, value = task
    if name == "action-cost":
        return ActionCost, dict(coef=value)
    if name == "spin-bonus":
        return SpinBonus, dict(coef=value)
    return TorqueLimit, dict(limit=value)


def task_tag(task: tuple[str, float]) -> str:
    return {"action-cost": "cost", "spin-bonus": "spin", "torque-limit": "limit"}[task[0]] + f"{task[1]:g}"


def evaluate(policy: Any, task: tuple[str, float] | None) -> float:
    """Mean return of 20 deterministic episodes (fixed reset seeds) on Pendulum-v1, original or modified."""
    env = gym.make("Pendulum-v1")
    wrapper, kwargs = task_wrapper(task)
    if wrapper is not None:
        env = wrapper(env, **kwargs)  # type: ignore[call-arg]
    returns = []
    for seed in EVAL_SEEDS:
        obs, _ = env.reset(seed=seed)
        done, total = False, 0.0
        while not done:
            action, _ = policy.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def record_path(name: str) -> str:
    return os.path.join(RUNS, f"{name}.json")


def pretrain(task: tuple[str, float]) -> dict[str, Any]:
    start, trained_here = time.time(), not os.path.exists(PRETRAINED)
    if trained_here:
        env = make_vec_env("Pendulum-v1", n_envs=4, seed=0)
        model = PPO("MlpPolicy", env, clip_range=0.2, seed=0, verbose=0, **ZOO_SETTINGS)
        model.learn(100_000)
        model.save(PRETRAINED)
    pretrain_time = time.time() - start if trained_here else None
    model = PPO.load(PRETRAINED, device="cpu")
    return {
        "name": f"{task_tag(task)}_pretrained",
        "algo": "PPO",
        "steps": 100_000,
        "settings": {**ZOO_SETTINGS, "n_envs": 4, "clip_range": 0.2, "seed": 0},
        "original_return": evaluate(model, None),
        "new_task_return": evaluate(model, task),
        "wall_time_s": pretrain_time,  # None when the zip already existed
        "zip_trained_here": trained_here,
        **provenance(),
    }


class TraceCallback(BaseCallback):
    """After each update (at the next rollout start, before the logs are dumped): the logged reference KL, beta_ref,
    the update KL and the training episodes' mean return. That return is the Pendulum reward of the actions as applied
    (the Monitor sits inside the task wrapper: the action cost is not included, the torque limit is)."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[dict[str, float]] = []

    def snapshot(self) -> None:
        values = self.model.logger.name_to_value
        if "train/ref_kl" not in values:
            return
        episodes = [info["r"] for info in self.model.ep_info_buffer]
        self.trace.append(
            {
                "timesteps": int(self.model.num_timesteps),
                "ref_kl": float(values["train/ref_kl"]),
                "ref_kl_p99": float(values["train/ref_kl_p99"]),
                "ref_kl_coef": float(values["train/ref_kl_coef"]),
                "update_kl": float(values["train/kl"]),
                "train_return": float(np.mean(episodes)) if episodes else float("nan"),
            }
        )

    def _on_rollout_start(self) -> None:
        self.snapshot()

    def _on_step(self) -> bool:
        return True


def finetune(job: tuple[str, int, int, tuple[str, float], float]) -> dict[str, Any]:
    condition, seed, steps, task, ref_target_kl = job
    th.set_num_threads(1)
    start = time.time()
    wrapper, wrapper_kwargs = task_wrapper(task)
    env = make_vec_env("Pendulum-v1", n_envs=4, seed=seed, wrapper_class=wrapper, wrapper_kwargs=wrapper_kwargs)
    anchor = dict(ref_target_kl=ref_target_kl, ref_kl_coef=1.0, ref_kl_coef_bounds=(1e-3, 100.0))
    model = KLPPO(
        "MlpPolicy",
        env,
        target_kl=0.03,
        seed=seed,
        device="cpu",
        ref_policy=PRETRAINED,
        **(anchor if condition.startswith("anchored") else dict(ref_kl_coef=0.0)),
        **ZOO_SETTINGS,
    )
    # Start from the pretrained actor and critic (the reference is a separate frozen copy)
    model.policy.load_state_dict(PPO.load(PRETRAINED, device="cpu").policy.state_dict())
    trace = TraceCallback()
    model.learn(steps, callback=trace)
    trace.snapshot()  # the last update's logs
    return {
        "name": f"{task_tag(task)}_{condition}_s{seed}",
        "condition": condition,
        "seed": seed,
        "steps": steps,
        "task": list(task),
        "ref_target_kl": ref_target_kl if condition.startswith("anchored") else None,
        "original_return": evaluate(model, None),
        "new_task_return": evaluate(model, task),
        "final_ref_kl": trace.trace[-1]["ref_kl"],
        "trace": trace.trace,
        "wall_time_s": time.time() - start,
        "torch_threads": 1,
        "niceness": os.nice(0),
        **provenance(),
    }


def run_and_save(job: tuple[str, int, int, tuple[str, float], float]) -> str:
    result = finetune(job)
    with open(record_path(result["name"]), "w") as file:
        json.dump(result, file, indent=1)
    return f"{result['name']}: {result['wall_time_s']:.0f}s"


def task_value(args: argparse.Namespace) -> float:
    """The value of the chosen task's own option (``--action-cost``, ``--spin-bonus`` or ``--torque-limit``)."""
    return {"action-cost": args.action_cost, "spin-bonus": args.spin_bonus, "torque-limit": args.torque_limit}[args.task]


def run_options(args: argparse.Namespace) -> str:
    """The options that choose the records (task, steps, seeds, targets), as on the command line."""
    return (
        f"--task {args.task} --{args.task} {task_value(args)} --steps {args.steps} --seeds {' '.join(map(str, args.seeds))}"
        + (f" --jobs {args.jobs}" if args.jobs is not None else "")
        + f" --ref-target-kl {args.ref_target_kl}"
        + (f" --extra-targets {' '.join(map(str, args.extra_targets))}" if args.extra_targets else "")
    )


def report(args: argparse.Namespace, command: str, plot_figure: bool = True) -> None:
    """
    Write ``reference_<task>.md`` from the records of the runs ``args`` choose (no training).

    :param args: The parsed options (``task_spec`` set to the task)
    :param command: The command that makes the runs, as the report quotes it
    :param plot_figure: Whether to also redraw ``reference_<task>.png``
    """
    task = args.task_spec
    tag = task_tag(task)
    description = {
        "action-cost": f"reward r - {task[1]:g}*a^2",
        "spin-bonus": f"reward r + {task[1]:g}*|angular velocity| (hackable shaping)",
        "torque-limit": f"torque limited to +/-{task[1]:g} (instead of 2)",
    }[task[0]]
    with open(record_path(f"{tag}_pretrained")) as file:
        pre = json.load(file)
    runs: dict[str, list[dict[str, Any]]] = {}
    for condition in conditions(args):
        runs[condition] = []
        for seed in args.seeds:
            with open(record_path(f"{tag}_{condition}_s{seed}")) as file:
                runs[condition].append(json.load(file))
    records = [pre, *(r for records in runs.values() for r in records)]
    versions: dict[str, int] = {}
    for record in records:
        versions[record_version(record)] = versions.get(record_version(record), 0) + 1
    per_run_version = len(versions) > 1
    report_options = run_options(argparse.Namespace(**{**vars(args), "jobs": None}))
    lines = [
        f"# Reference-policy KL on Pendulum-v1 (pretrain, then fine-tune with {description})",
        "",
        f"![KL to the reference, beta_ref and returns over fine-tuning](reference_{tag}.png)",
        "",
        f"Command: `{command}`",
        "",
        f"Written from the {len(records)} records `benchmarks/results/reference_runs/{tag}_*.json` of these runs "
        f"(`python benchmarks/reference.py --report {report_options}` rewrites it without training). "
        "Code version of the records (the commit of sb3-kl that made them): "
        + "; ".join(f"{version} ({count} records)" for version, count in versions.items())
        + ".",
        "",
        "- Pretraining: SB3 PPO, 100k steps, rl-zoo settings (n_envs 4, n_steps 1024, gamma 0.9, gae_lambda 0.95, lr 1e-3, "
        "n_epochs 10, batch 64, use_sde, sde_sample_freq 4, clip 0.2), seed 0, "
        + (f"{pre['wall_time_s']:.0f} s." if pre["wall_time_s"] is not None else "zip reused (wall time not recorded)."),
        f"- Fine-tuning: KLPPO (same settings, target_kl 0.03), {args.steps} steps per run "
        f"({args.steps // 4096} updates), from the pretrained weights, on Pendulum-v1 with {description}; "
        f"seeds {', '.join(map(str, args.seeds))}. `free`: ref_kl_coef=0 (KL to the reference measured only); "
        f"`anchored`: ref_target_kl={args.ref_target_kl}, adaptive beta_ref from 1.0, bounds (1e-3, 100)"
        + ("; `anchored_t<x>`: the same with ref_target_kl=x." if args.extra_targets else "."),
        "- KL to the reference = `train/ref_kl`: exact mean per-state KL(pi || pi_ref) (reverse/analytic/sum) over the "
        "buffer's states after each update. Returns: 20 deterministic episodes, reset seeds 1000-1019.",
        "- Machine and library versions: "
        + "; ".join(f"{count} records: {machine}" for machine, count in run_records.run_environments(records).items())
        + ". Time (s): the wall-clock time of each run on that machine, beside whatever else ran on it.",
        "",
        f"Pretrained policy: original-task return {pre['original_return']:.1f}, new-task return {pre['new_task_return']:.1f}.",
        "",
        "| condition | seed | new-task return | original-task return | forgetting (pretrained - after) | final KL to ref | "
        "mean KL to ref (2nd half) | final beta_ref | time (s) |" + (" code |" if per_run_version else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if per_run_version else ""),
    ]
    summary = {}
    for condition, records in runs.items():
        for r in records:
            late = [t["ref_kl"] for t in r["trace"][len(r["trace"]) // 2 :]]
            lines.append(
                f"| {condition} | {r['seed']} | {r['new_task_return']:.1f} | {r['original_return']:.1f} | "
                f"{pre['original_return'] - r['original_return']:.1f} | {r['final_ref_kl']:.4f} | {np.mean(late):.4f} | "
                f"{r['trace'][-1]['ref_kl_coef']:.3g} | {r['wall_time_s']:.0f} |"
                + (f" {record_version(r)} |" if per_run_version else "")
            )
        summary[condition] = {
            key: (float(np.mean([r[key] for r in records])), float(np.std([r[key] for r in records])))
            for key in ("new_task_return", "original_return", "final_ref_kl")
        }
    lines += [
        "",
        "Mean +/- std over seeds:",
        "",
        "| condition | new-task return | original-task return | forgetting | final KL to ref |",
        "| --- | --- | --- | --- | --- |",
    ]
    for condition, stats in summary.items():
        lines.append(
            f"| {condition} | {stats['new_task_return'][0]:.1f} +/- {stats['new_task_return'][1]:.1f} | "
            f"{stats['original_return'][0]:.1f} +/- {stats['original_return'][1]:.1f} | "
            f"{pre['original_return'] - stats['original_return'][0]:.1f} | "
            f"{stats['final_ref_kl'][0]:.4f} +/- {stats['final_ref_kl'][1]:.4f} |"
        )
    free, anchored = summary["free"], summary["anchored"]
    less_forgetting = anchored["original_return"][0] > free["original_return"][0]
    near_target = {
        condition: [
            float(np.mean([t["ref_kl"] for t in r["trace"][len(r["trace"]) // 2 :]])) / r["ref_target_kl"] for r in records
        ]
        for condition, records in runs.items()
        if condition != "free"
    }
    lines += [
        "",
        "Verdict (computed by the script):",
        "",
        f"- Forgetting: anchored runs keep an original-task return of {anchored['original_return'][0]:.1f} vs "
        f"{free['original_return'][0]:.1f} without the anchor: "
        + ("the anchor forgets less." if less_forgetting else "the anchor does NOT forget less here."),
        "- KL to the reference, mean over the second half of training / target (per seed): "
        + "; ".join(f"{c}: {', '.join(f'{x:.2f}' for x in values)}" for c, values in near_target.items())
        + f". Free runs end at {free['final_ref_kl'][0]:.3f} on average.",
        f"- New task: anchored {anchored['new_task_return'][0]:.1f} vs free {free['new_task_return'][0]:.1f} "
        f"(pretrained {pre['new_task_return']:.1f}).",
    ]
    for condition in runs:
        if condition.startswith("anchored_t"):
            stats = summary[condition]
            lines.append(
                f"- {condition}: original-task return {stats['original_return'][0]:.1f}, new-task return "
                f"{stats['new_task_return'][0]:.1f}, final KL to ref {stats['final_ref_kl'][0]:.3f}."
            )
    with open(os.path.join(RESULTS, f"reference_{tag}.md"), "w") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if plot_figure:
        plot(runs, args, tag, description)


def plot(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, tag: str, description: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    palette = iter(["tab:green", "tab:purple", "tab:orange", "tab:brown"])
    colors = {c: {"free": "tab:red", "anchored": "tab:blue"}.get(c) or next(palette) for c in runs}
    for condition, records in runs.items():
        for i, r in enumerate(records):
            steps = [t["timesteps"] for t in r["trace"]]
            label = condition if i == 0 else None
            axes[0].plot(steps, [t["ref_kl"] for t in r["trace"]], color=colors[condition], label=label, alpha=0.8)
            axes[1].plot(steps, [t["ref_kl_coef"] for t in r["trace"]], color=colors[condition], label=label, alpha=0.8)
            axes[2].plot(steps, [t["train_return"] for t in r["trace"]], color=colors[condition], label=label, alpha=0.8)
    for condition, records in runs.items():
        if condition != "free":
            axes[0].axhline(records[0]["ref_target_kl"], color=colors[condition], ls="--", lw=1)
    axes[0].plot([], [], color="k", ls="--", lw=1, label="ref_target_kl")
    axes[0].set_yscale("log")
    axes[0].set_title("KL(pi || pi_ref) after each update")
    axes[1].set_title("beta_ref (0 = measured only)")
    axes[2].set_title("training episodes, Pendulum's own reward", fontsize=10)
    fig.suptitle(f"Fine-tuning from the pretrained policy, {description}")
    for ax in axes:
        ax.set_xlabel("fine-tuning timesteps")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"reference_{tag}.png"), dpi=100)


def conditions(args: argparse.Namespace) -> list[str]:
    return ["free", "anchored", *(f"anchored_t{x:g}" for x in args.extra_targets)]


def target_of(args: argparse.Namespace, condition: str) -> float:
    return float(condition[len("anchored_t") :]) if condition.startswith("anchored_t") else args.ref_target_kl


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=81_920)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--task", choices=["action-cost", "torque-limit", "spin-bonus"], default="action-cost")
    parser.add_argument("--spin-bonus", type=float, default=1.5)
    parser.add_argument("--action-cost", type=float, default=0.5)
    parser.add_argument("--torque-limit", type=float, default=1.0)
    parser.add_argument("--ref-target-kl", type=float, default=0.05)
    parser.add_argument("--extra-targets", type=float, nargs="*", default=[], help="more anchored runs, one per target")
    parser.add_argument("--report", action="store_true", help="only rewrite the markdown from the records (no training)")
    parser.add_argument("--plot", action="store_true", help="with --report: redraw the figure too")
    args = parser.parse_args(argv)
    task = (args.task, task_value(args))
    args.task_spec = task
    command = f"nice -n 10 python benchmarks/reference.py {run_options(args)}"
    if args.report:
        report(args, command, plot_figure=args.plot)
        return
    th.set_num_threads(1)
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")
    os.makedirs(RUNS, exist_ok=True)
    code_version()  # read before the workers fork
    tag = task_tag(task)
    if not os.path.exists(record_path(f"{tag}_pretrained")):
        record = pretrain(task)  # computed before the file is opened: an interrupted run leaves no empty record
        with open(record_path(f"{tag}_pretrained"), "w") as file:
            json.dump(record, file, indent=1)
    jobs = [
        (condition, seed, args.steps, task, target_of(args, condition))
        for seed in args.seeds
        for condition in conditions(args)
        if not os.path.exists(record_path(f"{tag}_{condition}_s{seed}"))
    ]
    with Pool(min(args.jobs, max(len(jobs), 1))) as pool:
        for message in pool.imap_unordered(run_and_save, jobs):
            print(message, flush=True)
    report(args, command)


if __name__ == "__main__":
    main()
