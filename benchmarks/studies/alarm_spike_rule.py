"""
Which single-update factor should ``KLAlarmCallback``'s ``kl_spike`` use? Replays the per-update mean KLs of the
committed benchmark runs (``benchmarks/results/runs/**/records.jsonl``, exact forward KL measured by ``KLMonitorCallback``,
each run with the target it was judged against) through the callback's own rule (:class:`SpikeRule`) for a grid of
factors, and counts:

- false positives on the *normal* runs (``lr_mult == 1``: rl-zoo's settings, every algorithm): share of updates that
  alarm, and share of runs with at least one alarm;
- detections on the *stress* runs (``lr_mult == 10``: ten times the learning rate): share of runs with an alarm,
  separately for the stock algorithms (whose KL runs away) and for the sb3-kl algorithms (whose KL control holds it:
  an alarm there would be a false positive too), and the update of the first alarm.

The chosen factor is the smallest one of the grid with which the callback (the factor and the sustained rule,
``spike_factor=5`` for ``patience=3`` updates, together) alarms on every stock stress run, and whose single-update
alarms stay on at most ``--max-false-runs`` (5 %) of the normal runs and of the KL-controlled stress runs and are not
the usual outcome of any normal cell: no (algorithm, environment) pair at rl-zoo's settings alarms on more than half
of its seeds. The pooled share alone can hide one configuration the zoo ships as tuned that alarms on every run (stock
PPO on Hopper takes single updates of 20 to 330 times the target); a user of that configuration would learn to ignore
the alarm. Detection counts both rules because the factor's job is the lone spike the sustained rule would miss: a
runaway run whose KL stays above 5 x target without one update above the factor is caught by the sustained rule. Writes
``benchmarks/results/alarm_spike_rule.md``, ``.json`` (naming the commit) and ``.png``; ``--report`` rewrites the page
and its figure from the JSON alone, without reading the runs.

The records hold the joint KL(old||new) only, so a TRPO run's ratio here is that KL over TRPO's target, which bounds
KL(new||old) averaged over ``Box`` dimensions: about ``n_dims`` times the ratio the callback now uses for TRPO (it
compares the KL in the target's convention, ``kl/mean_in_target_convention``), about the same on discrete actions.
No TRPO run alarms even at these larger ratios in the committed result.

    python benchmarks/studies/alarm_spike_rule.py
    python benchmarks/studies/alarm_spike_rule.py --report
"""

import argparse
import glob
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path[:0] = [str(HERE.parent), str(HERE)]

import run_records  # noqa: E402
from sb3_kl.common.callbacks_alarm import SpikeRule  # noqa: E402

FACTORS = (5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0)
STOCK = ("ppo", "trpo")
NORMAL = "normal (lr x1, all algorithms)"
STOCK_STRESS = "stress, stock (lr x10, PPO/TRPO without KL control)"
CONTROLLED_STRESS = "stress, KL-controlled (lr x10, sb3-kl and PPO with target_kl)"
SPIKE_FACTOR, PATIENCE = 5.0, 3


def load_runs(pattern: str) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(glob.glob(pattern, recursive=True)):  # records files (run_records.RECORDS_FILE)
        for record in run_records.read_folder(Path(path).parent):
            if not record.get("kl_updates") or not record.get("target_kl"):
                continue
            ratios = np.array([update["mean"] for update in record["kl_updates"]]) / float(record["target_kl"])
            name = f"{Path(path).parent.relative_to(HERE.parent)}/{run_records.record_key(record)}"
            runs.append(dict(path=name, algo=record["algo"], env=record["env"], seed=record["seed"],
                             lr_mult=record["lr_mult"], ratios=ratios))  # fmt: skip
    return runs


def alarms(ratios: np.ndarray, max_kl_factor: float | None, spike_factor: float, patience: int) -> np.ndarray:
    """:return: a boolean per update: whether the rule alarms at it"""
    rule = SpikeRule(max_kl_factor, spike_factor, patience)
    return np.array([rule.check(float(ratio)) is not None for ratio in ratios], dtype=bool)


def summarize(runs: list[dict[str, Any]], max_kl_factor: float | None, spike_factor: float, patience: int) -> dict:
    flags = [alarms(run["ratios"], max_kl_factor, spike_factor, patience) for run in runs]
    n_updates = sum(len(f) for f in flags)
    first = [int(np.argmax(f)) for f in flags if f.any()]
    return dict(
        runs=len(runs),
        runs_alarmed=int(sum(f.any() for f in flags)),
        updates=n_updates,
        updates_alarmed=int(sum(f.sum() for f in flags)),
        first_alarm_update_median=float(np.median(first)) if first else None,
        alarmed=[run["path"] for run, f in zip(runs, flags, strict=True) if f.any()],
    )


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--",
                "sb3_kl/common/callbacks_alarm.py",
                "benchmarks/studies/alarm_spike_rule.py",
            ],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.strip() + (" (with uncommitted changes)" if dirty.strip() else "")


def pct(numerator: int, denominator: int) -> str:
    return f"{100 * numerator / denominator:.2f} %" if denominator else "-"


def mostly_alarmed_cells(runs: list[dict[str, Any]], alarmed: list[str]) -> list[str]:
    """
    :param runs: The runs of one group
    :param alarmed: The paths of those that alarm (``summarize``'s ``alarmed``)
    :return: the (algorithm, environment) cells in which more than half of the seeds alarm
    """
    alarmed_paths = set(alarmed)
    cells: dict[tuple[str, str], list[bool]] = {}
    for run in runs:
        cells.setdefault((run["algo"], run["env"]), []).append(run["path"] in alarmed_paths)
    return [f"{algo} on {env} ({sum(f)}/{len(f)})" for (algo, env), f in sorted(cells.items()) if sum(f) > len(f) / 2]


def factor_rows(groups: dict[str, list[dict[str, Any]]]) -> list[dict]:
    """
    One row per factor of :data:`FACTORS`: each group's alarms under the single-update rule alone (``single``) and
    with the sustained rule beside it (``combined``), and the normal cells alarmed on most of their seeds.

    :param groups: The runs by group name
    """
    rows = []
    for factor in FACTORS:
        single = {name: summarize(group, factor, np.inf, PATIENCE) for name, group in groups.items()}
        combined = {name: summarize(group, factor, SPIKE_FACTOR, PATIENCE) for name, group in groups.items()}
        # the single-update rule's alarms, already replayed by summarize
        cells = mostly_alarmed_cells(groups.get(NORMAL, []), single[NORMAL]["alarmed"] if NORMAL in single else [])
        rows.append(dict(max_kl_factor=factor, single=single, combined=combined, normal_cells_mostly_alarmed=cells))
    return rows


def choose(rows: list[dict], groups: dict[str, list], max_false: float, per_cell: bool) -> dict | None:
    """
    The first row (smallest factor) meeting the criterion: every stock stress run alarmed by the callback's rules
    together (the factor and the sustained rule), and, by the factor alone, at most ``max_false`` of the normal runs
    and of the KL-controlled stress runs alarmed and (``per_cell``) no normal cell mostly alarmed. A group without runs
    constrains nothing.

    :param rows: The rows of :func:`factor_rows`, by increasing factor
    :param groups: The runs by group name
    :param max_false: Largest share of false alarms allowed in each group of normal or KL-controlled runs
    :param per_cell: Whether to apply the clause on the normal cells
    :return: the chosen row, or None when no factor meets the criterion
    """
    empty = dict(runs_alarmed=0)
    for row in rows:
        single = row["single"]
        # detection as the callback runs (the sustained rule beside the factor); false alarms of the factor alone
        if row["combined"].get(STOCK_STRESS, empty)["runs_alarmed"] < len(groups.get(STOCK_STRESS, [])):
            continue
        if any(
            single.get(name, empty)["runs_alarmed"] > max_false * len(groups.get(name, []))
            for name in (NORMAL, CONTROLLED_STRESS)
        ):
            continue
        if per_cell and row["normal_cells_mostly_alarmed"]:
            continue
        return row
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(HERE / "results" / "runs" / "**" / "records.jsonl"))
    parser.add_argument(
        "--max-false-runs",
        type=float,
        default=0.05,
        help="largest share of the normal runs, and of the KL-controlled stress runs, that may alarm",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "alarm_spike_rule")
    parser.add_argument("--report", action="store_true", help="only rewrite the page and its figure from the JSON")
    args = parser.parse_args(argv)
    if args.report:
        print(write_page(json.loads(args.out.with_suffix(".json").read_text()), args.out))
        return

    runs = load_runs(args.runs)
    groups = {
        NORMAL: [r for r in runs if r["lr_mult"] == 1],
        STOCK_STRESS: [r for r in runs if r["lr_mult"] == 10 and r["algo"] in STOCK],
        CONTROLLED_STRESS: [r for r in runs if r["lr_mult"] == 10 and r["algo"] not in STOCK],
        "lr x3, all algorithms": [r for r in runs if r["lr_mult"] == 3],
    }
    # the learning grid no longer runs x3 (its committed table came from records of an earlier grid)
    groups = {name: group for name, group in groups.items() if group}
    rows = factor_rows(groups)
    sustained = {name: summarize(group, None, SPIKE_FACTOR, PATIENCE) for name, group in groups.items()}
    chosen = choose(rows, groups, args.max_false_runs, per_cell=True)
    pooled_only = choose(rows, groups, args.max_false_runs, per_cell=False)

    meta = dict(
        commit=commit(),
        command="python benchmarks/studies/alarm_spike_rule.py" + ("" if argv is None else " " + " ".join(argv)),
        runs=len(runs),
        criterion="smallest factor with every stock stress run alarmed by the callback's rules together (the factor "
        f"and the sustained rule), and, by the single-update factor alone, at most {args.max_false_runs:.0%} of the "
        f"normal runs and at most {args.max_false_runs:.0%} of the KL-controlled stress runs alarmed and no normal "
        "cell (algorithm, environment) alarmed on more than half of its seeds",
        sustained_rule=dict(spike_factor=SPIKE_FACTOR, patience=PATIENCE),
    )
    result = dict(
        meta=meta,
        chosen=None if chosen is None else dict(max_kl_factor=chosen["max_kl_factor"]),
        chosen_without_the_cell_clause=None if pooled_only is None else dict(max_kl_factor=pooled_only["max_kl_factor"]),
        grid=rows,
        sustained_only=sustained,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(write_page(result, args.out))


def plot_alarms(result: dict[str, Any], path: Path) -> None:
    """
    Draw the share of runs alarmed by the single-update factor alone, per group of runs, against the factor, with the
    chosen factor, to a PNG.

    :param result: What the JSON holds
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["grid"]
    factors = [row["max_kl_factor"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for name in result["sustained_only"]:
        shares = [row["single"][name]["runs_alarmed"] / row["single"][name]["runs"] for row in rows]
        ax.plot(factors, [100 * share for share in shares], "o-", ms=4, label=name)
    if result["chosen"] is not None:
        chosen = result["chosen"]["max_kl_factor"]
        ax.axvline(chosen, color="black", lw=1, ls="--", label=f"chosen: max_kl_factor={chosen:g}")
    ax.set_xscale("log")
    ax.set_xlabel("max_kl_factor (single update above factor x target)")
    ax.set_ylabel("runs alarmed (%)")
    ax.set_title("KLAlarmCallback's single-update rule replayed on the committed runs", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def write_page(result: dict[str, Any], out: Path) -> str:
    """
    Write the page (``out`` with ``.md``) and its figure (``.png``) from the study's result (what the JSON holds).

    :param result: What the JSON holds
    :param out: The path of the files without their suffix
    :return: the page's text
    """
    meta, rows, sustained = result["meta"], result["grid"], result["sustained_only"]
    names = list(sustained)
    by_factor = {row["max_kl_factor"]: row for row in rows}
    chosen = None if result["chosen"] is None else by_factor[result["chosen"]["max_kl_factor"]]
    pooled = result["chosen_without_the_cell_clause"]
    pooled_only = None if pooled is None else by_factor[pooled["max_kl_factor"]]
    figure = out.with_suffix(".png")
    plot_alarms(result, figure)
    lines = [
        "# KLAlarmCallback: the single-update KL-spike factor",
        "",
        f"![runs alarmed against the factor]({figure.name})",
        "",
    ]
    if chosen is not None:
        factor = chosen["max_kl_factor"]
        lines += [
            f"| runs | alarmed by a single update above {factor:g} x target | with the sustained rule too (the callback) |",
            "|---|---|---|",
            *(
                f"| {name} | {chosen['single'][name]['runs_alarmed']}/{chosen['single'][name]['runs']} "
                f"| {chosen['combined'][name]['runs_alarmed']}/{chosen['combined'][name]['runs']} |"
                for name in names
            ),
            "",
        ]
    lines += [
        f"Generated by `{meta['command']}` at commit {meta['commit']}, from {meta['runs']} committed benchmark runs"
        " (`benchmarks/results/runs/`, per-update exact mean KL and the target each run was judged against; stock"
        " PPO runs are judged against KLPPO's defaults 0.02 discrete / 0.03 Box, which `KLAlarmCallback` now also uses"
        " for a model without a target; TRPO runs hold the joint KL, see the script's docstring). An alarm on a normal run or"
        " on a KL-controlled stress run (sb3-kl's algorithms, and stock PPO with SB3's `target_kl` early stop) is counted"
        " as a false positive, an alarm on a stock stress run (KL not controlled, ten times the learning rate) as a"
        " detection.",
        "",
        f"Criterion: {meta['criterion']}. **Chosen: `max_kl_factor="
        + ("none" if chosen is None else f"{chosen['max_kl_factor']:g}")
        + "`** (`KLAlarmCallback`'s default). Without the clause on the cells, the pooled shares alone would choose "
        + ("none" if pooled_only is None else f"`max_kl_factor={pooled_only['max_kl_factor']:g}`")
        + (
            ""
            if pooled_only is None or pooled_only == chosen
            else ", at which the normal cells "
            + ", ".join(pooled_only["normal_cells_mostly_alarmed"])
            + " alarm on most of their seeds, with rl-zoo's tuned settings"
        )
        + ".",
        "",
        "## Single update above factor x target",
        "",
        "| factor | " + " | ".join(f"{name}: runs alarmed" for name in names) + " | normal: updates alarmed"
        " | stock stress: first alarm (update, median) | normal cells alarmed on most seeds |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    for row in rows:
        single = row["single"]
        first = single[STOCK_STRESS]["first_alarm_update_median"]
        first_text = "-" if first is None else f"{first:g}"
        lines.append(
            f"| {row['max_kl_factor']:g} | "
            + " | ".join(f"{single[n]['runs_alarmed']}/{single[n]['runs']}" for n in names)
            + f" | {pct(single[names[0]]['updates_alarmed'], single[names[0]]['updates'])}"
            f" ({single[names[0]]['updates_alarmed']}/{single[names[0]]['updates']}) | {first_text}"
            f" | {', '.join(row['normal_cells_mostly_alarmed']) or 'none'} |"
        )
    lines += [
        "",
        f"## With the sustained rule ({SPIKE_FACTOR:g} x target for {PATIENCE} consecutive updates), as the callback runs",
        "",
        "| factor | " + " | ".join(f"{name}: runs alarmed" for name in names) + " | normal: updates alarmed |",
        "|---|" + "---|" * (len(names) + 1),
        "| sustained rule alone | "
        + " | ".join(f"{sustained[n]['runs_alarmed']}/{sustained[n]['runs']}" for n in names)
        + f" | {pct(sustained[names[0]]['updates_alarmed'], sustained[names[0]]['updates'])} |",
    ]
    for row in rows:
        combined = row["combined"]
        lines.append(
            f"| {row['max_kl_factor']:g} | "
            + " | ".join(f"{combined[n]['runs_alarmed']}/{combined[n]['runs']}" for n in names)
            + f" | {pct(combined[names[0]]['updates_alarmed'], combined[names[0]]['updates'])} |"
        )
    if chosen is not None:
        lines += ["", f"Normal runs alarmed by the chosen single-update factor ({chosen['max_kl_factor']:g}):", ""]
        lines += [f"- `{path}`" for path in chosen["single"][names[0]]["alarmed"]] or ["- none"]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    return text


if __name__ == "__main__":
    main()
