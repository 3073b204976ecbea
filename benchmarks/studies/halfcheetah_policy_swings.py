"""
How much the policy's return swings from one update to the next on HalfCheetah-v5 when every update takes the same KL,
and so how much the grid's single evaluation of the final policy depends on the update a run happens to end on.

The grid's HalfCheetah-v5 runs of ``klppo_auto`` (``learning_rate="auto"``) meet the target 0.03 in every update, yet
some end far under their training episodes' return (x10 seed 0: 125 against 1,847). Each run here trains with the grid's
code and settings (``grid_runs.train_and_evaluate``) and a probe that, every ``EVAL_EVERY`` rollouts, evaluates the
deterministic policy on ``EVAL_EPISODES`` episodes of an environment of its own (normalized with a copy of the training
statistics; no random draw of the training is touched, so the run is the grid's). Compared at the same target:
``klppo_auto`` (the rate adapted, no clip range), ``klppo_noclip`` (the fixed rate, no clip range: beta and the
hinge hold the KL) and ``klppo`` (the fixed rate with the zoo's ``clip_range=0.1``), at x10 of the zoo's rate, where
all three take about 0.03 per update; and two variants that tell the parts of ``"auto"`` apart: its step scale
without extension, and the fixed rate at the low rate that ``"auto"`` settles at (``VARIANTS``).

    python benchmarks/studies/halfcheetah_policy_swings.py            # the missing runs, then the page
    python benchmarks/studies/halfcheetah_policy_swings.py --report

Records: ``benchmarks/results/halfcheetah_policy_swings.json`` (one per run, written as each finishes, each naming its
commit and machine); page ``benchmarks/results/halfcheetah_policy_swings.md`` and its figure.
"""

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = run_records.MAIN_RESULTS
RECORDS = RESULTS / "halfcheetah_policy_swings.json"
PAGE = RESULTS / "halfcheetah_policy_swings.md"
FIGURE = RESULTS / "halfcheetah_policy_swings.png"
ENV_ID = "HalfCheetah-v5"
#: variant: (the grid's algorithm, overrides of its settings, the largest step scale of ``"auto"``, what it is)
VARIANTS: dict[str, tuple[str, dict[str, Any], float | None, str]] = {
    "klppo_auto": ("klppo_auto", {}, None, "the grid's: the rate adapted, no clip range"),
    "klppo_noclip": ("klppo_noclip", {}, None, "the grid's: the zoo's rate x10 fixed, no clip range (beta holds the KL)"),
    "klppo": ("klppo", {}, None, "the grid's: the zoo's rate x10 fixed, the zoo's `clip_range=0.1`"),
    "auto_no_extension": ("klppo_auto", {}, 1.0, "`klppo_auto` whose step scale only shrinks a step (at most 1)"),
    "noclip_auto_rate": (
        "klppo_noclip",
        {"learning_rate": 5e-6},
        None,
        "`klppo_noclip` at 5e-6 fixed, about the rate `klppo_auto` settles at (a quarter of the zoo's)",
    ),
    "first_epoch": ("klppo_auto", {}, None, "the candidate rule of `auto_rate_rule.md`: the rate sets the first epoch's KL"),
}
ALGOS = tuple(VARIANTS)
LR_MULT = 10.0
SEEDS = (0, 1)
#: Rollouts between two evaluations of the deterministic policy (512 steps each: every 5,120 steps)
EVAL_EVERY = 10
EVAL_EPISODES = 2
#: The evaluation environments' seed (apart from the grid's 10_000 + seed)
EVAL_SEED = 20_000
#: An evaluation under this share of the run's best one counts as a drop
DROP_SHARE = 0.5


@functools.cache
def code_version() -> str:
    return run_records.code_version("studies/halfcheetah_policy_swings.py", "settings.py", "grid_runs.py")


def run_key(record: dict[str, Any]) -> tuple[str, float, int]:
    return record["algo"], record["lr_mult"], record["seed"]


def read_records() -> list[dict[str, Any]]:
    return run_records.read_json_list(RECORDS)


def run_one(algo: str, lr_mult: float, seed: int) -> dict[str, Any]:
    """Train one run with the grid's code, evaluating the deterministic policy along the way; :return: its record."""
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    import grid_runs

    made_by = code_version()  # the checkout when the run starts (the worker imported its code then)
    evaluations: list[tuple[int, float]] = []
    episodes: list[tuple[int, float]] = []

    class Along(BaseCallback):
        def _on_step(self) -> bool:
            episodes.extend((self.num_timesteps, float(i["episode"]["r"])) for i in self.locals["infos"] if "episode" in i)
            return True

        def _on_rollout_start(self) -> None:  # after an update: the policy that acts next
            self.rollouts = getattr(self, "rollouts", -1) + 1
            if self.rollouts == 0 or self.rollouts % EVAL_EVERY:
                return
            env = grid_runs.evaluation_env(ENV_ID, EVAL_SEED + seed, self.training_env)
            returns, _ = evaluate_policy(self.model, env, n_eval_episodes=EVAL_EPISODES, deterministic=True)
            evaluations.append((self.num_timesteps, float(returns)))
            env.close()

    grid_algo, overrides, max_scale, _ = VARIANTS[algo]
    if max_scale is not None:  # the algorithm's module calls find_step_scale with the default largest scale
        import sb3_kl.common.on_policy_algorithm as algorithm_module

        algorithm_module.find_step_scale = functools.partial(algorithm_module.find_step_scale, max_scale=max_scale)
    candidate = None
    if algo == "first_epoch":
        sys.path.insert(0, str(HERE / "studies"))
        from auto_rate_rule import first_epoch_class

        candidate = first_epoch_class()
    spec = dict(algo=grid_algo, env=ENV_ID, seed=seed, lr_mult=lr_mult, tier="full", overrides=overrides)
    grid = grid_runs.train_and_evaluate(spec, probes=[Along()], algorithm=candidate)
    return dict(
        algo=algo,
        grid_algo=grid_algo,
        overrides=overrides,
        env=ENV_ID,
        lr_mult=lr_mult,
        seed=seed,
        hyperparameters=grid["hyperparameters"],
        target_kl=grid["target_kl"],
        eval_mean=grid["eval_mean"],
        kl_update_median=float(np.median([u["mean"] for u in grid["kl_updates"]])),
        evaluations=evaluations,
        episodes=episodes,
        code_version=made_by,
        run_environment=run_records.run_environment(),
    )


def swing_figures(record: dict[str, Any]) -> dict[str, float]:
    """The second half's evaluations of one run: median, drops under :data:`DROP_SHARE` of the run's best, and the
    median change from one evaluation to the next; the same change for the training episodes."""
    values = np.array([v for _, v in record["evaluations"]])
    half = values[len(values) // 2 :]
    trained = np.array([v for _, v in record["episodes"]])
    trained = trained[len(trained) // 2 :]
    return dict(
        median=float(np.median(half)),
        drops=float(np.mean(half < DROP_SHARE * values.max())),
        step=float(np.median(np.abs(np.diff(half)))),
        episode_step=float(np.median(np.abs(np.diff(trained)))),
    )


def plot(records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ALGOS), figsize=(3.4 * len(ALGOS), 3.2), sharey=True)
    for ax, algo in zip(axes, ALGOS, strict=True):
        for r in sorted((r for r in records if r["algo"] == algo), key=lambda r: r["seed"]):
            steps, values = zip(*r["evaluations"], strict=True) if r["evaluations"] else ((), ())
            ax.plot(np.array(steps) / 1000, values, marker=".", label=f"seed {r['seed']}")
            ax.axhline(r["eval_mean"], linestyle=":", color=ax.lines[-1].get_color())
        ax.set_title(algo, fontsize=9)
        ax.set_xlabel("steps (k)")
    axes[0].set_ylabel("deterministic return")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=90, metadata={"Software": None})
    plt.close(fig)


def report() -> str:
    """Write the page and its figure from the records; :return: the page."""
    records = sorted(read_records(), key=lambda r: (ALGOS.index(r["algo"]), r["seed"]))
    plot(records)
    lines = [
        "# HalfCheetah-v5: how far the return swings between updates at the same KL",
        "",
        f"![the deterministic policy's return every {EVAL_EVERY * 512:,} steps; dotted: the grid's final evaluation]"
        f"({FIGURE.name})",
        "",
        "| algo | seed | median KL per update | final evaluation | second half: median | drops | median change between "
        "evaluations | between training episodes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        f = swing_figures(r)
        lines.append(
            f"| `{r['algo']}` | {r['seed']} | {r['kl_update_median']:.4f} | {r['eval_mean']:.0f} | {f['median']:.0f} | "
            f"{f['drops']:.0%} | {f['step']:.0f} | {f['episode_step']:.0f} |"
        )
    lines += [
        "",
        f"Every {EVAL_EVERY} rollouts ({EVAL_EVERY * 512:,} steps) the deterministic policy is evaluated on "
        f"{EVAL_EPISODES} episodes (seed {EVAL_SEED} + seed, the training's observation statistics). Final "
        "evaluation: the grid's (10 episodes, seed 10,000 + seed). Second half: the evaluations of the run's second half; "
        f"drops: the share of them under {DROP_SHARE:.0%} of the run's best evaluation; median change: the median "
        "absolute difference between consecutive evaluations, and between consecutive training episodes (stochastic, "
        "1,000 steps each).",
        "",
        "## Variants",
        "",
        *[f"- `{name}`: {description}" for name, (_, _, _, description) in VARIANTS.items()],
        "",
        "## Setting",
        "",
        f"{ENV_ID}, the grid's settings (`benchmarks/grid_runs.py`), budget and target 0.03, x{LR_MULT:g} the zoo's "
        "learning rate (`klppo_auto` starts there), seeds "
        f"{', '.join(map(str, sorted({r['seed'] for r in records})))}: the grid's. The probe draws nothing from the "
        "training's random streams: `klppo_auto`'s final evaluations repeat its grid records, made on the same machine "
        "(the fixed-rate cells' grid records come from another machine, and differ).",
        "",
        run_records.provenance(records) if records else "",
        "",
        "Made by `python benchmarks/studies/halfcheetah_policy_swings.py` (records: `halfcheetah_policy_swings.json`).",
    ]
    page = "\n".join(lines) + "\n"
    PAGE.write_text(page)
    return page


def _run_and_save(cell: tuple[str, float, int]) -> str:
    record = run_one(*cell)
    run_records.replace_in_json_list(RECORDS, record, run_key)
    return f"done {cell[0]} x{cell[1]:g} seed {cell[2]}: final {record['eval_mean']:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if not args.report:
        done = {run_key(r) for r in read_records()}
        cells = [(a, LR_MULT, s) for s in args.seeds for a in args.algos if (a, LR_MULT, s) not in done]
        # one process per run: a variant patches the algorithm's module
        run_records.run_in_pool(_run_and_save, cells, args.workers, one_process_per_run=True)
    print(report())


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
