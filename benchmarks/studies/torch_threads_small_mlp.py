"""
Does torch's default number of intra-op threads slow down a small-MLP training on CPU, compared with one thread?

Paired, interleaved runs (A B, then B A, ...): each run is a fresh Python process that trains KLPPO on CartPole-v1
for a short budget, once with torch's default threads (``OMP_NUM_THREADS`` unset, no ``torch.set_num_threads``) and
once with one thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``). Settings: rl-zoo's PPO settings for
CartPole-v1 (8 envs, ``n_steps=32``, ``batch_size=256``, 20 epochs; ``benchmarks/settings.py``) and the README's
quick-start shape (1 env, ``n_steps=256``, 10 epochs). The load average is recorded before and after every run: the
figures mean something only together with it (on a busy machine extra threads fight the other jobs for cores).

Writes ``benchmarks/results/torch_threads_small_mlp.md``, ``.json`` (naming the commit that produced them) and
``.png``; ``--report`` rewrites the page and its figure from the JSON alone (``--out`` names the pair of files; the
JSON's optional ``meta.note`` is added to the page's first paragraph).

    python benchmarks/studies/torch_threads_small_mlp.py [--pairs 3] [--steps 2048]
    python benchmarks/studies/torch_threads_small_mlp.py --report [--out benchmarks/results/torch_threads_small_mlp_idle]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
SHAPES = ("zoo", "quickstart")


def child(shape: str, threads: str, steps: int) -> dict[str, Any]:
    """One timed run inside this process (called in a fresh process by :func:`run_child`)."""
    import torch as th

    if threads == "1":
        th.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_kl import KLPPO

    if shape == "zoo":
        from settings import KLPPO_DROPPED, PPO_SETTINGS

        setting = PPO_SETTINGS["CartPole-v1"]
        kwargs = {k: v for k, v in setting["kwargs"].items() if k not in KLPPO_DROPPED}
        env = make_vec_env("CartPole-v1", n_envs=setting["n_envs"], seed=0)
    else:
        kwargs = dict(n_steps=256, batch_size=256, n_epochs=10, gamma=0.98, gae_lambda=0.8, learning_rate=1e-3)
        env = make_vec_env("CartPole-v1", n_envs=1, seed=0)
    model = KLPPO("MlpPolicy", env, seed=0, device="cpu", **kwargs)
    load_before = os.getloadavg()
    start, start_cpu = time.perf_counter(), time.process_time()
    model.learn(steps)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    return dict(
        shape=shape,
        threads=threads,
        torch_threads=th.get_num_threads(),
        steps=steps,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        load_before=load_before,
        load_after=os.getloadavg(),
    )


def run_child(shape: str, threads: str, steps: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("MKL_NUM_THREADS", None)
    if threads == "1":
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
    out = subprocess.run(
        [sys.executable, __file__, "--child", shape, threads, str(steps)], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "sb3_kl", "benchmarks/studies/torch_threads_small_mlp.py"],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.strip() + (" (with uncommitted changes)" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(child(argv[1], argv[2], int(argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2048, help="environment steps per timed run")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "torch_threads_small_mlp")
    parser.add_argument("--report", action="store_true", help="only rewrite the page and its figure from the JSON")
    args = parser.parse_args(argv)
    if args.report:
        print(write_page(json.loads(args.out.with_suffix(".json").read_text()), args.out))
        return

    start_commit = commit()  # the runs take long: the commit at the start and at the end are both recorded
    runs = []
    for shape in args.shapes:
        for pair in range(args.pairs):
            order = ("default", "1") if pair % 2 == 0 else ("1", "default")
            for threads in order:
                record = run_child(shape, threads, args.steps)
                record["pair"] = pair
                runs.append(record)
                print(
                    f"{shape} pair {pair} threads={threads} (torch {record['torch_threads']}):"
                    f" {record['seconds']:.1f} s, CPU {record['cpu_seconds']:.1f} s,"
                    f" load {record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}",
                    flush=True,
                )
    import torch as th

    end_commit = commit()
    meta = dict(
        commit=start_commit if start_commit == end_commit else f"{start_commit} (start) .. {end_commit} (end)",
        command="python benchmarks/studies/torch_threads_small_mlp.py " + " ".join(argv),
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        torch=th.__version__,
        python=platform.python_version(),
        default_torch_threads=run_child_threads(),
    )
    rows = []
    for shape in args.shapes:
        by_pair: dict[int, dict[str, dict[str, Any]]] = {}
        for record in runs:
            if record["shape"] == shape:
                by_pair.setdefault(record["pair"], {})[record["threads"]] = record
        ratios = [p["default"]["seconds"] / p["1"]["seconds"] for p in by_pair.values()]
        cpu_ratios = [p["default"]["cpu_seconds"] / p["1"]["cpu_seconds"] for p in by_pair.values()]
        loads = [r["load_before"][0] for r in runs if r["shape"] == shape] + [
            r["load_after"][0] for r in runs if r["shape"] == shape
        ]
        rows.append(
            dict(
                shape=shape,
                default_seconds=float(np.median([p["default"]["seconds"] for p in by_pair.values()])),
                one_seconds=float(np.median([p["1"]["seconds"] for p in by_pair.values()])),
                ratio_median=float(np.median(ratios)),
                ratio_min=float(min(ratios)),
                ratio_max=float(max(ratios)),
                ratios=ratios,
                cpu_ratio_median=float(np.median(cpu_ratios)),
                cpu_ratios=cpu_ratios,
                load_min=float(min(loads)),
                load_max=float(max(loads)),
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, summary=rows, runs=runs), indent=1) + "\n")
    print(write_page(dict(meta=meta, summary=rows, runs=runs), args.out))


def plot_slowdown(data: dict[str, Any], path: Path) -> None:
    """
    Draw each shape's per-pair wall-clock slowdown and CPU-seconds ratio of torch's default threads, to a PNG.

    :param data: What the JSON holds (``meta``, ``summary``, ``runs``)
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["summary"]
    fig, ax = plt.subplots(figsize=(5.5, 0.9 + 0.9 * len(rows)))
    for i, row in enumerate(rows):
        first = i == 0
        ax.plot(row["ratios"], [i + 0.12] * len(row["ratios"]), "o", color="tab:blue", label="wall-clock" if first else None)
        cpu = row["cpu_ratios"]
        ax.plot(cpu, [i - 0.12] * len(cpu), "x", color="tab:orange", label="CPU seconds" if first else None)
    ax.axvline(1.0, color="0.5", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [row["shape"] for row in rows])
    ax.invert_yaxis()  # the table's order
    ax.set_ylim(-0.6, len(rows) - 0.4)
    load = f"load average {min(r['load_min'] for r in rows):.1f}-{max(r['load_max'] for r in rows):.1f}"
    ax.set_xlabel("torch's default threads / one thread, per pair of runs")
    ax.set_title(f"KLPPO on CartPole-v1, {data['meta']['machine']}, {load}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def write_page(data: dict[str, Any], out: Path) -> str:
    """
    Write the page ``out`` (``.md``) and its figure (``.png``) from a measurement.

    :param data: What the JSON holds (``meta``, ``summary``, ``runs``)
    :param out: The path of the files without their suffix
    :return: the page's text
    """
    meta, rows, runs = data["meta"], data["summary"], data["runs"]
    steps = runs[0]["steps"]
    figure = out.with_suffix(".png")
    plot_slowdown(data, figure)
    lines = [
        "# Torch threads and small-MLP training on CPU",
        "",
        f"![slowdown of torch's default threads]({figure.name})",
        "",
        "| shape | pairs | default threads / one thread, wall-clock (median) | CPU seconds (median) | load average |",
        "|---|---|---|---|---|",
        *(
            f"| {row['shape']} | {len(row['ratios'])} | {row['ratio_median']:.2f} | {row['cpu_ratio_median']:.2f} "
            f"| {row['load_min']:.1f}-{row['load_max']:.1f} |"
            for row in rows
        ),
        "",
        f"Generated by `{meta['command'].strip()}` at commit {meta['commit']}. {meta['machine']}, torch {meta['torch']},"
        f" Python {meta['python']}; torch's default intra-op threads here: {meta['default_torch_threads']}."
        + (f" {meta['note']}" if meta.get("note") else ""),
        "",
        f"KLPPO on CartPole-v1, {steps:,} environment steps per run, each run a fresh process; pairs interleaved"
        " (default/one, then one/default). *default* = `OMP_NUM_THREADS` unset and no `torch.set_num_threads`;"
        " *one* = `OMP_NUM_THREADS=1` and `torch.set_num_threads(1)`. Slowdown = default seconds / one-thread seconds of"
        " the same pair; the CPU-seconds ratio compares the CPU time the process used (threads that wait for each other"
        " still burn CPU), which depends less on the other jobs. The 1-minute load average before/after each run is"
        " given: the machine was shared with other jobs, and the slowdown of extra threads depends on how many cores"
        " are free.",
        "",
        "| shape | default threads, s (median) | one thread, s (median) | slowdown median | slowdown min-max"
        " | CPU-seconds ratio median | load average during the runs (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['default_seconds']:.1f} | {row['one_seconds']:.1f} | {row['ratio_median']:.2f} |"
            f" {row['ratio_min']:.2f}-{row['ratio_max']:.2f} | {row['cpu_ratio_median']:.2f} |"
            f" {row['load_min']:.2f}-{row['load_max']:.2f} |"
        )
    lines += ["", "Every run (seconds, load average before -> after):", ""]
    for record in runs:
        lines.append(
            f"- {record['shape']}, pair {record['pair']}, {'default' if record['threads'] == 'default' else 'one'} thread(s)"
            f" (torch {record['torch_threads']}): {record['seconds']:.1f} s, CPU {record['cpu_seconds']:.1f} s,"
            f" load {record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}"
        )
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    return text


def run_child_threads() -> int:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True
    )
    return int(out.stdout.strip() or 0)


if __name__ == "__main__":
    main()
