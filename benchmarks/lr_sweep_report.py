"""
The learning-rate sweep's page, ``results/lr_sweep.md``, and its figure, ``results/lr_sweep.png``, from the sweep's
records (``python benchmarks/lr_sweep.py --report``): return against the learning-rate multiplier, each cell's
normalized return and share of updates in the KL band, each algorithm's robust range, the aggregates over tasks and
multipliers, and the goals.

Normalized return: ``(R - R_random) / (R_best - R_random)``, ``R`` a cell's mean evaluation return, ``R_random`` that of
a uniform-random policy under the same evaluation (:func:`random_returns`, cached beside the sweep's records) and
``R_best`` the task's best cell mean.
"""

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import run_records
from aggregate import (
    interquartile_mean,
    pooled_iqm,
    probability_of_improvement,
    probability_of_improvement_ci,
    stratified_bootstrap_ci,
)
from grid import (
    ADAPTIVE_LR_TARGET,
    AUTO_RULE_SINCE,
    QUARTER_SHARE_SINCE,
    BAND,
    N_EVAL_EPISODES,
    STRESS_LR_MULTS,
    SWEEP_ALGOS,
    SWEEP_ENVS,
    SWEEP_LR_MULTS,
    made_by_todays_auto_rule,
)
from measures import summarize
from significance import SIGNIFICANCE, fmt, verdict

#: The results folder of the page, its figure and the random policy's returns (``lr_sweep/random_returns.json``)
RESULTS = run_records.MAIN_RESULTS
#: The seeds every cell runs (a cell without one of them is missing it); more join as the sweep runs them
BASE_SEEDS = (0, 1, 2)
#: The multipliers the learning grid does not run (it runs x1, and x10 in its stress grid): the seeds of their records
#: are the sweep's
SWEEP_ONLY_MULTS = tuple(m for m in SWEEP_LR_MULTS if m != 1.0 and m not in STRESS_LR_MULTS)
#: The algorithm the goals are about
OURS = "klppo_auto"
#: A multiplier is in an algorithm's robust range where the cell's normalized return is at least this
ROBUST = 0.8
#: The share of updates in band each of ``OURS``'s cells should reach
IN_BAND_GOAL = 0.8
COLORS = {"ppo": "tab:blue", "ppo_adaptive_lr": "tab:cyan", "klppo": "tab:green", "klppo_auto": "tab:red"}

Cell = tuple[str, str, float]
Groups = dict[Cell, list[dict[str, Any]]]


def random_returns_path() -> Path:
    return RESULTS / "lr_sweep" / "random_returns.json"


class _UniformRandomPolicy:
    """A policy for ``evaluate_policy`` that samples each action from the (seeded) action space."""

    def __init__(self, action_space: Any) -> None:
        self.action_space = action_space

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None, deterministic: bool = False) -> Any:
        return np.array([self.action_space.sample() for _ in range(len(observation))]), state


def random_policy_returns(
    env_id: str, seeds: tuple[int, ...] = BASE_SEEDS, episodes: int = N_EVAL_EPISODES["full"]
) -> dict[int, list[float]]:
    """
    The episode returns of a uniform-random policy under the sweep's evaluation: per seed, ``episodes`` episodes of
    ``make_vec_env(env_id, n_envs=1, seed=10_000 + seed)`` through ``evaluate_policy``, the action space seeded alike.

    :return: the returns of each seed
    """
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    returns = {}
    for seed in seeds:
        env = make_vec_env(env_id, n_envs=1, seed=10_000 + seed)
        env.action_space.seed(10_000 + seed)
        episode_returns, _ = evaluate_policy(
            _UniformRandomPolicy(env.action_space), env, n_eval_episodes=episodes, return_episode_rewards=True
        )
        returns[seed] = [float(r) for r in episode_returns]
        env.close()
    return returns


def random_returns(envs: list[str]) -> dict[str, float]:
    """
    ``R_random`` of each task: the mean return of :func:`random_policy_returns`, read from ``random_returns.json`` and
    computed (and added to it, with the commit and machine) only for a task it does not hold.
    """
    path = random_returns_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    missing = [env for env in envs if env not in cache]
    for env in missing:
        per_seed = random_policy_returns(env)
        cache[env] = dict(
            mean=float(np.mean([r for returns in per_seed.values() for r in returns])),
            returns={str(seed): returns for seed, returns in per_seed.items()},
            code_version=run_records.code_version("lr_sweep_report.py"),
            run_environment=run_records.run_environment(),
        )
    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        ordered = {env: cache[env] for env in [*SWEEP_ENVS, *sorted(set(cache) - set(SWEEP_ENVS))] if env in cache}
        path.write_text(json.dumps(ordered, indent=1) + "\n")
    return {env: cache[env]["mean"] for env in envs}


# ----------------------------------------------------------------------------------------------------------------------
# Measures


def sweep_seeds(records: list[dict[str, Any]]) -> list[int]:
    """
    The seeds the page reads in every cell: :data:`BASE_SEEDS` and every seed of a run at a multiplier only the sweep
    makes (the grid's further seeds of its x1 and x10 cells are left out: a cell with more runs would weigh more in
    the pooled IQM).
    """
    return sorted(set(BASE_SEEDS) | {r["seed"] for r in records if float(r["lr_mult"]) in SWEEP_ONLY_MULTS})


def complete_cells(groups: Groups) -> set[Cell]:
    """The cells with a run of every one of :data:`BASE_SEEDS`."""
    return {cell for cell, runs in groups.items() if {r["seed"] for r in runs} >= set(BASE_SEEDS)}


def sweep_groups(records: list[dict[str, Any]], seeds: list[int]) -> Groups:
    """The records of the sweep's cells and seeds, grouped by cell ``(env, algo, lr_mult)``."""
    groups: Groups = {}
    for r in records:
        mult = float(r["lr_mult"])
        if r["env"] in SWEEP_ENVS and r["algo"] in SWEEP_ALGOS and mult in SWEEP_LR_MULTS and r["seed"] in seeds:
            groups.setdefault((r["env"], r["algo"], mult), []).append(r)
    return groups


def normalized(value: float, random: float, best: float) -> float:
    """``(value - random) / (best - random)``; NaN where the best is not above the random policy."""
    return (value - random) / (best - random) if best > random else math.nan


def best_cells(groups: Groups) -> dict[str, tuple[float, Cell]]:
    """Each task's best cell mean (``R_best``) and its cell."""
    best: dict[str, tuple[float, Cell]] = {}
    for cell, runs in groups.items():
        mean = float(np.mean([r["eval_mean"] for r in runs]))
        if cell[0] not in best or mean > best[cell[0]][0]:
            best[cell[0]] = (mean, cell)
    return best


def cell_scores(groups: Groups, random: dict[str, float]) -> dict[Cell, float]:
    """The normalized return of each cell (of its mean evaluation return)."""
    best = best_cells(groups)
    return {
        cell: normalized(float(np.mean([r["eval_mean"] for r in runs])), random[cell[0]], best[cell[0]][0])
        for cell, runs in groups.items()
    }


def run_scores(groups: Groups, random: dict[str, float], cell: Cell) -> np.ndarray:
    """The normalized return of each run of a cell."""
    best = best_cells(groups)[cell[0]][0]
    return np.array([normalized(r["eval_mean"], random[cell[0]], best) for r in groups[cell]])


def robust_range(scores: dict[Cell, float], env: str, algo: str) -> list[float]:
    """The multipliers whose cell's normalized return is at least :data:`ROBUST`."""
    return [m for m in SWEEP_LR_MULTS if scores.get((env, algo, m), -math.inf) >= ROBUST]


def in_band_shares(runs: list[dict[str, Any]]) -> list[float]:
    """Each run's share of updates with KL in ``BAND`` x its ``target_kl`` (runs without KL records left out)."""
    return [summarize(r)["in_band"] for r in runs if r.get("kl_updates")]


def strata_scores(groups: Groups, random: dict[str, float], algo: str, strata: list[tuple[str, float]]) -> list[np.ndarray]:
    return [run_scores(groups, random, (env, algo, mult)) for env, mult in strata]


def algo_strata(groups: Groups, *algos: str) -> list[tuple[str, float]]:
    """The strata (task, multiplier) where every one of ``algos`` has runs, in the sweep's order."""
    return [(e, m) for e in SWEEP_ENVS for m in SWEEP_LR_MULTS if all((e, a, m) in groups for a in algos)]


def aggregate_iqm(groups: Groups, random: dict[str, float], algo: str) -> tuple[float, float, float, int] | None:
    """IQM of an algorithm's per-run normalized returns over its strata, its stratified-bootstrap 95 % CI, the strata."""
    strata = algo_strata(groups, algo)
    if not strata:
        return None
    scores = strata_scores(groups, random, algo, strata)
    return pooled_iqm(scores), *stratified_bootstrap_ci(scores), len(strata)


def improvement(groups: Groups, random: dict[str, float], other: str) -> tuple[float, float, float, int] | None:
    """P(``OURS`` > ``other``) over the strata both have, its stratified-bootstrap 95 % CI and the strata."""
    strata = algo_strata(groups, OURS, other)
    if not strata:
        return None
    ours, theirs = strata_scores(groups, random, OURS, strata), strata_scores(groups, random, other, strata)
    return probability_of_improvement(ours, theirs), *probability_of_improvement_ci(ours, theirs), len(strata)


# ----------------------------------------------------------------------------------------------------------------------
# Page


def mult_label(mult: float) -> str:
    return f"x{mult:g}"


def seeds_label(seeds: list[int]) -> str:
    return run_records.seed_range([dict(seed=s) for s in seeds])


def range_text(scores: dict[Cell, float], env: str, algo: str) -> str:
    """An algorithm's robust range on a task, with the multipliers not run yet."""
    run = [m for m in SWEEP_LR_MULTS if (env, algo, m) in scores]
    if not run:
        return "not run"
    inside = robust_range(scores, env, algo)
    text = ", ".join(map(mult_label, inside)) or "none"
    missing = [mult_label(m) for m in SWEEP_LR_MULTS if m not in run]
    return text + (f" ({', '.join(missing)} not run)" if missing else "")


def interval(values: tuple[float, float, float, int] | None) -> str:
    return "—" if values is None else f"{values[0]:.2f} [{values[1]:.2f}, {values[2]:.2f}] ({values[3]})"


def summary_table(groups: Groups, random: dict[str, float], scores: dict[Cell, float]) -> list[str]:
    short = [env.split("-v")[0] for env in SWEEP_ENVS]
    lines = [
        f"| algorithm | IQM of normalized return [95 % CI] (strata) | P({OURS} better) [95 % CI] (strata) | robust range: "
        + " | ".join(short)
        + " |",
        "|---|---|---|" + "---|" * len(short),
    ]
    for algo in SWEEP_ALGOS:
        poi = "—" if algo == OURS else interval(improvement(groups, random, algo))
        ranges = " | ".join(range_text(scores, env, algo) for env in SWEEP_ENVS)
        lines.append(f"| {algo} | {interval(aggregate_iqm(groups, random, algo))} | {poi} | {ranges} |")
    return lines


def cell_table(groups: Groups, value: Callable[[Cell, list[dict[str, Any]]], str]) -> list[str]:
    """A table with a row per task and algorithm and a column per multiplier; ``value(cell, runs)`` fills a cell."""
    lines = [
        "| task | algorithm | " + " | ".join(map(mult_label, SWEEP_LR_MULTS)) + " |",
        "|---|---|" + "---|" * len(SWEEP_LR_MULTS),
    ]
    for env in SWEEP_ENVS:
        for algo in SWEEP_ALGOS:
            cells = []
            for mult in SWEEP_LR_MULTS:
                runs = groups.get((env, algo, mult), [])
                text = value((env, algo, mult), runs) if runs else "—"
                cells.append(text + (f" (n={len(runs)})" if runs and len(runs) != len(BASE_SEEDS) else ""))
            lines.append(f"| {env} | {algo} | " + " | ".join(cells) + " |")
    return lines


def normalization_lines(groups: Groups, random: dict[str, float]) -> list[str]:
    best = best_cells(groups)
    lines = []
    for env in SWEEP_ENVS:
        if env in best:
            value, (_, algo, mult) = best[env]
            lines.append(f"- {env}: R_random {random[env]:.1f}, R_best {value:.1f} ({algo} {mult_label(mult)})")
    return lines


def status(met: bool | None) -> str:
    return "not yet measured" if met is None else ("**met**" if met else "**not met**")


def judge(passes: dict[Cell, bool], complete: set[Cell], needed: set[Cell]) -> bool | None:
    """Not met when a complete cell fails; met when every needed cell is complete and passes; else not yet measured."""
    if any(not ok for cell, ok in passes.items() if cell in complete):
        return False
    if needed <= complete and all(passes.get(cell, False) for cell in needed):
        return True
    return None


def goal_lines(groups: Groups, random: dict[str, float], scores: dict[Cell, float]) -> list[str]:
    """The goals, each with its measured figure and status."""
    every = {(e, a, m) for e in SWEEP_ENVS for a in SWEEP_ALGOS for m in SWEEP_LR_MULTS}
    complete = complete_cells(groups)
    ours = {(e, OURS, m) for e in SWEEP_ENVS for m in SWEEP_LR_MULTS}
    # R_best is any algorithm's: a robust range is final once the whole sweep is in
    robust = {cell: scores[cell] >= ROBUST for cell in ours if cell in scores}
    met = judge(robust, complete if every <= complete else set(), ours)
    below = [f"{e} {mult_label(m)} ({scores[(e, a, m)]:.2f})" for e, a, m in sorted(ours) if not robust.get((e, a, m), True)]
    n = len(ours)
    lines = [
        f"- {OURS}'s robust range covers all {len(SWEEP_LR_MULTS)} multipliers on all {len(SWEEP_ENVS)} tasks:"
        f" {status(met)} ({sum(robust.values())} of {n} cells at ≥ {ROBUST:g}; {n - len(robust)} not run;"
        f" below: {', '.join(below) or 'none'})"
    ]
    shares = {cell: float(np.mean(s)) for cell in ours if (s := in_band_shares(groups.get(cell, [])))}
    in_band = judge({cell: share >= IN_BAND_GOAL for cell, share in shares.items()}, complete, ours)
    low = min(shares.items(), key=lambda kv: kv[1]) if shares else None
    lowest = f"lowest {100 * low[1]:.0f}% ({low[0][0]} {mult_label(low[0][2])})" if low else "no records"
    lines.append(
        f"- ≥ {100 * IN_BAND_GOAL:.0f}% of {OURS}'s updates in band in every cell: {status(in_band)} ({len(shares)} of"
        f" {n} cells measured, {sum(v < IN_BAND_GOAL for v in shares.values())} below; {lowest})"
    )
    for other, needs in (("ppo", "with its 95 % CI above 0.5"), ("ppo_adaptive_lr", "≥ 0.5")):
        poi = improvement(groups, random, other)
        both = ours | {(e, other, m) for e in SWEEP_ENVS for m in SWEEP_LR_MULTS}
        final = poi is not None and both <= complete
        ok = None if poi is None or not final else (poi[1] > 0.5 if other == "ppo" else poi[0] >= 0.5)
        figure = (
            "no stratum with both" if poi is None else f"{poi[0]:.2f} [{poi[1]:.2f}, {poi[2]:.2f}] on {poi[3]} of {n} strata"
        )
        lines.append(f"- P({OURS} > {other}) {needs}: {status(ok)} ({figure})")
    return lines


def welch_lines(groups: Groups) -> list[str]:
    """Cell by cell, ``OURS``'s mean return minus each other algorithm's, with Welch's test (a tie inside the noise)."""
    others = [a for a in SWEEP_ALGOS if a != OURS]
    rows, counts = [], {a: {"better": 0, "tie": 0, "worse": 0} for a in others}
    for env in SWEEP_ENVS:
        for mult in SWEEP_LR_MULTS:
            ours = [r["eval_mean"] for r in groups.get((env, OURS, mult), [])]
            if not ours:
                continue
            cells = []
            for other in others:
                theirs = [r["eval_mean"] for r in groups.get((env, other, mult), [])]
                if not theirs:
                    cells.append("—")
                    continue
                text, result = verdict(ours, theirs)
                counts[other][result] += 1
                cells.append(f"{result} {text}")
            rows.append(f"| {env} | {mult_label(mult)} | " + " | ".join(cells) + " |")
    if not rows:
        return [f"No records of {OURS} yet."]
    tally = "; ".join(f"vs {a}: " + ", ".join(f"{n} {k}" for k, n in counts[a].items()) for a in others)
    return [
        f"Mean evaluation return of {OURS} minus the other's, with the two-sided Welch p-value; a difference with p ≥"
        f" {SIGNIFICANCE} (or fewer than 2 seeds on a side) is inside the seed noise: a tie. Cells: {tally}.",
        "",
        "| task | lr | " + " | ".join(f"vs {a}" for a in others) + " |",
        "|---|---|" + "---|" * len(others),
        *rows,
    ]


def missing_lines(groups: Groups) -> list[str]:
    """The cells without records, and those short of some of :data:`BASE_SEEDS`, per task and algorithm."""
    lines = []
    for env in SWEEP_ENVS:
        for algo in SWEEP_ALGOS:
            absent = [mult_label(m) for m in SWEEP_LR_MULTS if (env, algo, m) not in groups]
            partial = [
                f"{mult_label(m)} seed{'s' if len(lack) > 1 else ''} {', '.join(map(str, lack))}"
                for m in SWEEP_LR_MULTS
                if (env, algo, m) in groups and (lack := sorted(set(BASE_SEEDS) - {r["seed"] for r in groups[(env, algo, m)]}))
            ]
            parts = ([", ".join(absent) + " (no records)"] if absent else []) + partial
            if parts:
                lines.append(f"- {env}, {algo}: " + "; ".join(parts))
    return lines or ["None: every cell has every seed."]


def records_lines(records: list[dict[str, Any]], left_out: int, seeds: list[int]) -> list[str]:
    """The command, the records read, their commits and machines, and those of the random policy's returns."""
    sweep = run_records.results_folder_label(RESULTS / "lr_sweep" / "runs" / "full")
    main = run_records.results_folder_label(RESULTS / "runs" / "full")
    budgets = ", ".join(
        f"{env} {'/'.join(f'{b:,}' for b in sorted({r['budget'] for r in records if r['env'] == env}))}"
        for env in SWEEP_ENVS
        if any(r["env"] == env for r in records)
    )
    cache = json.loads(random_returns_path().read_text()) if random_returns_path().exists() else {}
    random_made = sorted(
        {f"`{v['code_version']}` on {run_records.describe_run_environment(v['run_environment'])}" for v in cache.values()}
    )
    return [
        f"Run the missing cells: `python benchmarks/lr_sweep.py --workers 2`; regenerate this page and its figure only:"
        f" `python benchmarks/lr_sweep.py --report`. Read (`lr_sweep.sweep_records()`): {len(records)} records of seeds"
        f" {seeds_label(seeds)} from the sweep's `{sweep}/` and the learning grid's `{main}/` (the x1 cells, and the"
        " grid's own x10 runs)"
        + (
            f"; {left_out} records of the grid's further seeds are left out, so that the cells have the same seeds"
            if left_out
            else ""
        )
        + ". Settings: rl-zoo's (`benchmarks/settings.py`) with the learning rate scaled; `ppo_adaptive_lr`:"
        f' `KLAdaptiveLRCallback` at target {ADAPTIVE_LR_TARGET:g}; `{OURS}`: KLPPO with `learning_rate="auto_<rate>"`'
        " and no clip range (KLPPO's default)."
        f" Budgets (steps): {budgets or 'none yet'}. Evaluation: {N_EVAL_EPISODES['full']} deterministic episodes per run.",
        "",
        "Code versions of the records (commit of sb3-kl: runs): "
        + (", ".join(f"`{v}`: {n}" for v, n in sorted(run_records.code_versions(records).items())) or "none")
        + f". {auto_rule_line(records)} Machines and library versions (runs): "
        + ("; ".join(f"{m}: {n}" for m, n in sorted(run_records.run_environments(records).items())) or "none")
        + f". The random policy's returns (`{run_records.results_folder_label(random_returns_path())}`): "
        + ("; ".join(random_made) or "none")
        + ".",
    ]


def auto_rule_line(records: list[dict[str, Any]]) -> str:
    """One sentence: how many of the ``klppo_auto`` records ran today's rule of ``learning_rate="auto"``."""
    ours = [r for r in records if r["algo"] == OURS]
    current = sum(made_by_todays_auto_rule(r) for r in ours)
    return (
        f'`{OURS}`: {current} of {len(ours)} records made by today\'s rule of `learning_rate="auto"` (commit '
        f"`{AUTO_RULE_SINCE}` or later; where `n_epochs` is 4, `{QUARTER_SHARE_SINCE}` or later, the same rule there), "
        "the others by earlier rules."
    )


def report(records: list[dict[str, Any]]) -> str:
    """Write ``lr_sweep.md`` and ``lr_sweep.png`` into :data:`RESULTS` from the sweep's records; :return: the page."""
    seeds = sweep_seeds(records)
    groups = sweep_groups(records, seeds)
    used = [r for runs in groups.values() for r in runs]
    left_out = sum(r["env"] in SWEEP_ENVS and r["algo"] in SWEEP_ALGOS and r["seed"] not in seeds for r in records)
    random = random_returns(SWEEP_ENVS)
    scores = cell_scores(groups, random)
    n_cells = len(SWEEP_ENVS) * len(SWEEP_ALGOS) * len(SWEEP_LR_MULTS)
    complete = len(complete_cells(groups))
    base = seeds_label(list(BASE_SEEDS))
    targets = ", ".join(f"{t:g}" for t in sorted({r["target_kl"] for r in used}))
    lines = [
        '# Learning-rate sweep: PPO, PPO + `KLAdaptiveLRCallback`, KLPPO and KLPPO with `learning_rate="auto"`',
        "",
        "![Evaluation return against the learning-rate multiplier, IQM over seeds with 95 % bootstrap CIs](lr_sweep.png)",
        "",
        *summary_table(groups, random, scores),
        "",
        f"Cells with records: {len(groups)} of {n_cells} ({complete} with all of seeds {base}); the missing ones are"
        " listed at the end, and the numbers move as they come in. Normalized return: see below. IQM: over the"
        f" algorithm's runs in all its strata (task x multiplier); P({OURS} better): that a run of {OURS} beats one of the"
        " other algorithm, averaged over the strata both have (0.5: neither is better); in brackets, 95 %"
        " stratified-bootstrap intervals (2,000 resamples, seed 0; `benchmarks/aggregate.py`). Robust range: the"
        f" multipliers with a normalized return ≥ {ROBUST:g}.",
        "",
        "## Goals",
        "",
        f"A goal is judged once the cells it needs have all of seeds {base} (a robust range once the whole sweep has:"
        " R_best is any algorithm's); until then, its figure is that of the records so far.",
        "",
        *goal_lines(groups, random, scores),
        "",
        "## Normalized return per cell",
        "",
        "(R - R_random) / (R_best - R_random): R the cell's mean evaluation return; R_random a uniform-random"
        f" policy's, {N_EVAL_EPISODES['full']} episodes on each evaluation environment of seeds {base}"
        " (`make_vec_env(env, n_envs=1, seed=10_000 + seed)`, the action space seeded alike); R_best the task's best"
        f" cell. Bold: in the robust range; (n=k): a cell with k seeds instead of {len(BASE_SEEDS)}.",
        "",
        *normalization_lines(groups, random),
        "",
        *cell_table(groups, lambda cell, _: f"**{scores[cell]:.2f}**" if scores[cell] >= ROBUST else f"{scores[cell]:.2f}"),
        "",
        "## Share of updates in the KL band",
        "",
        f"Share of each run's updates whose exact KL(old‖new) (KLMonitorCallback) lies in [{BAND[0]:g}, {BAND[1]:g}] x the"
        f" record's `target_kl` ({targets or 'none yet'}), mean ± std over seeds.",
        "",
        *cell_table(groups, lambda _, runs: fmt(in_band_shares(runs), digits=0, percent=True)),
        "",
        f"## {OURS} against the others, cell by cell",
        "",
        *welch_lines(groups),
        "",
        "## Missing cells",
        "",
        *missing_lines(groups),
        "",
        "## Records",
        "",
        *records_lines(used, left_out, seeds),
    ]
    text = "\n".join(lines) + "\n"
    (RESULTS / "lr_sweep.md").write_text(text)
    plot(groups, random, RESULTS / "lr_sweep.png")
    return text


def plot(groups: Groups, random: dict[str, float], path: Path) -> None:
    """Evaluation return against the multiplier, a panel per task: IQM over seeds with 95 % bootstrap CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SWEEP_ENVS), figsize=(4.2 * len(SWEEP_ENVS), 3.8), squeeze=False)
    for ax, env in zip(axes[0], SWEEP_ENVS, strict=True):
        for i, algo in enumerate(SWEEP_ALGOS):
            cells = [(m, [r["eval_mean"] for r in groups[(env, algo, m)]]) for m in SWEEP_LR_MULTS if (env, algo, m) in groups]
            if not cells:
                continue
            # side by side within a multiplier, so the intervals do not hide each other
            x = np.array([m for m, _ in cells]) * 10 ** (0.025 * (i - 1.5))
            iqm = np.array([interquartile_mean(v) for _, v in cells])
            ci = np.array([stratified_bootstrap_ci([v]) for _, v in cells])
            ax.errorbar(
                x, iqm, yerr=[iqm - ci[:, 0], ci[:, 1] - iqm], color=COLORS[algo], marker="o", ms=4, capsize=2, label=algo
            )
        ax.axhline(random[env], color="grey", linestyle="--", linewidth=1, label="uniform-random policy")
        ax.set_xscale("log")
        ax.set_xticks(SWEEP_LR_MULTS, [mult_label(m) for m in SWEEP_LR_MULTS])
        ax.minorticks_off()
        ax.set_xlabel("learning rate / rl-zoo's")
        ax.set_title(env, fontsize=9)
        if not any(c[0] == env for c in groups):
            ax.text(0.5, 0.5, "no records yet", transform=ax.transAxes, ha="center", color="grey")
    axes[0][0].set_ylabel("evaluation return (IQM over seeds, 95 % CI)")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    labels = [a for a in [*SWEEP_ALGOS, "uniform-random policy"] if a in handles]
    fig.legend([handles[a] for a in labels], labels, fontsize=8, loc="lower center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
