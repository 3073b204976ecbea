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
    # only regenerate tables and figures from the records
    python benchmarks/learning.py --report --tier full
    # spread the grid over machines: the same command on each (cells queued once in a database-backed Optuna study,
    # a killed worker's cell re-run by another; see distributed_grid.py and docs/distributed.md)
    python benchmarks/learning.py --tier full --grid main --workers 2 --storage postgresql://USER:PASSWORD@HOST/grid

Records and results go to ``benchmarks/results/`` (``$SB3_KL_BENCHMARK_RESULTS`` to write elsewhere).
"""

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = Path(os.environ.get("SB3_KL_BENCHMARK_RESULTS", HERE / "results"))

MAIN_ENVS = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v5", "Hopper-v5"]
MAIN_ALGOS = ["ppo", "trpo", "klppo", "clip_klppo", "kltrpo"]
# not in the default grid; reported when records exist
EXTRA_ALGOS = ["klppo_noclip"]
ALL_ALGOS = MAIN_ALGOS + EXTRA_ALGOS
STRESS_ENVS = ["Pendulum-v1", "HalfCheetah-v5"]
STRESS_ALGOS = ["ppo", "klppo", "clip_klppo"]
STRESS_LR_MULTS = [3.0, 10.0]
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


def algorithm_class(algo: str) -> type:
    """:return: the class behind a benchmark name"""
    if algo == "ppo":
        from stable_baselines3 import PPO

        return PPO
    if algo == "trpo":
        from sb3_contrib import TRPO

        return TRPO
    import sb3_kl

    return getattr(sb3_kl, {"klppo": "KLPPO", "klppo_noclip": "KLPPO", "clip_klppo": "ClipKLPPO", "kltrpo": "KLTRPO"}[algo])


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
    if algo in ("trpo", "kltrpo"):
        return 0.01
    continuous = isinstance(gym.make(env_id).action_space, gym.spaces.Box)
    return 0.03 if continuous else 0.02


def record_path(tier: str, algo: str, env_id: str, lr_mult: float, seed: int) -> Path:
    return RESULTS / "runs" / tier / f"{algo}__{env_id}__lr{lr_mult:g}__s{seed}.json"


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


def train_and_evaluate(spec: dict[str, Any]) -> dict[str, Any]:
    """Train and evaluate one run; :return: its record (not written: :func:`run_one` or the distributed grid does)"""
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
    budget = BUDGETS[tier][env_id]
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

    callbacks: list[BaseCallback] = [Curve()]
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
            kl_updates.append(
                dict(timesteps=int(entry.get("num_timesteps", 0)), mean=float(stats["mean"]), p99=float(stats["p99"]))
            )
    record = dict(
        algo=algo,
        env=env_id,
        seed=seed,
        lr_mult=lr_mult,
        tier=tier,
        budget=budget,
        n_envs=setting["n_envs"],
        normalize=setting["normalize"],
        hyperparameters=describe(kwargs),
        target_kl=default_target_kl(algo, env_id, kwargs),
        eval_returns=[float(r) for r in returns],
        eval_mean=float(np.mean(returns)),
        curve=curve,
        kl_updates=kl_updates,
        kl_source="sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed)" if monitor is not None else None,
        train_seconds=train_seconds,
        env_steps_per_second=budget / train_seconds,
        torch_threads=1,
        code_version=code_version(),
    )
    return record


def code_version() -> str:
    """
    The commit of the sb3-kl checkout that ran, with ``+modified`` when the package or the benchmark code had
    uncommitted changes (results files do not count), or ``"unknown"`` outside a git checkout.
    """
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = git("status", "--porcelain", "--", "../sb3_kl", "settings.py", "learning.py")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) if commit else "unknown"


# ----------------------------------------------------------------------------------------------------------------------
# Report


def area_under_curve(curve: list[list[float]], budget: int) -> float:
    """Mean episode return over training (trapezoid area of the curve divided by its span)."""
    if len(curve) < 2:
        return float(curve[0][1]) if curve else float("nan")
    t, r = np.array(curve, dtype=float).T
    return float(np.trapezoid(r, t) / (t[-1] - t[0]))


def count_collapses(curve: list[list[float]]) -> int:
    """
    A collapse: after the return has improved by at least 10 % of its range, it falls below 50 % of the way from
    its starting value to its running best, and never comes back above 90 % of that best before the end.
    (Measured on progress from the start, so it works for negative returns such as Pendulum's.)
    """
    if len(curve) < 3:
        return 0
    returns = np.array([c[1] for c in curve], dtype=float)
    start, span = returns[0], np.ptp(returns)
    if span == 0:
        return 0
    collapses, best, in_collapse = 0, returns[0], False
    for i, r in enumerate(returns):
        best = max(best, r)
        gained = best - start
        if gained < 0.1 * span:
            continue
        progress = (r - start) / gained
        if not in_collapse and progress < 0.5:
            later = (returns[i:] - start) / gained
            if not np.any(later >= 0.9):
                collapses += 1
                in_collapse = True
        elif in_collapse and progress >= 0.9:
            in_collapse = False
    return collapses


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
    return summary


def load_records(tier: str) -> list[dict[str, Any]]:
    folder = RESULTS / "runs" / tier
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def fmt(values: list[float], digits: int = 1, percent: bool = False) -> str:
    if not values or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return "n/a"
    scale = 100.0 if percent else 1.0
    mean, std = scale * float(np.mean(values)), scale * float(np.std(values))
    suffix = "%" if percent else ""
    if abs(mean) < 0.1 and not percent and mean != 0:
        return f"{mean:.3g} ± {std:.2g}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}{suffix}"


def report(tier: str) -> str:
    """Write ``results/learning[_<tier>].md`` and the figures from the records of a tier."""
    records = load_records(tier)
    if not records:
        raise SystemExit(f"No records under {RESULTS / 'runs' / tier}: run the grid first.")
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["env"], record["algo"], record["lr_mult"]), []).append(record)
    envs = [e for e in MAIN_ENVS if any(k[0] == e for k in groups)]
    algos = [a for a in ALL_ALGOS if any(k[1] == a for k in groups)]
    suffix = "" if tier == "full" else f"_{tier}"
    lines = [
        f"# Learning benchmark ({tier} tier)",
        "",
        "Generated by `python benchmarks/learning.py --report --tier " + tier + "` from the JSON records in "
        f"`benchmarks/results/runs/{tier}/`. Hyperparameters: rl-baselines3-zoo's tuned settings (`benchmarks/settings.py`); "
        "`klppo` is the drop-in swap (PPO's entry unchanged: where it sets `clip_range`, KLPPO clips and penalizes); "
        "`klppo_noclip` is KLPPO with its own default `clip_range=None`. Evaluation: "
        f"{N_EVAL_EPISODES[tier]} deterministic episodes after training. AUC: mean training episode return over the run. "
        f"KL: exact per-update KL(old||new) from KLMonitorCallback, mean over updates of the per-update mean and p99; "
        f"in-band: share of updates whose KL lies in [{BAND[0]}, {BAND[1]}] x target (target: the algorithm's, or the "
        "family default 0.02 discrete / 0.03 continuous for PPO and 0.01 for TRPO). Collapses: see `count_collapses`. "
        "Values are mean ± std over seeds; the best evaluation return per row is in bold.",
        "",
        "KLTRPO and TRPO get the same `target_kl` but do not constrain the same number: KLTRPO holds the joint"
        " KL(old||new), summed over action dimensions, at or below it, while sb3-contrib's TRPO holds KL(new||old)"
        " averaged over action dimensions. On a d-dimensional action space TRPO's joint KL per update can reach about"
        " d times the target (see the KL tables: Hopper has 3 action dimensions, HalfCheetah 6), so at equal settings"
        ' KLTRPO takes smaller steps; `kl_reduction="mean"` gives it TRPO\'s budget per dimension.',
        "",
        "Budgets (environment steps per run, the same for every algorithm and learning rate): "
        + ", ".join(f"{env} {steps:,}" for env, steps in BUDGETS[tier].items())
        + ". rl-zoo trains LunarLanderContinuous and the MuJoCo tasks for 1M steps; these runs are shorter so that"
        " the grid fits a 2-core machine, so MuJoCo returns are those of early training. One torch thread per run.",
        "",
        "Code versions of the records (commit of sb3-kl that produced them: run count). sb3-kl algorithms: "
        + ", ".join(f"`{v}`: {n}" for v, n in sorted(code_versions([r for r in records if r["algo"] not in STOCK]).items()))
        + "; stock PPO/TRPO (whose training runs no sb3-kl code; only the KL monitor watches it): "
        + ", ".join(f"`{v}`: {n}" for v, n in sorted(code_versions([r for r in records if r["algo"] in STOCK]).items()))
        + ". *unrecorded*: runs from before records stored it, made with sb3-kl at commit d9fd1be or earlier.",
        "",
    ]
    for lr_mult in sorted({k[2] for k in groups}):
        title = "Main grid (base learning rate)" if lr_mult == 1.0 else f"Stress grid: learning rate x{lr_mult:g}"
        lines += [f"## {title}", ""]
        header = "| env | budget | " + " | ".join(algos) + " |"
        lines += ["### Evaluation return", "", header, "|" + "---|" * (len(algos) + 2)]
        for env in envs:
            cells, means = [], []
            for algo in algos:
                runs = groups.get((env, algo, lr_mult), [])
                values = [r["eval_mean"] for r in runs]
                means.append(np.mean(values) if values else -np.inf)
                cells.append(fmt(values) + (f" (n={len(values)})" if values else ""))
            if all(m == -np.inf for m in means):
                continue
            best = int(np.argmax(means))
            cells[best] = f"**{cells[best]}**"
            budget = next(r["budget"] for a in algos for r in groups.get((env, a, lr_mult), []))
            lines.append(f"| {env} | {budget:,} | " + " | ".join(cells) + " |")
        for metric, label, kwargs in (
            ("auc", "Area under the learning curve", {}),
            ("kl_mean", "Per-update KL, mean", {"digits": 4}),
            ("kl_p99", "Per-update KL, p99 over states", {"digits": 4}),
            ("in_band", "Updates with KL in band", {"percent": True, "digits": 0}),
            ("collapses", "Collapses", {"digits": 1}),
        ):
            lines += ["", f"### {label}", "", header, "|" + "---|" * (len(algos) + 2)]
            for env in envs:
                cells = []
                for algo in algos:
                    runs = groups.get((env, algo, lr_mult), [])
                    values = [summarize(r).get(metric) for r in runs]
                    cells.append(fmt(values, **kwargs) if runs else "")
                if any(cells):
                    budget = next(r["budget"] for a in algos for r in groups.get((env, a, lr_mult), []))
                    lines.append(f"| {env} | {budget:,} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += goals(groups), ""
    text = "\n".join(lines)
    (RESULTS / f"learning{suffix}.md").write_text(text)
    plot(groups, envs, algos, suffix)
    return text


# Stock algorithms: their records do not depend on the sb3-kl version
STOCK = ("ppo", "trpo")


def code_versions(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many records each code version produced (records from before versions were stored: ``unrecorded``)."""
    counts: dict[str, int] = {}
    for record in records:
        version = record.get("code_version", "unrecorded")
        counts[version] = counts.get(version, 0) + 1
    return counts


def goals(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> str:
    """The issue's goals, each stated as met / not met / not measured from the records."""
    out = ["## Goals", ""]

    def evals(env: str, algo: str, mult: float = 1.0) -> list[float]:
        return [r["eval_mean"] for r in groups.get((env, algo, mult), [])]

    for env in MAIN_ENVS:
        for ours, stock in (("klppo", "ppo"), ("klppo_noclip", "ppo"), ("clip_klppo", "ppo"), ("kltrpo", "trpo")):
            a, b = evals(env, ours), evals(env, stock)
            if not a or not b:
                continue
            met = np.mean(a) >= np.mean(b) - np.std(b)
            out.append(
                f"- x1, {env}: {ours} {np.mean(a):.1f} vs {stock} {np.mean(b):.1f} ± {np.std(b):.1f} -> "
                f"{'met' if met else 'NOT met'} (within one std of {stock} or better)"
            )
    for env in STRESS_ENVS:
        for ours in ("klppo", "clip_klppo"):
            runs = groups.get((env, ours, 10.0), [])
            base = evals(env, ours)
            if not runs or not base:
                continue
            in_band = [summarize(r).get("in_band") for r in runs]
            x10 = np.mean([r["eval_mean"] for r in runs])
            band_txt = "n/a" if None in in_band else f"{100 * np.mean(in_band):.0f}%"
            band_ok = None not in in_band and np.mean(in_band) >= 0.8
            # "lose <= 20 % of the x1 return", measured as a share of |x1 return|
            loss_ok = x10 >= np.mean(base) - 0.2 * abs(np.mean(base))
            out.append(
                f"- x10, {env}, {ours}: updates in band {band_txt} ({'met' if band_ok else 'NOT met'}, goal >= 80%); "
                f"return {x10:.1f} vs x1 {np.mean(base):.1f} ({'met' if loss_ok else 'NOT met'}, goal: lose <= 20%)"
            )
    if len(out) == 2:
        out.append("- No pair of runs to compare yet.")
    return "\n".join(out)


def plot(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str], algos: list[str], suffix: str) -> None:
    """Learning curves with seed bands, and KL timelines on a log scale with the target band, one PNG each per grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(ALL_ALGOS, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:olive"], strict=True))
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


def grid_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.grid == "main":
        algos, envs, mults = MAIN_ALGOS, MAIN_ENVS, [1.0]
    else:
        algos, envs, mults = STRESS_ALGOS, STRESS_ENVS, STRESS_LR_MULTS
    algos, envs = args.algos or algos, args.envs or envs
    mults = args.lr_mults or mults
    specs = [
        dict(algo=a, env=e, seed=s, lr_mult=m, tier=args.tier) for e in envs for a in algos for m in mults for s in args.seeds
    ]
    if not args.force:
        specs = [s for s in specs if not record_path(args.tier, s["algo"], s["env"], s["lr_mult"], s["seed"]).exists()]
    return specs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--quick", dest="tier", action="store_const", const="quick", help="the whole grid at short budgets")
    tier.add_argument("--full", dest="tier", action="store_const", const="full", help="the budgets the results report")
    tier.add_argument("--tier", choices=list(BUDGETS), help="budget tier")
    parser.add_argument("--grid", choices=["main", "stress"], default="main")
    parser.add_argument("--algos", nargs="+", choices=ALL_ALGOS)
    parser.add_argument("--envs", nargs="+", choices=MAIN_ENVS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--lr-mults", nargs="+", type=float)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="re-run runs that already have a record")
    parser.add_argument("--report", action="store_true", help="only regenerate tables and figures from the records")
    parser.add_argument(
        "--storage", help="database URL: queue the cells in an Optuna study there and work on them (distributed_grid.py)"
    )
    parser.add_argument("--study-name", help="study that holds the grid (default: learning-grid-<tier>)")
    parser.add_argument("--heartbeat-interval", type=int, default=60, help="seconds; a cell silent 2x this long is re-run")
    args = parser.parse_args(argv)
    args.tier = args.tier or "quick"
    if args.storage and not args.report:
        import distributed_grid

        heartbeat = distributed_grid.HeartbeatSettings(interval=args.heartbeat_interval)
        study_name = args.study_name or f"learning-grid-{args.tier}"
        specs = grid_specs(args)
        written = distributed_grid.run(specs, args.storage, study_name, args.workers, heartbeat, record_file, args.force)
        print(f"{len(written)} records written from study {study_name!r}", flush=True)
    elif not args.report:
        specs = grid_specs(args)
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
