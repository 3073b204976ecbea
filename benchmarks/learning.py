"""
Returns and KL stability of KLPPO, ClipKLPPO and KLTRPO beside stock SB3 PPO and sb3-contrib TRPO,
on the same seeds, hyperparameters (rl-zoo's, see ``settings.py``) and machine.

Each finished run writes one JSON record under ``benchmarks/results/runs/<tier>/``; the tables
(``benchmarks/results/learning*.md``) and figures (``benchmarks/results/*.png``) are regenerated from the records
by ``--report``, so a grid can be completed over several sessions. No number in the results is typed by hand.

Examples::

    # the main grid at the full budgets, 2 worker processes, then the report
    python benchmarks/learning.py --tier full --grid main --workers 2
    # a subset
    python benchmarks/learning.py --tier full --algos ppo klppo --envs CartPole-v1 Pendulum-v1 --seeds 0 1 2
    # the stress grid (learning rate x3 and x10)
    python benchmarks/learning.py --tier full --grid stress
    # five seeds ("a..b" is an inclusive range) on the environments where algorithms are close
    python benchmarks/learning.py --tier full --seeds 0..4 --envs Pendulum-v1 LunarLanderContinuous-v3
    # a side experiment in its own folder: the grid's Hopper runs trained on past the grid's budget
    SB3_KL_BENCHMARK_RESULTS=benchmarks/results/hopper_budget_300k \\
        python benchmarks/learning.py --tier full --algos klppo --envs Hopper-v5 --seeds 0..9 --budget 300000
    # only regenerate tables and figures from the records
    python benchmarks/learning.py --report --tier full
    # spread the grid over machines: the same command on each (cells queued once in a database-backed Optuna study,
    # a killed worker's cell re-run by another; see distributed_grid.py and docs/distributed.md)
    python benchmarks/learning.py --tier full --grid main --workers 2 --storage postgresql://USER:PASSWORD@HOST/grid

Records and results go to ``benchmarks/results/`` (``$SB3_KL_BENCHMARK_RESULTS`` to write elsewhere).
"""

import argparse
import inspect
import json
import math
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
#: The main results folder: the grid's records (``runs/<tier>/``), its report, and the side experiments' folders
MAIN_RESULTS = HERE / "results"
RESULTS = Path(os.environ.get("SB3_KL_BENCHMARK_RESULTS", MAIN_RESULTS))

MAIN_ENVS = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v5", "Hopper-v5"]
# ppo_target_kl: stock PPO with SB3's KL early stop at KLPPO's target (see settings.settings_for);
# klppo_noclip runs only where PPO's zoo entry clips (elsewhere klppo is already KLPPO without clipping)
MAIN_ALGOS = ["ppo", "ppo_target_kl", "trpo", "klppo", "klppo_noclip", "clip_klppo", "kltrpo"]
# not in the default grid (it needs TRPO's records first: ``--algos kltrpo_matched``); reported when records exist
EXTRA_ALGOS = ["kltrpo_matched"]
# TRPO's seeds whose records set kltrpo_matched's target: fixed, so that adding TRPO seeds does not move the target of
# later kltrpo_matched runs away from that of the earlier ones
MATCHED_SEEDS = (0, 1, 2)
ALL_ALGOS = MAIN_ALGOS + EXTRA_ALGOS
# the algorithms of sb3-kl (the others run no sb3-kl code: only the KL monitor watches them)
SB3_KL_ALGOS = ("klppo", "klppo_noclip", "clip_klppo", "kltrpo", "kltrpo_matched")
#: the sb3-kl algorithms whose loss carries the adaptive KL penalty (beta)
KL_PENALIZED_ALGOS = ("klppo", "klppo_noclip", "clip_klppo")
STRESS_ENVS = ["Pendulum-v1", "HalfCheetah-v5"]
STRESS_ALGOS = ["ppo", "ppo_target_kl", "klppo", "klppo_noclip", "clip_klppo"]
# the goals judge the controller at 10x the zoo learning rate
STRESS_LR_MULTS = [10.0]
# Budget (environment steps) per tier: "full" is what the results report; MuJoCo runs below rl-zoo's 1M steps to fit
# 2 CPU cores; "quick" runs the whole grid in minutes; "tiny" is for the test suite.
BUDGETS = {
    "full": {
        "CartPole-v1": 100_000,
        "Acrobot-v1": 100_000,
        "Pendulum-v1": 100_000,
        "LunarLanderContinuous-v3": 200_000,
        "HalfCheetah-v5": 150_000,
        "Hopper-v5": 150_000,
    },
    "quick": {env: 4096 for env in MAIN_ENVS},
    "tiny": {env: 1024 for env in MAIN_ENVS},
}
N_EVAL_EPISODES = {"full": 10, "quick": 3, "tiny": 1}
# The KL band of the goals: [0.5, 2] x target
BAND = (0.5, 2.0)
# Two-sided Welch t-test level under which a difference between two algorithms counts as significant
SIGNIFICANCE = 0.05


def algorithm_class(algo: str) -> type:
    """:return: the class behind a benchmark name"""
    if algo in ("ppo", "ppo_target_kl"):
        from stable_baselines3 import PPO

        return PPO
    if algo == "trpo":
        from sb3_contrib import TRPO

        return TRPO
    import sb3_kl

    names = {
        "klppo": "KLPPO",
        "klppo_noclip": "KLPPO",
        "clip_klppo": "ClipKLPPO",
        "kltrpo": "KLTRPO",
        "kltrpo_matched": "KLTRPO",
    }
    return getattr(sb3_kl, names[algo])


def scale_learning_rate(kwargs: dict[str, Any], lr_mult: float) -> None:
    """Multiply the learning rate (a number or an SB3 ``LinearSchedule``) in place."""
    from stable_baselines3.common.utils import LinearSchedule

    default = 3e-4 if "learning_rate" not in kwargs else kwargs["learning_rate"]
    if isinstance(default, LinearSchedule):
        kwargs["learning_rate"] = LinearSchedule(default.start * lr_mult, default.end * lr_mult, default.end_fraction)
    else:
        kwargs["learning_rate"] = float(default) * lr_mult


def describe(value: Any) -> Any:
    """JSON-friendly description of a hyperparameter value."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if hasattr(value, "start") and hasattr(value, "end"):
        return f"LinearSchedule({value.start}, {value.end}, {value.end_fraction})"
    return getattr(value, "__name__", repr(value))


def default_target_kl(algo: str, env_id: str, kwargs: dict[str, Any]) -> float:
    """The target the KL band is measured against (for stock algorithms: the family's default)."""
    import gymnasium as gym

    if "target_kl" in kwargs and kwargs["target_kl"] is not None:
        return float(kwargs["target_kl"])
    if algo in ("trpo", "kltrpo", "kltrpo_matched"):
        return 0.01
    continuous = isinstance(gym.make(env_id).action_space, gym.spaces.Box)
    return 0.03 if continuous else 0.02


def record_path(tier: str, algo: str, env_id: str, lr_mult: float, seed: int) -> Path:
    return RESULTS / "runs" / tier / f"{algo}__{env_id}__lr{lr_mult:g}__s{seed}.json"


def matched_target_kl(tier: str, env_id: str, lr_mult: float = 1.0) -> float:
    """
    The KL sb3-contrib's TRPO actually took per update on ``env_id`` (mean over the recorded updates of its seeds
    ``MATCHED_SEEDS`` of the monitor's exact joint KL(old||new), summed over action dimensions): ``kltrpo_matched``'s
    ``target_kl``, so that KLTRPO takes steps of the same size and only the constraint differs. Once the cell has
    ``kltrpo_matched`` records, their target: re-made TRPO records (another machine) do not move it.
    """
    records = load_records(tier)
    made = {r["target_kl"] for r in records if (r["algo"], r["env"], r["lr_mult"]) == ("kltrpo_matched", env_id, lr_mult)}
    if len(made) > 1:
        raise SystemExit(f"kltrpo_matched's records on {env_id} have different targets {sorted(made)}: re-make them.")
    if made:
        return made.pop()
    kls = matched_seed_kls([r for r in records if (r["algo"], r["env"], r["lr_mult"]) == ("trpo", env_id, lr_mult)])
    if not kls:
        raise SystemExit(f"kltrpo_matched on {env_id} needs TRPO's records of the {tier} tier first (--algos trpo).")
    return float(np.mean(kls))


def matched_seed_kls(trpo_records: list[dict[str, Any]]) -> list[float]:
    """The per-update joint KLs of the seeds ``MATCHED_SEEDS`` among TRPO's records of one cell."""
    return [u["mean"] for r in trpo_records if r["seed"] in MATCHED_SEEDS for u in r["kl_updates"]]


def rerun_spec(record: dict[str, Any]) -> dict[str, Any]:
    """:return: the spec of a record's run (cell, seed, tier and overrides), for :func:`train_and_evaluate` to repeat it"""
    spec = {key: record[key] for key in ("algo", "env", "seed", "lr_mult", "tier")}
    spec["overrides"] = record.get("overrides") or {}
    if record["budget"] != BUDGETS[record["tier"]][record["env"]]:  # a run made with --budget
        spec["budget"] = record["budget"]
    return spec


def record_file(record: dict[str, Any]) -> Path:
    """:return: the path of a record's file"""
    return record_path(record["tier"], record["algo"], record["env"], record["lr_mult"], record["seed"])


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train, evaluate and write the record of one run (executed in a worker process)."""
    record = train_and_evaluate(spec)
    path = record_file(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def train_and_evaluate(spec: dict[str, Any], probes: list[Any] | None = None) -> dict[str, Any]:
    """
    Train and evaluate one run.

    :param spec: the run: ``algo``, ``env``, ``seed``, ``lr_mult``, ``tier``, optional ``overrides``, ``code_version``
        and ``budget`` (environment steps, instead of the tier's for the environment)
    :param probes: more callbacks to train with (they must not change the training: no random draws, no writes to
        the model or the environment)
    :return: its record (not written: :func:`run_one` or the distributed grid does). ``learn(budget)`` ends with the
        rollout in which the budget is reached, so a run trains up to one rollout (``n_steps`` x ``n_envs``) more than
        ``budget``: ``trained_steps`` holds the steps it trained (the model's ``num_timesteps``), and
        ``env_steps_per_second`` is ``trained_steps / train_seconds``. Records made before ``trained_steps`` was stored
        hold ``budget / train_seconds`` there, which undercounts by the last rollout's overshoot (they were not re-made;
        :func:`trained_steps` reads their step count from the learning curve).
    """
    import torch as th

    th.set_num_threads(1)
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize

    from settings import settings_for

    algo, env_id, seed, lr_mult, tier = spec["algo"], spec["env"], spec["seed"], spec["lr_mult"], spec["tier"]
    setting = settings_for(algo, env_id)
    kwargs = dict(setting["kwargs"])
    if lr_mult != 1.0:
        scale_learning_rate(kwargs, lr_mult)
    if algo == "kltrpo_matched":
        kwargs["target_kl"] = matched_target_kl(tier, env_id, lr_mult)
    overrides = spec.get("overrides") or {}
    kwargs.update(resolve_activation(overrides))
    budget = spec.get("budget") or BUDGETS[tier][env_id]
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    if setting["normalize"]:
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))

    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            if len(self.model.ep_info_buffer) > 0:
                curve.append((self.num_timesteps, float(np.mean([info["r"] for info in self.model.ep_info_buffer]))))

    callbacks: list[BaseCallback] = [Curve(), *(probes or [])]
    monitor = None
    try:
        from sb3_kl.callbacks import KLMonitorCallback

        monitor = KLMonitorCallback()
        callbacks.append(monitor)
    except ImportError:
        pass

    model = algorithm_class(algo)("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    start = time.perf_counter()
    model.learn(budget, callback=CallbackList(callbacks))
    train_seconds = time.perf_counter() - start
    steps = int(model.num_timesteps)  # past the budget: learn() ends with the rollout in which it is reached

    eval_env = make_vec_env(env_id, n_envs=1, seed=10_000 + seed)
    if setting["normalize"]:
        assert isinstance(env, VecNormalize)
        eval_env = VecNormalize(eval_env, training=False, norm_reward=False)
        eval_env.obs_rms = env.obs_rms
    returns, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=N_EVAL_EPISODES[tier], deterministic=True, return_episode_rewards=True
    )

    kl_updates = []
    if monitor is not None:
        for entry in monitor.history:
            stats = entry.get("stats", entry)
            update = dict(timesteps=int(entry.get("num_timesteps", 0)), mean=float(stats["mean"]), p99=float(stats["p99"]))
            if "normalization_shift" in entry:  # the KL that VecNormalize's statistics alone made in the rollout
                update["normalization_shift"] = float(entry["normalization_shift"])
            if "drift" in entry:  # the KL between the policy drift_lag updates before and the updated one
                update["drift"] = float(entry["drift"])
            kl_updates.append(update)
    record = dict(
        algo=algo,
        env=env_id,
        seed=seed,
        lr_mult=lr_mult,
        tier=tier,
        budget=budget,
        trained_steps=steps,
        n_envs=setting["n_envs"],
        normalize=setting["normalize"],
        hyperparameters=describe(kwargs),
        target_kl=default_target_kl(algo, env_id, kwargs),
        eval_returns=[float(r) for r in returns],
        eval_mean=float(np.mean(returns)),
        curve=curve,
        kl_updates=kl_updates,
        overrides=overrides,
        kl_source="sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed)" if monitor is not None else None,
        # the lag, in updates, of the kl_updates' drift (the policy drift_lag updates before the updated one)
        drift_lag=monitor.drift_lag if monitor is not None else None,
        train_seconds=train_seconds,
        env_steps_per_second=steps / train_seconds,
        torch_threads=1,
        # the commit checked out when the batch started (the workers import the code then)
        code_version=spec.get("code_version") or code_version(),
        run_environment=run_environment(),
    )
    return record


def code_version(*scripts: str) -> str:
    """
    The commit of the sb3-kl checkout that ran, with ``+modified`` when the package or the benchmark code had
    uncommitted changes (results files do not count), or ``"unknown"`` outside a git checkout.

    :param scripts: The benchmark files (names in ``benchmarks/``) whose changes count; default this script's
    """
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = git("status", "--porcelain", "--", "../sb3_kl", *(scripts or ("settings.py", "learning.py")))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) if commit else "unknown"


def run_environment() -> dict[str, str]:
    """
    What besides the code decides a run's numbers: the CPU model and the versions of the numerical libraries and of
    the simulators. Runs are bit-for-bit repeatable on one machine with one set of versions, not across them (floating
    point rounding differs between CPUs and library builds), so every record names both.

    :return: ``{"cpu": ..., "python": ..., "<package>": "<version>", ...}`` (packages that are not installed are left out)
    """
    import platform
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    described = {"cpu": cpu, "python": platform.python_version()}
    for package in ("torch", "numpy", "stable-baselines3", "sb3-contrib", "gymnasium", "mujoco", "box2d"):
        try:
            described[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return described


# ----------------------------------------------------------------------------------------------------------------------
# Report


def area_under_curve(curve: list[list[float]], budget: int) -> float:
    """Mean episode return over training (trapezoid area of the curve divided by its span)."""
    if len(curve) < 2:
        return float(curve[0][1]) if curve else float("nan")
    t, r = np.array(curve, dtype=float).T
    return float(np.trapezoid(r, t) / (t[-1] - t[0]))


def collapse_points(curve: list[list[float]]) -> list[tuple[int, int]]:
    """
    The collapses of a learning curve. A collapse: after the return has improved by at least 10 % of its range, it
    falls below 50 % of the way from its starting value to its running best, and never comes back above 90 % of that
    best before the end. (Measured on progress from the start, so it works for negative returns such as Pendulum's.)

    :param curve: ``[timesteps, return]`` points
    :return: for each collapse, the index of the curve's running best when it fell and the index where it fell
        below 50 %
    """
    if len(curve) < 3:
        return []
    returns = np.array([c[1] for c in curve], dtype=float)
    start, span = returns[0], np.ptp(returns)
    if span == 0:
        return []
    points: list[tuple[int, int]] = []
    best, best_index, in_collapse = returns[0], 0, False
    for i, r in enumerate(returns):
        if r > best:
            best, best_index = r, i
        gained = best - start
        if gained < 0.1 * span:
            continue
        progress = (r - start) / gained
        if not in_collapse and progress < 0.5:
            later = (returns[i:] - start) / gained
            if not np.any(later >= 0.9):
                points.append((best_index, i))
                in_collapse = True
        elif in_collapse and progress >= 0.9:
            in_collapse = False
    return points


def cell_order(cell: tuple[str, str, float]) -> tuple[float, int, str]:
    """
    The report's order of the cells ``(env, algo, lr_mult)``: by learning-rate multiplier, then environment in the
    grid's order, then algorithm name.
    """
    env, algo, lr_mult = cell
    return lr_mult, MAIN_ENVS.index(env), algo


def count_collapses(curve: list[list[float]]) -> int:
    """The number of collapses of a learning curve (:func:`collapse_points`)."""
    return len(collapse_points(curve))


def fall_span(record: dict[str, Any]) -> tuple[float, float] | None:
    """
    The steps of the curve's best point and of the rollout where it fell below 50 % in the run's first collapse: the
    updates at ``low <= t < high`` made the policies of the fall; None without a collapse.
    """
    points = collapse_points(record["curve"])
    if not points:
        return None
    best, fell = points[0]
    return record["curve"][best][0], record["curve"][fell][0]


def fall_kl(record: dict[str, Any]) -> dict[str, float] | None:
    """
    The per-update KL (the monitor's exact per-update mean, as a multiple of the run's target) over the fall of the
    run's first collapse: the updates that made the policies of the rollouts after the curve's best point, up to the
    rollout where it fell below 50 % (an update at ``t`` steps trains on the rollout that ended at ``t``, and the
    next rollout acts with its result).

    :return: ``n`` updates, their ``mean`` and ``max`` KL / target, the share ``over`` 2 x target, and the run's
        share over 2 x target over all its updates (``over_run``); None without a collapse or KL records
    """
    span = fall_span(record)
    kl = record.get("kl_updates") or []
    if span is None or not kl:
        return None
    low, high = span
    target = record["target_kl"]
    fall = np.array([u["mean"] for u in kl if low <= u["timesteps"] < high]) / target
    whole = np.array([u["mean"] for u in kl]) / target
    if len(fall) == 0:
        return None
    return dict(
        n=len(fall),
        mean=float(fall.mean()),
        max=float(fall.max()),
        over=float(np.mean(fall > BAND[1])),
        over_run=float(np.mean(whole > BAND[1])),
    )


def summarize(record: dict[str, Any]) -> dict[str, float]:
    kl = record["kl_updates"]
    target = record["target_kl"]
    summary = dict(
        eval_mean=record["eval_mean"],
        auc=area_under_curve(record["curve"], record["budget"]),
        collapses=count_collapses(record["curve"]),
        steps_per_s=record["env_steps_per_second"],
    )
    if kl:
        means = np.array([u["mean"] for u in kl])
        summary["kl_mean"] = float(np.mean(means))
        summary["kl_p99"] = float(np.mean([u["p99"] for u in kl]))
        summary["in_band"] = float(np.mean((means >= BAND[0] * target) & (means <= BAND[1] * target)))
        summary["budget_use"] = float(np.mean(means)) / target
    return summary


def load_records(tier: str) -> list[dict[str, Any]]:
    folder = RESULTS / "runs" / tier
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def trained_steps(record: dict[str, Any]) -> int | None:
    """
    The environment steps a run trained: ``learn(budget)`` ends with the rollout in which the budget is reached, so up
    to one rollout (``n_steps`` x ``n_envs``, which depends on the algorithm's settings) more than ``budget``.

    :param record: a run's record
    :return: its ``trained_steps`` (the model's ``num_timesteps`` after training) where the record stores it; in
        records made before it was stored, the step count of the last point of the learning curve or of the last KL
        update, whichever is later (both are taken after a rollout, the last ones after the last rollout); None when
        the record holds neither
    """
    if "trained_steps" in record:
        return int(record["trained_steps"])
    points = [point[0] for point in record.get("curve", [])[-1:]]
    points += [update["timesteps"] for update in (record.get("kl_updates") or [])[-1:]]
    return int(max(points)) if points else None


def budgets_and_trained_steps(records: list[dict[str, Any]]) -> str:
    """
    The report's sentences on the step budgets, from the records: each environment's budget (``learn``'s
    ``total_timesteps``) and the steps its runs actually trained (:func:`trained_steps`), which exceed the budget by an
    amount that depends on the algorithm's rollout size, with the algorithms that trained each count.
    """
    budgets, trained = [], []
    for env in MAIN_ENVS:
        runs = [r for r in records if r["env"] == env]
        if not runs:
            continue
        budgets.append(f"{env} " + " / ".join(f"{b:,}" for b in sorted({r["budget"] for r in runs})))
        labels: dict[tuple[int, int | None], list[str]] = {}
        for algo in ALL_ALGOS:
            own = [r for r in runs if r["algo"] == algo]
            counts = {(r["budget"], trained_steps(r)) for r in own}
            for mult in sorted({r["lr_mult"] for r in own}):
                # the algorithm's name alone where all its runs on the environment trained as many steps
                cell = {(r["budget"], trained_steps(r)) for r in own if r["lr_mult"] == mult}
                for count in sorted(cell, key=lambda c: (c[0], c[1] or 0)):
                    label = algo if len(counts) == 1 else f"{algo} x{mult:g}"
                    if label not in labels.setdefault(count, []):
                        labels[count].append(label)
        cells = [
            (f"{steps:,} ({steps - budget:+,}" if steps is not None else "unknown (") + f": {', '.join(algos)})"
            for (budget, steps), algos in sorted(labels.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
        ]
        trained.append(f"{env} {', '.join(cells)}")
    stored = [("trained_steps" in r) for r in records]
    if all(stored):
        source = "each record's `trained_steps`, the model's step count after training"
    else:
        source = (
            "each run's step count at its last learning-curve point or last KL update, whichever is later; both are"
            " taken after a rollout, the last ones after the last rollout"
            + ("; or the record's `trained_steps` where it stores it" if any(stored) else "")
        )
    return (
        "Budgets (`total_timesteps` passed to `learn`, one per environment for every algorithm and learning rate): "
        + ", ".join(budgets)
        + ". `learn` does not stop inside a rollout: it ends with the rollout in which the budget is reached, so every"
        " run trained past its budget, by up to one rollout (`n_steps` x `n_envs`, which differs between algorithms)."
        f" Steps the runs trained, from the records ({source}), beyond the budget, and the algorithms that trained"
        " them: " + "; ".join(trained) + ". The AUC averages each run's curve over its own span."
    )


def results_folder_label(path: Path | None = None) -> str:
    """
    :param path: a results folder (default: ``RESULTS``, the one the report reads)
    :return: the folder as the reports name it: ``benchmarks/results[/...]`` where it lies in the main results folder
        (``MAIN_RESULTS``), else its absolute path
    """
    folder, main = (path or RESULTS).resolve(), MAIN_RESULTS.resolve()
    if folder == main or main in folder.parents:
        return (Path("benchmarks") / "results" / folder.relative_to(main)).as_posix()
    return folder.as_posix()


def is_side_folder() -> bool:
    """
    Whether ``RESULTS`` (``$SB3_KL_BENCHMARK_RESULTS``) is a side experiment's folder: one inside the main results
    folder, whose records the main report sets beside the grid's. Its report covers only its own records: the
    sections that compare side experiments with the main grid, and the goals, which are stated over the main grid, are
    left to the main report. (A results folder elsewhere is a grid of its own, reported as the main one is.)
    """
    return MAIN_RESULTS.resolve() in RESULTS.resolve().parents


def side_folder_scope(records: list[dict[str, Any]], tier: str) -> str:
    """The paragraph that opens a side folder's report (:func:`is_side_folder`): what it covers and what it does not."""
    name = RESULTS.resolve().relative_to(MAIN_RESULTS.resolve()).as_posix()
    cells = []
    for env in MAIN_ENVS:
        for mult in sorted({r["lr_mult"] for r in records if r["env"] == env}):
            runs = [r for r in records if r["env"] == env and r["lr_mult"] == mult]
            algos = [a for a in ALL_ALGOS if any(r["algo"] == a for r in runs)]
            cells.append(f"{env} x{mult:g}: {', '.join(algos)}, seeds {seed_range(runs)}")
    uses = [f"*{env} collapses over more seeds*" for env, (folder, _) in MORE_SEEDS_RUNS.items() if folder == name]
    return (
        f"This report covers only the {len(records)} records of this side folder ({'; '.join(cells)}), not the main"
        f" grid's in `benchmarks/results/runs/{tier}/`: its tables, comparisons and collapses are those of these runs"
        " alone. The sections that set side experiments beside the main grid, and the goals, which are stated over"
        " the main grid, are left to the main report, `benchmarks/results/learning.md`, which reads these records"
        + (f" in {', '.join(uses)}" if uses else " where a section names this folder")
        + "."
    )


def fmt(values: list[float], digits: int = 1, percent: bool = False) -> str:
    if not values or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return "n/a"
    scale = 100.0 if percent else 1.0
    mean, std = scale * float(np.mean(values)), scale * float(np.std(values))
    suffix = "%" if percent else ""
    if abs(mean) < 0.1 and not percent and mean != 0:
        return f"{mean:.3g} ± {std:.2g}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}{suffix}"


# ----------------------------------------------------------------------------------------------------------------------
# Significance


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, by its continued fraction (modified Lentz), on the side of ``x`` where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-13:
            break
    return math.exp(log_front) * fraction / a


def welch_p_value(a: list[float], b: list[float]) -> float:
    """
    Two-sided p-value of Welch's t-test of equal means (unequal variances); ``nan`` with fewer than 2 values on a
    side. A difference with p >= ``SIGNIFICANCE`` is inside the seed noise: a tie.
    """
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    var_a, var_b = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    difference = float(np.mean(a) - np.mean(b))
    if var_a + var_b == 0:
        return 1.0 if difference == 0 else 0.0
    t = difference / math.sqrt(var_a + var_b)
    dof = (var_a + var_b) ** 2 / (var_a**2 / (len(a) - 1) + var_b**2 / (len(b) - 1))
    return t_two_sided_p(t, dof)


def t_two_sided_p(t: float, dof: float) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``dof`` degrees of freedom."""
    return regularized_incomplete_beta(dof / 2.0, 0.5, dof / (dof + t * t))


def p_text(p: float) -> str:
    """A p-value as the report prints it: two decimals, three below 0.01, and ``p<0.001`` below that."""
    if math.isnan(p):
        return "p n/a"
    if p < 0.001:
        return "p<0.001"
    return f"p={p:.3f}" if p < 0.01 else f"p={p:.2f}"


def verdict(ours: list[float], theirs: list[float], higher_is_better: bool = True) -> tuple[str, str]:
    """
    :return: ``("+12.3 (p=0.04)", "better" | "worse" | "tie")``: the difference of the means (ours - theirs), its
        Welch p-value, and whether it is significant and in whose favour
    """
    difference = float(np.mean(ours) - np.mean(theirs))
    p = welch_p_value(ours, theirs)
    digits = 4 if max(abs(np.mean(ours)), abs(np.mean(theirs))) < 1 else 1
    text = f"{difference:+.{digits}f} ({p_text(p)})"
    if math.isnan(p) or p >= SIGNIFICANCE:
        return text, "tie"
    return text, "better" if (difference > 0) == higher_is_better else "worse"


# ----------------------------------------------------------------------------------------------------------------------


def report(tier: str) -> str:
    """
    Write ``learning[_<tier>].md`` and the figures into ``RESULTS`` from the records of a tier there. The report names
    the folder it read; in a side experiment's folder (:func:`is_side_folder`) it covers only that folder's records:
    the sections that set side experiments beside the main grid and the goals are left to the main report.
    """
    records = load_records(tier)
    if not records:
        raise SystemExit(f"No records under {RESULTS / 'runs' / tier}: run the grid first.")
    groups = group_records(records)
    envs = [e for e in MAIN_ENVS if any(k[0] == e for k in groups)]
    algos = [a for a in ALL_ALGOS if any(k[1] == a for k in groups)]
    suffix = "" if tier == "full" else f"_{tier}"
    folder, side = results_folder_label(), is_side_folder()
    command = f"python benchmarks/learning.py --report --tier {tier}"
    if RESULTS.resolve() != MAIN_RESULTS.resolve():
        command = f"SB3_KL_BENCHMARK_RESULTS={folder} {command}"
    lines = [
        f"# Learning benchmark ({tier} tier)" + (f": the records of `{folder}/` only" if side else ""),
        "",
        *([side_folder_scope(records, tier), ""] if side else []),
        f"Generated by `{command}` from the JSON records in `{folder}/runs/{tier}/`. "
        "Hyperparameters: rl-baselines3-zoo's tuned settings (`benchmarks/settings.py`); "
        "`klppo` is the drop-in swap (PPO's entry unchanged: where it sets `clip_range`, KLPPO clips and penalizes); "
        "`klppo_noclip` is KLPPO with its own default `clip_range=None` (run only where PPO's entry clips: elsewhere "
        "`klppo` is that run); `ppo_target_kl` is stock PPO with SB3's KL early stop, `target_kl` set to the target "
        "KLPPO controls toward (0.02 discrete, 0.03 continuous) and PPO's clip, the baseline an SB3 user would pick "
        "instead; `kltrpo_matched` is KLTRPO with `target_kl` set to the joint KL TRPO took per update on that "
        f"environment (from TRPO's records of seeds {', '.join(map(str, MATCHED_SEEDS))} beside which its first runs were "
        "made, kept fixed as seeds are added and records re-made), "
        "so both take steps of the same size. Evaluation: "
        f"{N_EVAL_EPISODES[tier]} deterministic episodes after training. AUC: the time-average of the learning curve "
        "(the mean return of the last 100 training episodes after each rollout; trapezoid area over the curve's span "
        "in steps). "
        f"KL: exact per-update KL(old||new) from KLMonitorCallback, mean over updates of the per-update mean and p99; "
        f"in-band: share of updates whose KL lies in [{BAND[0]}, {BAND[1]}] x target (target: the algorithm's, or the "
        "family default 0.02 discrete / 0.03 continuous for PPO and 0.01 for TRPO). Collapses: see `count_collapses`. "
        "Values are mean ± std over seeds (population std, ddof 0, also in the goals' 'minus one std'; the Welch "
        "tests use sample variances); the best evaluation return and AUC per row are in bold, and a cell marked ≈ "
        f"is not significantly different from the best (two-sided Welch t-test, p ≥ {SIGNIFICANCE}): a difference "
        "inside the seed noise is a tie.",
        "",
        *(
            [
                "KLTRPO and TRPO get the same `target_kl` but do not constrain the same number: KLTRPO holds the joint"
                " KL(old||new), summed over action dimensions, at or below it, while sb3-contrib's TRPO holds KL(new||old)"
                " averaged over action dimensions. On a d-dimensional action space TRPO's joint KL per update can reach"
                " about d times the target (see the KL tables: Hopper has 3 action dimensions, HalfCheetah 6), so at equal"
                ' settings KLTRPO takes smaller steps; `kl_reduction="mean"` gives it TRPO\'s budget per dimension, and'
                " `kltrpo_matched` TRPO's measured step size.",
                "",
            ]
            if not side or any(a in algos for a in ("trpo", "kltrpo", "kltrpo_matched"))
            else []
        ),
        budgets_and_trained_steps(records)
        + " rl-zoo trains LunarLanderContinuous and the MuJoCo tasks for 1M steps; these runs are shorter so that"
        " the grid fits a 2-core machine, so MuJoCo returns are those of early training. One torch thread per run.",
        "",
        "Code versions of the records (commit of sb3-kl that produced them: run count). sb3-kl algorithms: "
        + ", ".join(f"`{v}`: {n}" for v, n in sorted(code_versions([r for r in records if r["algo"] not in STOCK]).items()))
        + "; stock PPO/TRPO (whose training runs no sb3-kl code; only the KL monitor watches it): "
        + ", ".join(f"`{v}`: {n}" for v, n in sorted(code_versions([r for r in records if r["algo"] in STOCK]).items()))
        + "."
        + (
            " *unrecorded*: runs from before records stored it, made with sb3-kl at commit d9fd1be or earlier."
            if any("code_version" not in r for r in records)
            else ""
        ),
        "",
        "Machines and library versions of the records (run count): "
        + "; ".join(f"{described}: {n}" for described, n in sorted(run_environments(records).items()))
        + ". A run repeats bit for bit on one machine with one set of library versions, not across them, so records"
        " from different machines differ like different seeds do, not like different code.",
        "",
    ]
    for lr_mult in sorted({k[2] for k in groups}):
        title = "Main grid (base learning rate)" if lr_mult == 1.0 else f"Stress grid: learning rate x{lr_mult:g}"
        if side:  # not the grids: this folder's cells at that learning rate
            title = "Base learning rate" if lr_mult == 1.0 else f"Learning rate x{lr_mult:g}"
        lines += [f"## {title}", ""]
        lines += grid_tables(groups, envs, algos, lr_mult)
        lines.append("")
    if not side or any(algo == "ppo_target_kl" for (_, algo, _) in groups):
        lines += baseline_comparison(groups, envs), ""
    # the sections that set side experiments' folders beside the grid: a side folder's report leaves them out
    sections = [budget_use(groups, envs)]
    if not side:
        sections += [
            saturation_stop_comparison(groups),
            kl_stop_comparison(),
            kltrpo_direction_comparison(tier),
            initial_kl_coef_comparison(tier),
            clip_klppo_start_comparison(groups, tier),
            lower_target_comparison(groups, tier),
        ]
    sections += [collapse_table(groups, "this folder's records" if side else "both grids"), drift_table(groups)]
    if not side:
        sections += [collapse_rates(groups, tier, env) for env in MORE_SEEDS_RUNS]
        sections += [longer_budget_collapses(groups, tier, env) for env in LONGER_BUDGET_RUNS]
        sections.append(settings_swap_comparison(groups, tier))
    for section in sections:
        if section:
            lines += section, ""
    if side:
        lines += side_folder_checks(groups), ""
    else:
        replicated = replication(tier)
        note = (
            "The cells whose earlier records do not name their machine are judged again on this machine's records alone"
            " under *Records that do not name their machine, beside this machine's* below."
        )
        lines += goals(groups, note if replicated else None), ""
        if replicated:
            lines += replicated, ""
    text = "\n".join(lines)
    (RESULTS / f"learning{suffix}.md").write_text(text)
    plot(groups, envs, algos, suffix)
    return text


def grid_tables(
    groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str], algos: list[str], lr_mult: float
) -> list[str]:
    """The tables of one grid (one learning-rate multiple): a row per environment, a column per algorithm."""
    lines: list[str] = []
    header = "| env | budget | " + " | ".join(algos) + " |"
    for metric, label, kwargs in (
        ("eval_mean", "Evaluation return", {}),
        ("auc", "Area under the learning curve", {}),
        ("kl_mean", "Per-update KL, mean", {"digits": 4}),
        ("kl_p99", "Per-update KL, p99 over states", {"digits": 4}),
        ("in_band", "Updates with KL in band", {"percent": True, "digits": 0}),
        ("collapses", "Collapses", {"digits": 1}),
    ):
        lines += [f"### {label}", "", header, "|" + "---|" * (len(algos) + 2)]
        for env in envs:
            runs = [groups.get((env, algo, lr_mult), []) for algo in algos]
            if not any(runs):
                continue
            values = [[summarize(r).get(metric) for r in algo_runs] for algo_runs in runs]
            cells = [fmt(v, **kwargs) + (f" (n={len(v)})" if v and metric == "eval_mean" else "") if v else "" for v in values]
            if metric in ("eval_mean", "auc"):
                means = [float(np.mean(v)) if v else -np.inf for v in values]
                best = int(np.argmax(means))
                for i, v in enumerate(values):
                    if i != best and v and not welch_p_value(v, values[best]) < SIGNIFICANCE:
                        cells[i] = f"≈ {cells[i]}"
                cells[best] = f"**{cells[best]}**"
            budget = next(r["budget"] for algo_runs in runs for r in algo_runs)
            lines.append(f"| {env} | {budget:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def baseline_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str]) -> str:
    """KLPPO and ClipKLPPO against stock PPO with SB3's ``target_kl`` early stop, on return, AUC and KL tail."""
    out = [
        "## Against stock PPO with `target_kl`",
        "",
        "Difference of the seed means (sb3-kl algorithm - `ppo_target_kl`) with the Welch p-value; *better* / *worse* "
        f"only when p < {SIGNIFICANCE}, *tie* otherwise. KL tail: the per-update p99 of the per-state KL (lower is "
        "better).",
        "",
        "| grid | env | algorithm | return | AUC | KL p99 |",
        "|---|---|---|---|---|---|",
    ]
    not_beaten: list[str] = []
    for lr_mult in sorted({k[2] for k in groups}):
        for env in envs:
            baseline = groups.get((env, "ppo_target_kl", lr_mult), [])
            if not baseline:
                continue
            for ours in KL_PENALIZED_ALGOS:
                runs = groups.get((env, ours, lr_mult), [])
                if not runs:
                    continue
                cells = []
                for metric, higher_is_better in (("eval_mean", True), ("auc", True), ("kl_p99", False)):
                    a = [summarize(r).get(metric, float("nan")) for r in runs]
                    b = [summarize(r).get(metric, float("nan")) for r in baseline]
                    text, result = verdict(a, b, higher_is_better)
                    cells.append(f"{text}: {'**' + result + '**' if result == 'worse' else result}")
                    if result != "better":
                        label = {"eval_mean": "return", "auc": "AUC", "kl_p99": "KL tail"}[metric]
                        not_beaten.append(f"{ours} on {env} (x{lr_mult:g}), {label}: {result}")
                out.append(f"| x{lr_mult:g} | {env} | {ours} | " + " | ".join(cells) + " |")
    if not any(line.startswith("| x") for line in out):
        return "\n".join([*out[:2], "No `ppo_target_kl` records yet."])
    # where SB3's early stop never fired, ppo_target_kl trained exactly as PPO did: that cell compares with PPO
    never_stopped = [
        f"{env} (x{mult:g}, {len(new)} seeds)"
        for (env, _, mult), old, new in paired_runs(
            {(e, "ppo_target_kl", m): runs for (e, a, m), runs in groups.items() if a == "ppo"},
            {cell: runs for cell, runs in groups.items() if cell[1] == "ppo_target_kl"},
        )
        if all(same_run(a, b) for a, b in zip(new, old, strict=True))
    ]
    if never_stopped:
        out += [
            "",
            "Cells where every seed of `ppo_target_kl` trained identically to stock PPO's (SB3's early stop never "
            "fired, so there the baseline is PPO itself): " + ", ".join(never_stopped) + ".",
        ]
    out += ["", "Where KLPPO/ClipKLPPO do not beat stock PPO with `target_kl` (tie or worse):", ""]
    out += [f"- {line}" for line in not_beaten] or ["- nowhere: they beat it on every metric of every cell"]
    return "\n".join(out)


def budget_use(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str]) -> str:
    """
    How much of its KL budget each KLTRPO variant (and TRPO, in the joint convention) uses per update; empty without
    their records.
    """
    out = [
        "## KLTRPO's KL budget use",
        "",
        "Mean over updates and seeds of the measured per-update KL divided by the algorithm's `target_kl` (TRPO's"
        " target bounds its per-dimension reverse KL, so its joint forward KL can exceed 1).",
        "",
        "| env | algorithm | target_kl | mean KL / target |",
        "|---|---|---|---|",
    ]
    for env in envs:
        for algo in ("kltrpo", "kltrpo_matched", "trpo"):
            runs = groups.get((env, algo, 1.0), [])
            if runs:
                uses = [summarize(r).get("budget_use") for r in runs]
                targets = sorted({f"{r['target_kl']:.4g}" for r in runs})
                out.append(f"| {env} | {algo} | {', '.join(targets)} | {fmt(uses, digits=2)} |")
    return "\n".join(out) if not out[-1].startswith("|---") else ""


# Stock algorithms: their records do not depend on the sb3-kl version
STOCK = ("ppo", "ppo_target_kl", "trpo")


def group_records(records: list[dict[str, Any]]) -> dict[tuple[str, str, float], list[dict[str, Any]]]:
    """Records grouped by cell: (env, algo, lr_mult)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["env"], record["algo"], record["lr_mult"]), []).append(record)
    return groups


def load_folder(name: str) -> dict[tuple[str, str, float], list[dict[str, Any]]]:
    """Records of a side experiment kept in ``results/<name>/``, grouped by cell."""
    folder = RESULTS / name
    return group_records([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else [])


def update_share(record: dict[str, Any], low: float, high: float) -> float:
    """Share of a run's updates whose KL lies in [low, high) x target."""
    target = record["target_kl"]
    return float(np.mean([low * target <= u["mean"] < high * target for u in record["kl_updates"]]))


def kl_update_keys(record: dict[str, Any], until: int | None = None) -> list[tuple[int, float, float]]:
    """
    A record's per-update KLs as ``(timesteps, mean, p99)``, those at or before ``until`` steps where given: what two
    records that trained identically share (records made before the monitor measured the normalization's shift do not
    hold it).
    """
    updates = record.get("kl_updates") or []
    return [(u["timesteps"], u["mean"], u["p99"]) for u in updates if until is None or u["timesteps"] <= until]


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """
    Whether two records of one cell and seed trained identically: same evaluation returns and per-update KLs
    (:func:`kl_update_keys`).
    """
    return a["eval_returns"] == b["eval_returns"] and kl_update_keys(a) == kl_update_keys(b)


def sb3_kl_collapses(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The runs of sb3-kl algorithms among ``groups`` with a collapse (:func:`count_collapses`), in the groups' order."""
    return [r for (_, algo, _), runs in groups.items() if algo in SB3_KL_ALGOS for r in runs if count_collapses(r["curve"])]


def distinct_trainings(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    ``records`` without those that trained identically to an earlier one (:func:`same_run`): KLPPO with PPO's clip and
    ClipKLPPO train identically wherever beta stays at the same value in both, and such a training counts once.
    """
    return [r for i, r in enumerate(records) if not any(same_run(r, q) for q in records[:i])]


def seed_key(record: dict[str, Any]) -> tuple[str, str, float, int]:
    """:return: a record's cell and seed, ``(env, algo, lr_mult, seed)``"""
    return record["env"], record["algo"], record["lr_mult"], record["seed"]


def paired_runs(
    without: dict[tuple[str, str, float], list[dict[str, Any]]],
    with_: dict[tuple[str, str, float], list[dict[str, Any]]],
) -> list[tuple[tuple[str, str, float], list[dict[str, Any]], list[dict[str, Any]]]]:
    """
    The cells of ``with_`` that ``without`` also has, in report order, each with the records of the seeds both have:
    ``(cell, records in without, records in with_)``, paired seed by seed.
    """
    pairs = []
    for cell in sorted(with_, key=cell_order):
        old_by_seed = {r["seed"]: r for r in without.get(cell, [])}
        new = [r for r in with_[cell] if r["seed"] in old_by_seed]
        if new:
            pairs.append((cell, [old_by_seed[r["seed"]] for r in new], new))
    return pairs


def paired_rows(
    without: dict[tuple[str, str, float], list[dict[str, Any]]],
    with_: dict[tuple[str, str, float], list[dict[str, Any]]],
    identical: bool = False,
) -> list[str]:
    """
    Table rows comparing the cells of ``with_`` with the same cells and seeds of ``without``: evaluation return (Welch
    p), AUC, share of updates in band and over 2x target, collapses; with ``identical``, also how many seeds trained
    identically in both.
    """
    rows = []
    for (env, algo, mult), old, new in paired_runs(without, with_):
        text, result = verdict([r["eval_mean"] for r in new], [r["eval_mean"] for r in old])
        cells = [str(len(new))]
        if identical:
            cells.append(str(sum(same_run(a, b) for a, b in zip(new, old, strict=True))))
        cells += [
            fmt([r["eval_mean"] for r in old]),
            fmt([r["eval_mean"] for r in new]),
            f"{text}: {result}",
            fmt([summarize(r)["auc"] for r in old]),
            fmt([summarize(r)["auc"] for r in new]),
            fmt([summarize(r)["in_band"] for r in old], digits=0, percent=True),
            fmt([summarize(r)["in_band"] for r in new], digits=0, percent=True),
            fmt([update_share(r, BAND[1], np.inf) for r in old], digits=0, percent=True),
            fmt([update_share(r, BAND[1], np.inf) for r in new], digits=0, percent=True),
            f"{sum(count_collapses(r['curve']) for r in old)} / {sum(count_collapses(r['curve']) for r in new)}",
        ]
        rows.append(f"| {env} | x{mult:g} | {algo} | " + " | ".join(cells) + " |")
    return rows


PAIRED_HEADER = (
    "| eval {a} | eval {b} | difference | AUC {a} | AUC {b} | in band {a} | in band {b} | over 2x {a} | over 2x {b} "
    "| collapses {a} / {b} |"
)


def grid_beside(
    side: dict[tuple[str, str, float], list[dict[str, Any]]],
    groups: dict[tuple[str, str, float], list[dict[str, Any]]],
    tier: str = "full",
) -> dict[tuple[str, str, float], list[dict[str, Any]]]:
    """
    The grid's records, each seed of ``side`` taken from the machine its side record was made on where the grid
    re-made it on another (``--other-machines``; the earlier record is kept in ``results/unrecorded_machine/``): a
    comparison of two runs that should train identically wherever the change measured never acted needs both from
    one machine.
    """
    kept = {seed_key(r): r for runs in load_folder(f"unrecorded_machine/runs/{tier}").values() for r in runs}
    side_machine = {seed_key(r): machine(r) for runs in side.values() for r in runs}

    def from_side_machine(record: dict[str, Any]) -> dict[str, Any]:
        key = seed_key(record)
        earlier = kept.get(key)
        if key not in side_machine or earlier is None or machine(record) == side_machine[key]:
            return record
        return earlier if machine(earlier) == side_machine[key] else record

    return {cell: [from_side_machine(r) for r in runs] for cell, runs in groups.items()}


def saturation_stop_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> str:
    """
    KLPPO's stop at beta's upper bound (``kl_saturation_stop_factor``, default 1.5): every KLPPO cell of the grid
    beside the same runs from before the stop existed (``results/before_saturation_stop/``).
    """
    before = load_folder("before_saturation_stop")
    after = {key: runs for key, runs in grid_beside(before, groups).items() if key[1] in KL_PENALIZED_ALGOS}
    if not before or not after:
        return ""
    versions = ", ".join(sorted(code_versions([r for runs in before.values() for r in runs])))
    lines = [
        "## KLPPO's stop at beta's upper bound (`kl_saturation_stop_factor=1.5`, the default)",
        "",
        "While beta sits at the top of `kl_coef_bounds` (or one adaptation step below it), the update ends before the "
        "first optimizer step whose minibatch KL exceeds 1.5 x target, and beta is not lowered after an update the stop "
        "ended (records of commits before 3e1a52e: beta held, also one step below its bound); "
        "below the bound the updates are as without it. `before`: the same cells and seeds before the stop existed "
        f"(records in `benchmarks/results/before_saturation_stop/`, code {versions}); `after`: the grid above, from"
        " the machine each `before` record was made on (where the grid re-made a seed on another, the record it"
        " replaced: `benchmarks/results/unrecorded_machine/`). "
        "`identical`: seeds that trained identically (same evaluation returns and per-update KLs), i.e. where beta "
        f"never came near its bound. Difference of the evaluation returns (after - before), tie when p ≥ {SIGNIFICANCE}.",
        "",
        "| env | lr | algo | n | identical | " + PAIRED_HEADER.format(a="before", b="after")[2:],
        "|" + "---|" * 15,
        *paired_rows(before, after, identical=True),
    ]
    return "\n".join(lines)


def kl_stop_comparison() -> str:
    """
    KLPPO's per-epoch early stop at 1.5 x target, measured as a default and not adopted: cell by cell, the grid's
    records from before the stop at beta's bound (``results/before_saturation_stop/``, no early stop) beside the same
    runs with ``kl_stop_factor=1.5`` (``results/kl_stop_1.5_per_epoch/``), on the same seeds; then SB3's per-minibatch
    rule (``results/kl_stop_minibatch_judge/``). Empty without the records of the runs with the stop.
    """
    with_stop = load_folder("kl_stop_1.5_per_epoch")
    if not with_stop:
        return ""
    versions = ", ".join(sorted(code_versions([r for runs in with_stop.values() for r in runs])))
    lines = [
        "## KLPPO's early stop at 1.5 x target: measured as a default, not adopted",
        "",
        "`kl_stop_factor=1.5` skips an update's remaining epochs once an epoch's KL (the mean over its minibatches of "
        "the KL to the rollout policy, each taken before that minibatch's step) exceeds 1.5 x target, the multiple at "
        "which SB3's PPO stops. Every KLPPO cell of the grid was re-run with it as the default (records in "
        f"`benchmarks/results/kl_stop_1.5_per_epoch/`, code {versions}), same seeds; `without` is the grid as it was "
        "then (KLPPO's default, no early stop; `benchmarks/results/before_saturation_stop/`). `over 2x`: share of "
        "updates whose KL exceeds twice the target. Difference of the evaluation returns (with - without) with its "
        f"Welch p-value: tie when p ≥ {SIGNIFICANCE}. It holds the KL at 10x the learning rate where the penalty cannot "
        "(HalfCheetah without clip), but at the zoo's rate no return changed significantly and the drop-in with PPO's "
        "clip collapsed on Hopper, so the default stays None.",
        "",
        "| env | lr | algo | n | " + PAIRED_HEADER.format(a="without", b="with")[2:],
        "|" + "---|" * 14,
        *paired_rows(load_folder("before_saturation_stop"), with_stop),
    ]
    lines += ["", *minibatch_stop_rule()]
    return "\n".join(lines)


def updates_to_band(record: dict[str, Any]) -> int:
    """Updates a run spent before its first update with KL in band (its warm-up; all of them if none is in band)."""
    target = record["target_kl"]
    in_band = [BAND[0] * target <= u["mean"] <= BAND[1] * target for u in record["kl_updates"]]
    return in_band.index(True) if True in in_band else len(in_band)


def start_table(
    source: str,
    coef: float,
    default: dict[tuple[str, str, float], list[dict[str, Any]]],
    lowered: dict[tuple[str, str, float], list[dict[str, Any]]],
) -> list[str]:
    """
    The subsection of one initial beta: its heading (with ``source``, where its records are) and the table of its
    cells beside the same cells and seeds started at the default 1.0 (:func:`paired_rows`).
    """
    label = f"{coef:g}"
    return [
        "",
        f"### Starting at {label} ({source})",
        "",
        "| env | lr | algo | n | " + PAIRED_HEADER.format(a="1.0", b=label)[2:],
        "|" + "---|" * 14,
        *paired_rows(default, lowered),
    ]


#: KLPPO's initial beta measured as a default: (folder of the records under results/, kl_coef, what they showed)
INITIAL_KL_COEF_RUNS = [
    (
        "kl_coef_0.2",
        0.2,
        "The start at 0.2 shortens the warm-up, but no return or AUC changed significantly, and without clipping at 10x "
        "the learning rate it trades the first updates' undershoot for overshoot (`over 2x`).",
    ),
    (
        "kl_coef_0.0001",
        1e-4,
        "Starting at the floor is what the drop-in with PPO's clip at the zoo's learning rate wants on Pendulum: its "
        "AUC rises to PPO's (-594.8 -> -555.2, the one significant difference of these tables) and its share of updates "
        "in band from 74 % to 88 %, at the same return. Where beta is the only control (no clip) the first updates then "
        "overshoot instead: at 10x the learning rate, 11 % of the no-clip default's updates end over 2 x target (1 % "
        "from 1.0) and 89 % in band, below the 90 % the stress goal asks, with the AUC lower in every no-clip and x10 "
        "cell (not significantly). So the default stays 1.0, which errs toward small first steps; with PPO's clip "
        "(`ClipKLPPO`, or `KLPPO` given `clip_range`) at a tuned learning rate, `kl_coef=1e-4` lets the clip set the "
        "first steps as in PPO.",
    ),
]


def initial_kl_coef_comparison(tier: str) -> str:
    """
    KLPPO's initial beta measured as a default and kept: the cells re-run with a lower ``kl_coef``
    (``results/kl_coef_<value>/runs/<tier>/``, written with ``--override kl_coef=<value>``, :data:`INITIAL_KL_COEF_RUNS`)
    beside the same cells and seeds with the default 1.0 on the same machine (the replication's records).
    """
    default = load_folder(f"replication/runs/{tier}")
    measured = []
    for folder, coef, finding in INITIAL_KL_COEF_RUNS:
        lowered = load_folder(f"{folder}/runs/{tier}")
        pairs = paired_runs(default, lowered)
        if pairs:
            measured.append((folder, coef, finding, lowered, pairs))
    if not measured:
        return ""
    starts = " and ".join(f"{entry[1]:g}" for entry in measured)
    lines = [
        f"## KLPPO's initial beta (`kl_coef`): 1.0 kept as the default, {starts} measured",
        "",
        "beta starts at `kl_coef` and the adaptive controller moves it by a factor 1.5 per update, so a start far from "
        "where beta settles costs the first updates, which take less KL than the target (the warm-up counted below); "
        "Pendulum's budget holds 24 updates, CartPole's 390. 0.2 is RLlib's default; 1e-4 is the floor of "
        "`kl_coef_bounds`, from which beta only rises when an update overshoots the band. The cells below were re-run "
        "with each start (`python benchmarks/learning.py --override kl_coef=<start>`, records in "
        "`benchmarks/results/kl_coef_<start>/`) beside the same cells and seeds at the default 1.0 on the same machine "
        "(the replication's records below), so that only beta's start differs. Difference of the evaluation returns "
        f"(start - 1.0) and of the AUCs, with their Welch p-values: tie when p ≥ {SIGNIFICANCE}.",
    ]
    for folder, coef, finding, lowered, pairs in measured:
        records = [r for runs in lowered.values() for r in runs]
        versions = ", ".join(f"`{v}`" for v in sorted(code_versions(records)))
        warm_up, auc = [], []
        for (env, algo, mult), old, new in pairs:
            cell = f"{env} x{mult:g} {algo}"
            warm_up.append(
                f"{cell} {np.mean([updates_to_band(r) for r in old]):.1f} -> {np.mean([updates_to_band(r) for r in new]):.1f}"
            )
            text, result = verdict([summarize(r)["auc"] for r in new], [summarize(r)["auc"] for r in old])
            auc.append(f"{cell} {text}: {result}")
        label = f"{coef:g}"
        lines += [
            *start_table(f"records in `benchmarks/results/{folder}/`, code {versions}", coef, default, lowered),
            "",
            f"AUC difference ({label} - 1.0): " + "; ".join(auc) + ".",
            "",
            f"Updates before the first one in band, mean over seeds (1.0 -> {label}): " + "; ".join(warm_up) + ".",
            "",
            finding,
        ]
    return "\n".join(lines)


#: ClipKLPPO's initial beta measured below the default 1.0: (folder of the records under results/, kl_coef, the
#: cells re-run as ``(env, lr_mult)`` (None: every cell of the grid), what they showed), in report order
CLIP_KLPPO_START_RUNS: list[tuple[str, float, tuple[tuple[str, float], ...] | None, str]] = [
    (
        "clip_klppo_kl_coef_0.0001",
        1e-4,
        None,
        "From the floor, ClipKLPPO's two AUC losses to PPO at the zoo's learning rate (Pendulum-v1, "
        "LunarLanderContinuous-v3) become ties and CartPole-v1's one collapse is gone, at the same evaluation returns; "
        "Acrobot-v1 ends lower than from 1.0 (a tie with PPO), HalfCheetah-v5 at 10x keeps its AUC loss to PPO, and "
        "Hopper-v5 collapses more often (*Collapses by initial beta* below).",
    ),
    (
        "clip_klppo_kl_coef_0.01",
        1e-2,
        tuple((env, 1.0) for env in ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", "LunarLanderContinuous-v3", "Hopper-v5")),
        "Started at 0.01, between the floor and 1.0, on the cells where the floor start changed a collapse or a loss to "
        "PPO: ClipKLPPO does what it does from the floor. CartPole-v1 has no collapse, the AUCs of Pendulum-v1 and "
        "LunarLanderContinuous-v3 tie PPO's instead of losing to them, Acrobot-v1 ties 1.0, and Hopper-v5 collapses as "
        "often as from the floor, in other seeds.",
    ),
]

#: What the starts measured in :data:`CLIP_KLPPO_START_RUNS` decided, after their collapses
CLIP_KLPPO_START_VERDICT = (
    "Hopper-v5's collapses come in mostly different seeds at each start, with each fall's per-update KL about the target, and "
    "no start's count differs significantly from 1.0's: where beta starts does not decide whether Hopper falls, and "
    "neither lower start ends the collapses the no-collapse goal counts (they move from CartPole-v1 to Hopper-v5). "
    "So the default stays 1.0. A lower start pays where PPO's clip at a tuned learning rate should set the first steps "
    "(the AUC of Pendulum-v1 and LunarLanderContinuous-v3): `ClipKLPPO(kl_coef=0.01)`, or the floor."
)


def kl_coef_floor() -> float:
    """The lower end of ClipKLPPO's default ``kl_coef_bounds``, where beta can start."""
    from sb3_kl import ClipKLPPO

    return inspect.signature(ClipKLPPO).parameters["kl_coef_bounds"].default[0]


def clip_klppo_start_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]], tier: str) -> str:
    """
    ClipKLPPO's initial beta: the grid's ``clip_klppo`` cells (beta starting at the default 1.0) beside the same cells
    and seeds re-run with beta starting lower (:data:`CLIP_KLPPO_START_RUNS`, written with ``--override
    kl_coef=<value>``), and both against stock PPO (same clip, same seeds), whose steps ClipKLPPO's would then take
    until an update's KL leaves the band.
    """
    grid = {key: runs for key, runs in groups.items() if key[1] == "clip_klppo"}
    measured = []
    for folder, coef, cells, finding in CLIP_KLPPO_START_RUNS:
        lowered = {key: runs for key, runs in load_folder(f"{folder}/runs/{tier}").items() if key[1] == "clip_klppo"}
        pairs = paired_runs(grid, lowered)
        if pairs:
            measured.append((folder, coef, cells, finding, lowered, pairs))
    if not measured:
        return ""
    starts = " and ".join(f"{entry[1]:g}" for entry in measured)
    lines = [
        f"## ClipKLPPO's initial beta (`kl_coef`): {starts} measured against the default 1.0",
        "",
        "ClipKLPPO always clips, and stops an update's epochs (`kl_stop_factor=2.0`) and bends its loss (the hinge above "
        "2 x target) when the KL runs away, so beta is its third control, not its only one. Starting beta low, down to "
        f"the floor of `kl_coef_bounds` ({kl_coef_floor():g}), leaves the first steps to PPO's clip; beta rises by the "
        "adaptation factor after each update whose KL is over the band. The grid's `clip_klppo` cells were re-run so "
        "(from the repository root: `SB3_KL_BENCHMARK_RESULTS=benchmarks/results/clip_klppo_kl_coef_<start> python "
        f"benchmarks/learning.py --tier {tier} --algos clip_klppo --envs <env> --lr-mults <1 or 10> --seeds <the "
        "grid's> --override kl_coef=<start>`; records in `benchmarks/results/clip_klppo_kl_coef_<start>/`), same seeds "
        "and hyperparameters, beside the grid's runs at 1.0. Difference of the evaluation returns (start - 1.0) with "
        f"its Welch p-value: tie when p ≥ {SIGNIFICANCE}.",
    ]
    for folder, coef, cells, finding, lowered, pairs in measured:
        records = [r for runs in lowered.values() for r in runs]
        versions = ", ".join(f"`{v}`" for v in sorted(code_versions(records)))
        label = f"{coef:g}"
        lines += [
            *start_table(
                f"records in `benchmarks/results/{folder}/`, code {versions}; re-run: "
                + ("every cell of the grid" if cells is None else ", ".join(f"{env} x{mult:g}" for env, mult in cells)),
                coef,
                grid,
                lowered,
            ),
            "",
            f"Against stock PPO on the same seeds (ours - PPO's; evaluation, then AUC), at 1.0 and at {label}:",
            "",
            f"| env | lr | n | eval 1.0 - PPO | eval {label} - PPO | AUC 1.0 - PPO | AUC {label} - PPO |",
            "|---|---|---|---|---|---|---|",
        ]
        for (env, _, mult), old, new in pairs:
            ppo = {r["seed"]: r for r in groups.get((env, "ppo", mult), [])}
            seeds = [r["seed"] for r in new if r["seed"] in ppo]
            if not seeds:
                continue
            base = [ppo[seed] for seed in seeds]
            row = []
            for metric in ("eval", "auc"):
                for runs in (old, new):
                    ours = [r for r in runs if r["seed"] in seeds]
                    value = (lambda r: r["eval_mean"]) if metric == "eval" else (lambda r: summarize(r)["auc"])
                    text, result = verdict([value(r) for r in ours], [value(r) for r in base])
                    row.append(f"{text}: {result}")
            lines.append(f"| {env} | x{mult:g} | {len(seeds)} | " + " | ".join(row) + " |")
        done = {cell: len(new) for cell, _, new in pairs}
        missing = [
            f"{env} x{mult:g} ({len(runs) - done.get((env, algo, mult), 0)} of {len(runs)} seeds)"
            for (env, algo, mult), runs in sorted(grid.items(), key=lambda item: cell_order(item[0]))
            if (cells is None or (env, mult) in cells) and done.get((env, algo, mult), 0) < len(runs)
        ]
        lines += [
            "",
            f"The grid's clip_klppo runs not re-run at {label}: " + ", ".join(missing) + "."
            if missing
            else f"Every clip_klppo cell of the grid {'is measured' if cells is None else 'planned is measured'} at {label}.",
        ]
        if finding:
            lines += ["", finding]
    collapses = collapses_by_start(grid, [(entry[1], entry[4]) for entry in measured])
    return "\n".join([*lines, "", *collapses, "", CLIP_KLPPO_START_VERDICT] if collapses else lines)


def collapses_by_start(
    grid: dict[tuple[str, str, float], list[dict[str, Any]]],
    starts: list[tuple[float, dict[tuple[str, str, float], list[dict[str, Any]]]]],
) -> list[str]:
    """
    The collapses (``count_collapses``) of every cell with one at any initial beta, by start: how many of the seeds
    re-run at that start collapsed, which, and the two-sided Fisher exact test against the default 1.0 on the same seeds.

    :param grid: the grid's cells (beta starting at 1.0)
    :param starts: ``(kl_coef, its records by cell)`` for each start measured
    """

    def collapsed(runs: list[dict[str, Any]]) -> list[int]:
        return [r["seed"] for r in runs if count_collapses(r["curve"]) > 0]

    rows = []
    for cell in sorted(grid, key=cell_order):
        env, _, mult = cell
        by_seed = {r["seed"]: r for r in grid[cell]}
        measured = [(coef, [r for r in records.get(cell, []) if r["seed"] in by_seed]) for coef, records in starts]
        measured = [(coef, runs) for coef, runs in measured if runs]
        if not measured or not any(collapsed(runs) for runs in [list(by_seed.values()), *(runs for _, runs in measured)]):
            continue
        for coef, runs in [(1.0, list(by_seed.values())), *measured]:
            fell, p = collapsed(runs), "-"
            if coef != 1.0:
                default = collapsed([by_seed[r["seed"]] for r in runs])
                p = f"{fisher_exact_p(len(fell), len(runs), len(default), len(runs)):.2f}"
            seeds = ", ".join(map(str, fell)) or "-"
            falls = [(r["seed"], fall_kl(r)) for r in runs if r["seed"] in fell]
            kl = ", ".join(f"s{seed} {f['mean']:.2f} / {f['max']:.2f}" for seed, f in falls if f) or "-"
            label = "1.0 (default)" if coef == 1.0 else f"{coef:g}"
            rows.append(f"| {env} | x{mult:g} | {label} | {len(runs)} | {len(fell)} | {seeds} | {kl} | {p} |")
    if not rows:
        return []
    return [
        "### Collapses by initial beta",
        "",
        "Every cell with a collapse at any start: the seeds that collapsed (`count_collapses`) at each start, the "
        "per-update KL of each fall (`fall_kl`: mean / max over its updates, x target), and the two-sided Fisher exact "
        f"test of the collapse count against the default 1.0 on the same seeds (a difference with p ≥ {SIGNIFICANCE} is "
        "a tie).",
        "",
        "| env | lr | kl_coef | seeds | collapses | seeds collapsed | KL in the fall: mean / max | p vs 1.0 |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


#: KLPPO's target on Hopper-v5, measured below the continuous default 0.03: (folder of the records under results/,
#: environment, target)
LOWER_TARGET_RUNS = ("target_kl_0.01", "Hopper-v5", 0.01)


def seed_range(records: list[dict[str, Any]]) -> str:
    """:return: the seeds of ``records`` as :func:`seed_list` reads them (``a..b`` where they are consecutive)"""
    seeds = sorted({r["seed"] for r in records})
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1:
        return f"{seeds[0]}..{seeds[-1]}"
    return " ".join(map(str, seeds))


def lower_target_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]], tier: str) -> str:
    """
    KLPPO's target on Hopper-v5: the grid's PPO-family cells there (KLPPO at its default 0.03, PPO's early stop at the
    same target) beside the same cells and seeds re-run with a lower ``target_kl`` (:data:`LOWER_TARGET_RUNS`, written
    with ``--override target_kl=<target>``), and at the lower target each KL-penalized algorithm against PPO's early
    stop at that target.
    """
    folder, env, target = LOWER_TARGET_RUNS
    lowered = load_folder(f"{folder}/runs/{tier}")
    grid = {key: runs for key, runs in groups.items() if key[0] == env and key[1] in ("ppo_target_kl", *KL_PENALIZED_ALGOS)}
    pairs = paired_runs(grid, lowered)
    if not pairs:
        return ""
    records = [r for runs in lowered.values() for r in runs]
    versions = ", ".join(f"`{v}`" for v in sorted(code_versions(records)))
    grid_versions = ", ".join(f"`{v}`" for v in sorted(code_versions([r for _, old, _ in pairs for r in old])))
    label = f"{target:g}"
    collapsed = {(r["algo"], r["env"]) for r in sb3_kl_collapses(groups)}
    lines = [
        f"## KLPPO's target on {env}: {label} against the default 0.03",
        "",
        "The sb3-kl runs of the grid that collapse: "
        + (", ".join(f"{algo} on {where}" for algo, where in sorted(collapsed)) or "none")
        + f". On {env} their falls' updates average about the target (*The collapses*), with no single large step for a "
        "per-update control to catch, and a policy that had learned to stand starts to fall (`collapse_probe.md`: in "
        "some runs in a burst of a few rollouts, after which it stands again while the curve's window of 100 episodes "
        "refills one 1000-step episode at a time; in others over many rollouts). "
        f"The {env} cells of KLPPO (the drop-in, with PPO's clip), KLPPO without clip, ClipKLPPO and "
        f"PPO with SB3's early stop were re-run with `target_kl={label}` (from the repository root: "
        f"`SB3_KL_BENCHMARK_RESULTS=benchmarks/results/{folder} python benchmarks/learning.py --tier {tier} --algos "
        f"{' '.join(sorted({r['algo'] for r in records}))} --envs {env} --seeds {seed_range(records)} "
        f"--override target_kl={label}`, with `--force` to re-make records that exist; records in "
        f"`benchmarks/results/{folder}/`, code {versions}), same seeds and hyperparameters, beside the grid's runs at "
        f"0.03 (code {grid_versions}; PPO's early stop at 0.03 is the grid's `ppo_target_kl`). In band and over 2x "
        f"are measured against each run's own target. Difference of the evaluation returns ({label} - 0.03) with its "
        f"Welch p-value: tie when p ≥ {SIGNIFICANCE}.",
        "",
        "| env | lr | algo | n | " + PAIRED_HEADER.format(a="0.03", b=label)[2:],
        "|" + "---|" * 14,
        *paired_rows(grid, lowered),
    ]
    auc = []
    for (_, algo, _), old, new in pairs:
        text, result = verdict([summarize(r)["auc"] for r in new], [summarize(r)["auc"] for r in old])
        auc.append(f"{algo} {text}: {result}")
    lines += ["", f"AUC difference ({label} - 0.03): " + "; ".join(auc) + "."]
    baseline = lowered.get((env, "ppo_target_kl", 1.0), [])
    if baseline:
        against = []
        for algo in KL_PENALIZED_ALGOS:
            ours = lowered.get((env, algo, 1.0), [])
            if not ours:
                continue
            eval_text, eval_result = verdict([r["eval_mean"] for r in ours], [r["eval_mean"] for r in baseline])
            auc_text, auc_result = verdict([summarize(r)["auc"] for r in ours], [summarize(r)["auc"] for r in baseline])
            against.append(
                f"{algo} {fmt([r['eval_mean'] for r in ours])}, {eval_text}: {eval_result}; AUC {auc_text}: {auc_result}"
            )
        auc_before = [summarize(r)["auc"] for r in grid.get((env, "ppo_target_kl", 1.0), [])]
        lines += [
            "",
            f"At `target_kl={label}` against PPO with SB3's early stop at the same target "
            f"({fmt([r['eval_mean'] for r in baseline])}; differences ours - PPO's): "
            + "; ".join(against)
            + ". "
            + (
                f"Part of the AUC gap is PPO's early stop losing AUC itself at the lower target (mean "
                f"{np.mean(auc_before):.1f} at 0.03, {np.mean([summarize(r)['auc'] for r in baseline]):.1f} at {label})."
                if auc_before
                else ""
            ),
        ]
    penalized = [(old, new) for (_, algo, _), old, new in pairs if algo in KL_PENALIZED_ALGOS]
    runs = sum(len(new) for _, new in penalized)
    collapsed_before = [r for old, _ in penalized for r in old if count_collapses(r["curve"]) > 0]
    collapsed_after = [r for _, new in penalized for r in new if count_collapses(r["curve"]) > 0]
    counts = [f"{len(c)} ({len(distinct_trainings(c))} distinct trainings)" for c in (collapsed_before, collapsed_after)]
    falls = [
        f"{r['algo']} s{r['seed']} " + (f"{f['mean']:.2f} x on average, at most {f['max']:.2f}" if (f := fall_kl(r)) else "-")
        for r in collapsed_after
    ]
    finding = (
        f"The falls' per-update KL / target at {label}: {'; '.join(falls)}. A lower target does not end the falls: "
        "each update is smaller, and the policy still leaves its standing. The continuous default stays 0.03, and so "
        "do the shipped Hopper-v5 configs."
        if collapsed_after
        else f"At {label} no KL-penalized run collapses on {env}."
    )
    lines += ["", f"Collapses of the KL-penalized runs ({runs} runs): {counts[0]} at 0.03, {counts[1]} at {label}. {finding}"]
    return "\n".join(lines)


#: KLTRPO against TRPO on HalfCheetah-v5, one machine: (label, folder of the records under results/, algo)
KLTRPO_DIRECTION_RUNS = [
    ("sb3-contrib TRPO", "replication", "trpo"),
    ("KLTRPO in TRPO's KL (reverse, averaged over dimensions), growing", "kltrpo_line_search/sb3_contrib_kl_growth", "kltrpo"),
    ("KLTRPO, joint KL at TRPO's joint KL, backtracking only", "kltrpo_line_search/matched_no_growth", "kltrpo"),
    ("KLTRPO, joint KL at TRPO's joint KL, growing", "kltrpo_line_search/matched_growth", "kltrpo"),
    ("the same with 6 x `cg_damping`", "kltrpo_line_search/matched_growth_damping_x6", "kltrpo"),
]


def kltrpo_direction_comparison(tier: str) -> str:
    """
    What slowed KLTRPO's learning against TRPO's on HalfCheetah-v5 at the same per-update KL: the side experiment's
    records (``results/kltrpo_line_search/``, written with ``--override``) beside TRPO's on the same machine.
    """
    env = "HalfCheetah-v5"
    runs = []
    for label, folder, algo in KLTRPO_DIRECTION_RUNS:
        records = load_folder(f"{folder}/runs/{tier}").get((env, algo, 1.0), [])
        if records:
            runs.append((label, folder, records))
    if len(runs) < 2:
        return ""
    trpo_auc = [summarize(r)["auc"] for r in runs[0][2]]
    rows = []
    for label, folder, records in runs:
        overrides = records[0].get("overrides") or {}
        settings = ", ".join(f"`{k}={v}`" for k, v in overrides.items()) or "the grid's"
        summaries = [summarize(r) for r in records]
        auc = [m["auc"] for m in summaries]
        text, result = verdict(auc, trpo_auc)
        rows.append(
            f"| {label} | {settings} | {len(records)} | {fmt([r['eval_mean'] for r in records])} | {fmt(auc)} | "
            f"{text}: {result} | {fmt([m['kl_mean'] for m in summaries], digits=4)} | "
            f"{fmt([m['kl_p99'] for m in summaries], digits=3)} | `{folder}` |"
        )
    records = [r for _, _, group in runs for r in group]
    versions = ", ".join(f"`{v}`" for v in sorted(code_versions(records)))
    lines = [
        f"## KLTRPO against TRPO on {env}: what slowed KLTRPO's learning",
        "",
        "KLTRPO's AUC on HalfCheetah was below TRPO's at equal settings, and also with `target_kl` set to the joint KL "
        "TRPO takes (`kltrpo_matched`). The runs below take the differences one at a time, 5 seeds each on one machine "
        f"(code {versions}; records under `benchmarks/results/<folder>/`, settings on top of the grid's with "
        "`python benchmarks/learning.py --override`; `target_kl=0.118...` is TRPO's mean per-update joint KL in the "
        "records above). Against TRPO's row: growing the step to the bound of TRPO's own KL takes twice TRPO's joint "
        "KL at about TRPO's AUC; in the joint KL at TRPO's step size, the same `cg_damping` added to a Hessian 6 times "
        "larger (the summed KL's) damps the search direction 6 times less than TRPO does, and the last row damps it "
        "as TRPO does. Each difference is inside the seed noise of 5 seeds (Welch p), so this points the way rather "
        "than proves it; KLTRPO now scales `cg_damping` so (`KLTRPO.cg_damping_scale()`) because a drop-in should "
        "search where TRPO searches with TRPO's hyperparameters, and the last row's setting is what the joint "
        "convention runs since (the grid above).",
        "",
        "| run | settings | n | eval | AUC | AUC difference | KL mean | KL p99 | folder |",
        "|" + "---|" * 9,
        *rows,
    ]
    return "\n".join(lines)


def matched_target_on_machines(
    primary: dict[tuple[str, str, float], list[dict[str, Any]]],
    machines: dict[str, dict[tuple[str, str, float], list[dict[str, Any]]]],
) -> str:
    """
    How far ``kltrpo_matched``'s target (one per environment, used on both machines) lies from the joint KL TRPO took
    on the seeds ``MATCHED_SEEDS`` on each machine.

    :param primary: the grid's records, by cell (they hold ``kltrpo_matched``'s runs)
    :param machines: each machine's records, by cell, under a label
    """
    cells = []
    for env in MAIN_ENVS:
        targets = {r["target_kl"] for r in primary.get((env, "kltrpo_matched", 1.0), [])}
        if len(targets) != 1:
            continue
        target = targets.pop()
        offsets = [
            f"{label} {100 * (np.mean(kls) / target - 1):+.1f}%"
            for label, groups in machines.items()
            if (kls := matched_seed_kls(groups.get((env, "trpo", 1.0), [])))
        ]
        if offsets:
            cells.append(f"{env} {target:.4g} ({', '.join(offsets)})")
    if not cells:
        return ""
    return (
        "`kltrpo_matched` runs with one target per environment on both machines, TRPO's joint KL on seeds "
        f"{', '.join(map(str, MATCHED_SEEDS))} of the records its first runs were made beside; TRPO's joint KL on the "
        "same seeds of each machine differs from it by: " + "; ".join(cells) + "."
    )


def replication(tier: str) -> str:
    """
    The grid's cells and seeds run on two machines: records that do not name their machine (made before records did;
    where the grid re-made such a record on this machine, ``--other-machines``, the earlier one is kept in
    ``results/unrecorded_machine/runs/<tier>/``) beside the same runs on the machine the records name (the grid's own
    record, else the replication's in ``results/replication/runs/<tier>/``, written by the grid with
    ``SB3_KL_BENCHMARK_RESULTS=benchmarks/results/replication``), and the goals those cells decide, judged on the
    named machine's records alone.
    """
    replica = [r for runs in load_folder(f"replication/runs/{tier}").values() for r in runs]
    kept = [r for runs in load_folder(f"unrecorded_machine/runs/{tier}").values() for r in runs]
    if not replica and not kept:
        return ""
    primary_records = load_records(tier)
    primary = group_records(primary_records)
    by_seed = {seed_key(r): r for r in primary_records}
    # each seed's run on the machine that did not record itself, and on the one that did (the grid's record first)
    unnamed = {seed_key(r): r for r in kept}
    unnamed.update({key: r for key, r in by_seed.items() if machine(r) is None})
    named = {seed_key(r): r for r in replica if machine(r) is not None}
    named.update({key: r for key, r in by_seed.items() if machine(r) is not None})
    both = unnamed.keys() & named.keys()
    first = group_records([unnamed[key] for key in both])
    second = group_records([named[key] for key in both])
    rows = paired_rows(first, second, identical=True)
    moved = [
        f"{env} x{mult:g} {algo}"
        for (env, algo, mult), old, new in paired_runs(first, second)
        if verdict([r["eval_mean"] for r in new], [r["eval_mean"] for r in old])[1] != "tie"
    ]
    from_grid = [key for key in both if key in by_seed and machine(by_seed[key]) is not None]
    from_replica = [named[key] for key in both if key not in by_seed or machine(by_seed[key]) is None]
    records = [named[key] for key in both]
    versions = ", ".join(f"`{v}`" for v in sorted(code_versions(from_replica)))
    machines = "; ".join(sorted(run_environments(records)))
    out = [
        "## Records that do not name their machine, beside this machine's",
        "",
        "The grid's records that do not name their machine (made before records did) came from another machine than"
        " the one the other records name, or from that one. The cells below hold both runs of the same seeds and"
        " settings: *unrecorded*, the record that does not name its machine (the grid's, or, where the grid re-made it"
        " with `--other-machines`, the earlier record, kept in"
        f" `benchmarks/results/unrecorded_machine/runs/{tier}/`), beside *named*, the machine the records name"
        f" ({machines}; the grid's record: {len(from_grid)} runs, else the replication's, in"
        f" `benchmarks/results/replication/runs/{tier}/`, code {versions or 'none'}: {len(from_replica)} runs)."
        " Where the unrecorded record came from another machine, this shows how far the figures move with the"
        " machine's floating-point rounding (and, where it is of an older commit, with the code's changes since);"
        " where it came from this one, the training repeats. `identical`: seeds that trained identically on both"
        " (same evaluation returns and per-update KLs; a monitor whose arithmetic changed since can make a repeated"
        " training's KLs differ in their last digits, so a seed counted as different may still be the same training);"
        " difference: named - unrecorded, with its Welch p-value. "
        + matched_target_on_machines(primary, {"unrecorded": first, "named": second}),
        "",
        "| env | lr | algo | n | identical | " + PAIRED_HEADER.format(a="unrecorded", b="named")[2:],
        "|---" * 15 + "|",
        *rows,
        "",
        f"Evaluation returns that differ significantly between the two records (p < {SIGNIFICANCE}): {len(moved)} of"
        f" {len(rows)} cells{': ' + ', '.join(moved) if moved else ''}.",
    ]
    for described in sorted({machine(r) for r in records} - {None}):
        # that machine's records: the replication's, and those of the grid it made (which win a tie)
        own = {seed_key(r): r for r in replica if machine(r) == described}
        own.update({key: r for key, r in by_seed.items() if machine(r) == described})
        groups = group_records(list(own.values()))
        out += [
            "",
            f"The goals these cells decide, on the records of that machine alone ({described}; "
            f"{sum(machine(r) == described for r in primary_records)} of the grid's records, and the replication's of "
            "the seeds the grid has from the other machine):",
            "",
        ]
        out += [line for line in goal_stress(groups) if "not measured" not in line]
        for env in MAIN_ENVS:
            trpo = _evals(groups, env, "trpo")
            for ours in ("kltrpo", "kltrpo_matched"):
                evals = _evals(groups, env, ours)
                if not trpo or not evals:
                    continue
                text, result = verdict(evals, trpo)
                # judged with 5 seeds or more, as in the goals above
                met = within_one_std(evals, trpo) if min(len(evals), len(trpo)) >= 5 else None
                out.append(
                    f"- {env}: {ours} {np.mean(evals):.1f} vs TRPO {np.mean(trpo):.1f} ± {np.std(trpo):.1f} "
                    f"(n={len(evals)}/{len(trpo)}), within one std of TRPO or better: {status(met)} (difference "
                    f"{text}: {result})"
                )
    return "\n".join(out)


def minibatch_stop_rule() -> list[str]:
    """SB3's per-minibatch early-stop rule at 1.5 x target, measured on the KLPPO cells and rejected."""
    cells = load_folder("kl_stop_minibatch_judge")
    if not cells:
        return []
    versions = ", ".join(sorted(code_versions([r for runs in cells.values() for r in runs])))
    lines = [
        "SB3's own rule was measured too: the update ends before the first optimizer step whose minibatch's KL "
        "(before the step) exceeds 1.5 x target (KLPPO's default at the commit of these records, later removed; "
        f"records in `benchmarks/results/kl_stop_minibatch_judge/`, code {versions}; the grid was stopped once these "
        "cells had answered). It held HalfCheetah's KL at 10x the learning rate, where a whole epoch of steps passes "
        "before the per-epoch rule can stop, but on Pendulum's 64-state minibatches it stopped on noisy minibatch KLs "
        "while the update's KL was still low (`under 0.5x`), and KLPPO without clipping collapsed on CartPole.",
        "",
        "| env | lr | algo | n | eval | AUC | in band | under 0.5x | over 2x | collapses |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (env, algo, mult), runs in sorted(cells.items(), key=lambda kv: cell_order(kv[0])):
        lines.append(
            f"| {env} | x{mult:g} | {algo} | {len(runs)} | {fmt([r['eval_mean'] for r in runs])} | "
            f"{fmt([summarize(r)['auc'] for r in runs])} | "
            f"{fmt([summarize(r)['in_band'] for r in runs], digits=0, percent=True)} | "
            f"{fmt([update_share(r, 0.0, BAND[0]) for r in runs], digits=0, percent=True)} | "
            f"{fmt([update_share(r, BAND[1], np.inf) for r in runs], digits=0, percent=True)} | "
            f"{sum(count_collapses(r['curve']) for r in runs)} |"
        )
    return lines


def code_versions(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many records each code version produced (records from before versions were stored: ``unrecorded``)."""
    counts: dict[str, int] = {}
    for record in records:
        version = record.get("code_version", "unrecorded")
        counts[version] = counts.get(version, 0) + 1
    return counts


def describe_run_environment(described: dict[str, str]) -> str:
    """One line for a :func:`run_environment`: the CPU model, then ``<package> <version>``, comma-separated."""
    return ", ".join(version if name == "cpu" else f"{name} {version}" for name, version in described.items())


def machine(record: dict[str, Any]) -> str | None:
    """:return: the description of the machine and library versions that made a record (None: unrecorded)"""
    described = record.get("run_environment")
    return describe_run_environment(described) if described else None


def run_environments(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many records each machine and set of library versions produced (see :func:`run_environment`)."""
    counts: dict[str, int] = {}
    for record in records:
        key = machine(record) or "*unrecorded* (made before records named their machine and library versions)"
        counts[key] = counts.get(key, 0) + 1
    return counts


def overhead_ratios(ours: str, stock: str, name: str = "overhead.md") -> dict[str, float]:
    """
    Median steps/s ratio per environment of a pair from ``results/<name>`` (``overhead.py``'s output).

    :param name: the results file: ``overhead.md`` (every comparison) or one measured alone with ``--out``
    """
    path = RESULTS / name
    ratios: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 7 and cells[0] == ours and cells[1] == stock:
                ratios[cells[2]] = float(cells[6])
    return ratios


def collapse_table(groups: dict[tuple[str, str, float], list[dict[str, Any]]], scope: str = "both grids") -> str:
    """
    Every run of the grid that ``count_collapses`` counts, with its learning curve and its evaluation after training.

    :param groups: the records, by cell
    :param scope: what the records are, as the section names them
    """
    out = [
        "## The collapses",
        "",
        f"Every run of {scope} with a collapse (`count_collapses`, on the learning curve: the mean return of the last"
        " 100 training episodes, SB3's `ep_info_buffer`, after each rollout, from the stochastic policy), beside the"
        " deterministic evaluation after training (10 episodes) and the mean evaluation of its cell. The curve's window"
        " holds episodes, not steps: where an episode lasts up to 1000 steps (Hopper) it spans up to 100,000 steps, so"
        " a run of short episodes empties it within a few rollouts while long ones refill it slowly.",
        "",
        "*KL in the fall*: the exact per-update KL (the monitor's per-update mean, / target) of the updates between the"
        " curve's best point and the rollout where it fell below 50 % of its gain (`fall_kl`): their number, mean and"
        " maximum, and the share of them over 2 x target beside that share over the whole run. Where the fall's updates"
        " stay in the band, the policy left its best without any single update taking a large step, so a per-update KL"
        " control has nothing to act on. `benchmarks/results/collapse_probe.md` trains each sb3-kl collapse again with a"
        " probe that leaves the training unchanged: how the episodes end before and in the fall, the KL that"
        " `VecNormalize`'s statistics alone cause, and how often beta sat at its floor, where the penalty does nothing.",
        "",
        "| env | lr | algo | seed | curve: start | best | end | eval after training | cell's mean eval"
        " | KL in the fall: updates | mean | max | over 2x (run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (env, algo, mult), runs in sorted(groups.items(), key=lambda kv: cell_order(kv[0])):
        cell_eval = float(np.mean([r["eval_mean"] for r in runs]))
        for r in sorted(runs, key=lambda r: r["seed"]):
            if count_collapses(r["curve"]) == 0:
                continue
            curve = [c[1] for c in r["curve"]]
            fall = fall_kl(r)
            fall_cells = (
                f"{fall['n']} | {fall['mean']:.2f} | {fall['max']:.2f} | {fall['over']:.0%} ({fall['over_run']:.0%})"
                if fall is not None
                else "- | - | - | -"
            )
            out.append(
                f"| {env} | x{mult:g} | {algo} | {r['seed']} | {curve[0]:.1f} | {max(curve):.1f} | {curve[-1]:.1f}"
                f" | {r['eval_mean']:.1f} | {cell_eval:.1f} | {fall_cells} |"
            )
    if out[-1].startswith("|---"):
        out.append("| none | | | | | | | | | | | | |")
    return "\n".join(out)


#: Updates up to the curve's best point over which the drift before a collapse is averaged
DRIFT_WINDOW = 50


def update_mean(record: dict[str, Any], key: str, indices: list[int]) -> float:
    """The mean of ``key`` (e.g. ``mean``, ``drift``) over the record's updates at ``indices``, / its target (NaN without)."""
    wanted = set(indices)
    values = [u.get(key, math.nan) for i, u in enumerate(record["kl_updates"]) if i in wanted]
    if not values or np.all(np.isnan(values)):
        return math.nan
    return float(np.nanmean(values)) / record["target_kl"]


def drift_table(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> str:
    """
    The monitor's drift (``KLMonitorCallback``'s ``kl/drift``: the exact KL between the policy ``drift_lag`` updates
    before and the updated one) of every collapsed run whose record holds it, over the ``DRIFT_WINDOW`` updates up to
    the curve's best point and over the fall, beside the per-update KL and beside the cell's runs without a collapse
    over the same updates. Empty when no collapsed run's record holds the drift.
    """
    rows = []
    for (env, algo, mult), runs in sorted(groups.items(), key=lambda kv: cell_order(kv[0])):
        healthy = [r for r in runs if count_collapses(r["curve"]) == 0 and any("drift" in u for u in r["kl_updates"])]
        for r in sorted(runs, key=lambda r: r["seed"]):
            span = fall_span(r)
            if span is None or not any("drift" in u for u in r["kl_updates"]):
                continue
            t_best, t_fell = span
            times = [u["timesteps"] for u in r["kl_updates"]]
            up_to_best = [i for i, t in enumerate(times) if t <= t_best][-DRIFT_WINDOW:]
            in_fall = [i for i, t in enumerate(times) if t_best <= t < t_fell]
            others = [update_mean(h, "drift", up_to_best) for h in healthy]
            others = [x for x in others if not math.isnan(x)]
            rows.append(
                f"| {env} | x{mult:g} | {algo} | {r['seed']} | {r.get('drift_lag', '-')} | {len(up_to_best)}"
                f" | {update_mean(r, 'mean', up_to_best):.2f} | {update_mean(r, 'drift', up_to_best):.2f}"
                + (f" | {np.median(others):.2f} | {max(others):.2f} | {len(others)}" if others else " | - | - | 0")
                + f" | {len(in_fall)} | {update_mean(r, 'mean', in_fall):.2f} | {update_mean(r, 'drift', in_fall):.2f} |"
            )
    if not rows:
        return ""
    return "\n".join(
        [
            "## Drift before the collapses",
            "",
            "The monitor's drift (`kl/drift`: the exact KL(old || new), summed over action dimensions, between the policy"
            " `drift_lag` updates before an update's result and that result, on the update's rollout states) of every"
            " collapsed run whose record holds it (records made since the monitor measures it), / target, beside the"
            " update's own KL (the monitor's per-update mean, / target). *Before the best*: the last"
            f" {DRIFT_WINDOW} updates up to the curve's best point (the curve averages the last 100 episodes, so it peaks"
            " after the policies that earned its best acted); *healthy runs*: the same updates of the cell's runs"
            " without a collapse (median and largest of their means, and how many); *fall*: the updates from the best"
            " point to the rollout where the curve fell below 50 % of its gain (`fall_kl`). A drift many times the"
            " per-update KL, where each update stays far inside the target, is a move in one direction that no"
            " per-update control sees.",
            "",
            "| env | lr | algo | seed | lag | updates before the best | update KL | drift | healthy runs' drift: median"
            " | largest | runs | updates in the fall | update KL | drift |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def fisher_exact_p(a: int, n_a: int, b: int, n_b: int) -> float:
    """
    Two-sided p-value of Fisher's exact test that ``a`` of ``n_a`` and ``b`` of ``n_b`` come from one rate: the
    probability, under the hypergeometric law with the margins fixed, of the tables no more likely than the observed.
    """
    total, events = n_a + n_b, a + b

    def probability(k: int) -> float:
        return math.comb(n_a, k) * math.comb(n_b, events - k) / math.comb(total, events)

    observed = probability(a)
    low, high = max(0, events - n_b), min(n_a, events)
    return min(1.0, sum(p for k in range(low, high + 1) if (p := probability(k)) <= observed * (1 + 1e-9)))


#: The evaluation return from which CartPole-v1 counts as solved (the standing checks; gymnasium's `reward_threshold` for it)
CARTPOLE_SOLVED = 475.0

#: Environment -> results folder of its extra seeds (beside the grid's, same settings), and the return under which a
#: run does not solve it (None: no such line)
MORE_SEEDS_RUNS: dict[str, tuple[str, float | None]] = {
    "CartPole-v1": ("cartpole_seeds_10_29", CARTPOLE_SOLVED),
    "Hopper-v5": ("hopper_seeds_10_19", None),
}


def collapse_rates(groups: dict[tuple[str, str, float], list[dict[str, Any]]], tier: str, env: str) -> str:
    """
    How often each PPO-family algorithm collapses on ``env`` over the grid's seeds and the extra seeds of its
    :data:`MORE_SEEDS_RUNS` folder, against stock PPO (Fisher's exact test); empty without extra records.
    """
    folder, solved = MORE_SEEDS_RUNS[env]
    extra = {cell: runs for cell, runs in load_folder(f"{folder}/runs/{tier}").items() if cell[0] == env}
    if not extra:
        return ""
    algos = sorted({algo for (_, algo, _) in extra}, key=lambda a: MAIN_ALGOS.index(a))
    runs = {algo: groups.get((env, algo, 1.0), []) + extra.get((env, algo, 1.0), []) for algo in algos}
    reference = runs.get("ppo", [])
    n_ref = len(reference)
    collapses_ref = sum(count_collapses(r["curve"]) > 0 for r in reference)
    versions = ", ".join(f"`{v}`" for v in sorted({r.get("code_version", "?") for rs in extra.values() for r in rs}))
    extra_seeds = sorted({r["seed"] for rs in extra.values() for r in rs})
    under = f" and ends under {solved:g} (the standing check)" if solved is not None else ""
    out = [
        f"## {env} collapses over more seeds",
        "",
        f"The grid's {env} cells of {', '.join(algos)} with seeds {extra_seeds[0]}..{extra_seeds[-1]} added"
        f" (`SB3_KL_BENCHMARK_RESULTS=benchmarks/results/{folder} python benchmarks/learning.py --tier"
        f" {tier} --algos {' '.join(algos)} --envs {env} --seeds {extra_seeds[0]}..{extra_seeds[-1]} --lr-mults 1`;"
        f" records in `benchmarks/results/{folder}/`, code {versions}), same settings: how often each"
        f" collapses (`count_collapses`){under}, beside stock PPO on the same seeds; the evaluation after training of"
        " the collapsed runs (the deterministic policy at the end, which may have recovered while the curve of the"
        " stochastic policy's episodes had not). p: two-sided Fisher exact test of the collapse counts against PPO's;"
        f" a difference with p ≥ {SIGNIFICANCE} is a tie.",
        "",
        "| algo | seeds | collapses | seeds collapsed | eval of the collapsed |"
        + (f" eval < {solved:g} |" if solved is not None else "")
        + " eval (mean ± std) | collapses vs ppo: p |",
        "|---|---|---|---|---|" + ("---|" if solved is not None else "") + "---|---|",
    ]
    for algo in algos:
        records = sorted(runs[algo], key=lambda r: r["seed"])
        collapsed = [r for r in records if count_collapses(r["curve"]) > 0]
        evals = [r["eval_mean"] for r in records]
        p = "-" if algo == "ppo" or not n_ref else f"{fisher_exact_p(len(collapsed), len(records), collapses_ref, n_ref):.2f}"
        low = f" {sum(x < solved for x in evals)} |" if solved is not None else ""
        seeds = ", ".join(str(r["seed"]) for r in collapsed) or "-"
        collapsed_evals = ", ".join(f"{r['eval_mean']:.1f}" for r in collapsed) or "-"
        out.append(f"| {algo} | {len(records)} | {len(collapsed)} | {seeds} | {collapsed_evals} |{low} {fmt(evals)} | {p} |")
    return "\n".join(out)


#: A side experiment that gives KLTRPO the PPO entry's settings on one environment: (environment, results folder)
KLTRPO_PPO_SETTINGS_RUNS = ("Hopper-v5", "hopper_kltrpo_ppo_settings")


def settings_swap_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]], tier: str) -> str:
    """
    Whether the PPO family's collapses on an environment follow its settings or its optimizer: KLTRPO run with the
    settings of PPO's zoo entry that KLTRPO takes (``--override``: the discount, GAE lambda and policy network,
    :data:`KLTRPO_PPO_SETTINGS_RUNS`) beside the grid's KLTRPO (TRPO's zoo settings), KLPPO and PPO on the same seeds:
    collapses (Fisher's exact test), evaluation and AUC (Welch); empty without records.
    """
    env, folder = KLTRPO_PPO_SETTINGS_RUNS
    swapped = load_folder(f"{folder}/runs/{tier}").get((env, "kltrpo", 1.0), [])
    if not swapped:
        return ""
    overrides = swapped[0].get("overrides") or {}
    shown = " ".join(shlex.quote(f"{k}={json.dumps(v, separators=(',', ':'))}") for k, v in overrides.items())
    versions = ", ".join(f"`{v}`" for v in sorted(code_versions(swapped)))
    seeds = {r["seed"] for r in swapped}
    rows = [("kltrpo with PPO's settings", swapped)] + [
        (f"{algo} (grid)", [r for r in groups.get((env, algo, 1.0), []) if r["seed"] in seeds])
        for algo in ("kltrpo", "klppo", "klppo_noclip", "ppo")
    ]
    lines = [
        f"## KLTRPO on {env} with PPO's discount, GAE and policy network",
        "",
        f"Do the PPO family's falls on {env} come with its zoo settings or with its optimizer (many minibatch steps"
        " of Adam on a clipped or penalized surrogate, where TRPO takes one natural-gradient step)? KLTRPO was run with"
        " the settings of PPO's zoo entry that apply to it, the rest of TRPO's entry unchanged (from the repository"
        f" root: `SB3_KL_BENCHMARK_RESULTS=benchmarks/results/{folder} python benchmarks/learning.py --tier {tier}"
        f" --algos kltrpo --envs {env} --lr-mults 1 --seeds {seed_range(swapped)} --override {shown}`; records in"
        f" `benchmarks/results/{folder}/`, code {versions}), beside the grid's runs of the same seeds. Collapses:"
        f" `count_collapses`, with Fisher's exact test against KLTRPO with PPO's settings; evaluation and AUC as in"
        f" the grid, with the Welch p-value of the difference from KLTRPO with PPO's settings (p ≥ {SIGNIFICANCE}:"
        " a tie). *Largest update KL in the fall*: for each collapsed run, the largest per-update KL (the monitor's"
        " exact per-update mean, / the run's target) of the updates of its fall (`fall_kl`).",
        "",
        "| runs | seeds | collapses | seeds collapsed | largest update KL in the fall | collapses: p | eval |"
        " eval: difference | AUC | AUC: difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_collapsed = sum(count_collapses(r["curve"]) > 0 for r in swapped)
    base_eval = [r["eval_mean"] for r in swapped]
    base_auc = [summarize(r)["auc"] for r in swapped]
    for label, runs in rows:
        if not runs:
            continue
        fallen = [r for r in sorted(runs, key=lambda r: r["seed"]) if count_collapses(r["curve"]) > 0]
        collapsed = [r["seed"] for r in fallen]
        largest = ", ".join(f"{f['max']:.2f}" if (f := fall_kl(r)) else "n/a" for r in fallen) or "-"
        evals, aucs = [r["eval_mean"] for r in runs], [summarize(r)["auc"] for r in runs]
        first = runs is swapped
        p = "-" if first else f"{fisher_exact_p(len(collapsed), len(runs), base_collapsed, len(swapped)):.2f}"
        eval_diff = "-" if first else "{}: {}".format(*verdict(evals, base_eval))
        auc_diff = "-" if first else "{}: {}".format(*verdict(aucs, base_auc))
        lines.append(
            f"| {label} | {seed_range(runs)} | {len(collapsed)} | {', '.join(map(str, collapsed)) or '-'} | {largest} |"
            f" {p} |"
            f" {fmt(evals)} | {eval_diff} | {fmt(aucs)} | {auc_diff} |"
        )
    return "\n".join(lines)


#: Environment -> results folder of its grid runs trained again past the grid's budget (``--budget``), same seeds
LONGER_BUDGET_RUNS: dict[str, str] = {"Hopper-v5": "hopper_budget_300k"}
#: A curve that fell "came back" once it rises again to this share of the way from its start to its best before the
#: fall: the share above which :func:`collapse_points` no longer counts the fall
CAME_BACK = 0.9


def curve_until(curve: list[list[float]], steps: int) -> list[list[float]]:
    """
    The points of a learning curve up to ``steps``: those taken at or before it, and the first one after it where no
    point falls on it (a run's last rollout ends past its budget, so the points of a run trained to ``steps``).
    """
    before = [point for point in curve if point[0] <= steps]
    after = [point for point in curve if point[0] > steps]
    return before if (before and before[-1][0] == steps) or not after else before + after[:1]


def repeats_grid_run(grid: dict[str, Any], longer: dict[str, Any]) -> bool:
    """
    Whether a run trained past the grid's budget repeated the grid's run of its cell and seed over the grid's steps:
    the same learning curve and per-update KLs up to the grid run's last step (the evaluation after training differs:
    it comes later).
    """
    steps = trained_steps(grid)
    if steps is None:
        return False
    same_curve = [tuple(p) for p in longer["curve"] if p[0] <= steps] == [tuple(p) for p in grid["curve"]]
    return same_curve and kl_update_keys(longer, steps) == kl_update_keys(grid, steps)


def back_above(curve: list[list[float]], fell: tuple[int, int], share: float = CAME_BACK) -> float | None:
    """
    The step at which a curve that fell (``fell``: :func:`collapse_points`' indices of its best and of its fall, on the
    curve up to the grid's budget) first came back to ``share`` of the way from its start to that best, or None.
    """
    returns = np.array([point[1] for point in curve], dtype=float)
    start, best = returns[0], returns[fell[0]]
    for point in curve[fell[1] :]:
        if point[1] - start >= share * (best - start):
            return float(point[0])
    return None


def longer_run(record: dict[str, Any]) -> dict[str, Any] | None:
    """
    The record of a grid run trained again past the grid's budget (:data:`LONGER_BUDGET_RUNS`), where there is one and
    it repeated the grid's run up to the grid's budget (:func:`repeats_grid_run`); else None.
    """
    folder = LONGER_BUDGET_RUNS.get(record["env"])
    if folder is None:
        return None
    grid_path = record_path(record["tier"], record["algo"], record["env"], record["lr_mult"], record["seed"])
    path = RESULTS / folder / grid_path.relative_to(RESULTS)
    if not path.exists():
        return None
    longer = json.loads(path.read_text())
    return longer if repeats_grid_run(record, longer) else None


def after_the_budget(record: dict[str, Any]) -> str:
    """
    For a grid run with a collapse, what its run trained past the grid's budget (:func:`longer_run`) did after it: where
    its curve came back (:func:`back_above`), whether it fell again by the end, and its evaluation then; empty without
    such a run.
    """
    longer, points = longer_run(record), collapse_points(record["curve"])
    if longer is None or not points:
        return ""
    budget, eval_mean = int(longer["budget"]), longer["eval_mean"]
    step = back_above(longer["curve"], points[0])
    if step is None:
        return f"trained on to {budget:,} steps its curve did not come back (evaluation then {eval_mean:.1f})"
    again = "fell again by then" if count_collapses(longer["curve"]) else "stood to the end"
    return (
        f"trained on to {budget:,} steps its curve came back above {CAME_BACK:.0%} of its best at step {step:,.0f}"
        f" and {again} (evaluation at {budget:,} steps {eval_mean:.1f})"
    )


def longer_budget_collapses(groups: dict[tuple[str, str, float], list[dict[str, Any]]], tier: str, env: str) -> str:
    """
    The grid's runs of ``env`` trained again past the grid's budget (:data:`LONGER_BUDGET_RUNS`): whether the
    collapses that :func:`count_collapses` counts by the grid's budget are falls the curve comes back from with more
    steps, and whether runs that had not fallen by then fall later; empty without records. Fisher's test against stock
    PPO only where both were trained on for every seed of the grid's cell: the first runs trained on were the grid's
    collapsed ones, and a rate over seeds chosen for their collapse says nothing.
    """
    folder = LONGER_BUDGET_RUNS[env]
    longer = {cell: runs for cell, runs in load_folder(f"{folder}/runs/{tier}").items() if cell[0] == env and cell[2] == 1.0}
    if not longer:
        return ""
    algos = sorted({algo for (_, algo, _) in longer}, key=ALL_ALGOS.index)
    budgets = sorted({r["budget"] for runs in longer.values() for r in runs})
    grid_budget = BUDGETS[tier][env]
    versions = ", ".join(f"`{v}`" for v in sorted(code_versions([r for rs in longer.values() for r in rs])))
    share = f"{CAME_BACK:.0%}"
    out = [
        f"## {env} past the grid's budget",
        "",
        f"The grid's {env} runs of {', '.join(algos)} trained again, same settings and seeds, to"
        f" {' / '.join(f'{b:,}' for b in budgets)} steps instead of the grid's {grid_budget:,}"
        f" (`SB3_KL_BENCHMARK_RESULTS=benchmarks/results/{folder} python benchmarks/learning.py --tier {tier} --envs"
        f" {env} --lr-mults 1 --budget {budgets[-1]} --algos <algo> --seeds <seeds>`; records in"
        f" `benchmarks/results/{folder}/`, code {versions}). The grid's collapsed runs were trained on first, then the"
        " other seeds. No schedule of these settings depends on the budget (the learning rate and clip range are"
        " constant), so a longer run repeats the grid's run step for step up to the grid's budget and goes on from"
        " there (*repeats*: the same learning curve and per-update KLs as the grid's record up to its last step)."
        " *By the grid's budget*: `count_collapses` on the curve cut at the grid's run's last step (the grid's count,"
        f" where the run repeats it); *came back*: those of them whose curve rises again above {share} of the way from"
        " its start to the best it had before the fall, and the step where it did (`count_collapses` then no longer"
        f" counts that fall); *over {budgets[-1]:,}*: `count_collapses` on the whole curve, a fall from a later best"
        " included. p: Fisher's exact test of the counts over the whole curve against stock PPO's, only where both"
        f" have every seed of the grid's cell (p ≥ {SIGNIFICANCE}: a tie; '-' where not: a count over seeds chosen"
        " for their collapse is no rate). The evaluation (10 deterministic episodes after training) can stand while"
        " the curve of the stochastic policy's episodes is down.",
        "",
        "| algo | seeds | repeats | collapsed by the grid's budget | came back (step) |"
        f" collapsed over {budgets[-1]:,} | eval at the grid's budget | eval at {budgets[-1]:,} | collapses vs ppo: p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def complete(algo: str) -> bool:
        grid_seeds = {r["seed"] for r in groups.get((env, algo, 1.0), [])}
        return bool(grid_seeds) and grid_seeds <= {r["seed"] for r in longer.get((env, algo, 1.0), [])}

    reference = [r for r in longer.get((env, "ppo", 1.0), []) if complete("ppo")]
    collapses_ref = sum(count_collapses(r["curve"]) > 0 for r in reference)
    for algo in algos:
        runs = sorted(longer[(env, algo, 1.0)], key=lambda r: r["seed"])
        grid = {r["seed"]: r for r in groups.get((env, algo, 1.0), [])}
        repeated = [r for r in runs if r["seed"] in grid and repeats_grid_run(grid[r["seed"]], r)]
        early, came_back = [], []
        for r in runs:
            steps = trained_steps(grid[r["seed"]]) if r["seed"] in grid else None
            points = collapse_points(curve_until(r["curve"], steps or grid_budget))
            if points:
                early.append(r["seed"])
                step = back_above(r["curve"], points[0])
                if step is not None:
                    came_back.append(f"{r['seed']} ({step:,.0f})")
        late = [r["seed"] for r in runs if count_collapses(r["curve"]) > 0]
        grid_evals = [grid[r["seed"]]["eval_mean"] for r in runs if r["seed"] in grid]
        p = "-"
        if algo != "ppo" and reference and complete(algo):
            p = f"{fisher_exact_p(len(late), len(runs), collapses_ref, len(reference)):.2f}"
        out.append(
            f"| {algo} | {seed_range(runs)} | {len(repeated)} of {len(runs)} |"
            f" {len(early)}: {', '.join(map(str, early)) or '-'} | {len(came_back)}: {', '.join(came_back) or '-'} |"
            f" {len(late)}: {', '.join(map(str, late)) or '-'} | {fmt(grid_evals)} | {fmt([r['eval_mean'] for r in runs])} |"
            f" {p} |"
        )
    return "\n".join(out)


def side_folder_checks(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> str:
    """
    The goals' section of a side folder's report (:func:`is_side_folder`): the goals are stated over the main grid and
    not judged on a side folder's records; the standing checks of single cells are, labelled as such.
    """
    checks = [line for line in standing_checks(groups) if line.startswith("- ")]
    return "\n".join(
        [
            "## Goals: judged in the main report, not here",
            "",
            "The goals are stated over the main grid (all its environments, algorithms and learning rates, and the"
            " side experiments it sets beside them), so `benchmarks/results/learning.md` judges them on the main"
            " grid's records; a verdict on this folder's records alone would judge a part of the grid as the whole."
            + (
                " The standing checks of single cells, on this folder's records alone (not the main grid's seeds of"
                " the same cells):"
                if checks
                else ""
            ),
            *(["", *checks] if checks else []),
        ]
    )


def status(met: bool | None) -> str:
    return "not measured" if met is None else ("**met**" if met else "**NOT met**")


def goals(groups: dict[tuple[str, str, float], list[dict[str, Any]]], note: str | None = None) -> str:
    """The goals, each stated as met / NOT met / not measured from the records (``note``: a paragraph above them)."""
    out = ["## Goals", ""] + ([note, ""] if note else [])
    out += goal_trust_region(groups) + goal_fair_trpo(groups) + goal_stress(groups) + goal_collapses(groups)
    out += goal_baseline(groups) + goal_seeds(groups) + standing_checks(groups)
    return "\n".join(out)


def within_one_std(ours: list[float], theirs: list[float]) -> bool:
    """Whether the mean of ``ours`` is at least the mean of ``theirs`` minus one (population) std of ``theirs``."""
    return bool(np.mean(ours) >= np.mean(theirs) - np.std(theirs))


def _evals(groups: dict[tuple[str, str, float], list[dict[str, Any]]], env: str, algo: str, mult: float = 1.0) -> list[float]:
    return [r["eval_mean"] for r in groups.get((env, algo, mult), [])]


def goal_trust_region(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """KLTRPO uses its trust region: mean per-update KL >= 0.85 x target on every environment, and its speed."""
    uses = {env: [summarize(r)["budget_use"] for r in groups.get((env, "kltrpo", 1.0), [])] for env in MAIN_ENVS}
    measured = {env: float(np.mean(u)) for env, u in uses.items() if u}
    met = None if len(measured) < len(MAIN_ENVS) else all(u >= 0.85 for u in measured.values())
    detail = ", ".join(f"{env} {u:.2f}" for env, u in measured.items()) or "no records"
    out = [
        "- KLTRPO uses its trust region: mean per-update KL / target_kl ≥ 0.85 on all six environments: "
        f"{status(met)} ({detail})"
    ]
    source = "overhead.md"
    ratios = overhead_ratios("KLTRPO", "TRPO (sb3-contrib)", source)
    speed_met = None if not ratios else all(r >= 1.0 for r in ratios.values())
    detail = ", ".join(f"{env} {r:.3f}" for env, r in ratios.items()) or f"no {source} rows"
    out.append(f"- KLTRPO ≥ 1.0 x TRPO's env-steps/s (`{source}`, median paired ratio): {status(speed_met)} ({detail})")
    return out


def shipped_kltrpo_target_kl(env_id: str) -> float:
    """The ``target_kl`` of the shipped ``kltrpo`` zoo config of ``env_id`` (KLTRPO's default where it sets none)."""
    import yaml

    from sb3_kl import KLTRPO

    config = yaml.safe_load((HERE.parent / "sb3_kl" / "hyperparams" / "kltrpo.yml").read_text())
    default = inspect.signature(KLTRPO).parameters["target_kl"].default
    return float(config.get(env_id, {}).get("target_kl", default))


def shipped_kltrpo_cell(groups: dict[tuple[str, str, float], list[dict[str, Any]]], env_id: str) -> str | None:
    """
    The grid cell whose records ran at the shipped ``kltrpo`` config's ``target_kl`` on ``env_id``: ``kltrpo``
    (TRPO's target) or ``kltrpo_matched`` (whose target the config takes rounded to two significant digits,
    ``trpo_joint_kl.py --write-config``), or None when neither did.
    """
    from trpo_joint_kl import round_significant

    shipped = shipped_kltrpo_target_kl(env_id)
    for algo, rounded in (("kltrpo", False), ("kltrpo_matched", True)):
        targets = {r["target_kl"] for r in groups.get((env_id, algo, 1.0), [])}
        if targets and all(math.isclose(round_significant(t) if rounded else t, shipped) for t in targets):
            return algo
    return None


def goal_fair_trpo(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    KLTRPO's return >= TRPO's minus one std on all six environments, with 5 seeds: at equal settings (``kltrpo``), with
    TRPO's measured step size (``kltrpo_matched``) and as the shipped zoo configs set ``target_kl`` (the cell whose
    records ran at the config's target, :func:`shipped_kltrpo_cell`).
    """
    out = []
    for algo in ("kltrpo", "kltrpo_matched", "shipped"):
        cells, met = [], True
        for env in MAIN_ENVS:
            ours = algo if algo != "shipped" else shipped_kltrpo_cell(groups, env)
            a, b = (_evals(groups, env, ours) if ours else []), _evals(groups, env, "trpo")
            if algo == "shipped" and ours is None:
                met = False
                cells.append(f"{env}: no cell ran at the shipped target_kl {shipped_kltrpo_target_kl(env):g}")
                continue
            if not a or not b:
                met = None if met is not False else False
                continue
            ok = within_one_std(a, b) and min(len(a), len(b)) >= 5
            met = met and ok if met is not None else met
            label = f"{env} ({ours}) " if algo == "shipped" else f"{env} "
            cells.append(f"{label}{np.mean(a):.1f} vs {np.mean(b):.1f} ± {np.std(b):.1f} (n={len(a)}/{len(b)})")
        name = (
            "KLTRPO's return at the shipped zoo configs' `target_kl` (where a config takes TRPO's joint KL, the runs are "
            "kltrpo_matched's, whose target the config rounds to two significant digits)"
            if algo == "shipped"
            else f"{algo}'s return"
        )
        out.append(
            f"- {name} ≥ TRPO's minus one std on all six environments, 5 seeds each: {status(met)} "
            f"({'; '.join(cells) or 'no records'})"
        )
    return out


def goal_stress(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    x10 learning rate: >= 90 % of KLPPO's updates in band (every seed pooled) and a return within 20 % of x1, on the
    seeds both learning rates have (so that the comparison does not mix seed sets).
    """
    out = []
    for env in STRESS_ENVS:
        for ours in ("klppo_noclip", "klppo"):
            runs = groups.get((env, ours, 10.0), [])
            x1_by_seed = {r["seed"]: r["eval_mean"] for r in groups.get((env, ours, 1.0), [])}
            paired = [(r["eval_mean"], x1_by_seed[r["seed"]]) for r in runs if r["seed"] in x1_by_seed]
            if not runs or not paired:
                out.append(f"- x10, {env}, {ours}: updates in band ≥ 90%, return within 20% of x1: {status(None)}")
                continue
            kls = [(u["mean"], r["target_kl"]) for r in runs for u in r["kl_updates"]]
            share = float(np.mean([BAND[0] * t <= k <= BAND[1] * t for k, t in kls]))
            x10, x1 = (float(np.mean(v)) for v in zip(*paired, strict=True))
            return_ok = x10 >= x1 - 0.2 * abs(x1)
            out.append(
                f"- x10, {env}, {ours} ({len(runs)} seeds pooled): updates in band {100 * share:.0f}% "
                f"({status(share >= 0.9)}, goal ≥ 90%); return {x10:.1f} vs x1 {x1:.1f} on the {len(paired)} seeds "
                f"both have, {100 * (x10 - x1) / abs(x1):+.1f}% "
                f"({status(bool(return_ok))}, goal: within 20%)"
            )
    return out


def goal_collapses(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """No collapse of any sb3-kl algorithm anywhere in the grid."""
    runs = [r for (_, algo, _), rs in groups.items() if algo in SB3_KL_ALGOS for r in rs]
    collapsed = sb3_kl_collapses(groups)
    afters = [after_the_budget(r) for r in collapsed]  # what each did when trained on past the grid's budget
    detail = (
        ", ".join(
            f"{r['algo']} {r['env']} x{r['lr_mult']:g} s{r['seed']}, evaluation after training {r['eval_mean']:.1f}"
            + (
                f", per-update KL in its fall {fall['mean']:.2f} x target on average, at most {fall['max']:.2f}"
                if (fall := fall_kl(r)) is not None
                else ""
            )
            + (f", {afters[i]}" if afters[i] else "")
            for i, r in enumerate(collapsed)
        )
        or "none"
    )
    count = f"{len(collapsed)} runs, {len(distinct_trainings(collapsed))} distinct trainings: " if collapsed else ""
    trained_on = sorted({r["env"] for r, after in zip(collapsed, afters, strict=True) if after}, key=MAIN_ENVS.index)
    see = "*The collapses*" + "".join(f" and *{env} past the grid's budget*" for env in trained_on)
    swap_env, swap_folder = KLTRPO_PPO_SETTINGS_RUNS
    if any(r["env"] == swap_env for r in collapsed) and load_folder(f"{swap_folder}/runs/{collapsed[0]['tier']}"):
        see += f" and *KLTRPO on {swap_env} with PPO's discount, GAE and policy network*"
    return [
        f"- No collapse of any sb3-kl algorithm in the grid ({len(runs)} runs): "
        f"{status(not collapsed if runs else None)} (collapsed: {count}{detail}; see {see})"
    ]


def goal_baseline(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """Stock PPO with ``target_kl`` is a row of the main and stress grids."""
    grids = {mult for (_, algo, mult) in groups if algo == "ppo_target_kl"}
    met = {1.0, 10.0} <= grids
    return [
        f"- Stock PPO with `target_kl` in the main and stress grids, compared above: {status(met)} (grids with its "
        f"records: {', '.join(f'x{m:g}' for m in sorted(grids)) or 'none'})"
    ]


def goal_seeds(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    5 seeds for every cell of the main and stress grids where two algorithms are within two standard deviations of
    each other, and for every main-grid cell on LunarLanderContinuous, Hopper, HalfCheetah and Pendulum.
    """
    needed = set()
    grids = [(env, 1.0) for env in MAIN_ENVS] + [(env, mult) for env in STRESS_ENVS for mult in STRESS_LR_MULTS]
    for env, mult in grids:
        cells = {algo: _evals(groups, env, algo, mult) for algo in ALL_ALGOS if _evals(groups, env, algo, mult)}
        for a in cells:
            if mult == 1.0 and env in ("LunarLanderContinuous-v3", "Hopper-v5", "HalfCheetah-v5", "Pendulum-v1"):
                needed.add((env, a, mult))
            for b in cells:
                spread = 2 * max(np.std(cells[a]), np.std(cells[b]))
                if a < b and abs(np.mean(cells[a]) - np.mean(cells[b])) <= spread:
                    needed |= {(env, a, mult), (env, b, mult)}
    short = sorted(
        f"{a} on {env} x{mult:g} (n={len(_evals(groups, env, a, mult))})"
        for env, a, mult in needed
        if len(_evals(groups, env, a, mult)) < 5
    )
    met = None if not needed else not short
    cells = sum(bool(_evals(groups, env, algo, mult)) for env, mult in grids for algo in ALL_ALGOS)
    return [
        f"- 5 seeds in every close cell of the main and stress grids: {status(met)} ({len(needed)} close cells of the "
        f"grids' {cells}; fewer than 5 seeds: {', '.join(short) or 'none'})"
    ]


def standing_checks(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """Earlier checks: CartPole solved on every seed; each sb3-kl algorithm within one std of its stock counterpart."""
    out = ["", "Standing checks:", ""]
    for algo in SB3_KL_ALGOS:
        scores = _evals(groups, "CartPole-v1", algo)
        if scores:
            # the stock counterpart's seeds beside it: a check the stock algorithm fails too reads differently
            stock = "trpo" if algo.startswith("kltrpo") else "ppo"
            theirs = _evals(groups, "CartPole-v1", stock)
            beside = (
                f"; {stock}: min {min(theirs):.1f}, {sum(x < CARTPOLE_SOLVED for x in theirs)} of {len(theirs)} seeds under"
                f" {CARTPOLE_SOLVED:g}"
                if theirs
                else ""
            )
            out.append(
                f"- CartPole-v1, {algo}: every seed ≥ {CARTPOLE_SOLVED:g}: {status(min(scores) >= CARTPOLE_SOLVED)} (min"
                f" {min(scores):.1f}, {sum(x < CARTPOLE_SOLVED for x in scores)} of {len(scores)} seeds under"
                f" {CARTPOLE_SOLVED:g}{beside})"
            )
    for env in MAIN_ENVS:
        for ours, stock in (("klppo", "ppo"), ("klppo_noclip", "ppo"), ("clip_klppo", "ppo"), ("kltrpo", "trpo")):
            a, b = _evals(groups, env, ours), _evals(groups, env, stock)
            if a and b:
                text, result = verdict(a, b)
                met = within_one_std(a, b)
                out.append(
                    f"- x1, {env}: {ours} {np.mean(a):.1f} vs {stock} {np.mean(b):.1f} ± {np.std(b):.1f}: within one std "
                    f"of {stock} or better: {status(met)} (difference {text}: {result})"
                )
    return out


def plot(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str], algos: list[str], suffix: str) -> None:
    """Learning curves with seed bands, and KL timelines on a log scale with the target band, one PNG each per grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ["tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:olive", "tab:red", "tab:purple", "tab:pink"]
    colors = dict(zip(ALL_ALGOS, palette, strict=True))
    for lr_mult in sorted({k[2] for k in groups}):
        grid_envs = [e for e in envs if any((e, a, lr_mult) in groups for a in algos)]
        if not grid_envs:
            continue
        tag = "" if lr_mult == 1.0 else f"_lr{lr_mult:g}"
        for kind in ("curves", "kl"):
            fig, axes = plt.subplots(1, len(grid_envs), figsize=(4.5 * len(grid_envs), 3.6), squeeze=False)
            for ax, env in zip(axes[0], grid_envs, strict=True):
                for algo in algos:
                    runs = groups.get((env, algo, lr_mult), [])
                    series = [
                        r["curve"] if kind == "curves" else [(u["timesteps"], u["mean"]) for u in r["kl_updates"]]
                        for r in runs
                    ]
                    series = [s for s in series if len(s) > 1]
                    if not series:
                        continue
                    grid = np.linspace(max(s[0][0] for s in series), min(s[-1][0] for s in series), 100)
                    values = np.array([np.interp(grid, *np.array(s, dtype=float).T) for s in series])
                    mean = values.mean(axis=0)
                    ax.plot(grid, mean, color=colors[algo], label=algo)
                    ax.fill_between(grid, values.min(axis=0), values.max(axis=0), color=colors[algo], alpha=0.2)
                    if kind == "kl":
                        target = runs[0]["target_kl"]
                        ax.axhspan(BAND[0] * target, BAND[1] * target, color=colors[algo], alpha=0.06)
                if kind == "kl":
                    ax.set_yscale("log")
                    ax.set_ylabel("per-update KL(old||new)")
                else:
                    ax.set_ylabel("episode return")
                ax.set_title(env + ("" if lr_mult == 1.0 else f" (lr x{lr_mult:g})"))
                ax.set_xlabel("timesteps")
                ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(RESULTS / f"learning_{kind}{tag}{suffix}.png", dpi=90)
            plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------------


def seed_list(tokens: list[str]) -> list[int]:
    """Seeds from the command line: integers, or inclusive ranges ``a..b`` (``0..4`` = 0 1 2 3 4)."""
    seeds: list[int] = []
    for token in tokens:
        first, _, last = token.partition("..")
        try:
            seeds += list(range(int(first), int(last) + 1)) if last else [int(first)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seeds takes integers or ranges like 0..4, got {token!r}") from None
    return sorted(set(seeds))


def resolve_activation(overrides: dict[str, Any]) -> dict[str, Any]:
    """
    ``overrides`` with a ``policy_kwargs`` ``activation_fn`` given by name (JSON has no classes: ``"ReLU"`` or
    ``"nn.ReLU"``, as rl-zoo's configs write it) replaced by that ``torch.nn`` module class.

    :raise ValueError: for a name that is not a ``torch.nn`` module
    """
    import torch.nn as nn

    name = (overrides.get("policy_kwargs") or {}).get("activation_fn")
    if not isinstance(name, str):
        return overrides
    module = getattr(nn, name.removeprefix("nn."), None)
    if not (isinstance(module, type) and issubclass(module, nn.Module)):
        raise ValueError(f"policy_kwargs activation_fn={name!r} is not a torch.nn module: give one such as 'ReLU' or 'Tanh'")
    return {**overrides, "policy_kwargs": {**overrides["policy_kwargs"], "activation_fn": module}}


def parse_override(token: str) -> tuple[str, Any]:
    """:return: ``(name, value)`` of a ``--override NAME=VALUE`` (VALUE read as JSON, else kept as a string)"""
    name, sep, text = token.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--override takes NAME=VALUE such as kl_coef=0.2, got {token!r}")
    try:
        return name, json.loads(text)
    except json.JSONDecodeError:
        return name, text


def grid_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    from settings import clips

    if args.grid == "main":
        algos, envs, mults = MAIN_ALGOS, MAIN_ENVS, [1.0]
    else:
        algos, envs, mults = STRESS_ALGOS, STRESS_ENVS, STRESS_LR_MULTS
    algos, envs = args.algos or algos, args.envs or envs
    mults = args.lr_mults or mults
    version = code_version()
    specs = [
        dict(
            algo=a,
            env=e,
            seed=s,
            lr_mult=m,
            tier=args.tier,
            code_version=version,
            overrides=getattr(args, "override", {}),
            **({"budget": args.budget} if getattr(args, "budget", None) else {}),
        )
        for e in envs
        for a in algos
        for m in mults
        for s in seed_list(args.seeds)
        # where PPO's zoo entry does not clip, klppo is already KLPPO without clipping
        if not (a == "klppo_noclip" and not clips(e))
    ]
    if not args.force:
        here = run_environment() if args.other_machines else None
        specs = [
            s
            for s in specs
            if not up_to_date(record_path(args.tier, s["algo"], s["env"], s["lr_mult"], s["seed"]), version, args.stale, here)
        ]
    return specs


def keep_unrecorded(specs: list[dict[str, Any]], tier: str) -> list[Path]:
    """
    Before ``--other-machines`` re-makes them: copy the existing records of ``specs`` that do not name their machine to
    ``results/unrecorded_machine/runs/<tier>/`` (unless a copy is there), where the report's replication section sets
    them beside the re-made runs. A record that names another machine is replaced (git keeps it).

    :return: the copies written
    """
    kept = RESULTS / "unrecorded_machine" / "runs" / tier
    written = []
    for spec in specs:
        path = record_path(tier, spec["algo"], spec["env"], spec["lr_mult"], spec["seed"])
        copy = kept / path.name
        if path.exists() and not copy.exists() and "run_environment" not in json.loads(path.read_text()):
            kept.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text())
            written.append(copy)
    return written


def up_to_date(path: Path, version: str, stale: bool, here: dict[str, str] | None = None) -> bool:
    """
    :param path: a run's record file
    :param version: the commit this checkout would record
    :param stale: whether a record made by another commit counts as missing (re-run it)
    :param here: this machine's :func:`run_environment`, to count a record that another machine or set of library
        versions made, or that does not name its machine, as missing (None: the machine does not matter)
    :return: whether the run can be skipped
    """
    return path.exists() and record_is_current(json.loads(path.read_text()), version, stale, here)


def record_is_current(record: dict[str, Any], version: str, stale: bool, here: dict[str, str] | None = None) -> bool:
    """:func:`up_to_date` for a record already read (a file's, or a distributed grid's complete cell's)."""
    if stale and record.get("code_version") != version:
        return False
    return here is None or record.get("run_environment") == here


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--quick", dest="tier", action="store_const", const="quick", help="the whole grid at short budgets")
    tier.add_argument("--full", dest="tier", action="store_const", const="full", help="the budgets the results report")
    tier.add_argument("--tier", choices=list(BUDGETS), help="budget tier")
    parser.add_argument("--grid", choices=["main", "stress"], default="main")
    parser.add_argument("--algos", nargs="+", choices=ALL_ALGOS)
    parser.add_argument("--envs", nargs="+", choices=MAIN_ENVS)
    parser.add_argument("--seeds", nargs="+", default=["0", "1", "2"], help="seeds, or inclusive ranges such as 0..4")
    parser.add_argument("--lr-mults", nargs="+", type=float)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="re-run runs that already have a record")
    parser.add_argument(
        "--stale",
        action="store_true",
        help="re-run the runs whose record another commit made (resumable, unlike --force)",
    )
    parser.add_argument(
        "--other-machines",
        action="store_true",
        help="re-run the runs whose record another machine or set of library versions made, or that does not name its "
        "machine (resumable); the replaced records that do not name theirs are kept in results/unrecorded_machine/",
    )
    parser.add_argument(
        "--override",
        nargs="+",
        type=parse_override,
        default=[],
        metavar="NAME=VALUE",
        help="constructor keyword arguments set on top of the settings (VALUE is JSON, e.g. kl_coef=0.2), for measuring a "
        "candidate default: write such runs to their own results folder (SB3_KL_BENCHMARK_RESULTS)",
    )
    parser.add_argument(
        "--budget",
        type=int,
        help="environment steps per run instead of the tier's (a side experiment: only with SB3_KL_BENCHMARK_RESULTS set "
        "to a folder inside benchmarks/results/, so that no grid cell mixes budgets)",
    )
    parser.add_argument("--report", action="store_true", help="only regenerate tables and figures from the records")
    parser.add_argument(
        "--storage", help="database URL: queue the cells in an Optuna study there and work on them (distributed_grid.py)"
    )
    parser.add_argument("--study-name", help="study that holds the grid (default: learning-grid-<tier>)")
    parser.add_argument("--heartbeat-interval", type=int, default=60, help="seconds; a cell silent 2x this long is re-run")
    args = parser.parse_args(argv)
    args.tier = args.tier or "quick"
    args.override = dict(args.override)
    if args.budget is not None and args.storage:
        parser.error("--budget with --storage: the distributed grid's cells do not carry a budget; run it without --storage")
    if args.budget is not None and (args.budget <= 0 or not is_side_folder()):
        parser.error(
            f"--budget {args.budget}: give a positive number of steps, and set SB3_KL_BENCHMARK_RESULTS to a folder inside"
            f" {MAIN_RESULTS} (e.g. {MAIN_RESULTS}/hopper_budget_300k) so that the grid's records keep the tier's budgets"
        )
    if args.storage and not args.report:
        import distributed_grid

        heartbeat = distributed_grid.HeartbeatSettings(interval=args.heartbeat_interval)
        study_name = args.study_name or f"learning-grid-{args.tier}"
        specs = grid_specs(args)
        if args.other_machines:
            keep_unrecorded(specs, args.tier)
        is_current = None
        if args.stale or args.other_machines:  # the study's complete cells count as the files do (up_to_date)
            version, here = code_version(), run_environment() if args.other_machines else None

            def is_current(record: dict[str, Any]) -> bool:
                return record_is_current(record, version, args.stale, here)

        written = distributed_grid.run(
            specs, args.storage, study_name, args.workers, heartbeat, record_file, args.force, is_current
        )
        print(f"{len(written)} records written from study {study_name!r}", flush=True)
    elif not args.report:
        specs = grid_specs(args)
        if args.other_machines:
            keep_unrecorded(specs, args.tier)
        print(f"{len(specs)} runs to do ({args.tier} tier, {args.workers} workers)", flush=True)
        if args.workers > 1 and len(specs) > 1:
            with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
                for record in pool.imap_unordered(run_one, specs):
                    print(
                        f"done {record['algo']} {record['env']} lr x{record['lr_mult']:g} seed {record['seed']}: "
                        f"eval {record['eval_mean']:.1f}",
                        flush=True,
                    )
        else:
            for spec in specs:
                record = run_one(spec)
                print(
                    f"done {record['algo']} {record['env']} seed {record['seed']}: eval {record['eval_mean']:.1f}", flush=True
                )
    print(report(args.tier))


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
