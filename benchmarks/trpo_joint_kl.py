"""
The joint KL sb3-contrib's TRPO actually takes per update, from its records in the learning grid
(``benchmarks/results/runs/full/trpo__<env>__lr1__s<seed>.json``: the exact per-update KL(old||new), summed over action
dimensions, measured by ``KLMonitorCallback`` on the whole rollout buffer). TRPO bounds KL(new||old) *averaged* over
action dimensions, so on a multi-dimensional ``Box`` its joint KL is larger than its ``target_kl``; KLTRPO bounds the
joint KL (its default convention, the monitor's). The mean over updates and seeds, rounded to two significant digits,
is the ``target_kl`` of the shipped KLTRPO zoo configs for the MuJoCo and Box2D tasks, so that ``--algo kltrpo`` takes
steps of TRPO's size there.

Writes ``benchmarks/results/trpo_joint_kl.md`` and ``.json`` (naming the commit and the records' code versions);
``--write-config`` also sets ``target_kl`` (with a comment naming this script) in ``sb3_kl/hyperparams/kltrpo.yml``.

    python benchmarks/trpo_joint_kl.py [--write-config]
"""

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RUNS = HERE / "results" / "runs" / "full"
CONFIG = HERE.parent / "sb3_kl" / "hyperparams" / "kltrpo.yml"
#: The MuJoCo and Box2D tasks of the grid that KLTRPO ships zoo configs for
ENVS = ["LunarLanderContinuous-v3", "Hopper-v5", "HalfCheetah-v5"]


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when this script had uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = git("status", "--porcelain", "--", Path(__file__).name)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) if commit else "unknown"


#: TRPO's seeds the targets come from: those ``learning.py``'s ``kltrpo_matched`` takes its target from, so that
#: records of further TRPO seeds leave both unchanged
SEEDS = (0, 1, 2)


def round_significant(value: float, digits: int = 2) -> float:
    """``0.01764 -> 0.018``"""
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def joint_kl(env_id: str) -> dict[str, Any]:
    """TRPO's per-update joint KL on ``env_id``, from its records at the zoo learning rate (seeds ``SEEDS``)."""
    paths = [RUNS / f"trpo__{env_id}__lr1__s{seed}.json" for seed in SEEDS]
    paths = [path for path in paths if path.exists()]
    if not paths:
        raise FileNotFoundError(f"no TRPO record for {env_id} in {RUNS}")
    records = [json.loads(path.read_text()) for path in paths]
    for record in records:
        assert record["kl_source"].startswith("sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed)"), record[
            "kl_source"
        ]
    per_seed = [float(np.mean([update["mean"] for update in record["kl_updates"]])) for record in records]
    mean = float(np.mean(per_seed))
    return dict(
        env=env_id,
        trpo_target_kl=records[0]["target_kl"],
        records=[str(path.relative_to(HERE.parent)) for path in paths],
        record_code_versions=sorted({str(record.get("code_version", "unrecorded")) for record in records}),
        seeds=[record["seed"] for record in records],
        updates=sum(len(record["kl_updates"]) for record in records),
        per_seed_mean=per_seed,
        mean=mean,
        p99_mean=float(np.mean([update["p99"] for record in records for update in record["kl_updates"]])),
        kltrpo_target_kl=round_significant(mean),
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-config", action="store_true", help="set target_kl in sb3_kl/hyperparams/kltrpo.yml")
    args = parser.parse_args(argv)
    rows = [joint_kl(env_id) for env_id in ENVS]
    command = "python benchmarks/trpo_joint_kl.py" + (" --write-config" if args.write_config else "")
    version = code_version()
    out = HERE / "results" / "trpo_joint_kl.md"
    out.with_suffix(".json").write_text(json.dumps(dict(command=command, code_version=version, rows=rows), indent=1))
    table = [
        "# The joint KL sb3-contrib's TRPO takes per update",
        "",
        f"Generated by `{command}` (code `{version}`) from TRPO's records of the learning grid (rl-zoo settings, zoo "
        "learning rate): per-update KL(old||new) summed over action dimensions, measured from outside by "
        "`KLMonitorCallback` on the whole buffer; mean over updates, then over seeds. TRPO bounds KL(new||old) averaged "
        "over action dimensions by its `target_kl`; KLTRPO bounds the joint KL, so the last column, the mean rounded to "
        "two significant digits, is the `target_kl` that `--write-config` writes into `sb3_kl/hyperparams/kltrpo.yml` "
        "for these tasks (applied there together with a recorded zoo run of the entry).",
        "",
        "| env | TRPO target_kl (per dimension) | seeds | updates | joint KL per update, per seed | mean | p99 over states "
        "(mean) | records' code | KLTRPO target_kl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        table.append(
            f"| {row['env']} | {row['trpo_target_kl']:g} | {len(row['seeds'])} | {row['updates']} | "
            f"{', '.join(f'{v:.4f}' for v in row['per_seed_mean'])} | {row['mean']:.4f} | {row['p99_mean']:.4f} | "
            f"{', '.join(f'`{v}`' for v in row['record_code_versions'])} | {row['kltrpo_target_kl']:g} |"
        )
    out.write_text("\n".join(table) + "\n")
    if args.write_config:
        write_config(rows)
    print("\n".join(table))


if __name__ == "__main__":
    sys.exit(main())
