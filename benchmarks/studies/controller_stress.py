"""
Does KLPPO's KL controller hold the KL under stress? KLPPO at a multiple of rl-zoo's learning rate (x10 by default),
with PPO's clip (the drop-in, ``klppo``) and with KLPPO's own default ``clip_range=None`` (``klppo_noclip``), under
variants of the KL options: the share of updates whose exact KL (``KLMonitorCallback``) lies in [0.5, 2] x target,
how the others miss it (over or under, in the first updates or later, beta at a bound), the evaluation return and
collapses (``measures.count_collapses``).

Same settings, budgets, seeds and evaluation as ``learning.py``'s full tier; one JSON record per run under
``benchmarks/results/controller_stress_runs/`` (written as each run finishes, naming the commit that made it);
``--report`` writes ``benchmarks/results/controller_stress.md`` from the records.

    nice -n 5 python benchmarks/studies/controller_stress.py --variants defaults --envs Pendulum-v1 --lr-mults 10
    python benchmarks/studies/controller_stress.py --report
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

from grid import BAND, BUDGETS, N_EVAL_EPISODES  # noqa: E402
from grid_runs import default_target_kl, scale_learning_rate  # noqa: E402
from measures import area_under_curve, count_collapses  # noqa: E402
from run_records import code_version, run_environment  # noqa: E402
from significance import verdict  # noqa: E402

RESULTS = HERE / "results"
RUNS = RESULTS / "controller_stress_runs"
ALGOS = ("klppo", "klppo_noclip")
# the last commit with the previous KL defaults (kl_band=(0.5, 1.5), kl_hinge_coef=0): the "before" of each cell
BEFORE = "cb2e099"
# KL options of each variant (on top of the rl-zoo settings); "defaults" is KLPPO as shipped by the commit that ran
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "band_0.8_1.25": dict(kl_band=(0.8, 1.25)),
    "hinge": dict(kl_hinge_coef=1000.0),
    "stop_2": dict(kl_stop_factor=2.0),
    "band_0.8_1.25+hinge": dict(kl_band=(0.8, 1.25), kl_hinge_coef=1000.0),
}


def record_path(variant: str, algo: str, env_id: str, lr_mult: float, seed: int, version: str, tier: str = "full") -> Path:
    # only the full tier is reported; the others (for trying the script) write outside the repository
    folder = RUNS if tier == "full" else Path(os.environ.get("SB3_LOGDIR", "/tmp")) / f"controller_stress_runs_{tier}"
    return folder / f"{variant}__{algo}__{env_id}__lr{lr_mult:g}__s{seed}__{version}.json"


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train, evaluate and write the record of one run (in a worker process)."""
    import torch as th

    th.set_num_threads(1)
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_kl import KLPPO
    from sb3_kl.callbacks import KLMonitorCallback
    from settings import settings_for

    variant, algo, env_id, seed, lr_mult = spec["variant"], spec["algo"], spec["env"], spec["seed"], spec["lr_mult"]
    tier = spec.get("tier", "full")
    setting = settings_for(algo, env_id)
    kwargs = {**setting["kwargs"], **VARIANTS[variant]}
    scale_learning_rate(kwargs, lr_mult)
    budget = BUDGETS[tier][env_id]
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    if setting["normalize"]:
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))

    curve: list[tuple[int, float]] = []
    early_stops: list[float] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            # the train/ values of the previous update are still in the logger here
            if "train/early_stop_epoch" in self.model.logger.name_to_value:
                early_stops.append(float(self.model.logger.name_to_value["train/early_stop_epoch"]))

        def _on_rollout_end(self) -> None:
            if len(self.model.ep_info_buffer) > 0:
                curve.append((self.num_timesteps, float(np.mean([info["r"] for info in self.model.ep_info_buffer]))))

    monitor = KLMonitorCallback()
    model = KLPPO("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    start = time.perf_counter()
    model.learn(budget, callback=CallbackList([Curve(), monitor]))
    train_seconds = time.perf_counter() - start
    if "train/early_stop_epoch" in model.logger.name_to_value:
        early_stops.append(float(model.logger.name_to_value["train/early_stop_epoch"]))

    eval_env = make_vec_env(env_id, n_envs=1, seed=10_000 + seed)
    if setting["normalize"]:
        assert isinstance(env, VecNormalize)
        eval_env = VecNormalize(eval_env, training=False, norm_reward=False)
        eval_env.obs_rms = env.obs_rms
    returns, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=N_EVAL_EPISODES[tier], deterministic=True, return_episode_rewards=True
    )
    # the commit checked out when the batch started (the workers import the code then)
    version = spec.get("code_version") or code_version()
    record = dict(
        variant=variant,
        options={k: list(v) if isinstance(v, tuple) else v for k, v in VARIANTS[variant].items()},
        algo=algo,
        env=env_id,
        seed=seed,
        lr_mult=lr_mult,
        tier=tier,
        budget=budget,
        target_kl=default_target_kl(algo, env_id, kwargs),
        eval_returns=[float(r) for r in returns],
        eval_mean=float(np.mean(returns)),
        curve=curve,
        kl=[float(entry["mean"]) for entry in monitor.history],
        kl_p99=[float(entry["p99"]) for entry in monitor.history],
        kl_coef=[float(c) for c in model.kl_controller.kl_coef_history],
        kl_coef_bounds=list(model.kl_controller.kl_coef_bounds),
        early_stop_epoch=early_stops,
        n_epochs=model.n_epochs,
        train_seconds=train_seconds,
        code_version=version,
        run_environment=run_environment(),
    )
    path = record_path(variant, algo, env_id, lr_mult, seed, version, tier)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


# ----------------------------------------------------------------------------------------------------------------------


def misses(record: dict[str, Any], first: int = 2) -> dict[str, float]:
    """Shares of the run's updates in band, over and under it, misses in the first updates, beta at its bounds."""
    kl = np.array(record["kl"]) / record["target_kl"]
    # the learning grid's records (see grid_records) do not keep beta: its counts are then nan
    coef = np.array(record.get("kl_coef", [np.nan] * len(kl)))
    low, high = record.get("kl_coef_bounds", (np.nan, np.nan))
    # beta that drove each update: the initial one for the first, then the one left by the previous update
    driving = np.concatenate([[coef[0] if len(coef) else np.nan], coef[:-1]])[: len(kl)]
    out = ~((kl >= BAND[0]) & (kl <= BAND[1]))
    known = 1.0 if "kl_coef" in record else float("nan")
    return dict(
        n=len(kl),
        in_band=float(np.mean(~out)),
        over=float(np.mean(kl > BAND[1])),
        under=float(np.mean(kl < BAND[0])),
        first_misses=float(np.sum(out[:first])),
        under_at_floor=known * float(np.sum((kl < BAND[0]) & (driving <= low * 1.0001))),
        over_at_floor=known * float(np.sum((kl > BAND[1]) & (driving <= low * 1.0001))),
        over_at_ceiling=known * float(np.sum((kl > BAND[1]) & (driving >= high * 0.9999))),
        max_kl=float(np.max(kl)) if len(kl) else float("nan"),
    )


def load_records() -> list[dict[str, Any]]:
    """Every record; for a (variant, algo, env, lr, seed) made by several commits, the newest file wins."""
    records = {}
    for path in sorted(RUNS.glob("*.json"), key=lambda p: p.stat().st_mtime):
        record = json.loads(path.read_text())
        records[
            (record["variant"], record["code_version"], record["algo"], record["env"], record["lr_mult"], record["seed"])
        ] = record
    return list(records.values())


def grid_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    The learning grid's committed records (``learning.py``, full tier) of the (algorithm, environment, learning rate)
    cells measured here, as records of a variant named ``learning grid``: the state before this benchmark existed.
    """
    from run_records import load_records as load_grid_records

    cells = {(r["algo"], r["env"], r["lr_mult"]) for r in records}
    out = []
    for record in load_grid_records("full"):
        if (record["algo"], record["env"], record["lr_mult"]) in cells:
            kl = [u["mean"] for u in record["kl_updates"]]
            out.append(
                {
                    **record,
                    "variant": "learning grid",
                    "options": {},
                    "kl": kl,
                    "code_version": record.get("code_version", "unrecorded"),
                }
            )
    return out


def pooled_by_variant(records: list[dict[str, Any]]) -> list[tuple[tuple, list[dict[str, Any]]]]:
    """The records grouped by cell and variant (all commits together), in the report's order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["env"], record["lr_mult"], record["algo"], record["variant"]), []).append(record)
    order = list(VARIANTS)
    return [
        (key, groups[key])
        for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], order.index(k[3]) if k[3] in order else 99))
    ]


def plot_band_shares(records: list[dict[str, Any]], path: Path) -> None:
    """
    Draw, per cell and variant (commits pooled), the shares of updates under, in and over the band, to a PNG.

    :param records: The runs' records, with the learning grid's as the variant ``learning grid``
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = pooled_by_variant(records)[::-1]  # the first on top
    fig, ax = plt.subplots(figsize=(7.5, 1.0 + 0.35 * len(groups)))
    left = np.zeros(len(groups))
    for name, color in (("under", "tab:blue"), ("in_band", "tab:green"), ("over", "tab:red")):
        shares = []
        for _, runs in groups:
            stats = [misses(r) for r in runs]
            shares.append(100 * sum(st[name] * st["n"] for st in stats) / sum(st["n"] for st in stats))
        ax.barh(range(len(groups)), shares, left=left, color=color, label=name.replace("_", " "))
        left += np.array(shares)
    labels = [f"{env} x{lr:g}, {algo}: {variant}" for (env, lr, algo, variant), _ in groups]
    ax.set_yticks(range(len(groups)), labels, fontsize=7)
    ax.set_xlim(0, 100)
    ax.set_xlabel(f"updates (%), KL / target under, in or over the band [{BAND[0]}, {BAND[1]}]")
    ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def summary_table(records: list[dict[str, Any]]) -> list[str]:
    """:return: the page's opening table: per cell and variant (commits pooled), the band shares and the return"""
    lines = [
        "| env | lr | algo | variant | seeds | in band | over | eval return |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (env_id, lr_mult, algo, variant), runs in pooled_by_variant(records):
        stats = [misses(r) for r in runs]
        n = sum(st["n"] for st in stats)
        evals = [r["eval_mean"] for r in runs]
        lines.append(
            f"| {env_id} | x{lr_mult:g} | {algo} | {variant} | {len(runs)} "
            f"| {100 * sum(st['in_band'] * st['n'] for st in stats) / n:.0f}% "
            f"| {100 * sum(st['over'] * st['n'] for st in stats) / n:.0f}% | {np.mean(evals):.1f} ± {np.std(evals):.1f} |"
        )
    return lines


def report() -> str:
    records = load_records()
    records += grid_records(records)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        key = (record["env"], record["lr_mult"], record["algo"], record["variant"], record["code_version"])
        groups.setdefault(key, []).append(record)
    plot_band_shares(records, RESULTS / "controller_stress.png")
    lines = [
        "# KLPPO's KL controller under stress",
        "",
        "![shares of updates under, in and over the band](controller_stress.png)",
        "",
        *summary_table(records),
        "",
        "All commits of a variant together; per commit, and the other measures, in the table below.",
        "",
        "Generated by `python benchmarks/studies/controller_stress.py --report` from the JSON records in "
        "`benchmarks/results/controller_stress_runs/` (one per run, each naming the sb3-kl commit that made it). "
        "rl-zoo settings and budgets of `learning.py`'s full tier with the learning rate multiplied by *lr*; "
        "`klppo` = PPO's zoo entry unchanged (it clips), `klppo_noclip` = KLPPO's default `clip_range=None`. "
        f"KL: exact per-update KL(old||new) of `KLMonitorCallback`; band [{BAND[0]}, {BAND[1]}] x target; shares pooled "
        "over the seeds' updates. *first*: misses among the first 2 updates of each seed; *under/over at floor*: misses "
        "with beta at its lower bound during the update; *max*: largest per-update KL / target. Return: "
        f"{N_EVAL_EPISODES['full']} deterministic evaluation episodes, mean ± std over seeds. Variant *learning grid*: "
        "the learning grid's committed records of the same cells (`benchmarks/results/runs/full/`; they keep no beta, "
        "so its counts are nan). The KL options' defaults up to commit `cb2e099`: `kl_band=(0.5, 1.5)`, "
        "`kl_hinge_coef=0`; from `21c1b9d` on: `kl_band=(0.8, 1.25)`, `kl_hinge_coef=1000` (the variant "
        "`band_0.8_1.25+hinge`). *return - before*: difference of the seed means from the row `defaults` at "
        f"`{BEFORE}` of the same cell, with the two-sided Welch p-value (p ≥ 0.05: inside the seed noise).",
        "",
        "| env | lr | algo | variant (KL options) | commit | seeds | in band | over | under | first | under at floor "
        "| over at floor | max | eval return | return - before (Welch p) | AUC | collapses |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2], list(VARIANTS).index(k[3]) if k[3] in VARIANTS else 99, k[4])):
        env_id, lr_mult, algo, variant, version = key
        runs = sorted(groups[key], key=lambda r: r["seed"])
        stats = [misses(r) for r in runs]
        n = sum(s["n"] for s in stats)

        def pooled(name: str, stats: list[dict[str, float]] = stats, n: int = n) -> str:
            return f"{100 * sum(s[name] * s['n'] for s in stats) / n:.0f}%"

        evals = [r["eval_mean"] for r in runs]
        before = [r["eval_mean"] for r in groups.get((env_id, lr_mult, algo, "defaults", BEFORE), [])]
        change = verdict(evals, before)[0] if before and key[3:] != ("defaults", BEFORE) else ""
        aucs = [area_under_curve(r["curve"], r["budget"]) for r in runs]
        options = ", ".join(f"{k}={v}" for k, v in runs[0]["options"].items()) or "defaults of that commit"
        lines.append(
            f"| {env_id} | x{lr_mult:g} | {algo} | {variant} ({options}) | `{version}` | "
            f"{','.join(str(r['seed']) for r in runs)} | {pooled('in_band')} | {pooled('over')} | {pooled('under')} | "
            f"{sum(s['first_misses'] for s in stats):.0f} | {sum(s['under_at_floor'] for s in stats):.0f} | "
            f"{sum(s['over_at_floor'] for s in stats):.0f} | {max(s['max_kl'] for s in stats):.1f} | "
            f"{np.mean(evals):.1f} ± {np.std(evals):.1f} | {change} | {np.mean(aucs):.1f} | "
            f"{sum(count_collapses(r['curve']) for r in runs)} |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / "controller_stress.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["defaults"])
    parser.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    parser.add_argument("--envs", nargs="+", default=["Pendulum-v1"])
    parser.add_argument("--lr-mults", nargs="+", type=float, default=[10.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--tier", choices=list(BUDGETS), default="full", help="budgets; only the full tier is reported")
    parser.add_argument("--report", action="store_true", help="only write the report from the records")
    args = parser.parse_args(argv)
    if not args.report:
        version = code_version()
        specs = [
            dict(variant=v, algo=a, env=e, lr_mult=m, seed=s, tier=args.tier, code_version=version)
            for v in args.variants
            for e in args.envs
            for m in args.lr_mults
            for a in args.algos
            for s in args.seeds
            if not record_path(v, a, e, m, s, version, args.tier).exists()
        ]
        print(f"{len(specs)} runs to do", flush=True)
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.workers) as pool:
            for record in pool.imap_unordered(run_one, specs):
                stats = misses(record)
                print(
                    f"done {record['variant']} {record['algo']} {record['env']} x{record['lr_mult']:g} s{record['seed']}: "
                    f"in band {100 * stats['in_band']:.0f}%, eval {record['eval_mean']:.1f}",
                    flush=True,
                )
    print(report())


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
