"""
Which KL should the per-epoch early stop (``kl_stop_factor``) judge?

Two rules, same runs otherwise (same seeds, hyperparameters, budget):

- ``epoch_end``: after each epoch, one no-grad pass over the whole buffer measures the KL between the rollout policy
  and the policy the epoch leaves (the quantity ``train/kl`` logs);
- ``minibatch_mean``: the mean of the epoch's per-minibatch KLs, each taken *before* that minibatch's step (it lags
  by one step, the first minibatch of an update contributes 0); sb3-kl's rule, kept after this comparison.

Setting: Pendulum-v1 at 10x rl-zoo's learning rate (the stress setting of ``learning.py``), ClipKLPPO (its default
``kl_stop_factor=2``) and KLPPO without ratio clipping with ``kl_stop_factor=2``. For every judged epoch the script
records the judged KL and the actual KL of the policy the epoch left (measured for both rules; for
``minibatch_mean`` that measurement is extra and excluded from the timings), and the time spent judging.

Each run writes a JSON record under ``benchmarks/results/epoch_kl_stop_runs/`` (naming the commit);
``--report`` (also run at the end) writes ``benchmarks/results/epoch_kl_stop.md`` from the records.

Example::

    nice -n 5 python benchmarks/studies/epoch_kl_stop.py --seeds 0 1 2
"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = HERE / "results"
RUNS = RESULTS / "epoch_kl_stop_runs"
ENV_ID = "Pendulum-v1"
LR_MULT = 10.0
KL_STOP_FACTOR = 2.0
RULES = ("epoch_end", "minibatch_mean")
ALGOS = ("clip_klppo", "klppo_noclip")
BAND = (0.5, 2.0)


@functools.cache
def code_version() -> str:
    """
    The commit that ran, ``+modified`` when the package or this script had uncommitted changes, read once when the
    process starts its first run (the package is imported then: later edits of the checkout do not change the run).
    """
    return run_records.code_version("settings.py", "learning.py", "studies/epoch_kl_stop.py")


def instrumented(base: type, rule: str) -> type:
    """``base`` whose early stop uses ``rule`` and records, per judged epoch, the judged and the actual KL."""

    class Instrumented(base):  # type: ignore[misc, valid-type]
        _kl_stop_judge = rule

        def _setup_model(self) -> None:
            super()._setup_model()
            self.judgements: list[dict[str, Any]] = []
            self.judge_seconds = 0.0
            self.train_seconds = 0.0

        def train(self) -> None:
            start = time.perf_counter()
            super().train()
            self.train_seconds += time.perf_counter() - start

        def _kl_ran_away(self, epoch_kl_sum: Any, epoch_states: int, target_kl: float, epoch: int) -> bool:
            start = time.perf_counter()
            stop = super()._kl_ran_away(epoch_kl_sum, epoch_states, target_kl, epoch)
            self.judge_seconds += time.perf_counter() - start
            # the actual KL of the policy this epoch left (already measured by the epoch_end rule)
            measured = self._epoch_end_kl
            extra = time.perf_counter()
            actual = float(np.mean((measured or self._measure_update_kl())[0]))
            if measured is None:
                self.train_seconds -= time.perf_counter() - extra  # not part of the minibatch_mean rule's cost
            judged = actual if rule == "epoch_end" else float(epoch_kl_sum.item()) / max(epoch_states, 1)
            self.judgements.append(
                dict(update=self._n_updates, epoch=epoch, judged=judged, actual=actual, target=target_kl, stop=bool(stop))
            )
            return stop

    Instrumented.__name__ = f"{base.__name__}_{rule}"
    return Instrumented


def run_one(algo: str, rule: str, seed: int, budget: int = 100_000, runs: Path = RUNS) -> dict[str, Any]:
    import torch as th

    th.set_num_threads(1)
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    import sb3_kl
    from grid import N_EVAL_EPISODES
    from grid_runs import scale_learning_rate
    from settings import settings_for

    setting = settings_for(algo, ENV_ID)
    kwargs = dict(setting["kwargs"])
    scale_learning_rate(kwargs, LR_MULT)
    kwargs["kl_stop_factor"] = KL_STOP_FACTOR
    base = sb3_kl.ClipKLPPO if algo == "clip_klppo" else sb3_kl.KLPPO
    env = make_vec_env(ENV_ID, n_envs=setting["n_envs"], seed=seed)
    updates: list[dict[str, Any]] = []

    class Updates(BaseCallback):
        """The logs of the update that just ended (read at the next rollout's start)."""

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            values = self.model.logger.name_to_value
            if "train/kl" in values and self.model._n_updates > sum(u["epochs"] for u in updates):
                updates.append(
                    dict(
                        kl=float(values["train/kl"]),
                        target=float(values["train/target_kl"]),
                        epochs=int(values["train/early_stop_epoch"]),
                        return_mean=(
                            float(np.mean([i["r"] for i in self.model.ep_info_buffer]))
                            if self.model.ep_info_buffer
                            else float("nan")
                        ),
                    )
                )

        def _on_training_end(self) -> None:
            self._on_rollout_start()

    model = instrumented(base, rule)("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    start = time.perf_counter()
    model.learn(budget, callback=Updates())
    wall = time.perf_counter() - start
    eval_env = make_vec_env(ENV_ID, n_envs=1, seed=10_000 + seed)
    returns, _ = evaluate_policy(model, eval_env, n_eval_episodes=N_EVAL_EPISODES["full"], deterministic=True)
    record = dict(
        question="which KL the per-epoch early stop judges",
        algo=algo,
        rule=rule,
        env=ENV_ID,
        lr_mult=LR_MULT,
        kl_stop_factor=KL_STOP_FACTOR,
        seed=seed,
        budget=budget,
        eval_mean=float(returns),
        updates=updates,
        judgements=model.judgements,
        train_seconds=model.train_seconds,
        judge_seconds=model.judge_seconds,
        wall_seconds=wall,
        torch_threads=1,
        code_version=code_version(),
        run_environment=run_records.run_environment(),
    )
    runs.mkdir(parents=True, exist_ok=True)
    (runs / f"{algo}__{rule}__s{seed}.json").write_text(json.dumps(record, indent=1))
    return record


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    return f"{np.mean(values):.{digits}g} ± {np.std(values):.{digits - 1}g}" if len(values) > 1 else f"{values[0]:.{digits}g}"


def summarize(record: dict[str, Any]) -> dict[str, float]:
    """Per-run figures (KLs as multiples of the target)."""
    updates = record["updates"]
    ratios = np.array([u["kl"] / u["target"] for u in updates])
    judged = record["judgements"]
    first = [j for j in judged if j["epoch"] == 0]
    # judgements grouped by update (``update`` counts epochs: ``update - epoch`` is constant within an update)
    by_update: dict[int, list[dict[str, Any]]] = {}
    for j in judged:
        by_update.setdefault(j["update"] - j["epoch"], []).append(j)
    peaked = [js for js in by_update.values() if any(j["actual"] > KL_STOP_FACTOR * j["target"] for j in js)]
    recovered = [js for js in peaked if js[-1]["actual"] <= KL_STOP_FACTOR * js[-1]["target"]]
    return dict(
        eval_mean=record["eval_mean"],
        in_band=float(np.mean((ratios >= BAND[0]) & (ratios <= BAND[1]))),
        over_stop=float(np.mean(ratios > KL_STOP_FACTOR)),
        kl_ratio_mean=float(ratios.mean()),
        kl_ratio_max=float(ratios.max()),
        epochs=float(np.mean([u["epochs"] for u in updates])),
        judged_over_actual=float(np.sum([j["judged"] for j in judged]) / max(np.sum([j["actual"] for j in judged]), 1e-12)),
        first_epoch_judged=float(np.mean([j["judged"] / j["target"] for j in first])),
        first_epoch_actual=float(np.mean([j["actual"] / j["target"] for j in first])),
        peaks=float(len(peaked)),
        peaks_recovered=float(len(recovered)),
        judge_cost=record["judge_seconds"] / record["train_seconds"],
        train_seconds=record["train_seconds"],
    )


def plot_update_kl(records: list[dict[str, Any]], path: Path) -> None:
    """
    Draw the per-update KL / target of each (algorithm, rule), pooled over seeds, with the band and the stop, to a PNG.

    :param records: The runs' records
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {(r["algo"], r["rule"]) for r in records}
    groups = [(algo, rule) for algo in ALGOS for rule in RULES if (algo, rule) in present]
    ratios = [
        [u["kl"] / u["target"] for r in records if (r["algo"], r["rule"]) == group for u in r["updates"]] for group in groups
    ]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.axhspan(BAND[0], BAND[1], color="0.9", label=f"band [{BAND[0]:g}, {BAND[1]:g}] x target")
    ax.axhline(KL_STOP_FACTOR, color="tab:red", lw=1, ls="--", label=f"stop: kl_stop_factor={KL_STOP_FACTOR:g}")
    ax.boxplot(ratios, whis=(5, 95), showfliers=True, flierprops=dict(markersize=2))
    ax.set_xticks(range(1, len(groups) + 1), [f"{algo}\n{rule}" for algo, rule in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("update KL / target")
    ax.set_title(f"{ENV_ID}, learning rate x{LR_MULT:g}: KL of each update, all seeds (whiskers 5-95 %)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def report() -> str:
    records = [json.loads(path.read_text()) for path in sorted(RUNS.glob("*.json"))]
    versions = sorted({r["code_version"] for r in records})
    budgets = ", ".join(f"{b:,}" for b in sorted({r["budget"] for r in records}))
    plot_update_kl(records, RESULTS / "epoch_kl_stop.png")
    lines = [
        "# Which KL should the per-epoch early stop judge?",
        "",
        "![KL per update, by rule](epoch_kl_stop.png)",
        "",
        "| algo | rule | seeds | in band | over stop | eval return |",
        "|---|---|---|---|---|---|",
    ]
    for algo in ALGOS:
        for rule in RULES:
            group = [summarize(r) for r in records if r["algo"] == algo and r["rule"] == rule]
            if group:
                columns = (("in_band", 3), ("over_stop", 3), ("eval_mean", 4))
                cells = [_fmt([g[name] for g in group], digits) for name, digits in columns]
                lines.append(f"| {algo} | {rule} | {len(group)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Produced by `python benchmarks/studies/epoch_kl_stop.py` (records in `benchmarks/results/epoch_kl_stop_runs/`, "
        f"code version(s): {', '.join(versions)}). {ENV_ID}, rl-zoo settings with the learning rate x{LR_MULT:g}, "
        f"`kl_stop_factor={KL_STOP_FACTOR:g}`, {budgets} environment steps per run, one torch thread, mean ± std over seeds.",
        "",
        "- `epoch_end`: after each epoch, the mean per-state KL of the policy the epoch leaves over the whole buffer "
        "(one no-grad pass);",
        "- `minibatch_mean`: the mean of the epoch's per-minibatch KLs, each taken before that minibatch's step.",
        "",
        "KLs are multiples of the target. `update KL` is `train/kl` (exact, over the buffer, after the update); "
        f"`in band` the share of updates with KL in [{BAND[0]}, {BAND[1]}] x target; `over stop` the share above "
        f"`kl_stop_factor` x target; `judged / actual` the sum over judged epochs of the judged KL over the sum of the "
        "actual KL of the policy the epoch left; `1st epoch` the judged vs actual KL after the first epoch of an "
        "update; `peaks` the updates in which the KL of the policy some epoch left exceeded `kl_stop_factor` x target, "
        "`back below` those of them whose final KL ended at or below it (the remaining epochs' penalty pulled it back); "
        "`judge cost` the time spent judging over the time in `train()` (for `minibatch_mean` the extra "
        "measurement of the actual KL is excluded).",
        "",
        "| algo | rule | seeds | eval return | update KL (mean) | update KL (max) | in band | over stop | epochs run "
        "| judged / actual | 1st epoch judged | 1st epoch actual | peaks | back below | judge cost |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for algo in ALGOS:
        for rule in RULES:
            group = [summarize(r) for r in records if r["algo"] == algo and r["rule"] == rule]
            if not group:
                continue

            def col(name: str, digits: int = 3, group: list[dict[str, float]] = group) -> str:
                return _fmt([g[name] for g in group], digits)

            lines.append(
                f"| {algo} | {rule} | {len(group)} | {col('eval_mean', 4)} | {col('kl_ratio_mean')} | {col('kl_ratio_max')} "
                f"| {col('in_band')} | {col('over_stop')} | {col('epochs')} | {col('judged_over_actual')} "
                f"| {col('first_epoch_judged')} | {col('first_epoch_actual')} | {col('peaks')} | {col('peaks_recovered')} "
                f"| {col('judge_cost', 2)} |"
            )
    lines += [
        "",
        "Per run:",
        "",
        "| algo | rule | seed | eval return | in band | over stop | epochs run | peaks | back below | code |",
    ]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        s = summarize(r)
        lines.append(
            f"| {r['algo']} | {r['rule']} | {r['seed']} | {s['eval_mean']:.1f} | {s['in_band']:.2f} | {s['over_stop']:.2f} "
            f"| {s['epochs']:.2f} | {s['peaks']:.0f} | {s['peaks_recovered']:.0f} | {r['code_version']} |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / "epoch_kl_stop.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--budget", type=int, default=100_000, help="environment steps per run")
    parser.add_argument("--report", action="store_true", help="only regenerate the report from the records")
    args = parser.parse_args(argv)
    if not args.report:
        code_version()
        for seed in args.seeds:
            for algo in args.algos:
                for rule in args.rules:
                    record = run_one(algo, rule, seed, args.budget)
                    print(algo, rule, seed, f"{record['eval_mean']:.1f}", f"{record['train_seconds']:.0f}s", flush=True)
    print(report())


if __name__ == "__main__":
    main()
