"""
The learning grid's report, ``results/learning[_<tier>].md``: its tables, the comparison with PPO's ``target_kl`` early
stop, the collapses and KL drift, and the goals, from the records (``python benchmarks/learning.py --report``).
"""

import inspect
import math
from typing import Any

import numpy as np

import run_records
from grid import (
    ALL_ALGOS,
    BAND,
    KL_PENALIZED_ALGOS,
    MAIN_ENVS,
    MATCHED_SEEDS,
    N_EVAL_EPISODES,
    SB3_KL_ALGOS,
    STOCK,
    STRESS_ENVS,
    STRESS_LR_MULTS,
    cell_order,
)
from grid_runs import matched_seed_kls
from learning_plots import plot
from lr_sweep_report import auto_rule_line
from measures import count_collapses, fall_kl, fall_span, sb3_kl_collapses, summarize, update_mean
from run_records import (
    HERE,
    code_versions,
    distinct_trainings,
    group_records,
    is_side_folder,
    load_folder,
    load_records,
    machine,
    results_folder_label,
    run_environments,
    same_run,
    seed_key,
    seed_range,
    trained_steps,
)
from side_studies import (
    CARTPOLE_SOLVED,
    KLTRPO_PPO_SETTINGS_RUNS,
    MORE_SEEDS_RUNS,
    SETTINGS_SWAPS,
    PAIRED_HEADER,
    after_the_budget,
    paired_rows,
    paired_runs,
    write_pages,
)
from significance import SIGNIFICANCE, fmt, verdict, welch_p_value, within_one_std


def budgets_and_trained_steps(records: list[dict[str, Any]]) -> str:
    """
    The report's sentences on the step budgets, from the records: each environment's budget (``learn``'s
    ``total_timesteps``) and the steps its runs actually trained (:func:`trained_steps`), which exceed the budget by an
    amount that depends on the algorithm's rollout size, with the algorithms that trained each count.
    """
    budgets, trained = [], []
    for env in MAIN_ENVS:
        runs = [r for r in records if r["env"] == env]
        if not runs:
            continue
        budgets.append(f"{env} " + " / ".join(f"{b:,}" for b in sorted({r["budget"] for r in runs})))
        labels: dict[tuple[int, int | None], list[str]] = {}
        for algo in ALL_ALGOS:
            own = [r for r in runs if r["algo"] == algo]
            counts = {(r["budget"], trained_steps(r)) for r in own}
            for mult in sorted({r["lr_mult"] for r in own}):
                # the algorithm's name alone where all its runs on the environment trained as many steps
                cell = {(r["budget"], trained_steps(r)) for r in own if r["lr_mult"] == mult}
                for count in sorted(cell, key=lambda c: (c[0], c[1] or 0)):
                    label = algo if len(counts) == 1 else f"{algo} x{mult:g}"
                    if label not in labels.setdefault(count, []):
                        labels[count].append(label)
        cells = [
            (f"{steps:,} ({steps - budget:+,}" if steps is not None else "unknown (") + f": {', '.join(algos)})"
            for (budget, steps), algos in sorted(labels.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
        ]
        trained.append(f"{env} {', '.join(cells)}")
    stored = [("trained_steps" in r) for r in records]
    if all(stored):
        source = "each record's `trained_steps`, the model's step count after training"
    else:
        source = (
            "each run's step count at its last learning-curve point or last KL update, whichever is later; both are"
            " taken after a rollout, the last ones after the last rollout"
            + ("; or the record's `trained_steps` where it stores it" if any(stored) else "")
        )
    return (
        "Budgets (`total_timesteps` passed to `learn`, one per environment for every algorithm and learning rate): "
        + ", ".join(budgets)
        + ". `learn` does not stop inside a rollout: it ends with the rollout in which the budget is reached, so every"
        " run trained past its budget, by up to one rollout (`n_steps` x `n_envs`, which differs between algorithms)."
        f" Steps the runs trained, from the records ({source}), beyond the budget, and the algorithms that trained"
        " them: " + "; ".join(trained) + ". The AUC averages each run's curve over its own span."
    )


def side_folder_scope(records: list[dict[str, Any]], tier: str) -> str:
    """The paragraph that opens a side folder's report (:func:`is_side_folder`): what it covers and what it does not."""
    name = run_records.RESULTS.resolve().relative_to(run_records.MAIN_RESULTS.resolve()).as_posix()
    cells = []
    for env in MAIN_ENVS:
        for mult in sorted({r["lr_mult"] for r in records if r["env"] == env}):
            runs = [r for r in records if r["env"] == env and r["lr_mult"] == mult]
            algos = [a for a in ALL_ALGOS if any(r["algo"] == a for r in runs)]
            cells.append(f"{env} x{mult:g}: {', '.join(algos)}, seeds {seed_range(runs)}")
    uses = [f"*{env} collapses over more seeds*" for env, (folder, _) in MORE_SEEDS_RUNS.items() if folder == name]
    return (
        f"This report covers only the {len(records)} records of this side folder ({'; '.join(cells)}), not the main"
        f" grid's in `benchmarks/results/runs/{tier}/`: its tables, comparisons and collapses are those of these runs"
        " alone. The sections that set side experiments beside the main grid, and the goals, which are stated over"
        " the main grid, are left to the main report, `benchmarks/results/learning.md`, which reads these records"
        + (f" in {', '.join(uses)}" if uses else " where a section names this folder")
        + "."
    )


# ----------------------------------------------------------------------------------------------------------------------


def report(tier: str) -> str:
    """
    Write ``learning[_<tier>].md`` and the figures into ``RESULTS`` from the records of a tier there. The report names
    the folder it read; in a side experiment's folder (:func:`is_side_folder`) it covers only that folder's records:
    the sections that set side experiments beside the main grid and the goals are left to the main report.
    """
    records = load_records(tier)
    if not records:
        raise SystemExit(f"No records under {run_records.RESULTS / 'runs' / tier}: run the grid first.")
    groups = group_records(records)
    envs = [e for e in MAIN_ENVS if any(k[0] == e for k in groups)]
    algos = [a for a in ALL_ALGOS if any(k[1] == a for k in groups)]
    suffix = "" if tier == "full" else f"_{tier}"
    folder, side = results_folder_label(), is_side_folder()
    command = f"python benchmarks/learning.py --report --tier {tier}"
    if run_records.RESULTS.resolve() != run_records.MAIN_RESULTS.resolve():
        command = f"SB3_KL_BENCHMARK_RESULTS={folder} {command}"
    lines = [
        f"# Learning benchmark ({tier} tier)" + (f": the records of `{folder}/` only" if side else ""),
        "",
        *([side_folder_scope(records, tier), ""] if side else []),
        f"![Learning curves of every algorithm, mean and seed range](learning_curves{suffix}.png)",
        "",
        summary_table(groups, envs),
        "",
        "## Method",
        "",
        f"Generated by `{command}` from the JSON records in `{folder}/runs/{tier}/`. "
        "Hyperparameters: rl-baselines3-zoo's tuned settings (`benchmarks/settings.py`); "
        "`klppo` is the drop-in swap (PPO's entry unchanged: where it sets `clip_range`, KLPPO clips and penalizes); "
        "`klppo_noclip` is KLPPO with its own default `clip_range=None` (run only where PPO's entry clips: elsewhere "
        "`klppo` is that run); `ppo_target_kl` is stock PPO with SB3's KL early stop, `target_kl` set to the target "
        "KLPPO controls toward (0.02 discrete, 0.03 continuous) and PPO's clip, the baseline an SB3 user would pick "
        "instead; `kltrpo_matched` is KLTRPO with `target_kl` set to the joint KL TRPO took per update on that "
        f"environment (from TRPO's records of seeds {', '.join(map(str, MATCHED_SEEDS))} beside which its first runs were "
        "made, kept fixed as seeds are added and records re-made), "
        "so both take steps of the same size. Evaluation: "
        f"{N_EVAL_EPISODES[tier]} deterministic episodes after training. AUC: the time-average of the learning curve "
        "(the mean return of the last 100 training episodes after each rollout; trapezoid area over the curve's span "
        "in steps). "
        f"KL: exact per-update KL(old||new) from KLMonitorCallback, mean over updates of the per-update mean and p99; "
        f"in-band: share of updates whose KL lies in [{BAND[0]}, {BAND[1]}] x target (target: the algorithm's, or the "
        "family default 0.02 discrete / 0.03 continuous for PPO and 0.01 for TRPO). Collapses: see `count_collapses`. "
        "Values are mean ± std over seeds (population std, ddof 0, also in the goals' 'minus one std'; the Welch "
        "tests use sample variances); the best evaluation return and AUC per row are in bold, and a cell marked ≈ "
        f"is not significantly different from the best (two-sided Welch t-test, p ≥ {SIGNIFICANCE}): a difference "
        "inside the seed noise is a tie.",
        "",
        *(
            [
                "KLTRPO and TRPO get the same `target_kl` but do not constrain the same number: KLTRPO holds the joint"
                " KL(old||new), summed over action dimensions, at or below it, while sb3-contrib's TRPO holds KL(new||old)"
                " averaged over action dimensions. On a d-dimensional action space TRPO's joint KL per update can reach"
                " about d times the target (see the KL tables: Hopper has 3 action dimensions, HalfCheetah 6), so at equal"
                ' settings KLTRPO takes smaller steps; `kl_reduction="mean"` gives it TRPO\'s budget per dimension, and'
                " `kltrpo_matched` TRPO's measured step size.",
                "",
            ]
            if not side or any(a in algos for a in ("trpo", "kltrpo", "kltrpo_matched"))
            else []
        ),
        budgets_and_trained_steps(records)
        + " rl-zoo trains LunarLanderContinuous and the MuJoCo tasks for 1M steps; these runs are shorter so that"
        " the grid fits a 2-core machine, so MuJoCo returns are those of early training. One torch thread per run.",
        "",
        "Code versions of the records (commit of sb3-kl that produced them: run count). sb3-kl algorithms: "
        + ", ".join(f"`{v}`: {n}" for v, n in sorted(code_versions([r for r in records if r["algo"] not in STOCK]).items()))
        + "; stock PPO/TRPO (whose training runs no sb3-kl code; only the KL monitor watches it): "
        + ", ".join(f"`{v}`: {n}" for v, n in sorted(code_versions([r for r in records if r["algo"] in STOCK]).items()))
        + "."
        + (
            " *unrecorded*: runs from before records stored it, made with sb3-kl at commit d9fd1be or earlier."
            if any("code_version" not in r for r in records)
            else ""
        )
        + (" " + auto_rule_line(records) if any(r["algo"] == "klppo_auto" for r in records) else ""),
        "",
        "Machines and library versions of the records (run count): "
        + "; ".join(f"{described}: {n}" for described, n in sorted(run_environments(records).items()))
        + ". A run repeats bit for bit on one machine with one set of library versions, not across them, so records"
        " from different machines differ like different seeds do, not like different code.",
        "",
    ]
    for lr_mult in sorted({k[2] for k in groups}):
        title = "Main grid (base learning rate)" if lr_mult == 1.0 else f"Stress grid: learning rate x{lr_mult:g}"
        if side:  # not the grids: this folder's cells at that learning rate
            title = "Base learning rate" if lr_mult == 1.0 else f"Learning rate x{lr_mult:g}"
        lines += [f"## {title}", ""]
        lines += grid_tables(groups, envs, algos, lr_mult)
        lines.append("")
    if not side or any(algo == "ppo_target_kl" for (_, algo, _) in groups):
        lines += baseline_comparison(groups, envs), ""
    if not side:
        lines += aggregate_comparison(groups, envs), ""
    # the side studies, each set beside the grid on a page of its own: a side folder's report leaves them out
    reverse_kl_reruns = None if side else load_folder(f"reverse_kl/runs/{tier}")
    sections = [budget_use(groups, envs), reverse_kl_table(groups, envs, reverse_kl_reruns)]
    if not side:
        links = write_pages(groups, tier)
        if links:
            sections.append(
                "\n".join(
                    ["## Side studies", "", "Each on its own page, beside the grid's runs on the same seeds:", "", *links]
                )
            )
    sections += [collapse_table(groups, "this folder's records" if side else "both grids"), drift_table(groups)]
    for section in sections:
        if section:
            lines += section, ""
    if side:
        lines += side_folder_checks(groups), ""
    else:
        replicated = replication(tier)
        note = (
            "The cells whose earlier records do not name their machine are judged again on this machine's records alone"
            " under *Records that do not name their machine, beside this machine's* below."
        )
        lines += goals(groups, note if replicated else None), ""
        if replicated:
            lines += replicated, ""
    text = "\n".join(lines)
    (run_records.RESULTS / f"learning{suffix}.md").write_text(text)
    plot(groups, envs, algos, suffix)
    return text


#: The summary's comparisons: (column, sb3-kl algorithm, the stock one it is set against)
SUMMARY_PAIRS = [
    ("KLPPO vs PPO", "klppo", "ppo"),
    ("KLPPO vs PPO + `target_kl`", "klppo", "ppo_target_kl"),
    ("ClipKLPPO vs PPO + `target_kl`", "clip_klppo", "ppo_target_kl"),
    ("KLTRPO vs TRPO", "kltrpo", "trpo"),
]


def summary_table(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str]) -> str:
    """
    The report's opening table: per task and learning rate, the algorithm with the best mean evaluation return, and
    the Welch verdict on the evaluation return of each sb3-kl algorithm against its stock counterpart.
    """
    out = [
        "## Summary",
        "",
        "Evaluation return after training, per task: the best mean over seeds, and each sb3-kl algorithm against its"
        f" stock counterpart (two-sided Welch test over seeds: *better* or *worse* when p < {SIGNIFICANCE}, else *tie*;"
        " the details below).",
        "",
        "| task | lr | best | " + " | ".join(column for column, _, _ in SUMMARY_PAIRS) + " |",
        "|---|---|---|" + "---|" * len(SUMMARY_PAIRS),
    ]
    for lr_mult in sorted({k[2] for k in groups}):
        for env in envs:
            # in the grid tables' order, so that the best of equal means is the one they print in bold
            means = {a: float(np.mean(_evals(groups, env, a, lr_mult))) for a in ALL_ALGOS if groups.get((env, a, lr_mult))}
            if not means:
                continue
            best = max(means, key=lambda algo: means[algo])
            cells = [
                verdict(_evals(groups, env, ours, lr_mult), _evals(groups, env, stock, lr_mult))[1]
                if groups.get((env, ours, lr_mult)) and groups.get((env, stock, lr_mult))
                else ""
                for _, ours, stock in SUMMARY_PAIRS
            ]
            out.append(f"| {env} | x{lr_mult:g} | {best} ({means[best]:.1f}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def grid_tables(
    groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str], algos: list[str], lr_mult: float
) -> list[str]:
    """The tables of one grid (one learning-rate multiple): a row per environment, a column per algorithm."""
    lines: list[str] = []
    header = "| env | budget | " + " | ".join(algos) + " |"
    for metric, label, kwargs in (
        ("eval_mean", "Evaluation return", {}),
        ("auc", "Area under the learning curve", {}),
        ("kl_mean", "Per-update KL, mean", {"digits": 4}),
        ("kl_p99", "Per-update KL, p99 over states", {"digits": 4}),
        ("in_band", "Updates with KL in band", {"percent": True, "digits": 0}),
        ("collapses", "Collapses", {"digits": 1}),
    ):
        lines += [f"### {label}", "", header, "|" + "---|" * (len(algos) + 2)]
        for env in envs:
            runs = [groups.get((env, algo, lr_mult), []) for algo in algos]
            if not any(runs):
                continue
            values = [[summarize(r).get(metric) for r in algo_runs] for algo_runs in runs]
            cells = [fmt(v, **kwargs) + (f" (n={len(v)})" if v and metric == "eval_mean" else "") if v else "" for v in values]
            if metric in ("eval_mean", "auc"):
                means = [float(np.mean(v)) if v else -np.inf for v in values]
                best = int(np.argmax(means))
                for i, v in enumerate(values):
                    if i != best and v and not welch_p_value(v, values[best]) < SIGNIFICANCE:
                        cells[i] = f"≈ {cells[i]}"
                cells[best] = f"**{cells[best]}**"
            budget = next(r["budget"] for algo_runs in runs for r in algo_runs)
            lines.append(f"| {env} | {budget:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def baseline_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str]) -> str:
    """KLPPO and ClipKLPPO against stock PPO with SB3's ``target_kl`` early stop, on return, AUC and KL tail."""
    out = [
        "## Against stock PPO with `target_kl`",
        "",
        "Difference of the seed means (sb3-kl algorithm - `ppo_target_kl`) with the Welch p-value; *better* / *worse* "
        f"only when p < {SIGNIFICANCE}, *tie* otherwise. KL tail: the per-update p99 of the per-state KL (lower is "
        "better).",
        "",
        "| grid | env | algorithm | return | AUC | KL p99 |",
        "|---|---|---|---|---|---|",
    ]
    not_beaten: list[str] = []
    for lr_mult in sorted({k[2] for k in groups}):
        for env in envs:
            baseline = groups.get((env, "ppo_target_kl", lr_mult), [])
            if not baseline:
                continue
            for ours in KL_PENALIZED_ALGOS:
                runs = groups.get((env, ours, lr_mult), [])
                if not runs:
                    continue
                cells = []
                for metric, higher_is_better in (("eval_mean", True), ("auc", True), ("kl_p99", False)):
                    a = [summarize(r).get(metric, float("nan")) for r in runs]
                    b = [summarize(r).get(metric, float("nan")) for r in baseline]
                    text, result = verdict(a, b, higher_is_better)
                    cells.append(f"{text}: {'**' + result + '**' if result == 'worse' else result}")
                    if result != "better":
                        label = {"eval_mean": "return", "auc": "AUC", "kl_p99": "KL tail"}[metric]
                        not_beaten.append(f"{ours} on {env} (x{lr_mult:g}), {label}: {result}")
                out.append(f"| x{lr_mult:g} | {env} | {ours} | " + " | ".join(cells) + " |")
    if not any(line.startswith("| x") for line in out):
        return "\n".join([*out[:2], "No `ppo_target_kl` records yet."])
    # where SB3's early stop never fired, ppo_target_kl trained exactly as PPO did: that cell compares with PPO
    never_stopped = [
        f"{env} (x{mult:g}, {len(new)} seeds)"
        for (env, _, mult), old, new in paired_runs(
            {(e, "ppo_target_kl", m): runs for (e, a, m), runs in groups.items() if a == "ppo"},
            {cell: runs for cell, runs in groups.items() if cell[1] == "ppo_target_kl"},
        )
        if all(same_run(a, b) for a, b in zip(new, old, strict=True))
    ]
    if never_stopped:
        out += [
            "",
            "Cells where every seed of `ppo_target_kl` trained identically to stock PPO's (SB3's early stop never "
            "fired, so there the baseline is PPO itself): " + ", ".join(never_stopped) + ".",
        ]
    out += ["", "Where KLPPO/ClipKLPPO do not beat stock PPO with `target_kl` (tie or worse):", ""]
    out += [f"- {line}" for line in not_beaten] or ["- nowhere: they beat it on every metric of every cell"]
    return "\n".join(out)


#: The sb3-kl algorithms set against the stock ones in :func:`aggregate_comparison`: (ours, stock)
AGGREGATE_PAIRS = [
    ("klppo", "ppo"),
    ("klppo", "ppo_target_kl"),
    ("clip_klppo", "ppo"),
    ("clip_klppo", "ppo_target_kl"),
    ("kltrpo", "trpo"),
]


def aggregate_comparison(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str]) -> str:
    """
    The field's few-seed aggregates over the tasks of each grid (Agarwal et al., NeurIPS 2021, ``aggregate.py``):
    the interquartile mean of the per-task normalized evaluation returns with its stratified-bootstrap 95 % interval,
    and the probability that a run of the sb3-kl algorithm beats a run of the stock one on a task drawn at random.
    """
    from aggregate import pooled_iqm, probability_of_improvement, probability_of_improvement_ci, stratified_bootstrap_ci

    rows = []
    for lr_mult in sorted({k[2] for k in groups}):
        for ours, stock in AGGREGATE_PAIRS:
            tasks = [e for e in envs if groups.get((e, ours, lr_mult)) and groups.get((e, stock, lr_mult))]
            if not tasks:
                continue
            scores: dict[str, list[np.ndarray]] = {ours: [], stock: []}
            for env in tasks:
                every = [r["eval_mean"] for (e, _, m), runs in groups.items() if (e, m) == (env, lr_mult) for r in runs]
                low, high = min(every), max(every)
                for algo in (ours, stock):
                    returns = np.array([r["eval_mean"] for r in groups[(env, algo, lr_mult)]])
                    scores[algo].append((returns - low) / (high - low) if high > low else np.zeros_like(returns))
            iqm = {algo: (pooled_iqm(s), *stratified_bootstrap_ci(s)) for algo, s in scores.items()}
            poi = (
                probability_of_improvement(scores[ours], scores[stock]),
                *probability_of_improvement_ci(scores[ours], scores[stock]),
            )
            cells = [f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" for v in (iqm[ours], iqm[stock], poi)]
            rows.append(f"| x{lr_mult:g} | {ours} | {stock} | {len(tasks)} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join(
        [
            "## Aggregates over the tasks (IQM and probability of improvement)",
            "",
            "The few-seed aggregates of Agarwal et al. (NeurIPS 2021, *Deep RL at the edge of the statistical precipice*),"
            " beside the Welch tests above (`benchmarks/aggregate.py`). Each run's evaluation return is normalized per task"
            " to [0, 1] by the lowest and the highest return of any run of any algorithm on that task at that learning"
            " rate; IQM: the interquartile mean of the runs of all the tasks both algorithms have, pooled; P(better): the"
            " probability that a run of the sb3-kl algorithm scores above a run of the stock one on a task drawn at random"
            " (ties count one half; 0.5: neither is better). In brackets: 95 % stratified-bootstrap intervals (runs"
            " resampled within each task, 2,000 resamples, seed 0); a P(better) interval that holds 0.5 is a tie.",
            "",
            "| grid | algorithm | stock | tasks | IQM | stock's IQM | P(better) |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def budget_use(groups: dict[tuple[str, str, float], list[dict[str, Any]]], envs: list[str]) -> str:
    """
    How much of its KL budget each KLTRPO variant (and TRPO, in the joint convention) uses per update; empty without
    their records.
    """
    out = [
        "## KLTRPO's KL budget use",
        "",
        "Mean over updates and seeds of the measured per-update KL divided by the algorithm's `target_kl` (TRPO's"
        " target bounds its per-dimension reverse KL, so its joint forward KL can exceed 1).",
        "",
        "| env | algorithm | target_kl | mean KL / target |",
        "|---|---|---|---|",
    ]
    for env in envs:
        for algo in ("kltrpo", "kltrpo_matched", "trpo"):
            runs = groups.get((env, algo, 1.0), [])
            if runs:
                uses = [summarize(r).get("budget_use") for r in runs]
                targets = sorted({f"{r['target_kl']:.4g}" for r in runs})
                out.append(f"| {env} | {algo} | {', '.join(targets)} | {fmt(uses, digits=2)} |")
    return "\n".join(out) if not out[-1].startswith("|---") else ""


def reverse_kl_table(
    groups: dict[tuple[str, str, float], list[dict[str, Any]]],
    envs: list[str],
    extra: dict[tuple[str, str, float], list[dict[str, Any]]] | None = None,
) -> str:
    """
    The acting policies' per-state KL(new||old) per update (TRPL's bounded direction) of the records that hold it
    (``kl_reverse_updates``, in records made since it was added); empty without such records.

    :param extra: records of the same cells re-run into ``results/reverse_kl/`` for the field, used for a cell whose
        grid records lack it
    """
    out = [
        "## Per-state KL(new||old) per update",
        "",
        "On every state of the rollout an update trained on, the exact KL from the policy that collects the next rollout"
        " to the one that collected this one, summed over action dimensions (the direction TRPL bounds); per update its"
        " p99 and max over the states, then over the updates and seeds of a cell: the mean and the largest p99, and the"
        " largest max. The grid's records of the other algorithms were made before records held this figure: their"
        " rows come from the same cells re-run on seeds 0-2 (0-1 on the MuJoCo and Box2D tasks) into"
        " `results/reverse_kl/` (records: that folder).",
        "",
        "| lr | env | algorithm | runs | records | mean p99 | largest p99 | largest max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lr_mult in sorted({k[2] for k in groups}):
        for env in envs:
            for algo in ALL_ALGOS:
                runs = [r for r in groups.get((env, algo, lr_mult), []) if r.get("kl_reverse_updates")]
                source = "grid"
                if not runs and extra:
                    runs = [r for r in extra.get((env, algo, lr_mult), []) if r.get("kl_reverse_updates")]
                    source = "reverse_kl/"
                if not runs:
                    continue
                updates = [u for r in runs for u in r["kl_reverse_updates"]]
                p99s = [u["p99"] for u in updates]
                out.append(
                    f"| x{lr_mult:g} | {env} | {algo} | {len(runs)} | {source} | {np.mean(p99s):.4f} | {max(p99s):.4f} | "
                    f"{max(u['max'] for u in updates):.4f} |"
                )
    return "\n".join(out) if not out[-1].startswith("|---") else ""


def matched_target_on_machines(
    primary: dict[tuple[str, str, float], list[dict[str, Any]]],
    machines: dict[str, dict[tuple[str, str, float], list[dict[str, Any]]]],
) -> str:
    """
    How far ``kltrpo_matched``'s target (one per environment, used on both machines) lies from the joint KL TRPO took
    on the seeds ``MATCHED_SEEDS`` on each machine.

    :param primary: the grid's records, by cell (they hold ``kltrpo_matched``'s runs)
    :param machines: each machine's records, by cell, under a label
    """
    cells = []
    for env in MAIN_ENVS:
        targets = {r["target_kl"] for r in primary.get((env, "kltrpo_matched", 1.0), [])}
        if len(targets) != 1:
            continue
        target = targets.pop()
        offsets = [
            f"{label} {100 * (np.mean(kls) / target - 1):+.1f}%"
            for label, groups in machines.items()
            if (kls := matched_seed_kls(groups.get((env, "trpo", 1.0), [])))
        ]
        if offsets:
            cells.append(f"{env} {target:.4g} ({', '.join(offsets)})")
    if not cells:
        return ""
    return (
        "`kltrpo_matched` runs with one target per environment on both machines, TRPO's joint KL on seeds "
        f"{', '.join(map(str, MATCHED_SEEDS))} of the records its first runs were made beside; TRPO's joint KL on the "
        "same seeds of each machine differs from it by: " + "; ".join(cells) + "."
    )


def replication(tier: str) -> str:
    """
    The grid's cells and seeds run on two machines: records that do not name their machine (made before records did;
    where the grid re-made such a record on this machine, ``--other-machines``, the earlier one is kept in
    ``results/unrecorded_machine/runs/<tier>/``) beside the same runs on the machine the records name (the grid's own
    record, else the replication's in ``results/replication/runs/<tier>/``, written by the grid with
    ``SB3_KL_BENCHMARK_RESULTS=benchmarks/results/replication``), and the goals those cells decide, judged on the
    named machine's records alone.
    """
    replica = [r for runs in load_folder(f"replication/runs/{tier}").values() for r in runs]
    kept = [r for runs in load_folder(f"unrecorded_machine/runs/{tier}").values() for r in runs]
    if not replica and not kept:
        return ""
    primary_records = load_records(tier)
    primary = group_records(primary_records)
    by_seed = {seed_key(r): r for r in primary_records}
    # each seed's run on the machine that did not record itself, and on the one that did (the grid's record first)
    unnamed = {seed_key(r): r for r in kept}
    unnamed.update({key: r for key, r in by_seed.items() if machine(r) is None})
    named = {seed_key(r): r for r in replica if machine(r) is not None}
    named.update({key: r for key, r in by_seed.items() if machine(r) is not None})
    both = unnamed.keys() & named.keys()
    first = group_records([unnamed[key] for key in both])
    second = group_records([named[key] for key in both])
    rows = paired_rows(first, second, identical=True)
    moved = [
        f"{env} x{mult:g} {algo}"
        for (env, algo, mult), old, new in paired_runs(first, second)
        if verdict([r["eval_mean"] for r in new], [r["eval_mean"] for r in old])[1] != "tie"
    ]
    from_grid = [key for key in both if key in by_seed and machine(by_seed[key]) is not None]
    from_replica = [named[key] for key in both if key not in by_seed or machine(by_seed[key]) is None]
    records = [named[key] for key in both]
    versions = ", ".join(f"`{v}`" for v in sorted(code_versions(from_replica)))
    machines = "; ".join(sorted(run_environments(records)))
    out = [
        "## Records that do not name their machine, beside this machine's",
        "",
        "The grid's records that do not name their machine (made before records did) came from another machine than"
        " the one the other records name, or from that one. The cells below hold both runs of the same seeds and"
        " settings: *unrecorded*, the record that does not name its machine (the grid's, or, where the grid re-made it"
        " with `--other-machines`, the earlier record, kept in"
        f" `benchmarks/results/unrecorded_machine/runs/{tier}/`), beside *named*, the machine the records name"
        f" ({machines}; the grid's record: {len(from_grid)} runs, else the replication's, in"
        f" `benchmarks/results/replication/runs/{tier}/`, code {versions or 'none'}: {len(from_replica)} runs)."
        " Where the unrecorded record came from another machine, this shows how far the figures move with the"
        " machine's floating-point rounding (and, where it is of an older commit, with the code's changes since);"
        " where it came from this one, the training repeats. `identical`: seeds that trained identically on both"
        " (same evaluation returns and per-update KLs; a monitor whose arithmetic changed since can make a repeated"
        " training's KLs differ in their last digits, so a seed counted as different may still be the same training);"
        " difference: named - unrecorded, with its Welch p-value. "
        + matched_target_on_machines(primary, {"unrecorded": first, "named": second}),
        "",
        "| env | lr | algo | n | identical | " + PAIRED_HEADER.format(a="unrecorded", b="named")[2:],
        "|---" * 15 + "|",
        *rows,
        "",
        f"Evaluation returns that differ significantly between the two records (p < {SIGNIFICANCE}): {len(moved)} of"
        f" {len(rows)} cells{': ' + ', '.join(moved) if moved else ''}.",
    ]
    for described in sorted({machine(r) for r in records} - {None}):
        # that machine's records: the replication's, and those of the grid it made (which win a tie)
        own = {seed_key(r): r for r in replica if machine(r) == described}
        own.update({key: r for key, r in by_seed.items() if machine(r) == described})
        groups = group_records(list(own.values()))
        out += [
            "",
            f"The goals these cells decide, on the records of that machine alone ({described}; "
            f"{sum(machine(r) == described for r in primary_records)} of the grid's records, and the replication's of "
            "the seeds the grid has from the other machine):",
            "",
        ]
        out += [line for line in goal_stress(groups) if "not measured" not in line]
        for env in MAIN_ENVS:
            trpo = _evals(groups, env, "trpo")
            for ours in ("kltrpo", "kltrpo_matched"):
                evals = _evals(groups, env, ours)
                if not trpo or not evals:
                    continue
                text, result = verdict(evals, trpo)
                # judged with 5 seeds or more, as in the goals above
                met = within_one_std(evals, trpo) if min(len(evals), len(trpo)) >= 5 else None
                out.append(
                    f"- {env}: {ours} {np.mean(evals):.1f} vs TRPO {np.mean(trpo):.1f} ± {np.std(trpo):.1f} "
                    f"(n={len(evals)}/{len(trpo)}), within one std of TRPO or better: {status(met)} (difference "
                    f"{text}: {result})"
                )
    return "\n".join(out)


def overhead_rows(ours: str, stock: str, name: str = "overhead.md") -> dict[str, tuple[float, bool]]:
    """
    Per environment of a pair from ``results/<name>`` (``overhead.py``'s output): the median steps/s ratio as shown
    (three decimals) and whether it meets its goal as ``overhead.py`` judged it on the unrounded ratio.

    :param name: the results file: ``overhead.md`` (every comparison) or one measured alone with ``--out``
    """
    path = run_records.RESULTS / name
    rows: dict[str, tuple[float, bool]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 11 and cells[0] == ours and cells[1] == stock:
                rows[cells[2]] = (float(cells[6]), cells[10] == "yes")
    return rows


def speed_judgement(ours: str, stock: str, name: str) -> tuple[bool | None, str]:
    """:return: whether every environment's row of the pair meets its goal (None: no rows), and the ratios shown"""
    rows = overhead_rows(ours, stock, name)
    detail = ", ".join(f"{env} {ratio:.3f}" for env, (ratio, _) in rows.items()) or f"no {name} rows"
    return (None if not rows else all(met for _, met in rows.values())), detail


def collapse_table(groups: dict[tuple[str, str, float], list[dict[str, Any]]], scope: str = "both grids") -> str:
    """
    Every run of the grid that ``count_collapses`` counts, with its learning curve and its evaluation after training.

    :param groups: the records, by cell
    :param scope: what the records are, as the section names them
    """
    out = [
        "## The collapses",
        "",
        f"Every run of {scope} with a collapse (`count_collapses`, on the learning curve: the mean return of the last"
        " 100 training episodes, SB3's `ep_info_buffer`, after each rollout, from the stochastic policy), beside the"
        " deterministic evaluation after training (10 episodes) and the mean evaluation of its cell. The curve's window"
        " holds episodes, not steps: where an episode lasts up to 1000 steps (Hopper) it spans up to 100,000 steps, so"
        " a run of short episodes empties it within a few rollouts while long ones refill it slowly.",
        "",
        "*KL in the fall*: the exact per-update KL (the monitor's per-update mean, / target) of the updates between the"
        " curve's best point and the rollout where it fell below 50 % of its gain (`fall_kl`): their number, mean and"
        " maximum, and the share of them over 2 x target beside that share over the whole run. Where the fall's updates"
        " stay in the band, the policy left its best without any single update taking a large step, so a per-update KL"
        " control has nothing to act on. `benchmarks/results/collapse_probe.md` trains each sb3-kl collapse again with a"
        " probe that leaves the training unchanged: how the episodes end before and in the fall, the KL that"
        " `VecNormalize`'s statistics alone cause, and how often beta sat at its floor, where the penalty does nothing.",
        "",
        "| env | lr | algo | seed | curve: start | best | end | eval after training | cell's mean eval"
        " | KL in the fall: updates | mean | max | over 2x (run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (env, algo, mult), runs in sorted(groups.items(), key=lambda kv: cell_order(kv[0])):
        cell_eval = float(np.mean([r["eval_mean"] for r in runs]))
        for r in sorted(runs, key=lambda r: r["seed"]):
            if count_collapses(r["curve"]) == 0:
                continue
            curve = [c[1] for c in r["curve"]]
            fall = fall_kl(r)
            fall_cells = (
                f"{fall['n']} | {fall['mean']:.2f} | {fall['max']:.2f} | {fall['over']:.0%} ({fall['over_run']:.0%})"
                if fall is not None
                else "- | - | - | -"
            )
            out.append(
                f"| {env} | x{mult:g} | {algo} | {r['seed']} | {curve[0]:.1f} | {max(curve):.1f} | {curve[-1]:.1f}"
                f" | {r['eval_mean']:.1f} | {cell_eval:.1f} | {fall_cells} |"
            )
    if out[-1].startswith("|---"):
        out.append("| none | | | | | | | | | | | | |")
    return "\n".join(out)


#: Updates up to the curve's best point over which the drift before a collapse is averaged
DRIFT_WINDOW = 50


def drift_table(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> str:
    """
    The monitor's drift (``KLMonitorCallback``'s ``kl/drift``: the exact KL between the policy ``drift_lag`` updates
    before and the updated one) of every collapsed run whose record holds it, over the ``DRIFT_WINDOW`` updates up to
    the curve's best point and over the fall, beside the per-update KL and beside the cell's runs without a collapse
    over the same updates. Empty when no collapsed run's record holds the drift.
    """
    rows = []
    for (env, algo, mult), runs in sorted(groups.items(), key=lambda kv: cell_order(kv[0])):
        healthy = [r for r in runs if count_collapses(r["curve"]) == 0 and any("drift" in u for u in r["kl_updates"])]
        for r in sorted(runs, key=lambda r: r["seed"]):
            span = fall_span(r)
            if span is None or not any("drift" in u for u in r["kl_updates"]):
                continue
            t_best, t_fell = span
            times = [u["timesteps"] for u in r["kl_updates"]]
            up_to_best = [i for i, t in enumerate(times) if t <= t_best][-DRIFT_WINDOW:]
            in_fall = [i for i, t in enumerate(times) if t_best <= t < t_fell]
            others = [update_mean(h, "drift", up_to_best) for h in healthy]
            others = [x for x in others if not math.isnan(x)]
            rows.append(
                f"| {env} | x{mult:g} | {algo} | {r['seed']} | {r.get('drift_lag', '-')} | {len(up_to_best)}"
                f" | {update_mean(r, 'mean', up_to_best):.2f} | {update_mean(r, 'drift', up_to_best):.2f}"
                + (f" | {np.median(others):.2f} | {max(others):.2f} | {len(others)}" if others else " | - | - | 0")
                + f" | {len(in_fall)} | {update_mean(r, 'mean', in_fall):.2f} | {update_mean(r, 'drift', in_fall):.2f} |"
            )
    if not rows:
        return ""
    return "\n".join(
        [
            "## Drift before the collapses",
            "",
            "The monitor's drift (`kl/drift`: the exact KL(old || new), summed over action dimensions, between the policy"
            " `drift_lag` updates before an update's result and that result, on the update's rollout states) of every"
            " collapsed run whose record holds it (records made since the monitor measures it), / target, beside the"
            " update's own KL (the monitor's per-update mean, / target). *Before the best*: the last"
            f" {DRIFT_WINDOW} updates up to the curve's best point (the curve averages the last 100 episodes, so it peaks"
            " after the policies that earned its best acted); *healthy runs*: the same updates of the cell's runs"
            " without a collapse (median and largest of their means, and how many); *fall*: the updates from the best"
            " point to the rollout where the curve fell below 50 % of its gain (`fall_kl`). A drift many times the"
            " per-update KL, where each update stays far inside the target, is a move in one direction that no"
            " per-update control sees.",
            "",
            "| env | lr | algo | seed | lag | updates before the best | update KL | drift | healthy runs' drift: median"
            " | largest | runs | updates in the fall | update KL | drift |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def side_folder_checks(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> str:
    """
    The goals' section of a side folder's report (:func:`is_side_folder`): the goals are stated over the main grid and
    not judged on a side folder's records; the standing checks of single cells are, labelled as such.
    """
    checks = [line for line in standing_checks(groups) if line.startswith("- ")]
    return "\n".join(
        [
            "## Goals: judged in the main report, not here",
            "",
            "The goals are stated over the main grid (all its environments, algorithms and learning rates, and the"
            " side experiments it sets beside them), so `benchmarks/results/learning.md` judges them on the main"
            " grid's records; a verdict on this folder's records alone would judge a part of the grid as the whole."
            + (
                " The standing checks of single cells, on this folder's records alone (not the main grid's seeds of"
                " the same cells):"
                if checks
                else ""
            ),
            *(["", *checks] if checks else []),
        ]
    )


def status(met: bool | None) -> str:
    return "not measured" if met is None else ("**met**" if met else "**NOT met**")


def goal_status(lines: list[str]) -> str:
    """The status of a goal from the lines that judge it: met when every judgement is, else how many are not."""
    met, missed, unmeasured = (sum(line.count(mark) for line in lines) for mark in (status(True), status(False), status(None)))
    if not met and not missed:
        return status(None)
    if not missed and not unmeasured:
        return status(True)
    return f"{status(False)} ({missed + unmeasured} of {met + missed + unmeasured} judgements)"


def goals(groups: dict[tuple[str, str, float], list[dict[str, Any]]], note: str | None = None) -> str:
    """
    The goals, one line each with its status (met / NOT met / not measured, from the records), then the judgements
    that make each status (``note``: a paragraph above them).
    """
    judged = [
        ("KLTRPO uses its trust region, and runs at least as fast as TRPO", goal_trust_region(groups)),
        ("KLTRPO's return is at least TRPO's minus one std on every task", goal_fair_trpo(groups)),
        ("At 10x the learning rate KLPPO keeps its KL in band and its return", goal_stress(groups)),
        ("No sb3-kl algorithm collapses in the grid", goal_collapses(groups)),
        ("Stock PPO with `target_kl` is in the grids", goal_baseline(groups)),
        ("5 seeds in every close cell", goal_seeds(groups)),
        ("TRPL holds its bound in every state, learns and keeps up", goal_trpl(groups)),
    ]
    checks = standing_checks(groups)
    out = ["## Goals", ""] + ([note, ""] if note else [])
    out += [f"- {title}: {goal_status(lines)}" for title, lines in judged]
    out += [f"- Standing checks (CartPole solved; each algorithm within one std of its stock one): {goal_status(checks)}"]
    out += ["", "### The judgements", ""]
    for _, lines in judged:
        out += lines
    return "\n".join(out + checks)


def _evals(groups: dict[tuple[str, str, float], list[dict[str, Any]]], env: str, algo: str, mult: float = 1.0) -> list[float]:
    return [r["eval_mean"] for r in groups.get((env, algo, mult), [])]


def goal_trust_region(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """KLTRPO uses its trust region: mean per-update KL >= 0.85 x target on every environment, and its speed."""
    uses = {env: [summarize(r)["budget_use"] for r in groups.get((env, "kltrpo", 1.0), [])] for env in MAIN_ENVS}
    measured = {env: float(np.mean(u)) for env, u in uses.items() if u}
    met = None if len(measured) < len(MAIN_ENVS) else all(u >= 0.85 for u in measured.values())
    detail = ", ".join(f"{env} {u:.2f}" for env, u in measured.items()) or "no records"
    out = [
        "- KLTRPO uses its trust region: mean per-update KL / target_kl ≥ 0.85 on all six environments: "
        f"{status(met)} ({detail})"
    ]
    source = "overhead.md"
    speed_met, detail = speed_judgement("KLTRPO", "TRPO (sb3-contrib)", source)
    out.append(f"- KLTRPO ≥ 1.0 x TRPO's env-steps/s (`{source}`, median paired ratio): {status(speed_met)} ({detail})")
    return out


def shipped_kltrpo_target_kl(env_id: str) -> float:
    """The ``target_kl`` of the shipped ``kltrpo`` zoo config of ``env_id`` (KLTRPO's default where it sets none)."""
    import yaml

    from sb3_kl import KLTRPO

    config = yaml.safe_load((HERE.parent / "sb3_kl" / "hyperparams" / "kltrpo.yml").read_text())
    default = inspect.signature(KLTRPO).parameters["target_kl"].default
    return float(config.get(env_id, {}).get("target_kl", default))


def shipped_kltrpo_cell(groups: dict[tuple[str, str, float], list[dict[str, Any]]], env_id: str) -> str | None:
    """
    The grid cell whose records ran at the shipped ``kltrpo`` config's ``target_kl`` on ``env_id``: ``kltrpo``
    (TRPO's target) or ``kltrpo_matched`` (whose target the config takes rounded to two significant digits,
    ``trpo_joint_kl.py --write-config``), or None when neither did.
    """
    from trpo_joint_kl import round_significant

    shipped = shipped_kltrpo_target_kl(env_id)
    for algo, rounded in (("kltrpo", False), ("kltrpo_matched", True)):
        targets = {r["target_kl"] for r in groups.get((env_id, algo, 1.0), [])}
        if targets and all(math.isclose(round_significant(t) if rounded else t, shipped) for t in targets):
            return algo
    return None


def goal_fair_trpo(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    KLTRPO's return >= TRPO's minus one std on all six environments, with 5 seeds: at equal settings (``kltrpo``), with
    TRPO's measured step size (``kltrpo_matched``) and as the shipped zoo configs set ``target_kl`` (the cell whose
    records ran at the config's target, :func:`shipped_kltrpo_cell`).
    """
    out = []
    for algo in ("kltrpo", "kltrpo_matched", "shipped"):
        cells, met = [], True
        for env in MAIN_ENVS:
            ours = algo if algo != "shipped" else shipped_kltrpo_cell(groups, env)
            a, b = (_evals(groups, env, ours) if ours else []), _evals(groups, env, "trpo")
            if algo == "shipped" and ours is None:
                met = False
                cells.append(f"{env}: no cell ran at the shipped target_kl {shipped_kltrpo_target_kl(env):g}")
                continue
            if not a or not b:
                met = None if met is not False else False
                continue
            ok = within_one_std(a, b) and min(len(a), len(b)) >= 5
            met = met and ok if met is not None else met
            label = f"{env} ({ours}) " if algo == "shipped" else f"{env} "
            cells.append(f"{label}{np.mean(a):.1f} vs {np.mean(b):.1f} ± {np.std(b):.1f} (n={len(a)}/{len(b)})")
        name = (
            "KLTRPO's return at the shipped zoo configs' `target_kl` (where a config takes TRPO's joint KL, the runs are "
            "kltrpo_matched's, whose target the config rounds to two significant digits)"
            if algo == "shipped"
            else f"{algo}'s return"
        )
        out.append(
            f"- {name} ≥ TRPO's minus one std on all six environments, 5 seeds each: {status(met)} "
            f"({'; '.join(cells) or 'no records'})"
        )
    return out


def x10_return_against_x1(
    groups: dict[tuple[str, str, float], list[dict[str, Any]]], env: str, algo: str
) -> tuple[float, float, int] | None:
    """
    The x10 return beside x1's on the seeds both learning rates have (so that the comparison does not mix seed sets).

    :return: the x10 and x1 mean evaluation returns and the number of seeds, or None without a seed in common
    """
    x1_by_seed = {r["seed"]: r["eval_mean"] for r in groups.get((env, algo, 1.0), [])}
    paired = [(r["eval_mean"], x1_by_seed[r["seed"]]) for r in groups.get((env, algo, 10.0), []) if r["seed"] in x1_by_seed]
    if not paired:
        return None
    x10, x1 = (float(np.mean(v)) for v in zip(*paired, strict=True))
    return x10, x1, len(paired)


def return_within_20_percent(x10: float, x1: float, n: int) -> str:
    """The stress goal's return judgement, as the goals' lines read."""
    return (
        f"return {x10:.1f} vs x1 {x1:.1f} on the {n} seeds both have, {100 * (x10 - x1) / abs(x1):+.1f}% "
        f"({status(x10 >= x1 - 0.2 * abs(x1))}, goal: within 20%)"
    )


def goal_stress(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    x10 learning rate: >= 90 % of KLPPO's updates in band (every seed pooled) and a return within 20 % of x1, on the
    seeds both learning rates have (so that the comparison does not mix seed sets).
    """
    out = []
    for env in STRESS_ENVS:
        for ours in ("klppo_noclip", "klppo"):
            runs = groups.get((env, ours, 10.0), [])
            returns = x10_return_against_x1(groups, env, ours)
            if returns is None:
                out.append(f"- x10, {env}, {ours}: updates in band ≥ 90%, return within 20% of x1: {status(None)}")
                continue
            kls = [(u["mean"], r["target_kl"]) for r in runs for u in r["kl_updates"]]
            share = float(np.mean([BAND[0] * t <= k <= BAND[1] * t for k, t in kls]))
            out.append(
                f"- x10, {env}, {ours} ({len(runs)} seeds pooled): updates in band {100 * share:.0f}% "
                f"({status(share >= 0.9)}, goal ≥ 90%); {return_within_20_percent(*returns)}"
            )
    return out


def trpl_bound(record: dict[str, Any]) -> float:
    """
    TRPL's joint per-state bound in a record: ``mean_bound`` (+ ``cov_bound``, which only Box actions are given), else
    its ``target_kl`` (the grid records TRPL's joint bound there).
    """
    settings = record.get("hyperparameters") or {}
    if "mean_bound" not in settings:
        return float(record["target_kl"])
    return settings["mean_bound"] + settings.get("cov_bound", 0.0)


def goal_trpl(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    TRPL's goals: return >= the better of PPO and TRPO minus one std on every task; the acting policies' largest
    per-state KL(new||old) <= 1.05 x its bound in >= 99 % of updates; its per-update p99 and max at most half of PPO's
    and KLPPO's (their rows from ``results/reverse_kl/``); at x10 no collapse and a return within 20 % of x1; and
    >= 0.8 x PPO's env-steps/s (``overhead_trpl.md``, ``overhead.py --out``).
    """
    trpl = [r for (_, algo, _), rs in groups.items() if algo == "trpl" for r in rs]
    if not trpl:
        return ["- TRPL's goals: " + status(None)]
    out, cells, met = [], [], True
    for env in MAIN_ENVS:
        ours = _evals(groups, env, "trpl")
        stock = max((_evals(groups, env, a) for a in ("ppo", "trpo")), key=lambda e: np.mean(e) if e else -np.inf)
        if not ours or not stock:
            met = None if met is not False else False
            continue
        ok = float(np.mean(ours)) >= float(np.mean(stock)) - float(np.std(stock)) and len(ours) >= 5
        met = met and ok if met is not None else met
        cells.append(f"{env} {np.mean(ours):.1f} vs {np.mean(stock):.1f} ± {np.std(stock):.1f}{'' if ok else ' (short)'}")
    swap = next(swap for swap in SETTINGS_SWAPS if swap.algo == "trpl")
    tier = trpl[0]["tier"]
    see = (
        f"; where it trails, see *TRPL on {' and '.join(swap.envs)} with TRPO's {swap.swapped}*"
        if any(load_folder(f"{swap.folder}/runs/{tier}").values())
        else ""
    )
    out.append(
        f"- TRPL's return ≥ the better of PPO and TRPO minus one std, six tasks: {status(met)} ({'; '.join(cells)}{see})"
    )
    updates = [(u["max"], trpl_bound(r)) for r in trpl for u in r.get("kl_reverse_updates", [])]
    share = float(np.mean([kl <= 1.05 * bound for kl, bound in updates])) if updates else None
    worst = max(kl / bound for kl, bound in updates) if updates else float("nan")
    out.append(
        f"- TRPL's largest per-state KL(new||old) between acting policies ≤ 1.05 x its bound in ≥ 99% of updates: "
        f"{status(None if share is None else share >= 0.99)} ({len(updates)} updates of {len(trpl)} runs, x1 and x10:"
        f" {100 * (share or 0):.1f}% within, the largest {worst:.3f} x the bound)"
    )
    reruns = load_folder(f"reverse_kl/runs/{trpl[0]['tier']}")
    tails, met = [], True
    for env in MAIN_ENVS:
        ours = [u for r in groups.get((env, "trpl", 1.0), []) for u in r.get("kl_reverse_updates", [])]
        for algo in ("ppo", "klppo"):
            theirs = [u for r in reruns.get((env, algo, 1.0), []) for u in r.get("kl_reverse_updates", [])]
            if not ours or not theirs:
                met = None if met is not False else False
                continue
            p99 = np.mean([u["p99"] for u in ours]) / np.mean([u["p99"] for u in theirs])
            largest = max(u["max"] for u in ours) / max(u["max"] for u in theirs)
            met = met and bool(p99 <= 0.5 and largest <= 0.5) if met is not None else met
            tails.append(f"{env} vs {algo}: mean p99 x{p99:.2f}, largest max x{largest:.2f}")
    out.append(
        f"- TRPL's per-update p99 and largest per-state KL(new||old) at most half of PPO's and KLPPO's, every task: "
        f"{status(met)} ({'; '.join(tails) or 'no rows'})"
    )
    for env in STRESS_ENVS:
        runs = groups.get((env, "trpl", 10.0), [])
        returns = x10_return_against_x1(groups, env, "trpl")
        if returns is None:
            out.append(f"- x10, {env}, trpl: no collapse, return within 20% of x1: {status(None)}")
            continue
        falls = sum(count_collapses(r["curve"]) > 0 for r in runs)
        out.append(
            f"- x10, {env}, trpl ({len(runs)} seeds): collapses {falls} ({status(falls == 0)}); "
            + return_within_20_percent(*returns)
        )
    for ours, stock in (("TRPL", "PPO"), ("TRPL, gSDE", "PPO, gSDE")):
        met, detail = speed_judgement(ours, stock, "overhead_trpl.md")
        out.append(
            f"- {ours} ≥ 0.8 x {stock}'s env-steps/s (`overhead_trpl.md`, median paired ratio): {status(met)} ({detail})"
        )
    return out


def goal_collapses(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """No collapse of any sb3-kl algorithm anywhere in the grid."""
    runs = [r for (_, algo, _), rs in groups.items() if algo in SB3_KL_ALGOS for r in rs]
    collapsed = sb3_kl_collapses(groups)
    afters = [after_the_budget(r) for r in collapsed]  # what each did when trained on past the grid's budget
    detail = (
        ", ".join(
            f"{r['algo']} {r['env']} x{r['lr_mult']:g} s{r['seed']}, evaluation after training {r['eval_mean']:.1f}"
            + (
                f", per-update KL in its fall {fall['mean']:.2f} x target on average, at most {fall['max']:.2f}"
                if (fall := fall_kl(r)) is not None
                else ""
            )
            + (f", {afters[i]}" if afters[i] else "")
            for i, r in enumerate(collapsed)
        )
        or "none"
    )
    count = f"{len(collapsed)} runs, {len(distinct_trainings(collapsed))} distinct trainings: " if collapsed else ""
    trained_on = sorted({r["env"] for r, after in zip(collapsed, afters, strict=True) if after}, key=MAIN_ENVS.index)
    see = "*The collapses*" + "".join(f" and *{env} past the grid's budget*" for env in trained_on)
    swap_env, swap_folder = KLTRPO_PPO_SETTINGS_RUNS
    if any(r["env"] == swap_env for r in collapsed) and load_folder(f"{swap_folder}/runs/{collapsed[0]['tier']}"):
        see += f" and *KLTRPO on {swap_env} with PPO's discount, GAE and policy network*"
    return [
        f"- No collapse of any sb3-kl algorithm in the grid ({len(runs)} runs): "
        f"{status(not collapsed if runs else None)} (collapsed: {count}{detail}; see {see})"
    ]


def goal_baseline(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """Stock PPO with ``target_kl`` is a row of the main and stress grids."""
    grids = {mult for (_, algo, mult) in groups if algo == "ppo_target_kl"}
    met = {1.0, 10.0} <= grids
    return [
        f"- Stock PPO with `target_kl` in the main and stress grids, compared above: {status(met)} (grids with its "
        f"records: {', '.join(f'x{m:g}' for m in sorted(grids)) or 'none'})"
    ]


def goal_seeds(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """
    5 seeds for every cell of the main and stress grids where two algorithms are within two standard deviations of
    each other, and for every main-grid cell on LunarLanderContinuous, Hopper, HalfCheetah and Pendulum.
    """
    needed = set()
    grids = [(env, 1.0) for env in MAIN_ENVS] + [(env, mult) for env in STRESS_ENVS for mult in STRESS_LR_MULTS]
    for env, mult in grids:
        cells = {algo: _evals(groups, env, algo, mult) for algo in ALL_ALGOS if _evals(groups, env, algo, mult)}
        for a in cells:
            if mult == 1.0 and env in ("LunarLanderContinuous-v3", "Hopper-v5", "HalfCheetah-v5", "Pendulum-v1"):
                needed.add((env, a, mult))
            for b in cells:
                spread = 2 * max(np.std(cells[a]), np.std(cells[b]))
                if a < b and abs(np.mean(cells[a]) - np.mean(cells[b])) <= spread:
                    needed |= {(env, a, mult), (env, b, mult)}
    short = sorted(
        f"{a} on {env} x{mult:g} (n={len(_evals(groups, env, a, mult))})"
        for env, a, mult in needed
        if len(_evals(groups, env, a, mult)) < 5
    )
    met = None if not needed else not short
    cells = sum(bool(_evals(groups, env, algo, mult)) for env, mult in grids for algo in ALL_ALGOS)
    return [
        f"- 5 seeds in every close cell of the main and stress grids: {status(met)} ({len(needed)} close cells of the "
        f"grids' {cells}; fewer than 5 seeds: {', '.join(short) or 'none'})"
    ]


def standing_checks(groups: dict[tuple[str, str, float], list[dict[str, Any]]]) -> list[str]:
    """Earlier checks: CartPole solved on every seed; each sb3-kl algorithm within one std of its stock counterpart."""
    out = ["", "Standing checks:", ""]
    for algo in SB3_KL_ALGOS:
        scores = _evals(groups, "CartPole-v1", algo)
        if scores:
            # the stock counterpart's seeds beside it: a check the stock algorithm fails too reads differently
            stock = "trpo" if algo.startswith("kltrpo") else "ppo"
            theirs = _evals(groups, "CartPole-v1", stock)
            beside = (
                f"; {stock}: min {min(theirs):.1f}, {sum(x < CARTPOLE_SOLVED for x in theirs)} of {len(theirs)} seeds under"
                f" {CARTPOLE_SOLVED:g}"
                if theirs
                else ""
            )
            out.append(
                f"- CartPole-v1, {algo}: every seed ≥ {CARTPOLE_SOLVED:g}: {status(min(scores) >= CARTPOLE_SOLVED)} (min"
                f" {min(scores):.1f}, {sum(x < CARTPOLE_SOLVED for x in scores)} of {len(scores)} seeds under"
                f" {CARTPOLE_SOLVED:g}{beside})"
            )
    for env in MAIN_ENVS:
        for ours, stock in (("klppo", "ppo"), ("klppo_noclip", "ppo"), ("clip_klppo", "ppo"), ("kltrpo", "trpo")):
            a, b = _evals(groups, env, ours), _evals(groups, env, stock)
            if a and b:
                text, result = verdict(a, b)
                met = within_one_std(a, b)
                out.append(
                    f"- x1, {env}: {ours} {np.mean(a):.1f} vs {stock} {np.mean(b):.1f} ± {np.std(b):.1f}: within one std "
                    f"of {stock} or better: {status(met)} (difference {text}: {result})"
                )
    return out
