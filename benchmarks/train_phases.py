"""
Where an update's time goes: KLPPO and ClipKLPPO against stock PPO given the same fused Adam kernel, on the same seed,
settings and minibatches. Imported by ``overhead.py`` (``--phases``), which writes the table into the overhead page.

Each phase is timed by wrapping the method that does it (``time.perf_counter`` and the thread's CPU time around
every call): the rollout, the rollout policy's distribution on the buffer (``_prepare_rollout_distribution``), the
minibatch loop's forward pass, KL term (per-state KL and penalty), surrogate and value losses, optimizer step
(backward, clipping, Adam) and the update's KL measurement and records; the rest of ``train()`` is "other". Stock
PPO's ``train()`` is one method, so its minibatch is its ``train()`` time over its minibatches; the difference per
minibatch is the KL machinery's cost.
"""

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# phase name: the methods (of the algorithm) whose calls it sums
PHASES = {
    "forward pass": ("_forward_samples",),
    # _kl_term: the fused node (the other two run inside it where it does not apply, and in the per-epoch stop)
    "KL term (per-state KL, penalty)": ("_kl_term", "_per_state_kl", "_kl_penalty"),
    "surrogate and value losses": ("_surrogate_loss", "_value_loss", "_normalized_advantages"),
    "optimizer step (backward, clip, Adam)": ("_optimizer_step",),
    "rollout distribution (once per update)": ("_prepare_rollout_distribution",),
    "update KL and records (once per update)": ("_measure_update_kl", "_record_update_kl", "_gradient_ratio"),
}


# TRPL's phases: the projection (with its distances) is the part of its minibatch the other algorithms do not have
TRPL_PHASES = {
    "forward pass": ("_forward_samples",),
    "projection (trust region, distances)": ("_project",),
    "optimizer step (backward, clip, Adam)": ("_optimizer_step",),
    "rollout distribution (once per update)": ("_prepare_rollout_distribution",),
    "bound enforcement and update KL (once per update)": ("_enforce_bound", "_record_update_kl"),
}


class PhaseClock:
    """Wall-clock and thread CPU seconds and call counts of the wrapped methods of one model."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth = 0  # phases being timed: a phase called inside another (TRPL's enforcement steps) is the outer's

    def wrap(self, model: Any, name: str, outer: bool = False) -> None:
        """:param outer: a method around the phases (``train``, the rollout), timed whatever runs inside it"""
        method = getattr(model, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not outer and self.depth > 0:
                return method(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            self.depth += 0 if outer else 1
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 0 if outer else 1
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.thread_time() - cpu
                self.calls[name] += 1

        setattr(model, name, timed)


def time_phases(
    build: Callable[[str, str, str, int], tuple[Any, Any]], comparison: str, env_id: str, seed: int, steps: int
) -> dict[str, Any]:
    """
    Train both sides of ``comparison`` (``klppo_fused_adam``, ``clip_klppo_fused_adam`` or ``trpl``) one after the
    other for ``steps`` env steps and time their phases (:data:`PHASES`, TRPL's :data:`TRPL_PHASES`).

    :param build: ``overhead.build``: ``(comparison, side, env_id, seed) -> (model, callback)``

    :return: per side: ``updates``, ``minibatches``, ``train_seconds``, ``rollout_seconds`` and ``phases`` (phase name:
        seconds), all wall-clock
    """
    phases = TRPL_PHASES if comparison.startswith("trpl") else PHASES
    result = {}
    for side in ("stock", "ours"):
        model, _ = build(comparison, side, env_id, seed)
        clock = PhaseClock()
        names = ["train", "collect_rollouts"] + ([m for methods in phases.values() for m in methods] if side == "ours" else [])
        for name in names:
            clock.wrap(model, name, outer=name in ("train", "collect_rollouts"))
        if side == "stock":
            clock.wrap(model.policy.optimizer, "step")
        model.learn(steps)
        minibatches = clock.calls["_optimizer_step" if side == "ours" else "step"]
        result[side] = dict(
            updates=clock.calls["train"],
            minibatches=minibatches,
            train_seconds=clock.wall["train"],
            rollout_seconds=clock.wall["collect_rollouts"],
            phases={phase: sum(clock.wall[m] for m in methods) for phase, methods in phases.items()} if side == "ours" else {},
        )
    return result


def phase_table(rows: list[dict[str, Any]]) -> list[str]:
    """
    :param rows: ``dict(comparison, env, ours, stock, measured)`` with ``measured`` from :func:`time_phases`
    :return: markdown lines: per row, microseconds per minibatch of each phase, and of the whole train() beside PPO's
    """
    lines = [
        "| ours | env | phase | µs per minibatch | share of ours' train() |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ours, stock = row["measured"]["ours"], row["measured"]["stock"]
        per_minibatch = 1e6 / max(ours["minibatches"], 1)
        other = ours["train_seconds"] - sum(ours["phases"].values())
        for phase, seconds in [*ours["phases"].items(), ("other (minibatch sampling, log-probs, logs)", other)]:
            lines.append(
                f"| {row['ours']} | {row['env']} | {phase} | {seconds * per_minibatch:.0f} | "
                f"{seconds / ours['train_seconds']:.1%} |"
            )
        lines.append(
            f"| {row['ours']} | {row['env']} | **whole train()** ({row['stock']}: "
            f"{stock['train_seconds'] * 1e6 / max(stock['minibatches'], 1):.0f}) | "
            f"**{ours['train_seconds'] * per_minibatch:.0f}** | 100% |"
        )
    return lines
