"""
Returns and KL stability of RecurrentKLPPO beside sb3-contrib's RecurrentPPO on the velocity-masked tasks the
rl-zoo tunes ``ppo_lstm`` for (CartPoleNoVel-v1, PendulumNoVel-v1, and PendulumNoVel-v1 at 10x the zoo's learning
rate), on the same seeds, with the zoo's ``ppo_lstm`` hyperparameters (read from the installed rl_zoo3) and the zoo's
budget (``--budget zoo``, 1e5 steps; ``--budget reduced``: the shorter runs of an earlier session). RecurrentKLPPO
takes them without ``clip_range`` (the KL penalty alone controls the step, as KLPPO in ``learning.py``);
``recurrent_klppo_clip`` keeps the zoo's ``clip_range``, as the shipped ``klppo_lstm`` config for CartPoleNoVel-v1 does;
``recurrent_klppo_target_0.1`` is the shipped config for PendulumNoVel-v1 (no clip, ``target_kl=0.1``).

The exact KL of every update is measured on both algorithms by ``KLMonitorCallback`` (each policy's LSTM re-run over
each env's rollout). Each finished run appends its JSON record to ``benchmarks/results/recurrent_runs/<budget>/``
(``run_records``' layout);
the tables (``benchmarks/results/recurrent_learning.md``) and figures (``recurrent_learning.png`` for the zoo budget,
``recurrent_learning_reduced.png``) are regenerated from the records by ``--report``. Summaries (AUC, collapses, band
share) are ``learning.py``'s.

    python benchmarks/recurrent_learning.py --workers 2                                  # the grid, then the report
    python benchmarks/recurrent_learning.py --algos recurrent_klppo_clip --envs CartPoleNoVel-v1   # the shipped config
    python benchmarks/recurrent_learning.py --report                                     # only the report
"""

import argparse
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402
from aggregate import probability_of_improvement, probability_of_improvement_ci  # noqa: E402
from grid import BAND  # noqa: E402
from grid_runs import default_target_kl, describe, scale_learning_rate  # noqa: E402
from measures import summarize  # noqa: E402
from significance import fmt, verdict  # noqa: E402

RESULTS = HERE / "results"
RUNS = RESULTS / "recurrent_runs"
ENVS = ["CartPoleNoVel-v1", "PendulumNoVel-v1"]
ALGOS = ["recurrent_ppo", "recurrent_klppo"]
#: Run only when named with ``--algos``: RecurrentKLPPO with the zoo's ``clip_range`` kept (KL penalty and ratio clip)
#: and RecurrentKLPPO without clip_range whose KL target decays linearly to 0 as the zoo's learning rate and clip range do
#: and RecurrentKLPPO without clip_range at a KL target of 0.1 (PendulumNoVel: RecurrentPPO's updates take ~0.4 each,
#: the default target 0.03; the zoo's 24 updates of 4 x 1024 steps leave little room for small steps)
VARIANTS = ["recurrent_klppo_clip", "recurrent_klppo_lin_target", "recurrent_klppo_target_0.1"]
#: The KL target of the fixed-target variants (the others take the default, or a schedule from it)
VARIANT_TARGETS = {"recurrent_klppo_target_0.1": 0.1}
# (env, learning-rate multiplier) cells of the grid
CELLS = [("CartPoleNoVel-v1", 1.0), ("PendulumNoVel-v1", 1.0), ("PendulumNoVel-v1", 10.0)]
SEEDS = [0, 1, 2]
#: Environment steps per run, per budget tier. ``zoo``: the zoo's ``n_timesteps`` (1e5 for both tasks). ``reduced``: an
#: earlier session's shorter runs (LSTM training on a shared 2-core machine runs at roughly 150-250 env-steps per
#: CPU-second): CartPoleNoVel 96 updates of 8 x 32 steps, PendulumNoVel 4 updates of 4 x 1024 steps.
BUDGETS = {
    "zoo": {"CartPoleNoVel-v1": 100_000, "PendulumNoVel-v1": 100_000},
    "reduced": {"CartPoleNoVel-v1": 24_576, "PendulumNoVel-v1": 16_384},
}
N_EVAL_EPISODES = 10
#: Zoo keys that are not constructor arguments
ZOO_ONLY = ("n_envs", "n_timesteps", "policy", "normalize", "env_wrapper", "frame_stack", "callback")


def zoo_settings(env_id: str) -> dict[str, Any]:
    """The zoo's ``ppo_lstm`` entry for ``env_id`` (from the installed rl_zoo3), with its schedules parsed."""
    import rl_zoo3
    import yaml
    from stable_baselines3.common.utils import LinearSchedule
    from torch import nn  # noqa: F401  (the zoo's policy_kwargs strings name nn.ReLU)

    path = Path(rl_zoo3.__file__).parent / "hyperparams" / "ppo_lstm.yml"
    entry = dict(yaml.safe_load(path.read_text())[env_id])
    for key, value in list(entry.items()):
        if isinstance(value, str) and value.startswith("lin_"):
            entry[key] = LinearSchedule(float(value[4:]), 0.0, 1.0)
    if isinstance(entry.get("policy_kwargs"), str):
        entry["policy_kwargs"] = eval(entry["policy_kwargs"])
    return entry


def has_record(budget: str, algo: str, env_id: str, lr_mult: float, seed: int) -> bool:
    """Whether the run has a record in the records folder of its budget tier (``run_records``' layout)."""
    return run_records.find_record(RUNS / budget, run_records.record_name(algo, env_id, lr_mult, seed)) is not None


def code_version() -> str:
    """The commit that ran, ``+modified`` when the package or this script had uncommitted changes."""
    return run_records.code_version("recurrent_learning.py", "learning.py")


def kl_options(model: Any) -> dict[str, Any] | None:
    """The KL options a RecurrentKLPPO run used (its defaults included); None for RecurrentPPO."""
    controller = getattr(model, "kl_controller", None)
    if controller is None:
        return None
    clip_range = model.clip_range
    return dict(
        kl_band=list(getattr(controller, "kl_band", ())) or None,
        kl_hinge_coef=model.kl_hinge_coef,
        kl_hinge_factor=model.kl_hinge_factor,
        kl_stop_factor=model.kl_stop_factor,
        clip_range=None if clip_range is None else float(clip_range(1.0)),
    )


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train, evaluate and write the record of one run (in a worker process)."""
    import rl_zoo3.import_envs  # noqa: F401  (registers the NoVel tasks)
    import torch as th
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.utils import LinearSchedule
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_kl import RecurrentKLPPO
    from sb3_kl.callbacks import KLMonitorCallback

    th.set_num_threads(1)
    version = code_version()  # the commit the run starts from
    algo, env_id, seed, lr_mult, budget_tier = spec["algo"], spec["env"], spec["seed"], spec["lr_mult"], spec["budget"]
    budget = BUDGETS[budget_tier][env_id]
    entry = zoo_settings(env_id)
    kwargs = {key: value for key, value in entry.items() if key not in ZOO_ONLY}
    if algo in ("recurrent_klppo", "recurrent_klppo_lin_target", *VARIANT_TARGETS):
        kwargs.pop("clip_range", None)
    if algo == "recurrent_klppo_lin_target":
        kwargs["target_kl"] = LinearSchedule(default_target_kl("klppo", env_id, {}), 0.0, 1.0)
    if algo in VARIANT_TARGETS:
        kwargs["target_kl"] = VARIANT_TARGETS[algo]
    if lr_mult != 1.0:
        scale_learning_rate(kwargs, lr_mult)
    env = make_vec_env(env_id, n_envs=entry["n_envs"], seed=seed)
    if entry.get("normalize"):
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            if len(self.model.ep_info_buffer) > 0:
                curve.append((self.num_timesteps, float(np.mean([info["r"] for info in self.model.ep_info_buffer]))))

    monitor = KLMonitorCallback()
    algorithm = RecurrentPPO if algo == "recurrent_ppo" else RecurrentKLPPO
    model = algorithm(entry["policy"], env, seed=seed, device="cpu", **kwargs)
    start, cpu_start = time.perf_counter(), time.process_time()
    model.learn(budget, callback=[Curve(), monitor])
    train_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start

    eval_env = make_vec_env(env_id, n_envs=1, seed=10_000 + seed)
    if isinstance(env, VecNormalize):
        eval_env = VecNormalize(eval_env, training=False, norm_reward=False)
        eval_env.obs_rms = env.obs_rms
    returns, _ = evaluate_policy(
        model, eval_env, n_eval_episodes=N_EVAL_EPISODES, deterministic=True, return_episode_rewards=True
    )
    record = dict(
        algo=algo,
        env=env_id,
        seed=seed,
        lr_mult=lr_mult,
        budget=budget,
        budget_tier=budget_tier,
        zoo_budget=int(entry["n_timesteps"]),
        n_envs=entry["n_envs"],
        normalize=bool(entry.get("normalize")),
        hyperparameters=describe(kwargs),
        target_kl=VARIANT_TARGETS.get(algo) or default_target_kl("klppo", env_id, {}),
        eval_returns=[float(r) for r in returns],
        eval_mean=float(np.mean(returns)),
        curve=curve,
        kl_updates=[
            dict(timesteps=int(h["num_timesteps"]), mean=float(h["mean"]), p99=float(h["p99"])) for h in monitor.history
        ],
        kl_source="sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed; LSTMs re-run over each env's rollout)",
        kl_options=kl_options(model),
        train_seconds=train_seconds,
        cpu_seconds=cpu_seconds,
        env_steps_per_second=budget / train_seconds,
        torch_threads=1,
        code_version=version,
        run_environment=run_records.run_environment(),
    )
    run_records.append_record(RUNS / budget_tier, record)
    print(f"{algo} {env_id} lr x{lr_mult:g} seed {seed}: eval {record['eval_mean']:.1f} ({cpu_seconds:.0f} CPU-s)", flush=True)
    return record


def load_records(budget: str) -> list[dict[str, Any]]:
    return run_records.read_folder(RUNS / budget)


def figure_name(budget: str) -> str:
    return "recurrent_learning.png" if budget == "zoo" else f"recurrent_learning_{budget}.png"


def report() -> str:
    """Write ``recurrent_learning.md`` and one figure per budget tier from the records; return the markdown."""
    lines = [
        "# RecurrentKLPPO vs RecurrentPPO on velocity-masked tasks",
        "",
        "Generated by `python benchmarks/recurrent_learning.py --report` from the records in "
        "`benchmarks/results/recurrent_runs/<budget>/`. `recurrent_klppo_clip` on CartPoleNoVel-v1 is the shipped "
        "`klppo_lstm` config (the zoo's `clip_range` kept); on PendulumNoVel-v1 the shipped config is "
        "`recurrent_klppo_target_0.1` (`recurrent_klppo` at the default target was the shipped config before).",
        "",
    ]
    for budget in BUDGETS:
        lines += report_tier(budget)
    text = "\n".join(lines)
    (RESULTS / "recurrent_learning.md").write_text(text)
    return text


def report_tier(budget_tier: str) -> list[str]:
    """The section of one budget tier (and its figure); no lines when it has no records."""
    records = load_records(budget_tier)
    if not records:
        return []
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["env"], record["lr_mult"], record["algo"]), []).append(record)
    versions = sorted({r["code_version"] for r in records})
    options: dict[str, set[str]] = {}
    for r in records:
        if r.get("kl_options"):
            hyperparameters = r["hyperparameters"]
            recorded = {**r["kl_options"], "target_kl": hyperparameters.get("target_kl", "default")}
            # a schedule as the run was given it (kl_options holds its value at the start)
            recorded["clip_range"] = hyperparameters.get("clip_range", recorded["clip_range"])
            options.setdefault(r["algo"], set()).add(", ".join(f"`{key}={value}`" for key, value in recorded.items()))
    options_text = (
        "; ".join(f"{algo}: {' / '.join(sorted(values))}" for algo, values in sorted(options.items()))
        or "not recorded (records made before the options were recorded)"
    )
    seeds = sorted({r["seed"] for r in records})
    cpu = sum(r.get("cpu_seconds", 0.0) for r in records) / 60
    budgets = ", ".join(f"{env_id} {budget:,}" for env_id, budget in BUDGETS[budget_tier].items())
    budget_text = (
        f"**the zoo's budget, {budgets} environment steps per run**"
        if budget_tier == "zoo"
        else f"**{budgets} environment steps per run instead of the zoo's 1e5** (an earlier session's shorter runs)"
    )
    lines = [
        f"## {'Zoo budget' if budget_tier == 'zoo' else 'Reduced budget'} (`--budget {budget_tier}`)",
        "",
        f"Records in `benchmarks/results/recurrent_runs/{budget_tier}/` (code versions: {', '.join(versions)}).",
        "",
        "Settings: rl-zoo's `ppo_lstm` hyperparameters for each task (RecurrentKLPPO without `clip_range`, "
        "`recurrent_klppo_clip` with the zoo's `clip_range` as well, `recurrent_klppo_lin_target` without it and with "
        "a KL target decaying linearly to 0 (its band share is scored against the initial target), "
        "`recurrent_klppo_target_0.1` without it at a KL target of 0.1 (its band share scored against 0.1), the others "
        f"at the default KL target; the KL options as the runs recorded them: {options_text}), seeds {seeds}, "
        f"{budget_text} (one torch thread; the runs took {cpu:.0f} CPU-minutes). The exact KL of every update is "
        "measured on both algorithms by `KLMonitorCallback` (forward KL(old||new), summed over action dimensions; "
        "each policy's LSTM re-run over each env's rollout). KL in band: share of updates with a KL in "
        f"[{BAND[0]}, {BAND[1]}] x target (0.02 CartPoleNoVel, 0.03 PendulumNoVel; `learning.py`'s scoring band, not "
        "the controller's `kl_band`). Return: "
        f"deterministic evaluation after training, {N_EVAL_EPISODES} episodes; AUC: mean training return over the "
        "run; collapses as `learning.py` counts them. "
        "Mean ± std over seeds; the comparison below the table marks the differences inside the seed noise.",
        "",
        "| task | lr | algorithm | seeds | eval return | AUC | collapses | KL mean | KL p99 | KL in band | env-steps/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for env_id, lr_mult in CELLS:
        for algo in ALGOS + VARIANTS:
            group = groups.get((env_id, lr_mult, algo), [])
            if not group:
                continue
            summaries = [summarize(r) for r in group]
            lines.append(
                f"| {env_id} | x{lr_mult:g} | {algo} | {len(group)} | {fmt([s['eval_mean'] for s in summaries])} | "
                f"{fmt([s['auc'] for s in summaries])} | {sum(s['collapses'] for s in summaries)} | "
                f"{fmt([s['kl_mean'] for s in summaries])} | {fmt([s['kl_p99'] for s in summaries])} | "
                f"{fmt([s['in_band'] for s in summaries], 0, percent=True)} | "
                f"{fmt([s['steps_per_s'] for s in summaries], 0)} |"
            )
    # the figure and the comparison with RecurrentPPO first, then the method and every cell's numbers
    opening = [*lines[:2], f"![returns and KL per update]({figure_name(budget_tier)})", "", *baseline_comparison(groups)]
    plot(groups, figure_name(budget_tier))
    return [*opening, "", *lines[2:], ""]


def baseline_comparison(groups: dict[tuple[str, float, str], list[dict[str, Any]]]) -> list[str]:
    """
    Each RecurrentKLPPO variant against RecurrentPPO in its cell, on the seeds both have: the differences of the
    evaluation return, the AUC and the share of updates in the KL band, each with its Welch p-value (a tie when
    p >= 0.05: inside the seed noise).
    """
    rows = []
    for env_id, lr_mult in CELLS:
        stock = {r["seed"]: summarize(r) for r in groups.get((env_id, lr_mult, "recurrent_ppo"), [])}
        for algo in ALGOS[1:] + VARIANTS:
            ours = {r["seed"]: summarize(r) for r in groups.get((env_id, lr_mult, algo), [])}
            seeds = sorted(set(ours) & set(stock))
            if len(seeds) < 2:
                continue
            cells = []
            for key, scale in (("eval_mean", 1.0), ("auc", 1.0), ("in_band", 100.0)):  # band share in points
                text, outcome = verdict([scale * ours[s][key] for s in seeds], [scale * stock[s][key] for s in seeds])
                cells.append(f"{text}: {outcome}")
            # the probability of improvement of the evaluation return (Agarwal et al., 2021), with its bootstrap interval
            a, b = [[ours[s]["eval_mean"] for s in seeds]], [[stock[s]["eval_mean"] for s in seeds]]
            low, high = probability_of_improvement_ci(a, b)
            cells.append(f"{probability_of_improvement(a, b):.2f} [{low:.2f}, {high:.2f}]")
            rows.append(f"| {env_id} | x{lr_mult:g} | {algo} | {len(seeds)} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "Against RecurrentPPO, on the seeds both have (difference of the means, RecurrentKLPPO - RecurrentPPO, with its "
        "two-sided Welch p-value; a tie when p >= 0.05, a difference inside the seed noise; P(better): the probability"
        " that a run of RecurrentKLPPO ends with a higher evaluation return than one of RecurrentPPO, with its 95 %"
        " bootstrap interval, `aggregate.py`):",
        "",
        "| task | lr | algorithm | seeds | eval return | AUC | KL in band (points) | P(better), eval return |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def plot(groups: dict[tuple[str, float, str], list[dict[str, Any]]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(CELLS), figsize=(5 * len(CELLS), 7), squeeze=False)
    colors = {
        "recurrent_ppo": "tab:gray",
        "recurrent_klppo": "tab:blue",
        "recurrent_klppo_clip": "tab:orange",
        "recurrent_klppo_lin_target": "tab:green",
        "recurrent_klppo_target_0.1": "tab:purple",
    }
    for col, (env_id, lr_mult) in enumerate(CELLS):
        for algo in ALGOS + VARIANTS:
            for i, record in enumerate(groups.get((env_id, lr_mult, algo), [])):
                label = algo if i == 0 else None
                if record["curve"]:
                    t, r = np.array(record["curve"]).T
                    axes[0, col].plot(t, r, color=colors[algo], alpha=0.7, label=label)
                if record["kl_updates"]:
                    t = [u["timesteps"] for u in record["kl_updates"]]
                    axes[1, col].plot(t, [u["mean"] for u in record["kl_updates"]], color=colors[algo], alpha=0.7, label=label)
        target = 0.02 if env_id.startswith("CartPole") else 0.03
        axes[1, col].axhspan(BAND[0] * target, BAND[1] * target, color="tab:green", alpha=0.15, label="band")
        axes[1, col].set_yscale("log")
        axes[0, col].set_title(f"{env_id}, lr x{lr_mult:g}")
        axes[0, col].set_ylabel("mean training episode return")
        axes[1, col].set_ylabel("exact KL per update (mean over states)")
        axes[1, col].set_xlabel("environment steps")
        axes[0, col].legend(fontsize=8)
        axes[1, col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / name, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only regenerate the table and figure")
    parser.add_argument("--force", action="store_true", help="re-run runs that have a record")
    parser.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS + VARIANTS)
    parser.add_argument("--envs", nargs="+", default=None, help="only the cells of these tasks")
    parser.add_argument("--lr-mults", nargs="+", type=float, default=None, help="only the cells of these multipliers")
    parser.add_argument("--budget", choices=list(BUDGETS), default="zoo", help="environment steps per run (BUDGETS)")
    parser.add_argument("--seeds", nargs="+", type=int, default=SEEDS, help="the seeds to run (default: 0 1 2)")
    args = parser.parse_args(argv)
    if not args.report:
        # cell by cell (CELLS' order), each seed's comparison (both algorithms) completed before the next seed
        specs = [
            dict(algo=algo, env=env_id, lr_mult=lr_mult, seed=seed, budget=args.budget)
            for env_id, lr_mult in CELLS
            for seed in args.seeds
            for algo in args.algos
            if (args.envs is None or env_id in args.envs)
            and (args.lr_mults is None or lr_mult in args.lr_mults)
            and (args.force or not has_record(args.budget, algo, env_id, lr_mult, seed))
        ]
        with multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=1) as pool:
            for _ in pool.imap_unordered(run_one, specs):
                report()
    print(report())


if __name__ == "__main__":
    main()
