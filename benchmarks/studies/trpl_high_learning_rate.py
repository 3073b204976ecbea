"""
Where TRPL loses at ten times the learning rate: its per-state bound holds at x10 as at x1, yet its return on
Pendulum-v1 falls (the grid's stress rows). This study re-runs grid cells (same settings, seeds and budget, through
``grid_runs.train_and_evaluate``, which re-makes the grid's run bit for bit) with a probe that keeps TRPL's own
``train/`` figures of every update: how many states the projection moved, how far the network's raw output left the
bound before the enforcement, how many enforcement steps and how much move-back each update needed, the critic's fit
and the policy's spread. Writes ``benchmarks/results/trpl_high_learning_rate.{json,md,png}``, each run appended to the
JSON as it finishes (a stopped study resumes); ``--report`` rewrites the page from the JSON.

    python benchmarks/studies/trpl_high_learning_rate.py [--envs Pendulum-v1] [--seeds 0 1] [--n-epochs 2]

``--n-epochs`` runs the same cells with fewer epochs per update than the zoo entry's (not grid runs): whether the
loss at x10 comes from the step's size, which the bound holds, or from many epochs of large steps inside it.
    python benchmarks/studies/trpl_high_learning_rate.py --report
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

OUT = HERE / "results" / "trpl_high_learning_rate.md"
LR_MULTS = (1.0, 10.0)
# TRPL's per-update figures kept (train/<name>)
KEYS = (
    "projected_fraction",
    "distance_max_before_enforcement",
    "distance_max",
    "distance_bound",
    "enforcement_steps",
    "enforcement_rejected_tries",
    "enforcement_step_fraction",
    "trust_region_loss",
    "policy_gradient_loss",
    "value_loss",
    "explained_variance",
    "action_std_mean",
    "kl",
)


def enforcement_tries(update: dict[str, float]) -> float:
    """
    An update's regression tries, accepted steps and rejected ones (the figure this study reports as regression
    steps); records made before ``train/enforcement_rejected_tries`` existed counted every try in ``enforcement_steps``.
    """
    return update["enforcement_steps"] + update.get("enforcement_rejected_tries", 0.0)


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when the package or this script had uncommitted changes."""
    return run_records.code_version("settings.py", "grid_runs.py", f"studies/{Path(__file__).name}")


def run(env_id: str, seed: int, lr_mult: float, n_epochs: int | None = None) -> dict[str, Any]:
    """
    One grid run of TRPL with the probe (with ``n_epochs``, the same cell with that many epochs per update)

    :return: its eval returns and TRPL's figures of every update
    """
    from stable_baselines3.common.callbacks import BaseCallback

    from grid_runs import train_and_evaluate

    updates: list[dict[str, float]] = []

    class Probe(BaseCallback):
        """Reads the logger's ``train/`` values of the last update at each rollout's start (before they are dumped)."""

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            values = self.model.logger.name_to_value
            if "train/distance_max" in values:
                updates.append({key: float(values[f"train/{key}"]) for key in KEYS if f"train/{key}" in values})

    overrides = {} if n_epochs is None else {"n_epochs": n_epochs}
    spec = dict(algo="trpl", env=env_id, seed=seed, lr_mult=lr_mult, tier="full", overrides=overrides)
    record = train_and_evaluate(spec, probes=[Probe()])
    return dict(env=env_id, seed=seed, lr_mult=lr_mult, n_epochs=n_epochs, eval_mean=record["eval_mean"], updates=updates)


def grid_epochs(env_id: str) -> int:
    """The epochs per update of TRPL's grid settings on ``env_id`` (PPO's zoo entry, else SB3's default 10)."""
    from settings import n_epochs_for

    return n_epochs_for("trpl", env_id)


def variants(runs: list[dict[str, Any]], env_id: str) -> list[int | None]:
    """The epoch settings run on ``env_id``: None (the grid's) first, then the fewer-epoch variants."""
    return sorted({r.get("n_epochs") for r in runs if r["env"] == env_id}, key=lambda n: -1 if n is None else n)


def bound(env_id: str) -> float:
    """TRPL's joint per-state bound in the grid on ``env_id`` (``settings.TRPL_BOUNDS``)."""
    from settings import settings_for

    kwargs = settings_for("trpl", env_id)["kwargs"]
    return kwargs["mean_bound"] + kwargs.get("cov_bound", 0.0)


def summary(runs: list[dict[str, Any]]) -> list[str]:
    """The page's table: per task and learning rate, the medians over the updates of every seed."""
    lines = [
        "| task | lr | epochs | runs | eval return | projected states | raw max / bound | enforcement steps | kept step "
        "| explained variance | action std |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = [(env, n, m) for env in sorted({r["env"] for r in runs}) for n in variants(runs, env) for m in LR_MULTS]
    for env_id, n_epochs, lr_mult in cells:
        cell = [r for r in runs if r["env"] == env_id and r["lr_mult"] == lr_mult and r.get("n_epochs") == n_epochs]
        if cell:
            ups = [u for r in cell for u in r["updates"]]

            def med(key: str, ups: list[dict[str, float]] = ups) -> float:
                return float(np.median([u[key] for u in ups if key in u]))

            raw = float(np.median([u["distance_max_before_enforcement"] for u in ups])) / bound(env_id)
            epochs = f"{grid_epochs(env_id)} (grid)" if n_epochs is None else str(n_epochs)
            lines.append(
                f"| {env_id} | x{lr_mult:g} | {epochs} | {len(cell)} | {np.mean([r['eval_mean'] for r in cell]):.1f} | "
                f"{med('projected_fraction'):.1%} | {raw:.1f} | {np.median([enforcement_tries(u) for u in ups]):.0f} | "
                f"{med('enforcement_step_fraction'):.2f} | {med('explained_variance'):.2f} | {med('action_std_mean'):.3f} |"
            )
    return lines


def findings(runs: list[dict[str, Any]]) -> list[str]:
    """What the figures say, per task, computed from the runs (x10 against x1)."""
    out = []
    for env_id in sorted({r["env"] for r in runs}):
        out.extend(fewer_epochs(runs, env_id))
        grid_runs = [r for r in runs if r["env"] == env_id and r.get("n_epochs") is None]
        cells = {m: [r for r in grid_runs if r["lr_mult"] == m] for m in LR_MULTS}
        if not all(cells.values()):
            continue

        def med(m: float, key: str, cells: dict[float, list[dict[str, Any]]] = cells) -> float:
            return float(np.median([u[key] for r in cells[m] for u in r["updates"] if key in u]))

        def last_std(m: float, cells: dict[float, list[dict[str, Any]]] = cells) -> float:
            return float(np.mean([r["updates"][-1]["action_std_mean"] for r in cells[m]]))

        raw = {m: med(m, "distance_max_before_enforcement") / bound(env_id) for m in LR_MULTS}
        kl = {m: med(m, "kl") for m in LR_MULTS}
        fit = {m: med(m, "explained_variance") for m in LR_MULTS}
        steps = {m: float(np.median([enforcement_tries(u) for r in cells[m] for u in r["updates"]])) for m in LR_MULTS}
        kept = {m: med(m, "enforcement_step_fraction") for m in LR_MULTS}
        std = {m: last_std(m) for m in LR_MULTS}
        steps_alike = "alike" if kl[10.0] <= 1.25 * kl[1.0] else "larger at x10"
        critic = "alike" if abs(fit[10.0] - fit[1.0]) <= 0.1 else ("worse at x10" if fit[10.0] < fit[1.0] else "better at x10")
        kept_text = (
            f"{kept[10.0]:.2f} of the actor's step at both rates"
            if round(kept[10.0], 2) == round(kept[1.0], 2)
            else f"{kept[10.0]:.2f} of the actor's step instead of {kept[1.0]:.2f}"
        )
        out.append(
            f"- {env_id}: median per-update `train/kl` {kl[1.0]:.4f} at x1, {kl[10.0]:.4f} at x10 ({steps_alike});"
            f" the critic's explained variance {fit[1.0]:.2f} and {fit[10.0]:.2f} ({critic}). The network's raw output"
            f" leaves the bound farther ({raw[10.0]:.1f} against {raw[1.0]:.1f} x the bound); the enforcement takes"
            f" {steps[10.0]:.0f} regression steps per update instead of {steps[1.0]:.0f} (each an Adam step at the"
            f" run's rate) and keeps {kept_text}; the action std"
            f" ends at {std[10.0]:.2f} against {std[1.0]:.2f} ({'broader' if std[10.0] > std[1.0] else 'narrower'} at x10)."
        )
    return out


def fewer_epochs(runs: list[dict[str, Any]], env_id: str) -> list[str]:
    """Per fewer-epoch variant on ``env_id``: its return at x1 and x10 beside the grid's, on the seeds both have."""
    out = []
    for n_epochs in variants(runs, env_id)[1:]:
        seeds = sorted({r["seed"] for r in runs if r["env"] == env_id and r.get("n_epochs") == n_epochs})

        def ret(lr_mult: float, epochs: int | None, seeds: list[int] = seeds) -> str:
            cell = [r for r in runs if (r["env"], r["lr_mult"], r.get("n_epochs")) == (env_id, lr_mult, epochs)]
            values = [r["eval_mean"] for r in cell if r["seed"] in seeds]
            return f"{np.mean(values):.1f}" if len(values) == len(seeds) else "not run"

        out.append(
            f"- {env_id}, {n_epochs} epochs per update instead of {grid_epochs(env_id)} (seeds"
            f" {', '.join(map(str, seeds))}): eval return {ret(10.0, n_epochs)} at x10 and {ret(1.0, n_epochs)} at x1,"
            f" against the grid's {ret(10.0, None)} and {ret(1.0, None)}."
        )
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("projected_fraction", "states the projection moved"),
        ("distance_max_before_enforcement", "raw output's max distance / bound"),
        ("explained_variance", "critic's explained variance"),
        ("action_std_mean", "action std (mean)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for r in [r for r in runs if r.get("n_epochs") is None]:
            scale = bound(r["env"]) if key.startswith("distance") else 1.0
            values = [u[key] / scale for u in r["updates"]]
            ax.plot(values, color="tab:blue" if r["lr_mult"] == 1.0 else "tab:red", lw=0.8, alpha=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("update")
        if key.startswith("distance"):
            ax.set_yscale("log")
    axes[0].plot([], [], color="tab:blue", label="x1")
    axes[0].plot([], [], color="tab:red", label="x10")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"TRPL on {', '.join(sorted({r['env'] for r in runs}))}: x1 (blue) and x10 (red) learning rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(record: dict[str, Any]) -> str:
    runs = record["runs"]
    plot(runs, OUT.with_suffix(".png"))
    text = "\n".join(
        [
            "# TRPL at ten times the learning rate",
            "",
            f"![TRPL's per-update figures at x1 and x10]({OUT.with_suffix('.png').name})",
            "",
            *summary(runs),
            "",
            "Medians over every update of the runs (per update: the share of the minibatch states the projection moved,"
            " averaged over the update's minibatches; the largest per-state distance of the network's raw output to the"
            " rollout policy before the enforcement, over the bound; the enforcement's regression steps and the share of"
            " the update's actor step kept by its move-back (1: none needed); the critic's explained variance; the"
            " action std). Eval return: the grid's evaluation of the same runs, which the grid's rows re-make bit for bit;"
            " rows with other epochs are not grid runs. The figure shows the grid's runs.",
            "",
            *findings(runs),
            "",
            "Written by "
            + ", ".join(
                f"`python benchmarks/studies/trpl_high_learning_rate.py --envs {env_id} --seeds "
                + " ".join(map(str, sorted({r["seed"] for r in runs if (r["env"], r.get("n_epochs")) == (env_id, n)})))
                + ("" if n is None else f" --n-epochs {n}")
                + "`"
                for env_id in sorted({r["env"] for r in runs})
                for n in variants(runs, env_id)
            )
            + "; runs made by sb3-kl"
            f" {', '.join(sorted({r.get('code_version', record['code_version']) for r in runs}))}, from"
            f" `benchmarks/results/{OUT.with_suffix('.json').name}`.",
        ]
    )
    OUT.write_text(text + "\n")
    return text


def run_key(made: dict[str, Any]) -> tuple[str, int, float, int | None]:
    """What identifies a run: task, seed, learning-rate multiple and epochs (None: the grid's)."""
    return made["env"], made["seed"], made["lr_mult"], made.get("n_epochs")


def save_run(path: Path, record: dict[str, Any], made: dict[str, Any]) -> dict[str, Any]:
    """
    Write a finished run into the study's JSON, in place of an earlier one of its cell, under an exclusive lock and
    on the file's current runs: two studies run side by side (other cells) keep each other's runs.

    :return: the record as written
    """
    import fcntl

    with open(path, "a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        text = file.read()
        runs = json.loads(text)["runs"] if text else record["runs"]
        runs = [r for r in runs if run_key(r) != run_key(made)]
        record = {**record, "runs": [*runs, made]}
        file.seek(0)
        file.truncate()
        file.write(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=["Pendulum-v1"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--n-epochs", type=int, default=None, help="epochs per update instead of the zoo entry's")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args(argv)
    path = OUT.with_suffix(".json")
    record = json.loads(path.read_text()) if path.exists() else None
    if not args.report:
        seeds = " ".join(map(str, args.seeds))
        command = f"python benchmarks/studies/trpl_high_learning_rate.py --envs {' '.join(args.envs)} --seeds {seeds}"
        command += "" if args.n_epochs is None else f" --n-epochs {args.n_epochs}"
        version = code_version()
        if record is None:
            record = dict(command=command, code_version=version, run_environment=run_records.run_environment(), runs=[])
        # runs made earlier are kept (each names its commit) unless this command asks for them again, when one made by
        # other code is made again: the grid's run it re-makes changes with the code
        for made in record["runs"]:
            made.setdefault("code_version", record["code_version"])
        record["command"], record["code_version"] = command, version
        for env_id in args.envs:
            for seed in args.seeds:
                for lr_mult in LR_MULTS:
                    key = (env_id, seed, lr_mult, args.n_epochs)
                    same = [r for r in record["runs"] if run_key(r) == key]
                    if any(r["code_version"] == version for r in same):
                        continue
                    made = {**run(env_id, seed, lr_mult, args.n_epochs), "code_version": version}
                    record = save_run(path, record, made)
                    epochs = grid_epochs(env_id) if args.n_epochs is None else args.n_epochs
                    print(f"done {env_id} seed {seed} x{lr_mult:g}, {epochs} epochs: eval {made['eval_mean']:.1f}", flush=True)
    if record is None:
        raise SystemExit(f"no {path}: run the study first")
    print(write_report(record))


if __name__ == "__main__":
    main()
