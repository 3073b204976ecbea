"""
The joint KL sb3-contrib's TRPO actually takes per update, from its records in the learning grid
(``benchmarks/results/runs/full/trpo__<env>__lr1__s<seed>.json``: the exact per-update KL(old||new), summed over action
dimensions, measured by ``KLMonitorCallback`` on the whole rollout buffer). TRPO bounds KL(new||old) *averaged* over
action dimensions, so on a multi-dimensional ``Box`` its joint KL is larger than its ``target_kl``; KLTRPO bounds the
joint KL (its default convention, the monitor's). And TRPO's line search only shrinks the quadratic model's step,
which overestimates the KL, so TRPO takes less than its target per update (60-75 % on the discrete and
one-dimensional tasks of the grid, the table), where KLTRPO's grows to use all of it
(``benchmarks/results/kltrpo_budget_use.md``): at TRPO's ``target_kl`` KLTRPO takes larger steps than TRPO on the
discrete and one-dimensional tasks, and smaller ones on the multi-dimensional. The target of the grid's
``kltrpo_matched`` cell is this mean on the TRPO records that cell was first made beside (``grid_runs.matched_target_kl``:
once the cell has records, the target they ran with, which re-made TRPO records do not move: on Pendulum-v1 it is
2.4 % above this mean on the current records); rounded to two significant digits, that target is the
``target_kl`` of the shipped KLTRPO zoo configs for every task of the grid, so that ``--algo kltrpo`` takes steps of
TRPO's size there and every shipped target has the grid's ``kltrpo_matched`` runs behind it.

Writes ``benchmarks/results/trpo_joint_kl.md``, ``.json`` (naming the commit and the records' code versions) and
``.png``; ``--write-config`` also sets ``target_kl`` (with a comment naming this script) in
``sb3_kl/hyperparams/kltrpo.yml``; ``--report`` only rewrites the page and its figure from the JSON.

    python benchmarks/trpo_joint_kl.py [--write-config]
    python benchmarks/trpo_joint_kl.py --report
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "runs" / "full"
CONFIG = HERE.parent / "sb3_kl" / "hyperparams" / "kltrpo.yml"
#: The tasks of the learning grid, all of which KLTRPO ships zoo configs for
ENVS = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "LunarLanderContinuous-v3", "Hopper-v5", "HalfCheetah-v5"]


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when the package or this script had uncommitted changes."""
    import run_records

    return run_records.code_version(Path(__file__).name)


#: TRPO's seeds the targets come from: those ``learning.py``'s ``kltrpo_matched`` takes its target from, so that
#: records of further TRPO seeds leave both unchanged
SEEDS = (0, 1, 2)


def round_significant(value: float, digits: int = 2) -> float:
    """``0.01764 -> 0.018``"""
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def joint_kl(env_id: str) -> dict[str, Any]:
    """TRPO's per-update joint KL on ``env_id``, from its records at the zoo learning rate (seeds ``SEEDS``)."""
    import run_records

    found = [run_records.find_record(RUNS, run_records.record_name("trpo", env_id, 1.0, seed)) for seed in SEEDS]
    records = [record for record in found if record is not None]
    if not records:
        raise FileNotFoundError(f"no TRPO record for {env_id} in {RUNS}")
    for record in records:
        assert record["kl_source"].startswith("sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed)"), record[
            "kl_source"
        ]
    per_seed = [float(np.mean([update["mean"] for update in record["kl_updates"]])) for record in records]
    mean = float(np.mean(per_seed))
    import grid_runs

    grid_target = grid_runs.matched_target_kl("full", env_id)
    return dict(
        env=env_id,
        trpo_target_kl=records[0]["target_kl"],
        records=[f"{RUNS.relative_to(HERE.parent)}/{run_records.record_key(record)}" for record in records],
        record_code_versions=sorted({str(record.get("code_version", "unrecorded")) for record in records}),
        seeds=[record["seed"] for record in records],
        updates=sum(len(record["kl_updates"]) for record in records),
        per_seed_mean=per_seed,
        mean=mean,
        p99_mean=float(np.mean([update["p99"] for record in records for update in record["kl_updates"]])),
        kltrpo_matched_target_kl=grid_target,
        kltrpo_target_kl=round_significant(grid_target),
    )


def write_config(rows: list[dict[str, Any]], path: Path = CONFIG) -> None:
    """Set ``target_kl`` of each env's entry in the KLTRPO zoo config, with a comment naming its source."""
    lines = path.read_text().splitlines()
    for row in rows:
        start = lines.index(f"{row['env']}:")
        end = start + 1
        while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
            end += 1
        while not lines[end - 1].strip():
            end -= 1
        block = [line for line in lines[start + 1 : end] if not re.match(r"\s+target_kl:", line)]
        block.append(
            f"  target_kl: {row['kltrpo_target_kl']:g}  # TRPO's joint KL per update here: benchmarks/results/trpo_joint_kl.md"
        )
        lines[start + 1 : end] = block
    path.write_text("\n".join(lines) + "\n")


def plot_joint_kl(rows: list[dict[str, Any]], path: Path) -> None:
    """
    Draw TRPO's joint KL per update over its ``target_kl`` per task (mean, and each seed), to a PNG.

    :param rows: What :func:`joint_kl` returned, per task
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.2))
    x = np.arange(len(rows))
    ax.bar(x, [row["mean"] / row["trpo_target_kl"] for row in rows], 0.6, color="tab:blue", label="mean over seeds")
    for i, row in enumerate(rows):
        seeds = [value / row["trpo_target_kl"] for value in row["per_seed_mean"]]
        ax.plot([i] * len(seeds), seeds, ".", color="black", ms=4, label="a seed" if i == 0 else None)
    ax.axhline(1.0, color="tab:red", lw=1, ls="--", label="TRPO's target_kl (per action dimension)")
    ax.set_xticks(x, [row["env"].replace("Continuous", "Cont.") for row in rows], fontsize=8)
    ax.set_ylabel("joint KL per update / target_kl")
    ax.set_title("sb3-contrib TRPO: the joint KL it takes per update, over its target_kl", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def write_page(saved: dict[str, Any], out: Path) -> str:
    """
    Write the page ``out`` and its figure (same stem, ``.png``) from the JSON's content.

    :param saved: The JSON's content: ``command``, ``code_version``, ``rows``
    :param out: The markdown page
    :return: the page's text
    """
    command, version, rows = saved["command"], saved["code_version"], saved["rows"]
    figure = out.with_suffix(".png")
    plot_joint_kl(rows, figure)
    table = [
        "# The joint KL sb3-contrib's TRPO takes per update",
        "",
        f"![TRPO's joint KL per update over its target_kl]({figure.name})",
        "",
        "| env | TRPO's joint KL per update / its target_kl | KLTRPO target_kl (TRPO's step size) |",
        "|---|---|---|",
        *(
            f"| {row['env']} | {row['mean'] / row['trpo_target_kl']:.2f} | {row['kltrpo_target_kl']:g} |"
            for row in rows
        ),
        "",
        f"Generated by `{command}` (code `{version}`) from TRPO's records of the learning grid (rl-zoo settings, zoo "
        "learning rate): per-update KL(old||new) summed over action dimensions, measured from outside by "
        "`KLMonitorCallback` on the whole buffer; mean over updates, then over seeds. TRPO bounds KL(new||old) averaged "
        "over action dimensions by its `target_kl`, and takes less than it (its line search only shrinks the quadratic "
        "model's step), while KLTRPO bounds the joint KL and uses all of it. *kltrpo_matched's target*: the target of the "
        "grid's cell of KLTRPO at TRPO's step size, this mean on the TRPO records that cell was first made beside (on "
        "another machine's records where they differ in the last digits, `learning.md`'s replication section); the last "
        "column, that target rounded to two significant digits, is the `target_kl` that `--write-config` writes into "
        "`sb3_kl/hyperparams/kltrpo.yml` for these tasks (applied there together with a recorded zoo run of the entry).",
        "",
        "| env | TRPO target_kl (per dimension) | seeds | updates | joint KL per update, per seed | mean | p99 over states "
        "(mean) | records' code | kltrpo_matched's target | KLTRPO target_kl |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        table.append(
            f"| {row['env']} | {row['trpo_target_kl']:g} | {len(row['seeds'])} | {row['updates']} | "
            f"{', '.join(f'{v:.4f}' for v in row['per_seed_mean'])} | {row['mean']:.4f} | {row['p99_mean']:.4f} | "
            f"{', '.join(f'`{v}`' for v in row['record_code_versions'])} | {row['kltrpo_matched_target_kl']:.6f} | "
            f"{row['kltrpo_target_kl']:g} |"
        )
    text = "\n".join(table) + "\n"
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-config", action="store_true", help="set target_kl in sb3_kl/hyperparams/kltrpo.yml")
    parser.add_argument("--report", action="store_true", help="only rewrite the page and its figure from the JSON")
    args = parser.parse_args(argv)
    out = HERE / "results" / "trpo_joint_kl.md"
    if args.report:
        print(write_page(json.loads(out.with_suffix(".json").read_text()), out))
        return
    rows = [joint_kl(env_id) for env_id in ENVS]
    command = "python benchmarks/trpo_joint_kl.py" + (" --write-config" if args.write_config else "")
    saved = dict(command=command, code_version=code_version(), rows=rows)
    out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
    text = write_page(saved, out)
    if args.write_config:
        write_config(rows)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
