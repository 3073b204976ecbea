"""
Stock PPO with a too-high learning rate (3e-2) on Pendulum-v1, with and without KLAdaptiveLRCallback: the exact KL of
every update (KLMonitorCallback) and the learning rate, and the median KL over the second half of training.

    nice -n 10 python benchmarks/studies/adaptive_lr.py [--steps 40960] [--target-kl 0.01] [--seeds 0]
    python benchmarks/studies/adaptive_lr.py --report [--steps 40960] [--target-kl 0.01]

Each run (seed x with/without the callback) writes a JSON record under ``benchmarks/results/adaptive_lr_runs/``
naming the commit that ran (``code_version``) and the machine and library versions (``run_environment``); a run whose
record exists for the same parameters is skipped (resume). ``--report`` (also run at the end) writes
``benchmarks/results/adaptive_lr.md`` from the records of the given ``--steps``, ``--learning-rate`` and
``--target-kl``, and its figure ``adaptive_lr.png``, without training.

Goal: with the callback, the late-training median KL is within ~3x the target.
"""

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = run_records.RESULTS
RUNS = RESULTS / "adaptive_lr_runs"
ENV_ID = "Pendulum-v1"
SCRIPT = "benchmarks/studies/adaptive_lr.py"


@functools.cache
def code_version() -> str:
    """
    The commit that ran, ``+modified`` when the package or this script had uncommitted changes, read once when the
    process starts its first run (the package is imported then: later edits of the checkout do not change the run).
    """
    return run_records.code_version("studies/adaptive_lr.py", "learning.py")


def callback_label(adapt: bool) -> str:
    """The ``callback`` column of a run: ``KLAdaptiveLRCallback`` or ``none``."""
    return "KLAdaptiveLRCallback" if adapt else "none"


def record_path(steps: int, learning_rate: float, target_kl: float, seed: int, adapt: bool, runs: Path = RUNS) -> Path:
    """Where the record of one run goes (its name holds every parameter of the run)."""
    side = "callback" if adapt else "none"
    return runs / f"steps{steps}__lr{learning_rate:g}__target{target_kl:g}__s{seed}__{side}.json"


def parameters(steps: int, learning_rate: float, target_kl: float, seed: int, adapt: bool) -> dict[str, Any]:
    """The parameters that decide a run (a record made with other parameters is not reused)."""
    return dict(env=ENV_ID, steps=steps, learning_rate=learning_rate, target_kl=target_kl, seed=seed, callback=adapt)


def run_one(steps: int, learning_rate: float, target_kl: float, seed: int, adapt: bool, runs: Path = RUNS) -> dict[str, Any]:
    """
    Train stock PPO once and write its record.

    :param steps: Environment steps of the training
    :param learning_rate: PPO's (constant) learning rate, the callback's starting value
    :param target_kl: The callback's target
    :param seed: Seed of the model and the environment
    :param adapt: Whether KLAdaptiveLRCallback adapts the learning rate
    :param runs: The folder of the records
    :return: the record
    """
    import torch as th
    from stable_baselines3 import PPO

    from sb3_kl.callbacks import KLAdaptiveLRCallback, KLMonitorCallback

    th.set_num_threads(1)
    version = code_version()
    model = PPO("MlpPolicy", ENV_ID, learning_rate=learning_rate, seed=seed, device="cpu")
    monitor = KLMonitorCallback()
    adaptive = KLAdaptiveLRCallback(target_kl=target_kl, monitor=monitor) if adapt else None
    callbacks = [monitor] + ([adaptive] if adaptive is not None else [])
    load_before = os.getloadavg()
    start = time.perf_counter()
    model.learn(steps, callback=callbacks)
    wall = time.perf_counter() - start
    history = monitor.history
    record = dict(
        question="KLAdaptiveLRCallback on stock PPO with a too-high learning rate",
        **parameters(steps, learning_rate, target_kl, seed, adapt),
        command=(
            f"python {SCRIPT} --steps {steps} --learning-rate {learning_rate:g} --target-kl {target_kl:g} --seeds {seed}"
        ),
        ppo_kwargs=dict(learning_rate=learning_rate, device="cpu"),
        monitor=dict(
            direction=monitor.settings.direction, estimator=monitor.settings.estimator, reduction=monitor.settings.reduction
        ),
        callback_settings=(
            dict(factor=adaptive.factor, band=list(adaptive.band), lr_bounds=list(adaptive.lr_bounds))
            if adaptive is not None
            else None
        ),
        trained_steps=int(model.num_timesteps),
        updates=len(history),
        kl=[float(entry["mean"]) for entry in history],
        # the learning rate chosen after each update for the next one (None without the callback)
        learning_rates=[float(entry["learning_rate"]) if "learning_rate" in entry else None for entry in history],
        final_learning_rate=float(history[-1].get("learning_rate", learning_rate)) if history else learning_rate,
        wall_seconds=wall,
        load_average_before=list(load_before),
        load_average_after=list(os.getloadavg()),
        niceness=os.nice(0),
        cpu_count=os.cpu_count(),
        torch_threads=1,
        code_version=version,
        run_environment=run_records.run_environment(),
    )
    path = record_path(steps, learning_rate, target_kl, seed, adapt, runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def existing_record(
    steps: int, learning_rate: float, target_kl: float, seed: int, adapt: bool, runs: Path = RUNS
) -> dict[str, Any] | None:
    """:return: the record of a run already made with these parameters (None: the run is still to do)"""
    path = record_path(steps, learning_rate, target_kl, seed, adapt, runs)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    wanted = parameters(steps, learning_rate, target_kl, seed, adapt)
    return record if all(record.get(key) == value for key, value in wanted.items()) else None


def late_median(record: dict[str, Any]) -> float:
    """The median KL over the second half of a run's updates."""
    kl = record["kl"]
    return float(np.median(kl[len(kl) // 2 :]))


def load_records(steps: int, learning_rate: float, target_kl: float, runs: Path = RUNS) -> list[dict[str, Any]]:
    """:return: the records made with these parameters, by seed, the run without the callback first"""
    records = [json.loads(path.read_text()) for path in sorted(runs.glob("*.json"))] if runs.exists() else []
    records = [r for r in records if (r["steps"], r["learning_rate"], r["target_kl"]) == (steps, learning_rate, target_kl)]
    return sorted(records, key=lambda r: (r["seed"], r["callback"]))


def plot_kl(records: list[dict[str, Any]], target_kl: float, path: Path) -> None:
    """
    Draw every run's per-update KL / target, without and with the callback, on a log scale, to a PNG.

    :param records: The records to draw
    :param target_kl: Their target
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    band = next((r["callback_settings"]["band"] for r in records if r["callback_settings"]), None)
    if band is not None:
        ax.axhspan(band[0], band[1], color="0.9", label=f"callback's band [{band[0]:g}, {band[1]:g}] x target")
    for r in records:
        color = "tab:green" if r["callback"] else "tab:red"
        label = callback_label(r["callback"])
        ax.plot(range(1, len(r["kl"]) + 1), np.array(r["kl"]) / target_kl, color=color, alpha=0.8, label=label)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel("KL / target")
    rate = records[0]["learning_rate"]
    ax.set_title(f"PPO on {ENV_ID}, learning rate {rate:g}: KL of each update (one line per seed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(records: list[dict[str, Any]], target_kl: float) -> list[str]:
    """:return: the page's opening table: per callback setting, the late median KL / target and final rate over seeds"""
    lines = [
        "| callback | seeds | late median KL / target (median, range over seeds) | final learning rate (median) |",
        "|---|---|---|---|",
    ]
    for adapt in (False, True):
        group = [r for r in records if r["callback"] == adapt]
        if not group:
            continue
        ratios = [late_median(r) / target_kl for r in group]
        rates = [r["final_learning_rate"] for r in group]
        lines.append(
            f"| {callback_label(adapt)} | {len(group)} | {np.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f}) "
            f"| {np.median(rates):.2e} |"
        )
    return lines


def report(steps: int, learning_rate: float, target_kl: float, runs: Path = RUNS, out: Path | None = None) -> str:
    """
    Write the report from the records (no training).

    :param steps: Environment steps of the runs to report
    :param learning_rate: Their learning rate
    :param target_kl: Their target
    :param runs: The folder of the records
    :param out: The markdown file; default ``adaptive_lr.md`` beside the records' folder
    :return: the report's text
    """
    records = load_records(steps, learning_rate, target_kl, runs)
    if not records:
        raise SystemExit(
            f"no records in {runs} for --steps {steps} --learning-rate {learning_rate:g} --target-kl {target_kl:g}"
        )
    seeds = sorted({r["seed"] for r in records})
    versions = run_records.code_versions(records)
    environments = run_records.run_environments(records)
    monitors = sorted({json.dumps(r["monitor"], sort_keys=True) for r in records})
    settings = sorted({json.dumps(r["callback_settings"], sort_keys=True) for r in records if r["callback_settings"]})
    monitor_text = "; ".join("/".join(json.loads(m)[key] for key in ("direction", "estimator", "reduction")) for m in monitors)
    settings_text = "; ".join(
        "factor {factor:g}, band ({band[0]:g}, {band[1]:g}) x target, lr bounds ({lr_bounds[0]:g}, {lr_bounds[1]:g})".format(
            **json.loads(s)
        )
        for s in settings
    )
    loads = [max(r["load_average_before"][0], r["load_average_after"][0]) for r in records]
    nices = sorted({r["niceness"] for r in records})
    cores = ", ".join(str(n) for n in sorted({r["cpu_count"] for r in records}))
    nice = f"nice -n {nices[0]} " if len(nices) == 1 and nices[0] > 0 else ""
    try:
        folder = runs.resolve().relative_to(HERE.parent)
    except ValueError:
        folder = runs
    out = out or runs.parent / "adaptive_lr.md"
    figure = out.with_suffix(".png")
    plot_kl(records, target_kl, figure)
    lines = [
        "# KLAdaptiveLRCallback on stock PPO with a too-high learning rate",
        "",
        f"![KL per update, with and without the callback]({figure.name})",
        "",
        *summary_table(records, target_kl),
        "",
        f"Command: `{nice}python {SCRIPT} --steps {steps} --target-kl {target_kl:g} "
        f"--seeds {' '.join(map(str, seeds))}`"
        + (f" (with `--learning-rate {learning_rate:g}`)" if learning_rate != 3e-2 else ""),
        "",
        f"Generated by `python {SCRIPT} --report --steps {steps} --learning-rate {learning_rate:g} "
        f"--target-kl {target_kl:g}` from the {len(records)} records in `{folder}/` (one per seed and callback). "
        "Code version(s) of the records (commit of sb3-kl, `+modified`: the package or the script had uncommitted "
        "changes): " + ", ".join(f"{version} ({count} records)" for version, count in sorted(versions.items())) + ". "
        "Machine and library versions: "
        + "; ".join(f"{machine} ({count} records)" for machine, count in sorted(environments.items()))
        + ".",
        "",
        f"PPO defaults on {ENV_ID} except learning_rate={learning_rate:g}; KL = exact mean per-state "
        f"KL(pi_rollout || pi_updated) of each update on the rollout's states (KLMonitorCallback, {monitor_text}); "
        f"callback settings: {settings_text}; target_kl={target_kl:g}. Late = second half of the updates. "
        "Final learning rate: the rate the callback chose after the last update (without the callback, the constant rate).",
        "",
        "| seed | callback | updates | late median KL | late median / target | final learning rate | wall time (s) | code |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        late = late_median(r)
        lines.append(
            f"| {r['seed']} | {callback_label(r['callback'])} | {r['updates']} | {late:.4f} | {late / target_kl:.2f} "
            f"| {r['final_learning_rate']:.2e} | {r['wall_seconds']:.0f} | {r['code_version']} |"
        )
    lines += [
        "",
        "*Wall time* is how long each training took on this machine, not a measure of speed or of the callback's cost: "
        f"the runs ran at niceness {', '.join(map(str, nices))} with a 1-minute load average at their start or end of up "
        f"to {max(loads):.1f} on {cores} cores, so their times depend on whatever else ran beside them; "
        "`benchmarks/overhead.py` measures the monitor's cost.",
        "",
        "KL of every update:",
        "",
    ]
    lines += [
        f"- seed {r['seed']}, {callback_label(r['callback'])}: KL per update " + ", ".join(f"{x:.3g}" for x in r["kl"])
        for r in records
    ]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40_960)
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--target-kl", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", type=Path, default=RUNS, help="folder of the JSON records")
    parser.add_argument("--out", type=Path, default=None, help="the report (default: adaptive_lr.md beside --runs)")
    parser.add_argument("--report", action="store_true", help="only regenerate the report from the records")
    args = parser.parse_args(argv)
    os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")
    if not args.report:
        code_version()
        for seed in args.seeds:
            for adapt in (False, True):
                record = existing_record(args.steps, args.learning_rate, args.target_kl, seed, adapt, args.runs)
                status = "kept"
                if record is None:
                    record = run_one(args.steps, args.learning_rate, args.target_kl, seed, adapt, args.runs)
                    status = "ran"
                print(
                    f"seed {seed}, {callback_label(adapt)}: {status}, late median KL {late_median(record):.4f}, "
                    f"final lr {record['final_learning_rate']:.2e} ({record['code_version']})",
                    flush=True,
                )
    print(report(args.steps, args.learning_rate, args.target_kl, args.runs, args.out))


if __name__ == "__main__":
    main()
