"""
Why ``learning_rate="auto"`` lost to the fixed rate on HalfCheetah-v5 at the grid's settings, and what the sweep's
``klppo_auto`` now is: variants beside KLPPO at the zoo's fixed rate, on seeds outside the grid's (12, 13), at x1 and
x10 of the zoo's rate, 150k steps.

- ``auto_clip``: ``learning_rate="auto"`` with the zoo's ``clip_range=0.1`` kept (the sweep's ``klppo_auto`` before).
- ``auto``: without the clip range (KLPPO's own default, as in sb3-kl's zoo configs): the sweep's ``klppo_auto``.
- ``auto_value_follows``: ``auto`` with the value function at the policy's adapted rate, as before the value function
  had an optimizer group of its own (it now trains at the adapted rate or the starting one, whichever is larger).
- ``fixed_noclip``: KLPPO at the zoo's fixed rate without the clip range (the grid's ``klppo_noclip``): the KL at the
  same target, held by beta alone.

Per update (read from the logger after each update): the learning rate, the step scale, the KL, the clip fraction,
the explained variance and beta. Returns: 10 deterministic episodes on a separate environment (the grid's evaluation).

    python benchmarks/studies/auto_learning_rate_halfcheetah.py --workers 2   # the missing runs, then the page
    python benchmarks/studies/auto_learning_rate_halfcheetah.py --report

Records: ``benchmarks/results/auto_learning_rate_halfcheetah.json`` (one per run, written as each finishes, each naming
its commit and machine); page ``benchmarks/results/auto_learning_rate_halfcheetah.md``.
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
from settings import PPO_SETTINGS  # noqa: E402

RESULTS = run_records.MAIN_RESULTS
RECORDS = RESULTS / "auto_learning_rate_halfcheetah.json"
PAGE = RESULTS / "auto_learning_rate_halfcheetah.md"
ENV_ID = "HalfCheetah-v5"
#: rl-zoo's learning rate of the task
ZOO_RATE = float(PPO_SETTINGS[ENV_ID]["kwargs"]["learning_rate"])
BUDGET = 150_000
SEEDS = (12, 13)
LR_MULTS = (1.0, 10.0)
#: variant: (the grid's algorithm, overrides of its settings, whether the value function follows the adapted rate, what
#: it is)
VARIANTS: dict[str, tuple[str, dict[str, Any], bool, str]] = {
    "auto_clip": ("klppo_auto", {"clip_range": 0.1}, False, '`"auto"` with the zoo\'s `clip_range=0.1` (x1 only)'),
    "auto": ("klppo_auto", {}, False, "the same without the clip range: the sweep's `klppo_auto`"),
    "auto_value_follows": ("klppo_auto", {}, True, "`auto`, the value function at the policy's adapted rate (as before)"),
    "fixed_noclip": ("klppo_noclip", {}, False, "KLPPO at the zoo's fixed rate, no clip range: beta alone holds the KL"),
}
LOGGED = ("learning_rate", "step_scale", "kl", "clip_fraction", "explained_variance", "kl_coef")


@functools.cache
def code_version() -> str:
    return run_records.code_version("studies/auto_learning_rate_halfcheetah.py", "settings.py", "grid_runs.py")


def value_follows_class() -> type:
    """:return: KLPPO whose value function trains at the policy's adapted rate (one rate for the whole optimizer)"""
    from sb3_kl import KLPPO
    from sb3_kl.common.learning_rate import VALUE_GROUP_KEY

    class ValueFollows(KLPPO):
        def _update_learning_rate(self, optimizers: Any) -> None:
            super()._update_learning_rate(optimizers)
            for group in self.policy.optimizer.param_groups:
                if group.get(VALUE_GROUP_KEY):
                    group["lr"] = self.adapted_learning_rate

    return ValueFollows


def run_key(record: dict[str, Any]) -> tuple[str, float, int]:
    return record["variant"], record["lr_mult"], record["seed"]


def read_records() -> list[dict[str, Any]]:
    return run_records.read_json_list(RECORDS)


def append(record: dict[str, Any]) -> None:
    """Add a finished run to the records file (a run made again replaces its record)."""
    run_records.replace_in_json_list(RECORDS, record, run_key)


def run_one(variant: str, lr_mult: float, seed: int) -> dict[str, Any]:
    """Train one run with the grid's code (``grid_runs.train_and_evaluate``) and return its record."""
    import grid_runs

    algo, overrides, value_follows, _ = VARIANTS[variant]
    updates: list[dict[str, float]] = []

    spec = dict(algo=algo, env=ENV_ID, seed=seed, lr_mult=lr_mult, tier="full", budget=BUDGET, overrides=overrides)
    grid = grid_runs.train_and_evaluate(
        spec,
        probes=[grid_runs.logged_updates_probe(LOGGED, updates)],
        algorithm=value_follows_class() if value_follows else None,
    )
    return dict(
        variant=variant,
        env=ENV_ID,
        lr_mult=lr_mult,
        seed=seed,
        budget=BUDGET,
        hyperparameters=grid["hyperparameters"],
        target_kl=grid["target_kl"],
        eval_returns=grid["eval_returns"],
        eval_mean=grid["eval_mean"],
        updates=updates,
        code_version=code_version(),
        run_environment=run_records.run_environment(),
    )


def report() -> str:
    """Write the page from the records; :return: the page."""
    records = read_records()
    cells: dict[tuple[str, float], dict[int, dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["variant"], r["lr_mult"]), {})[r["seed"]] = r
    seeds = sorted({r["seed"] for r in records})
    lines = [
        '# `learning_rate="auto"` on HalfCheetah-v5: the clip range and the value function\'s rate',
        "",
        "| variant | lr | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | median rate / zoo rate "
        "| median clip fraction | median beta | updates with EV < 0 |",
        "|---|---|" + "---|" * (len(seeds) + 5),
    ]
    for variant in VARIANTS:
        for lr_mult in LR_MULTS:
            runs = cells.get((variant, lr_mult), {})
            if not runs:
                continue
            returns = [f"{runs[s]['eval_mean']:.0f}" if s in runs else "—" for s in seeds]
            updates = [u for r in runs.values() for u in r["updates"]]
            rate = np.median([u["learning_rate"] for u in updates]) / ZOO_RATE
            clip = [u["clip_fraction"] for u in updates if "clip_fraction" in u]
            ev = np.mean([u["explained_variance"] < 0 for u in updates])
            lines.append(
                f"| `{variant}` | x{lr_mult:g} | " + " | ".join(returns) + " | "
                f"{np.mean([r['eval_mean'] for r in runs.values()]):.0f} | {rate:.2g} | "
                f"{f'{np.median(clip):.2f}' if clip else '—'} | "
                f"{np.median([u['kl_coef'] for u in updates]):.2g} | {ev:.0%} |"
            )
    lines += [
        "",
        "Evaluation return (10 deterministic episodes), per seed and mean. Rate: the policy's learning rate in each "
        f"update, over the zoo's {ZOO_RATE:g}; clip fraction: PPO's, where a clip range is set; beta: KLPPO's KL "
        "coefficient; EV: the update's explained variance of the value function.",
        "",
        "## Variants",
        "",
        *[f"- `{name}`: {description}" for name, (_, _, _, description) in VARIANTS.items()],
        "",
        "## Setting",
        "",
        f"{ENV_ID}, the grid's settings and evaluation (`benchmarks/grid_runs.py`), {BUDGET:,} steps, rl-zoo's "
        f"learning rate times x{', x'.join(f'{m:g}' for m in LR_MULTS)}, seeds {', '.join(map(str, seeds))} (outside "
        "the grid's 0..9), target 0.03.",
        "",
        run_records.provenance(records),
        "",
        "Made by `python benchmarks/studies/auto_learning_rate_halfcheetah.py --workers 2` "
        "(records: `auto_learning_rate_halfcheetah.json`).",
    ]
    page = "\n".join(lines) + "\n"
    PAGE.write_text(page)
    return page


def _run_and_save(cell: tuple[str, float, int]) -> str:
    record = run_one(*cell)
    append(record)
    return f"done {cell[0]} x{cell[1]:g} seed {cell[2]}: return {record['eval_mean']:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--lr-mults", nargs="+", type=float, default=list(LR_MULTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    if not args.report:
        done = {run_key(r) for r in read_records()}
        cells = [
            (variant, lr_mult, seed)
            for lr_mult in args.lr_mults
            for seed in args.seeds
            for variant in args.variants
            if (variant, lr_mult, seed) not in done and not (variant == "auto_clip" and lr_mult != 1.0)
        ]
        run_records.run_in_pool(_run_and_save, cells, args.workers)
    print(report())


if __name__ == "__main__":
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    main()
