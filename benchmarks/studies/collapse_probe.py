"""
What happens in the learning grid's collapses, and what the per-update KL does not see there.

Each collapsed sb3-kl run of ``benchmarks/results/runs/<tier>/`` (``measures.count_collapses``) is trained again with
the same settings and seed and a probe that records, after each rollout:

- how the rollout's episodes end: the environment's forward velocity (``x_velocity`` in its ``info``, where it reports
  one) and the episodes that ended by termination (a fall) rather than by the time limit;
- the KL that the observation normalization alone causes: ``VecNormalize`` updates its running statistics during the
  rollout, which moves the policy's actions on the same raw states without any change of its parameters. It is the
  monitor's ``kl/normalization_shift``: the exact KL(pi(norm_start(s)) || pi(norm_end(s))), summed over action
  dimensions, on the rollout's states, with the statistics at the start and at the end of the rollout and the
  parameters that acted in it;
- the last update's KL on the states of this rollout, which the updated policy chose, beside the monitor's KL of the
  same update on the states it trained on: the exact KL(before || after), summed over action dimensions, both
  policies evaluated on the rollout's stored observations;
- the KL coefficient beta and whether it sits at its lower bound (the penalty then does nothing), and the mean std
  of a Gaussian policy.

The probe draws no random numbers and changes neither the model nor the environment, so the run trains as the grid's
record did on the machine that made it (checked: same evaluation returns and per-update KLs, ``run_records.same_run``).
The 20 rollouts up to the curve's best point (*before*) are compared with those of the fall (*fall*: the rollouts
after the best point up to the one after which the curve fell below 50 % of its gain), and the updates that made their
policies (as ``measures.fall_kl`` takes them); the falls also with the rest of the run (*after*).

    python benchmarks/studies/collapse_probe.py [--tier full] [--workers 2]
    python benchmarks/studies/collapse_probe.py --report    # only rewrite the table from collapse_probe.json
    python benchmarks/studies/collapse_probe.py --healthy-cells klppo_noclip:Hopper-v5   # and the cell's other runs

writes ``benchmarks/results/collapse_probe.md`` and ``.json``.
"""

import argparse
import copy
import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import grid  # noqa: E402
import grid_runs  # noqa: E402
import measures  # noqa: E402
import run_records  # noqa: E402

#: Rollouts before the curve's best point that make the *before* phase
BEFORE_ROLLOUTS = 20


def make_probe() -> Any:
    """:return: a fresh :class:`CollapseProbe` callback (built here so that SB3 is imported in the worker)"""
    from stable_baselines3.common.callbacks import BaseCallback

    class CollapseProbe(BaseCallback):
        """Records, after each rollout, how its episodes ended and beta (see the module)."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict[str, float]] = []

        def _on_rollout_start(self) -> None:
            self.velocities: list[float] = []
            self.terminated = self.truncated = 0
            # the policy that acts in this rollout, and the one that acted in the last (before the update between)
            self.previous_policy = getattr(self, "acting_policy", None)
            self.acting_policy = copy.deepcopy(self.model.policy)

        def _on_step(self) -> bool:
            for info, done in zip(self.locals["infos"], self.locals["dones"], strict=True):
                if "x_velocity" in info:
                    self.velocities.append(float(info["x_velocity"]))
                if done:
                    if info.get("TimeLimit.truncated", False):
                        self.truncated += 1
                    else:
                        self.terminated += 1
            return True

        def _on_rollout_end(self) -> None:
            policy, model = self.model.policy, self.model
            buffer = model.ep_info_buffer
            row = dict(
                timesteps=float(self.num_timesteps),
                curve=float(np.mean([info["r"] for info in buffer])) if buffer else float("nan"),
                velocity=float(np.mean(self.velocities)) if self.velocities else float("nan"),
                terminated=float(self.terminated),
                truncated=float(self.truncated),
                kl_coef=float("nan"),
                kl_coef_at_floor=float("nan"),
                std=float(policy.log_std.detach().exp().mean()) if hasattr(policy, "log_std") else float("nan"),
            )
            if self.previous_policy is not None:
                row["last_update_kl_here"] = self._last_update_kl_here()
            controller = getattr(model, "kl_controller", None)
            if controller is not None and model.has_kl_coef:
                row["kl_coef"] = float(model.kl_coef)
                row["kl_coef_at_floor"] = float(model.kl_coef <= controller.kl_coef_bounds[0] * (1.0 + 1e-9))
            self.rows.append(row)

        def _last_update_kl_here(self) -> float:
            """
            The exact KL(before || after) of the last update (forward, summed over action dimensions, as the
            monitor's), on the states of the rollout its result acted in, rather than on those it trained on: both
            policies evaluated on the same stored (normalized) observations, so only the parameters differ.
            """
            import torch as th
            from stable_baselines3.common.utils import obs_as_tensor

            buffer = self.model.rollout_buffer
            obs = buffer.observations.reshape((-1, *buffer.obs_shape))
            with th.no_grad():
                tensor = obs_as_tensor(obs, self.model.device)
                before = self.previous_policy.get_distribution(tensor).distribution
                after = self.acting_policy.get_distribution(tensor).distribution
                kl = th.distributions.kl_divergence(before, after)
                if kl.dim() > 1:
                    kl = kl.sum(dim=-1)
            return float(kl.mean())

    return CollapseProbe()


def probe_run(record: dict[str, Any]) -> dict[str, Any]:
    """Train a record's run again with the probe; :return: the probe's rows and whether the training repeated"""
    probe = make_probe()
    again = grid_runs.train_and_evaluate(grid_runs.rerun_spec(record), probes=[probe])
    # the monitor measured each rollout's normalization shift with the update that trained on it (same step count)
    shifts = {u["timesteps"]: u.get("normalization_shift", float("nan")) for u in again["kl_updates"]}
    for row in probe.rows:
        row["normalization_kl"] = shifts.get(int(row["timesteps"]), float("nan"))
    return dict(
        algo=record["algo"],
        env=record["env"],
        seed=record["seed"],
        lr_mult=record["lr_mult"],
        target_kl=record["target_kl"],
        record_code_version=record.get("code_version"),
        code_version=run_records.code_version(),
        run_environment=run_records.run_environment(),
        same_run=run_records.same_run(again, record),
        curve=record["curve"],
        kl_updates=record["kl_updates"],
        rollouts=probe.rows,
    )


def phases(probed: dict[str, Any]) -> dict[str, dict[str, float]]:
    """
    :param probed: a :func:`probe_run` result
    :return: for ``before``, ``fall`` and ``after`` (the rollouts after the fall, to the end of the run), the mean
        forward velocity, falls per 1000 steps, normalization KL / target, per-update KL / target (the monitor's,
        from the record), share of updates with beta at its floor, and rollouts
    """
    best_at, fell_at = measures.fall_span(probed)  # the same fall as measures.fall_kl's
    times = [point[0] for point in probed["curve"]]
    spans = {
        "before": (times[max(times.index(best_at) - BEFORE_ROLLOUTS, 0)], best_at),
        "fall": (best_at, fell_at),
        "after": (fell_at, times[-1]),
    }
    target = probed["target_kl"]
    out = {}
    for name, (low, high) in spans.items():
        # a rollout row at t describes the rollout that ended at t; the update at t (and the beta it used, recorded
        # at t) made the policy of the rollouts after it
        rows = [r for r in probed["rollouts"] if low < r["timesteps"] <= high]
        at_updates = [r for r in probed["rollouts"] if low <= r["timesteps"] < high]
        updates = [u["mean"] / target for u in probed["kl_updates"] if low <= u["timesteps"] < high]
        steps = high - low
        falls = sorted((r["terminated"] for r in rows), reverse=True)
        out[name] = dict(
            rollouts=float(len(rows)),
            # how concentrated the falls are: the fewest rollouts that hold half of them
            rollouts_with_half_the_falls=float(np.searchsorted(np.cumsum(falls), sum(falls) / 2) + 1) if sum(falls) else 0.0,
            velocity=float(np.mean([r["velocity"] for r in rows])),
            falls_per_1000_steps=1000.0 * sum(falls) / steps if steps else float("nan"),
            normalization_kl=float(np.mean([r["normalization_kl"] for r in rows]) / target),
            update_kl=float(np.mean(updates)) if updates else float("nan"),
            # the same updates' KL on the states of the rollouts their results acted in (probes made before it: nan)
            update_kl_where_it_acted=float(np.mean([r.get("last_update_kl_here", np.nan) for r in rows]) / target),
            kl_coef_at_floor=float(np.mean([r["kl_coef_at_floor"] for r in at_updates])),
        )
    return out


def collapsed_runs(tier: str) -> list[dict[str, Any]]:
    """The grid's sb3-kl records with a collapse, one per distinct training (``run_records.distinct_trainings``)."""
    records = measures.sb3_kl_collapses(run_records.group_records(run_records.load_records(tier)))
    return sorted(run_records.distinct_trainings(records), key=run_records.seed_key)


def healthy_runs(tier: str, cells: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The grid's runs at the zoo's learning rate of the ``(algo, env)`` cells that did not collapse."""
    groups = run_records.group_records(run_records.load_records(tier))
    runs = [r for algo, env in cells for r in groups.get((env, algo, 1.0), []) if not measures.count_collapses(r["curve"])]
    return sorted(runs, key=run_records.seed_key)


#: A rollout whose last update's KL where it acted exceeds this multiple of the target counts as flagged
FLAG_FACTOR = 10.0
#: A rollout with at least this many falls (episodes ended by termination) counts as a falling one
FALLING_ROLLOUT = 5


def where_it_acted(probed: dict[str, Any]) -> dict[str, float]:
    """
    Over a whole run: each update's KL on the states its result acted in, / target (median, 95th percentile, max),
    the rollouts where it exceeds :data:`FLAG_FACTOR` x target (flagged), how many of those had at least
    :data:`FALLING_ROLLOUT` falls, and how many falling rollouts there were.
    """
    rows = [r for r in probed["rollouts"] if "last_update_kl_here" in r]
    ratios = np.array([r["last_update_kl_here"] for r in rows]) / probed["target_kl"]
    falling = np.array([r["terminated"] >= FALLING_ROLLOUT for r in rows])
    flagged = ratios > FLAG_FACTOR
    return dict(
        median=float(np.median(ratios)),
        p95=float(np.percentile(ratios, 95)),
        max=float(ratios.max()),
        flagged=float(flagged.sum()),
        flagged_falling=float((flagged & falling).sum()),
        falling=float(falling.sum()),
    )


def detection_report(results: list[dict[str, Any]], healthy: list[dict[str, Any]]) -> list[str]:
    """The section comparing the KL where the updates acted in the collapsed runs and in their cells' other runs."""
    cells = sorted({(r["env"], r["algo"]) for r in healthy})
    lines = [
        "",
        "## The KL where each update acted, in the runs that collapse and in those that do not",
        "",
        f"Every run of the cells {', '.join(f'{algo} on {env}' for env, algo in cells)} (the collapsed runs above and "
        "their cells' other seeds, probed the same way: `python benchmarks/studies/collapse_probe.py --healthy-cells "
        + " ".join(f"{algo}:{env}" for env, algo in cells)
        + "`), over all its rollouts: each update's exact KL on the states of the rollout its result acted in, / "
        f"target; flagged: rollouts where it exceeds {FLAG_FACTOR:g} x target, and how many of them had at least "
        f"{FALLING_ROLLOUT} falls; falling rollouts: all rollouts with at least {FALLING_ROLLOUT} falls. Whether such a "
        "KL could tell a control that an update went wrong, one rollout after it acted, and how often it would fire "
        "on runs that do not collapse.",
        "",
        "| env | algo | seed | collapses | median | p95 | max | flagged (with falls) | falling rollouts |",
        "|" + "---|" * 9,
    ]
    runs = [r for r in results if (r["env"], r["algo"]) in cells] + healthy
    for r in sorted(runs, key=lambda r: (r["env"], r["algo"], r["seed"])):
        w = where_it_acted(r)
        lines.append(
            f"| {r['env']} | {r['algo']} | {r['seed']} | {measures.count_collapses(r['curve'])} | {w['median']:.2f} | "
            f"{w['p95']:.2f} | {w['max']:.1f} | {w['flagged']:.0f} ({w['flagged_falling']:.0f}) | {w['falling']:.0f} |"
        )
    return lines


def before_and_fall(
    phase_values: dict[str, dict[str, float]],
    name: str,
    spec: str,
    scale: float = 1.0,
    unit: str = "",
    shown: tuple[str, ...] = ("before", "fall"),
) -> str:
    """
    One table cell: a :func:`phases` value before and in the fall, or in the ``shown`` phases (n/a where the
    environment reports no forward velocity, the run does not normalize observations or the algorithm has no beta).
    """
    values = [phase_values[phase][name] * scale for phase in shown]
    return " / ".join("n/a" if np.isnan(v) else f"{v:{spec}}{unit}" for v in values)


def plot_collapses(results: list[dict[str, Any]], path: Path) -> None:
    """
    Draw each probed run's learning curve with its fall shaded, and its per-update KL / target on a second axis, to a
    PNG.

    :param results: :func:`probe_run` results
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(1, len(results), figsize=(3.3 * len(results), 3.2), squeeze=False)
    for ax, probed in zip(axes[0], results, strict=True):
        best_at, fell_at = measures.fall_span(probed)
        ax.axvspan(best_at, fell_at, color="tab:red", alpha=0.15, lw=0)
        times, returns = zip(*probed["curve"], strict=True)
        ax.plot(times, returns, color="tab:blue", lw=1)
        ax.set_title(f"{probed['algo']}, {probed['env']}, seed {probed['seed']}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("timesteps", fontsize=7)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value / 1000:g}k"))
        kl = ax.twinx()
        updates = probed["kl_updates"]
        ratios = [u["mean"] / probed["target_kl"] for u in updates]
        kl.plot([u["timesteps"] for u in updates], ratios, ".", color="0.4", ms=1.5)
        kl.set_yscale("log")
        kl.yaxis.set_minor_formatter(NullFormatter())
        kl.tick_params(labelsize=7)
    axes[0][0].set_ylabel("training return (line)", fontsize=8)
    kl.set_ylabel("update KL / target (dots); shaded: the fall", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(results: list[dict[str, Any]]) -> list[str]:
    """:return: the page's opening table: per collapsed run, the fall's length and its falls and KL against before it"""
    lines = [
        "| env | algo | seed | rollouts in the fall | falls per 1000 steps before / fall | update KL / target before / fall |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        p = phases(r)
        lines.append(
            f"| {r['env']} | {r['algo']} | {r['seed']} | {p['fall']['rollouts']:.0f} | "
            f"{before_and_fall(p, 'falls_per_1000_steps', '.2f')} | {before_and_fall(p, 'update_kl', '.2f')} |"
        )
    return lines


def report(
    results: list[dict[str, Any]], healthy: list[dict[str, Any]] | None = None, figure: str | None = None
) -> str:
    """
    The Markdown report of the probed runs (and of the ``healthy`` runs of their cells, when probed).

    :param results: :func:`probe_run` results of the collapsed runs
    :param healthy: Those of their cells' runs that did not collapse, if probed
    :param figure: The name of the figure (:func:`plot_collapses`) the page opens with, if any
    """
    versions = ", ".join(sorted({f"`{r['code_version']}`" for r in results + (healthy or [])}))
    lines = [
        "# What happens in the grid's collapses",
        "",
        *([f"![learning curves and update KLs of the collapsed runs]({figure})", ""] if figure else []),
        *summary_table(results),
        "",
        f"Generated by `python benchmarks/studies/collapse_probe.py` (code {versions}): every collapsed sb3-kl run of the "
        "learning grid, one per distinct training, trained again with a probe that changes nothing in the training "
        "(`repeats`: same evaluation returns and per-update KLs as the grid's record). *before*: the "
        f"{BEFORE_ROLLOUTS} rollouts up to the curve's best point; *fall*: the rollouts after it up to the one after "
        "which the curve fell below 50 % of its gain (update KL and beta: the updates that made their policies). "
        "*after*: the rest of the run, from the end of the fall. "
        "velocity: mean forward velocity of the rollouts' steps; falls: episodes ended by termination per 1000 steps; "
        "rollouts with half the falls: the fewest rollouts of the fall that hold half of its falls (a burst of falls "
        "in a few rollouts, or falls spread over the fall); "
        "normalization KL: the exact KL by which `VecNormalize`'s statistics update over one rollout moves the policy "
        "on its states (parameters unchanged; the monitor's `kl/normalization_shift`), / target; "
        "update KL: the monitor's per-update KL / target, on the states of the rollout the update trained on; "
        "where it acted: the same updates' exact KL (forward, summed over action dimensions, as the monitor's) on the "
        "states of the rollout that their result then acted in, / target (an update that moves the policy more on the "
        "states it leads to than on those it was measured on reads higher here); "
        "beta at floor: share of those updates that KLPPO's beta entered at its lower "
        "bound, where the penalty does nothing.",
        "",
        "| env | algo | seed | repeats | rollouts before / fall / after | velocity before / fall | falls per 1000 steps "
        "before / fall / after | rollouts with half the falls of the fall | normalization KL before / fall | update KL "
        "before / fall | update KL where it acted before / fall | beta at floor before / fall |",
        "|---" * 12 + "|",
    ]
    for r in results:
        p = phases(r)
        cells = [
            before_and_fall(p, "rollouts", ".0f", shown=("before", "fall", "after")),
            before_and_fall(p, "velocity", "+.3f"),
            before_and_fall(p, "falls_per_1000_steps", ".2f", shown=("before", "fall", "after")),
            f"{p['fall']['rollouts_with_half_the_falls']:.0f}",
            before_and_fall(p, "normalization_kl", ".4f"),
            before_and_fall(p, "update_kl", ".2f"),
            before_and_fall(p, "update_kl_where_it_acted", ".2f"),
            before_and_fall(p, "kl_coef_at_floor", ".0f", scale=100.0, unit="%"),
        ]
        lines.append(
            f"| {r['env']} | {r['algo']} | {r['seed']} | {'yes' if r['same_run'] else 'no'} | " + " | ".join(cells) + " |"
        )
    if healthy:
        lines += detection_report(results, healthy)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", default="full", choices=list(grid.BUDGETS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only rewrite the table from collapse_probe.json")
    parser.add_argument(
        "--healthy-cells",
        nargs="+",
        default=[],
        metavar="ALGO:ENV",
        help="also probe the runs of these cells that did not collapse (only them: the collapsed runs' probes are read "
        "from collapse_probe.json), written to collapse_probe_healthy.json",
    )
    args = parser.parse_args(argv)
    collapsed_path = run_records.RESULTS / "collapse_probe.json"
    healthy_path = run_records.RESULTS / "collapse_probe_healthy.json"
    healthy = json.loads(healthy_path.read_text()) if healthy_path.exists() else None
    if args.report or args.healthy_cells:
        results = json.loads(collapsed_path.read_text())
    else:
        results = probe_all(collapsed_runs(args.tier), args.workers, "collapsed runs")
        collapsed_path.write_text(json.dumps(results, indent=1))
    if args.healthy_cells:
        cells = [tuple(cell.split(":", 1)) for cell in args.healthy_cells]
        healthy = probe_all(healthy_runs(args.tier, cells), args.workers, "runs that did not collapse")  # type: ignore[arg-type]
        healthy_path.write_text(json.dumps(healthy, indent=1))
    plot_collapses(results, run_records.RESULTS / "collapse_probe.png")
    text = report(results, healthy, "collapse_probe.png")
    (run_records.RESULTS / "collapse_probe.md").write_text(text)
    print(text)


def probe_all(runs: list[dict[str, Any]], workers: int, what: str) -> list[dict[str, Any]]:
    """:return: :func:`probe_run` of each record, in ``workers`` processes"""
    print(f"{len(runs)} {what} to probe", flush=True)
    with multiprocessing.get_context("spawn").Pool(max(1, min(workers, len(runs)))) as pool:
        return pool.map(probe_run, runs)


if __name__ == "__main__":
    main()
