"""
Cost of KL control: environment steps per second of each sb3-kl algorithm against its stock counterpart, measured
side by side in one process, in pairs of runs that take turns one rollout and its update at a time (:class:`Turns`;
which side starts alternates from pair to pair), one torch thread, same seed and same hyperparameters (rl-zoo's,
``settings.py``; both sides get the same keyword arguments, except that KLPPO keeps its documented default
``clip_range=None``: the KL penalty replaces the ratio clip).

Pairs: KLPPO vs PPO, ClipKLPPO vs PPO, KLTRPO vs sb3-contrib TRPO (also both with sub_sampling_factor=8), PPO +
KLMonitorCallback vs PPO,
on CartPole-v1 and Pendulum-v1; sb3-contrib RecurrentPPO + KLMonitorCallback vs RecurrentPPO (``monitor_lstm``) on
their velocity-masked variants with rl-zoo's ``ppo_lstm`` settings. Writes ``benchmarks/results/overhead.json``
(every pair's measured steps and wall-clock and CPU seconds per side, the ratios, the command, ``code_version`` and
``run_environment``) and, from it, ``benchmarks/results/overhead.md`` (median ratio, min-max, per-pair ratios);
``--out`` names the markdown, the JSON goes beside it with the same stem. ``--report`` only rewrites the markdown from
that JSON.
For the monitor, a third figure that other load on the machine does not disturb: the share of ``learn()``'s wall-clock
time spent inside the monitor's own hooks (snapshot and measurement, and on the recurrent tasks, which ``VecNormalize``
wraps, the raw observations kept at each step and the normalization shift), whose complement is the steps/s ratio it
implies.

    python benchmarks/overhead.py [--pairs 5] [--steps-scale 1.0] [--comparisons klppo clip_klppo kltrpo monitor]
    python benchmarks/overhead.py --report [--out benchmarks/results/overhead.md]
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ENVS = ["CartPole-v1", "Pendulum-v1", "HalfCheetah-v5"]
# environment steps per timed run (at least a few updates of each algorithm's rl-zoo settings; HalfCheetah-v5's 16
# updates of 512 steps x 20 epochs are as many minibatches as Pendulum-v1's 16,384 steps)
STEPS = {"CartPole-v1": 16_384, "Pendulum-v1": 16_384, "HalfCheetah-v5": 8_192}
# TRPO's zoo rollouts are long (2,048 steps on Pendulum, 1,024 on CartPole, against PPO's 256 on CartPole): its pairs
# run 3x the steps, so that they take at least 24 turns each (:class:`Turns`) and the KLTRPO goal's small margin is
# not left to a handful of turns
STEPS_SCALE = {"kltrpo": 3, "kltrpo_subsampled": 3}
GOALS = {
    "klppo": 0.95,
    "clip_klppo": 0.95,
    "klppo_fused_adam": 0.97,
    "clip_klppo_fused_adam": 0.97,
    "kltrpo": 1.0,
    "kltrpo_subsampled": 1.0,
    "trpl": 0.8,
    "trpl_gsde": 0.8,
    "monitor": 0.95,
    "monitor_lstm": 0.95,
}
# The recurrent pair runs on the velocity-masked task of each env, with the zoo's ppo_lstm settings for it
RECURRENT_ENVS = {"CartPole-v1": "CartPoleNoVel-v1", "Pendulum-v1": "PendulumNoVel-v1"}
LABELS = {
    "klppo": ("KLPPO", "PPO"),
    "clip_klppo": ("ClipKLPPO", "PPO"),
    # The same pairs with stock PPO also given the fused Adam kernel the sb3-kl algorithms use by default: what the
    # KL itself costs, without the optimizer's speed-up (informational, no goal)
    "klppo_fused_adam": ("KLPPO", "PPO with fused Adam"),
    "clip_klppo_fused_adam": ("ClipKLPPO", "PPO with fused Adam"),
    "kltrpo": ("KLTRPO", "TRPO (sb3-contrib)"),
    # Both with sub_sampling_factor=8: KLTRPO's line search still checks every candidate on the whole buffer
    "kltrpo_subsampled": ("KLTRPO, sub_sampling_factor=8", "TRPO (sb3-contrib), sub_sampling_factor=8"),
    # TRPL (PPO's zoo entry without the clip, the grid's bounds) against stock PPO as users run it; on Pendulum-v1 the
    # zoo entry already uses gSDE, trpl_gsde turns it on for both sides where it does not
    "trpl": ("TRPL", "PPO"),
    "trpl_gsde": ("TRPL, gSDE", "PPO, gSDE"),
    "monitor": ("PPO + KLMonitorCallback", "PPO"),
    "monitor_lstm": ("RecurrentPPO + KLMonitorCallback", "RecurrentPPO"),
}
# The tasks a comparison runs on, where not all of ENVS (gSDE needs Box actions; the recurrent pair has its masked tasks)
COMPARISON_ENVS = {"trpl_gsde": ["HalfCheetah-v5"], "monitor_lstm": ["CartPole-v1", "Pendulum-v1"]}


def timed_monitor() -> Any:
    """:return: a ``KLMonitorCallback`` that adds up the wall-clock time spent in its hooks (``hook_time``)"""
    from sb3_kl.callbacks import KLMonitorCallback

    class TimedKLMonitor(KLMonitorCallback):
        hook_time = 0.0

        def _timed(self, hook: Any) -> Any:
            start = time.perf_counter()
            result = hook()
            self.hook_time += time.perf_counter() - start
            return result

        def _on_rollout_start(self) -> None:
            self._timed(super()._on_rollout_start)

        def _on_rollout_end(self) -> None:
            self._timed(super()._on_rollout_end)

        def _on_step(self) -> bool:
            # keeps the raw observations when VecNormalize wraps the env (kl/normalization_shift)
            return self._timed(super()._on_step)

        def _on_training_end(self) -> None:
            self._timed(super()._on_training_end)

    return TimedKLMonitor()


def build_recurrent(side: str, env_id: str, seed: int) -> tuple[Any, Any]:
    """:return: (RecurrentPPO with the zoo's ppo_lstm settings for the masked task, monitor or None)"""
    import rl_zoo3.import_envs  # noqa: F401  (registers the NoVel tasks)
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from recurrent_learning import ZOO_ONLY, zoo_settings

    entry = zoo_settings(RECURRENT_ENVS[env_id])
    kwargs = {key: value for key, value in entry.items() if key not in ZOO_ONLY}
    env = make_vec_env(RECURRENT_ENVS[env_id], n_envs=entry["n_envs"], seed=seed)
    if entry.get("normalize"):
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    callback = timed_monitor() if side == "ours" else None
    return RecurrentPPO(entry["policy"], env, seed=seed, device="cpu", **kwargs), callback


def env_label(comparison: str, env_id: str) -> str:
    """The task a comparison ran on ``env_id``'s row (the recurrent comparison runs its velocity-masked version)."""
    return RECURRENT_ENVS[env_id] if comparison == "monitor_lstm" else env_id


def build(comparison: str, side: str, env_id: str, seed: int) -> tuple[Any, Any]:
    """:return: (model, callback) for one side ("ours" or "stock") of a comparison"""
    if comparison == "monitor_lstm":
        return build_recurrent(side, env_id, seed)
    from sb3_contrib import TRPO
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    import sb3_kl
    from settings import KLPPO_DROPPED, PPO_SETTINGS, TRPO_SETTINGS

    if comparison == "kltrpo_subsampled":
        comparison = "kltrpo"
        sub_sampling = dict(sub_sampling_factor=8)
    else:
        sub_sampling = {}
    if comparison.startswith("trpl"):
        return build_trpl(comparison, side, env_id, seed)
    family = TRPO_SETTINGS if comparison == "kltrpo" else PPO_SETTINGS
    setting = family[env_id]
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    kwargs = {**setting["kwargs"], **sub_sampling}
    if comparison.endswith("_fused_adam"):
        if side == "stock":
            # SB3's Adam settings (eps=1e-5) plus the fused kernel
            kwargs["policy_kwargs"] = {**kwargs.get("policy_kwargs", {}), "optimizer_kwargs": dict(eps=1e-5, fused=True)}
        comparison = comparison.removesuffix("_fused_adam")
    if comparison == "klppo" and side == "ours":
        # KLPPO as users run it: PPO's settings with KLPPO's own default of no ratio clipping
        for name in KLPPO_DROPPED:
            kwargs.pop(name, None)
    if comparison in ("klppo", "clip_klppo") and side == "ours":
        # every epoch runs on both sides (PPO's zoo entries set no target_kl): the cost of the same work, not the
        # time an early stop saves
        kwargs["kl_stop_factor"] = None
    callback = None
    if side == "stock":
        cls = TRPO if comparison == "kltrpo" else PPO
    elif comparison == "monitor":
        cls, callback = PPO, timed_monitor()
    else:
        cls = getattr(sb3_kl, LABELS[comparison][0])
    return cls("MlpPolicy", env, seed=seed, device="cpu", **kwargs), callback


def build_trpl(comparison: str, side: str, env_id: str, seed: int) -> tuple[Any, None]:
    """:return: (model, None): TRPL with the grid's settings (``settings_for("trpl", ...)``) or stock PPO with the zoo's"""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    import sb3_kl
    from settings import PPO_SETTINGS, settings_for

    setting = settings_for("trpl", env_id) if side == "ours" else PPO_SETTINGS[env_id]
    kwargs = dict(setting["kwargs"])
    if comparison == "trpl_gsde":
        kwargs["use_sde"] = True
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    cls = sb3_kl.TRPL if side == "ours" else PPO
    return cls("MlpPolicy", env, seed=seed, device="cpu", **kwargs), None


class Turns:
    """
    Two ``learn()`` calls, each in its own thread, that take turns one rollout at a time: a side runs one rollout and
    the update that follows it, then waits while the other side does the same. Each side's clock (wall and thread CPU
    time) runs only while it holds the turn, so a slower or faster stretch of the machine (on a shared host the same
    code's speed drifts by 10-20 % over seconds) falls on both sides alike instead of on whichever run it happened in.
    Only one thread runs at any time.
    """

    def __init__(self, first: str) -> None:
        self.turn = first
        self.finished: set[str] = set()
        self.condition = threading.Condition()

    def callback(self, side: str, other: str) -> Any:
        """:return: the callback that makes ``side``'s ``learn()`` take its turns (pass it first in a CallbackList)"""
        from stable_baselines3.common.callbacks import BaseCallback

        turns = self

        class TakeTurns(BaseCallback):
            wall = 0.0
            cpu = 0.0

            def _take(self) -> None:
                with turns.condition:
                    turns.condition.wait_for(lambda: turns.turn == side or other in turns.finished)
                self._start, self._start_cpu = time.perf_counter(), time.thread_time()

            def _give(self) -> None:
                self.wall += time.perf_counter() - self._start
                self.cpu += time.thread_time() - self._start_cpu
                with turns.condition:
                    turns.turn = other
                    turns.condition.notify_all()

            def _on_training_start(self) -> None:
                self._take()
                self._first_rollout = True

            def _on_rollout_start(self) -> None:
                if self._first_rollout:  # its turn began with the training
                    self._first_rollout = False
                    return
                self._give()
                self._take()

            def _on_step(self) -> bool:
                return True

            def _on_training_end(self) -> None:
                self._give()

        return TakeTurns()

    def finish(self, side: str) -> None:
        """Release the other side for good (also when ``side``'s ``learn()`` raised)."""
        with self.condition:
            self.finished.add(side)
            self.condition.notify_all()


def timed_pair(comparison: str, env_id: str, seed: int, steps: int, first: str) -> dict[str, dict[str, Any]]:
    """
    Train both sides of a pair at once, taking turns one rollout (and its update) at a time (:class:`Turns`).

    :param first: The side ("ours" or "stock") whose rollout comes first in each round
    :return: per side (``"ours"``, ``"stock"``): ``steps`` (the budget passed to ``learn()``, the numerator of the
        speeds), ``trained_steps`` (the model's ``num_timesteps`` after it), ``wall_seconds`` and ``cpu_seconds`` (its
        turns' wall-clock time and its thread's CPU time; model construction and ``learn()``'s setup before the first
        rollout excluded), ``steps_per_second`` and ``cpu_steps_per_second`` (``steps`` over each), and ``hook_share``,
        the share of that wall-clock time spent in the KL monitor's hooks (None without a monitor)
    """
    from stable_baselines3.common.callbacks import CallbackList

    sides = ("ours", "stock")
    turns = Turns(first)
    built = {side: build(comparison, side, env_id, seed) for side in sides}
    clocks = {side: turns.callback(side, other) for side, other in zip(sides, reversed(sides), strict=True)}
    errors: list[BaseException] = []

    def run(side: str) -> None:
        model, monitor = built[side]
        try:
            model.learn(steps, callback=CallbackList([clocks[side]] + ([monitor] if monitor is not None else [])))
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)
        finally:
            turns.finish(side)

    threads = [threading.Thread(target=run, args=(side,)) for side in sides]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    result = {}
    for side in sides:
        clock, (model, monitor) = clocks[side], built[side]
        result[side] = dict(
            steps=steps,
            trained_steps=int(model.num_timesteps),
            wall_seconds=clock.wall,
            cpu_seconds=clock.cpu,
            steps_per_second=steps / clock.wall,
            cpu_steps_per_second=steps / clock.cpu,
            hook_share=monitor.hook_time / clock.wall if hasattr(monitor, "hook_time") else None,
        )
    return result


def command(pairs: int, steps_scale: float, comparisons: list[str], envs: list[str], out: Path, phases: bool = False) -> str:
    """The command line of a measurement (options left at their defaults omitted)."""
    try:
        out_text = str(out.resolve().relative_to(HERE.parent))
    except ValueError:
        out_text = str(out)
    default_out = (HERE / "results" / "overhead.md").resolve()
    return (
        f"python benchmarks/overhead.py --pairs {pairs}"
        + (f" --steps-scale {steps_scale:g}" if steps_scale != 1.0 else "")
        + (f" --comparisons {' '.join(comparisons)}" if comparisons != list(LABELS) else "")
        + (f" --envs {' '.join(envs)}" if envs != ENVS else "")
        + (f" --out {out_text}" if out.resolve() != default_out else "")
        + (" --phases" if phases else "")
    )


def measure(
    pairs: int,
    steps_scale: float,
    comparisons: list[str],
    envs: list[str],
    out: Path,
    resume: bool = False,
    phases: bool = False,
) -> dict[str, Any]:
    """
    Time every pair of every comparison and environment, writing the JSON record (:func:`json_path`) after each row
    so that a stopped measurement keeps what it measured.

    :param pairs: Pairs of runs per comparison and environment (pair ``i`` uses seed ``i``)
    :param steps_scale: Multiplies the per-run step counts
    :param comparisons: Keys of :data:`LABELS`
    :param envs: Environments (the recurrent comparison runs their velocity-masked versions)
    :param out: The markdown the measurement is for (named in the command)
    :param resume: Keep the rows of the JSON record already there that this run does not measure again (each names
        the commit that measured it)
    :param phases: Also time the phases of KLPPO's and ClipKLPPO's updates (:mod:`train_phases`), seed 0
    :return: the JSON record: the command and its arguments, ``code_version``, ``run_environment``, the load average
        when the measurement ended and, per comparison and environment, every pair's measurements and the ratios
    """
    import run_records
    import train_phases

    version = run_records.code_version("overhead.py", "settings.py", "train_phases.py")  # the checkout the runs start from
    arguments = dict(pairs=pairs, steps_scale=steps_scale, comparisons=comparisons, envs=envs)
    record: dict[str, Any] = dict(
        question="env-steps/s of each sb3-kl algorithm against its stock counterpart, in pairs that take turns",
        command=command(pairs, steps_scale, comparisons, envs, out, phases),
        arguments=arguments,
        torch_threads=1,
        cpu_count=os.cpu_count(),
        load_average_end=list(os.getloadavg()),
        code_version=version,
        run_environment=run_records.run_environment(),
        rows=[],
        phases=[],
    )
    previous = json.loads(json_path(out).read_text()) if resume and json_path(out).exists() else None
    if previous is not None:
        # every row keeps the commit that measured it; this run adds the rows it measures (same comparison and task:
        # measured again) and its command
        for row in previous["rows"] + previous.get("phases", []):
            row.setdefault("code_version", previous["code_version"])
        measuring = {(c, e) for c in comparisons for e in envs}

        def kept(row: dict[str, Any], measured: bool) -> bool:
            # rows this run does not measure, and those it measures that this code already measured (a resumed run)
            return (row["comparison"], row["env"]) not in measuring or not measured or row["code_version"] == version

        record["rows"] = [row for row in previous["rows"] if kept(row, True)]
        record["phases"] = [row for row in previous.get("phases", []) if kept(row, phases)]
        commands = previous.get("commands", [previous["command"]])
        record["commands"] = commands if record["command"] in commands else [*commands, record["command"]]
    done = {(row["comparison"], row["env"]) for row in record["rows"] if row.get("code_version") == version}

    def save() -> None:
        record["load_average_end"] = list(os.getloadavg())
        json_path(out).parent.mkdir(parents=True, exist_ok=True)
        json_path(out).write_text(json.dumps(record, indent=1))

    for comparison in comparisons:
        for env_id in [env for env in envs if env in COMPARISON_ENVS.get(comparison, ENVS)]:
            if (comparison, env_id) in done:
                continue
            steps = int(STEPS[env_id] * STEPS_SCALE.get(comparison, 1) * steps_scale)
            measured = []
            for pair in range(pairs):
                first = "ours" if pair % 2 == 0 else "stock"
                result = timed_pair(comparison, env_id, seed=pair, steps=steps, first=first)
                ours, stock = result["ours"], result["stock"]
                measured.append(
                    dict(
                        pair=pair,
                        seed=pair,
                        first=first,
                        ours=ours,
                        stock=stock,
                        ratio=ours["steps_per_second"] / stock["steps_per_second"],
                        cpu_ratio=ours["cpu_steps_per_second"] / stock["cpu_steps_per_second"],
                    )
                )
                print(
                    f"{comparison} {env_id} pair {pair}: ours {ours['steps_per_second']:.0f} steps/s, stock "
                    f"{stock['steps_per_second']:.0f} steps/s, ratio {measured[-1]['ratio']:.3f} "
                    f"(CPU-time ratio {measured[-1]['cpu_ratio']:.3f})",
                    flush=True,
                )
            ratios = [m["ratio"] for m in measured]
            record["rows"].append(
                dict(
                    comparison=comparison,
                    env=env_id,
                    task=env_label(comparison, env_id),
                    ours=LABELS[comparison][0],
                    stock=LABELS[comparison][1],
                    steps=steps,
                    goal=GOALS.get(comparison),
                    pairs=measured,
                    ratio_median=float(np.median(ratios)),
                    ratio_min=min(ratios),
                    ratio_max=max(ratios),
                    cpu_ratio_median=float(np.median([m["cpu_ratio"] for m in measured])),
                    code_version=version,
                )
            )
            save()
    timed = {(row["comparison"], row["env"]) for row in record["phases"]}
    for comparison in [c for c in ("klppo_fused_adam", "clip_klppo_fused_adam", "trpl") if phases and c in comparisons]:
        for env_id in envs:
            if (comparison, env_id) not in timed:
                steps = int(STEPS[env_id] * steps_scale)
                measured_phases = train_phases.time_phases(build, comparison, env_id, seed=0, steps=steps)
                ours, stock = LABELS[comparison]
                row = dict(
                    comparison=comparison, env=env_id, ours=ours, stock=stock, measured=measured_phases, code_version=version
                )
                record["phases"].append(row)
                save()
    save()
    return record


def json_path(out: Path) -> Path:
    """The JSON record beside the markdown ``out`` (same stem)."""
    return out.with_suffix(".json")


def plot_ratios(record: dict[str, Any], path: Path) -> None:
    """
    Draw each comparison's steps/s ratio (median and min-max over pairs, with its goal) to a PNG.

    :param record: What :func:`measure` returned (or its JSON file holds)
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"][::-1]  # the table's first row on top
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.3 * len(rows)))
    y = np.arange(len(rows))
    medians = np.array([row["ratio_median"] for row in rows])
    errors = np.array([[m - row["ratio_min"], row["ratio_max"] - m] for row, m in zip(rows, medians, strict=True)]).T
    ax.errorbar(medians, y, xerr=errors, fmt="o", color="tab:blue", capsize=2, label="wall-clock ratio (median, min-max)")
    ax.plot([row["cpu_ratio_median"] for row in rows], y, "x", color="tab:orange", label="CPU-time ratio (median)")
    for i, row in enumerate(rows):
        if row["goal"] is not None:
            ax.plot([row["goal"]] * 2, [i - 0.4, i + 0.4], color="tab:red", lw=1.5)
    ax.axvline(1.0, color="0.6", lw=0.8)
    def short(name: str) -> str:
        return name.replace(" (sb3-contrib)", "").replace(", sub_sampling_factor=", " sub-sampling ").replace("Callback", "")

    ax.set_yticks(y, [f"{short(row['ours'])} / {short(row['stock'])}, {row['task']}" for row in rows], fontsize=7)
    ax.set_xlabel("ours / stock env-steps/s (red tick: goal)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(record: dict[str, Any]) -> list[str]:
    """:return: the page's opening table: per comparison, the median wall and CPU ratios per task and the goals met"""
    lines = ["| ours / stock | wall-clock ratio (median) | CPU-time ratio (median) | goal met (wall) |", "|---|---|---|---|"]
    comparisons = dict.fromkeys((row["ours"], row["stock"]) for row in record["rows"])
    for ours, stock in comparisons:
        rows = [row for row in record["rows"] if (row["ours"], row["stock"]) == (ours, stock)]
        goals = [row for row in rows if row["goal"] is not None]
        met = sum(row["ratio_median"] >= row["goal"] for row in goals)
        lines.append(
            f"| {ours} / {stock} | " + ", ".join(f"{row['task']} {row['ratio_median']:.3f}" for row in rows) + " | "
            + ", ".join(f"{row['task']} {row['cpu_ratio_median']:.3f}" for row in rows) + " | "
            + (f"{met}/{len(goals)} tasks (≥ {goals[0]['goal']})" if goals else "-") + " |"
        )
    return lines


def render(record: dict[str, Any], json_name: str, figure: str | None = None) -> str:
    """
    The markdown report of a measurement, from its JSON record only.

    :param record: What :func:`measure` returned (or its JSON file holds)
    :param json_name: How the report names the JSON file
    :param figure: The name of the figure (:func:`plot_ratios`) the page opens with, if any
    """
    import run_records

    lines = [
        "# Overhead of KL control",
        "",
        *([f"![steps/s ratios]({figure})", ""] if figure else []),
        *summary_table(record),
        "",
        f"Generated by `{'`, then `'.join(record.get('commands', [record['command']]))}` on the code of commit"
        f" {', '.join(sorted({row.get('code_version', record['code_version']) for row in record['rows']}))} (each"
        " row's commit is in the table); every pair's measured"
        f" steps, wall-clock and CPU seconds per side and the ratios are in `{json_name}`, from which this report is"
        " written. Paired runs in one process that take turns one rollout (and the update"
        " after it) at a time, each side's clock running only during its turns, so that the machine's speed drifts"
        " (10-20 % over seconds on this shared host, for the same code) fall on both sides alike; which side starts"
        " alternates from pair to pair. One torch thread, same seed and"
        " the same keyword arguments per pair (rl-zoo settings from `benchmarks/settings.py`), except that KLPPO keeps its"
        " documented default `clip_range=None` (ClipKLPPO gets PPO's clip range) and that KLPPO and ClipKLPPO run with"
        " `kl_stop_factor=None`, so that, like PPO without `target_kl`, they run every epoch: the ratio compares the"
        " same work, not the time an early stop saves. Ratio = ours / stock env-steps/s."
        " The sb3-kl algorithms step Adam with PyTorch's fused kernel by default (same update rule, see"
        " `KLOnPolicyAlgorithm._use_fused_adam`); the rows against *PPO with fused Adam* give stock PPO that kernel too,"
        " so they show what the KL machinery itself costs.",
        "",
        f"Machine: {record['cpu_count']} cores; " + run_records.describe_run_environment(record["run_environment"]) + ".",
        "",
        f"Load average when the run ended: {', '.join(f'{x:.1f}' for x in record['load_average_end'])} (wall-clock ratios"
        " are only meaningful on an otherwise idle machine; the CPU-time ratio divides each side's thread CPU seconds"
        " instead). Steps/s count the time from the first rollout to the end of training (model construction and"
        " `learn()`'s setup excluded).",
        "",
        "| ours | stock | env | steps per run | ours steps/s (median) | stock steps/s (median) | ratio median | ratio min-max "
        "| CPU-time ratio median | goal | met (wall) | pairs | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        median, goal = row["ratio_median"], row["goal"]
        goal_text, met = (f"≥ {goal}", "yes" if median >= goal else "NO") if goal is not None else ("-", "-")
        ours_sps = np.median([m["ours"]["steps_per_second"] for m in row["pairs"]])
        stock_sps = np.median([m["stock"]["steps_per_second"] for m in row["pairs"]])
        lines.append(
            f"| {row['ours']} | {row['stock']} | {row['task']} | {row['steps']:,} | {ours_sps:.0f} | {stock_sps:.0f} | "
            f"{median:.3f} | {row['ratio_min']:.3f}-{row['ratio_max']:.3f} | {row['cpu_ratio_median']:.3f} | {goal_text} "
            f"| {met} | {len(row['pairs'])} | {row.get('code_version', record['code_version'])} |"
        )
    monitor_rows = [row for row in record["rows"] if row["comparison"] in ("monitor", "monitor_lstm")]
    if monitor_rows:
        lines += [
            "",
            "KLMonitorCallback's own cost, insensitive to other load: the share of `learn()`'s wall-clock time spent"
            " inside its hooks (snapshot of the rollout policy and the KL measurement; where VecNormalize wraps the env,"
            " as on the recurrent tasks, also the raw observations kept at each step and the normalization's own KL,"
            " `kl/normalization_shift`) in the monitored runs above, and"
            " the steps/s ratio it implies (1 - share).",
            "",
            "| monitored | env | runs | hook share median | implied ratio median | implied ratio min-max | goal | met |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in monitor_rows:
            shares = [m["ours"]["hook_share"] for m in row["pairs"]]
            implied = [1.0 - share for share in shares]
            goal = row["goal"]
            lines.append(
                f"| {row['stock']} | {row['task']} | {len(shares)} | {np.median(shares):.4f} | "
                f"{np.median(implied):.3f} | {min(implied):.3f}-{max(implied):.3f} | ≥ {goal} | "
                f"{'yes' if np.median(implied) >= goal else 'NO'} |"
            )
    if record.get("phases"):
        import train_phases

        lines += [
            "",
            "## Where the time goes",
            "",
            "One run per side (seed 0, the steps of the rows above), each phase timed around the methods that do it"
            " (`benchmarks/train_phases.py`); per minibatch of the update, the once-per-update phases spread over its"
            " minibatches. Stock PPO's `train()` is one method: its figure is its whole `train()` per minibatch.",
            "",
            *train_phases.phase_table(record["phases"]),
        ]
    lines += ["", "Per-pair ratios:", ""]
    for row in record["rows"]:
        lines.append(
            f"- {row['ours']} / {row['stock']}, {row['task']}: " + ", ".join(f"{m['ratio']:.3f}" for m in row["pairs"])
        )
    return "\n".join(lines) + "\n"


def write_report(out: Path) -> str:
    """Rewrite the markdown ``out`` and its figure (same stem) from the JSON record beside it; :return: the markdown"""
    path = json_path(out)
    try:
        json_name = str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        json_name = path.name
    record = json.loads(path.read_text())
    figure = out.with_suffix(".png")
    plot_ratios(record, figure)
    text = render(record, json_name, figure.name)
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    import torch as th

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply the per-run step counts")
    parser.add_argument("--comparisons", nargs="+", choices=list(LABELS), default=list(LABELS))
    parser.add_argument("--envs", nargs="+", choices=ENVS, default=ENVS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "overhead.md", help="the markdown report")
    parser.add_argument(
        "--report", action="store_true", help="only rewrite --out from the JSON record beside it (no measurement)"
    )
    parser.add_argument("--resume", action="store_true", help="keep the rows of the JSON this run does not measure")
    parser.add_argument("--phases", action="store_true", help="also time the phases of KLPPO's and ClipKLPPO's updates")
    args = parser.parse_args(argv)
    if not args.report:
        th.set_num_threads(1)
        os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3-kl-benchmarks")
        measure(args.pairs, args.steps_scale, args.comparisons, args.envs, args.out, args.resume, args.phases)
    print(write_report(args.out))


if __name__ == "__main__":
    main()
