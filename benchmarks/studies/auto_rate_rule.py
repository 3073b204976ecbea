"""
The rule of ``learning_rate="auto"``: the rate sets the first epoch's KL, beta and the hinge hold the update's.

The earlier rule (``step_scale``, sb3-kl before commit cfddeeb) settled at the rate whose update alone meets
``target_kl``, and scaled each step onto it. On HalfCheetah-v5 that is about a quarter of the zoo's rate, and there the
return swings from one update to the next, as it does for KLPPO fixed at that low rate, while KLPPO at 10x the zoo's
rate (the penalty holding the same KL) climbs steadily (``halfcheetah_policy_swings.md``). The candidate
(``first_epoch``) kept the rate high enough for the penalty to shape the step: after the first epoch it measured the
exact KL over the rollout's states, and the next rate was this one times ``sqrt(0.25 * target / KL_first_epoch)``
(within 1/16..16; its square root within 2x), with no step scale. It left 25-50 % of LunarLanderContinuous-v3's updates
below the band, so the rule shipped (``auto``, ``sb3_kl/common/learning_rate.py``) adds a guard (a step whose KL ends
outside [0.5, 2] x target is scaled onto beta's band, beta adapting from the unscaled KL) and sets the rate from the
median of five rollouts' first-epoch KLs.

Variants, each from x0.1 and x10 of rl-zoo's rate (and x1), on seeds outside the grid's: ``auto`` (the grid's
``klppo_auto``: today's rule), ``step_scale`` and ``first_epoch`` (records of the code that defined them, commits
named on the page), ``fixed`` (the grid's ``klppo_noclip``: KLPPO at the fixed rate without the clip range, the KL held
by beta).

    python benchmarks/studies/auto_rate_rule.py --workers 2     # the missing runs, then the page
    python benchmarks/studies/auto_rate_rule.py --report

Records: ``benchmarks/results/auto_rate_rule.json`` (one per run, written as each finishes, each naming its commit and
machine); page ``benchmarks/results/auto_rate_rule.md``.
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
RECORDS = RESULTS / "auto_rate_rule.json"
PAGE = RESULTS / "auto_rate_rule.md"
FIGURE = RESULTS / "auto_rate_rule.png"
#: (task, learning-rate multiplier) cells, cheapest first
CELLS = (
    ("HalfCheetah-v5", 10.0),
    ("HalfCheetah-v5", 1.0),
    ("Pendulum-v1", 0.1),
    ("Pendulum-v1", 10.0),
    ("LunarLanderContinuous-v3", 1.0),
)
#: HalfCheetah-v5's ``step_scale`` and ``fixed`` runs on these seeds, made by the same code in another study: its variant
#: names
BORROWED = {"step_scale": "auto", "fixed": "fixed_noclip"}
BORROWED_FROM = RESULTS / "auto_learning_rate_halfcheetah.json"
SEEDS = (12, 13)
#: variant: the grid's algorithm it runs
VARIANTS = {"step_scale": "klppo_auto", "first_epoch": "klppo_auto", "auto": "klppo_auto", "fixed": "klppo_noclip"}
#: Variants of earlier code, kept as records (their code is in the commits the records name): not run again
EARLIER_RULES = ("step_scale", "first_epoch")
LOGGED = ("learning_rate", "kl", "kl_coef")


@functools.cache
def code_version() -> str:
    return run_records.code_version("studies/auto_rate_rule.py", "settings.py", "grid_runs.py")


def run_key(record: dict[str, Any]) -> tuple[str, str, float, int]:
    return record["variant"], record["env"], record["lr_mult"], record["seed"]


def read_records() -> list[dict[str, Any]]:
    return run_records.read_json_list(RECORDS)


def run_one(variant: str, env_id: str, lr_mult: float, seed: int) -> dict[str, Any]:
    """Train one run with the grid's code (``grid_runs.train_and_evaluate``); :return: its record."""
    import grid_runs
    from measures import summarize

    made_by = code_version()
    algo = VARIANTS[variant]
    updates: list[dict[str, float]] = []

    spec = dict(algo=algo, env=env_id, seed=seed, lr_mult=lr_mult, tier="full")
    grid = grid_runs.train_and_evaluate(
        spec,
        probes=[grid_runs.logged_updates_probe((*LOGGED, "first_epoch_kl"), updates)],
    )
    target = grid["target_kl"]
    return dict(
        variant=variant,
        env=env_id,
        lr_mult=lr_mult,
        seed=seed,
        hyperparameters=grid["hyperparameters"],
        target_kl=target,
        eval_returns=grid["eval_returns"],
        eval_mean=grid["eval_mean"],
        in_band=summarize(grid)["in_band"],
        updates=updates,
        train_seconds=grid["train_seconds"],
        code_version=made_by,
        run_environment=run_records.run_environment(),
    )


def report() -> str:
    """Write the page from the records; :return: the page."""
    records = read_records()
    borrowed = [
        {**r, "variant": name, "in_band": None, "borrowed": True}
        for r in run_records.read_json_list(BORROWED_FROM)
        for name, theirs in BORROWED.items()
        if r["variant"] == theirs and r["seed"] in SEEDS
    ]
    records = records + [r for r in borrowed if run_key(r) not in {run_key(own) for own in records}]
    runs: dict[tuple[str, str, float], dict[int, dict[str, Any]]] = {}
    for r in records:
        runs.setdefault((r["variant"], r["env"], r["lr_mult"]), {})[r["seed"]] = r
    seeds = sorted({r["seed"] for r in records})
    plot(runs)
    lines = [
        '# The rule of `learning_rate="auto"`: the rate sets the first epoch\'s KL',
        "",
        f"![evaluation return per seed and mean, per cell and variant]({FIGURE.name})",
        "",
        "| task | lr | variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | updates in band "
        "| median rate / zoo rate | median first-epoch KL / target |",
        "|---|---|---|" + "---|" * (len(seeds) + 4),
    ]
    for env_id, lr_mult in CELLS:
        for variant in VARIANTS:
            cell = runs.get((variant, env_id, lr_mult), {})
            if not cell:
                continue
            any_run = next(iter(cell.values()))
            zoo_rate = _zoo_rate(env_id)
            updates = [u for r in cell.values() for u in r["updates"]]
            rates = [u["learning_rate"] for u in updates if "learning_rate" in u]
            first = [u["first_epoch_kl"] / any_run["target_kl"] for u in updates if "first_epoch_kl" in u]
            lines.append(
                f"| {env_id} | x{lr_mult:g} | `{variant}` | "
                + " | ".join(f"{cell[s]['eval_mean']:.0f}" if s in cell else "—" for s in seeds)
                + f" | {np.mean([r['eval_mean'] for r in cell.values()]):.0f} | "
                f"{_in_band(cell)} | "
                f"{np.median(rates) / zoo_rate:.2g} | {f'{np.median(first):.2f}' if first else '—'} |"
            )
    lines += [
        "",
        "Evaluation return (10 deterministic episodes, the grid's evaluation) per seed and mean. Updates in band: the "
        "share of updates whose exact KL (`KLMonitorCallback`) lies in [0.5, 2] x target. Rate: each update's learning "
        "rate over rl-zoo's for the task; first-epoch KL: the measurement the rate follows, over the target. *: "
        "HalfCheetah-v5's `step_scale` and `fixed` runs are those of `auto_learning_rate_halfcheetah.json` (variants "
        "`auto` and `fixed_noclip`, the same code and seeds, 150k steps), their band judged on the KL the algorithm logged.",
        "",
        "## Variants",
        "",
        "- `auto`: the grid's `klppo_auto`, today's rule: the rate gives the first epoch a quarter of the target (median "
        "of five rollouts), beta holds the update's KL, an update outside [0.5, 2] x target is scaled onto beta's band.",
        "- `step_scale`: the earlier rule (before commit `cfddeeb`): the rate whose update meets the target; each step "
        "scaled onto it.",
        "- `first_epoch`: the candidate: the rate gives the first epoch 0.25 x the target (that rollout's alone); no "
        "step scale.",
        "- `fixed`: the grid's `klppo_noclip`, KLPPO at the multiplied zoo rate without the clip range.",
        "",
        "## Setting",
        "",
        "The grid's settings, budgets and evaluation (`benchmarks/grid_runs.py`), seeds "
        f"{', '.join(map(str, seeds))} (outside the grid's 0..9).",
        "",
        run_records.provenance(records) if records else "",
        "",
        "Made by `python benchmarks/studies/auto_rate_rule.py --workers 2` (records: `auto_rate_rule.json`).",
    ]
    page = "\n".join(lines) + "\n"
    PAGE.write_text(page)
    return page


def plot(runs: dict[tuple[str, str, float], dict[int, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CELLS), figsize=(2.6 * len(CELLS), 3.0))
    for ax, (env_id, lr_mult) in zip(axes, CELLS, strict=True):
        for x, variant in enumerate(VARIANTS):
            returns = [r["eval_mean"] for r in runs.get((variant, env_id, lr_mult), {}).values()]
            if returns:
                ax.bar(x, np.mean(returns), color=f"C{x}", alpha=0.4)
                ax.plot([x] * len(returns), returns, "o", color=f"C{x}")
        ax.set_xticks(range(len(VARIANTS)), list(VARIANTS), rotation=30, fontsize=8)
        ax.set_title(f"{env_id.split('-')[0]} x{lr_mult:g}", fontsize=9)
    axes[0].set_ylabel("evaluation return")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=90, metadata={"Software": None})
    plt.close(fig)


def _in_band(cell: dict[int, dict[str, Any]]) -> str:
    """The cell's mean share of updates in band, or where the runs are borrowed, their share of updates whose KL the
    algorithm logged in [0.5, 2] x target."""
    shares = [
        r["in_band"]
        if r["in_band"] is not None
        else np.mean([0.5 * r["target_kl"] <= u["kl"] <= 2 * r["target_kl"] for u in r["updates"]])
        for r in cell.values()
    ]
    return f"{np.mean(shares):.0%}" + ("*" if any(r.get("borrowed") for r in cell.values()) else "")


def _zoo_rate(env_id: str) -> float:
    from settings import settings_for

    rate = settings_for("klppo", env_id)["kwargs"].get("learning_rate", 3e-4)
    return float(rate) if not isinstance(rate, str) else float(rate.split("_")[-1])


def _run_and_save(cell: tuple[str, str, float, int]) -> str:
    record = run_one(*cell)
    run_records.replace_in_json_list(RECORDS, record, run_key)
    return f"done {cell[0]} {cell[1]} x{cell[2]:g} seed {cell[3]}: return {record['eval_mean']:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true")
    runnable = [variant for variant in VARIANTS if variant not in EARLIER_RULES]
    parser.add_argument("--variants", nargs="+", choices=runnable, default=runnable)
    parser.add_argument("--envs", nargs="+", default=sorted({env for env, _ in CELLS}))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if not args.report:
        done = {run_key(r) for r in read_records()}
        cells = [
            (variant, env_id, lr_mult, seed)
            for env_id, lr_mult in CELLS
            if env_id in args.envs
            for seed in args.seeds
            for variant in args.variants
            if (variant, env_id, lr_mult, seed) not in done
        ]
        run_records.run_in_pool(_run_and_save, cells, args.workers)
    print(report())


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
