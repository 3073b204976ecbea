"""
How fast can KLPPO be beside PPO with fused Adam while its update stays bit for bit what it is? The KL term of the
loss (the per-state KL and the penalty on it) runs on every minibatch; this measures what its forward pass alone
costs, in the same process as a stock PPO-with-fused-Adam run of the overhead benchmark's settings, and the best
steps/s ratio that leaves: ``T_stock / (T_stock + minibatches * t_kl)``, with every other cost of KLPPO (the KL
term's backward, the loss's other terms) taken as free. It also counts the forward's aten ops, and times one small
aten op, the floor each of them pays in eager PyTorch.

The term measured is the one KLPPO's loss builds (``_kl_term``): the fused autograd node where it applies
(``sb3_kl/common/kl_term.py``). ``--count-ops`` only counts the aten ops of the term, forward and backward, of the fused
node and of the same term built from autograd operations (``KLPPO._fused_kl_term = False``), and prints them: it times
nothing and writes nothing, so it may run beside other work.

Writes ``benchmarks/results/kl_term_floor.{json,md,png}``, naming the commit; ``--report`` rewrites the page and its
figure from the JSON alone.

    python benchmarks/studies/kl_term_floor.py [--envs CartPole-v1 Pendulum-v1 HalfCheetah-v5] [--repeats 3]
    python benchmarks/studies/kl_term_floor.py --report
    python benchmarks/studies/kl_term_floor.py --count-ops [--envs ...]
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

import overhead  # noqa: E402
import run_records  # noqa: E402

OUT = HERE / "results" / "kl_term_floor.md"
GOAL = 0.97


def aten_ops(prof: Any) -> int:
    """The aten ops a profiled block dispatched itself (not those an aten op ran inside it)."""
    own = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in own if not (e.cpu_parent and e.cpu_parent.name.startswith("aten::")))


class KLTermOnMinibatch:
    """
    KLPPO (the overhead benchmark's settings on ``env_id``) after one update, and the KL term of its loss on a minibatch
    of its buffer, as ``train()`` builds it (:meth:`~sb3_kl.KLPPO._kl_term`).
    """

    def __init__(self, env_id: str) -> None:
        self.model, _ = overhead.build("klppo_fused_adam", "ours", env_id, 0)
        self.model.learn(self.model.n_steps * self.model.n_envs)  # one update: the buffer holds the rollout distribution
        self.data = next(self.model.rollout_buffer.get(self.model.batch_size))
        _, self.distribution = self.model._forward_samples(self.data)
        self.target = self.model._current_target_kl()

    def __call__(self) -> Any:
        """:return: the KL term (beta * KL plus the hinge)"""
        _, penalty = self.model._kl_term(self.data.old_dist_params, self.distribution, None, self.model.kl_coef, self.target)
        return penalty

    def mean(self) -> Any:
        """The Gaussian's mean or a categorical's logits: what the backward is counted as far as."""
        inner = self.distribution.distribution
        return inner.loc if hasattr(inner, "loc") else inner.logits

    def ops(self) -> tuple[int, int]:
        """:return: the aten ops of the term's forward, and of its backward as far as :meth:`mean`"""
        import torch as th
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self()
        forward = aten_ops(prof)
        loss = self()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            th.autograd.grad(loss, [self.mean()])
        return forward, aten_ops(prof)


def count_ops(env_ids: list[str]) -> list[dict[str, Any]]:
    """
    The aten ops of KLPPO's KL term on each task, forward and backward, as the fused node and as autograd operations.
    Counts only: nothing is timed.
    """
    import torch as th

    th.set_num_threads(1)
    rows = []
    for env_id in env_ids:
        term = KLTermOnMinibatch(env_id)
        row: dict[str, Any] = dict(env=env_id)
        for path, fused in (("fused", True), ("autograd", False)):
            term.model._fused_kl_term = fused
            row[path] = term.ops()
        rows.append(row)
    return rows


def measure(env_id: str, repeats: int) -> dict[str, Any]:
    """One environment: stock PPO's timed run, then KLPPO's KL term on a minibatch of the same shape."""
    import torch as th

    th.set_num_threads(1)
    steps = overhead.STEPS[env_id]
    stock_seconds = []
    for seed in range(repeats):
        model, _ = overhead.build("klppo_fused_adam", "stock", env_id, seed)
        start = time.perf_counter()
        model.learn(steps)
        stock_seconds.append(time.perf_counter() - start)
    rollout = model.n_steps * model.n_envs
    minibatches = (steps // rollout) * model.n_epochs * -(-rollout // model.batch_size)

    kl_term = KLTermOnMinibatch(env_id)
    ops, backward_ops = kl_term.ops()
    batch_size = kl_term.model.batch_size
    calls, small = 2000, th.ones(batch_size)

    def fastest(fn: Any, n: int) -> float:
        """The least seconds per call over five timed batches of ``n`` calls (a floor: noise only adds time)."""
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - start) / n)
        return best

    for _ in range(200):
        kl_term()
    kl_seconds = fastest(kl_term, calls)
    op_seconds = fastest(lambda: small.mul(1.0), 20 * calls)
    stock = float(np.median(stock_seconds))
    return dict(
        env=env_id,
        steps=steps,
        minibatches=minibatches,
        stock_seconds=stock,
        kl_term_us=kl_seconds * 1e6,
        kl_term_ops=ops,
        aten_op_us=op_seconds * 1e6,
        backward_ops=backward_ops,
        best_ratio=stock / (stock + minibatches * kl_seconds),
        floor_ratio=stock / (stock + minibatches * ops * op_seconds),
        floor_ratio_with_backward=stock / (stock + minibatches * (ops + backward_ops) * op_seconds),
    )


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    columns = (
        ("best_ratio", "forward"),
        ("floor_ratio", "aten floor, forward"),
        ("floor_ratio_with_backward", "aten floor, forward and backward"),
    )
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.8 / len(columns)
    for i, (key, label) in enumerate(columns):
        ax.bar([j + i * width for j in range(len(rows))], [r[key] for r in rows], width, label=label)
    ax.axhline(GOAL, color="black", lw=1, ls="--", label=f"goal {GOAL}")
    ax.set_xticks([j + width for j in range(len(rows))], [r["env"] for r in rows])
    ax.set_ylim(0.85, 1.0)
    ax.set_ylabel("best KLPPO / PPO steps/s")
    ax.set_title("If KLPPO cost only its KL term", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(record: dict[str, Any], out: Path = OUT) -> str:
    plot(record, out.with_suffix(".png"))
    lines = [
        "# KLPPO's KL term: the least it costs",
        "",
        f"![best ratios]({out.with_suffix('.png').name})",
        "",
        "| task | minibatches | stock PPO (fused Adam) s | KL term forward µs | aten ops: forward, backward"
        " | one aten op µs | best ratio: forward | best ratio: aten floor, forward | best ratio: aten floor, both"
        " | goal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['env']} | {r['minibatches']:,} | {r['stock_seconds']:.2f} | {r['kl_term_us']:.0f}"
            f" | {r['kl_term_ops']}, {r['backward_ops']} | {r['aten_op_us']:.1f} | {r['best_ratio']:.3f}"
            f" | {r['floor_ratio']:.3f} | {r['floor_ratio_with_backward']:.3f} | ≥ {GOAL} |"
        )
    # records before the fused node (no "kl_term" entry) measured the term built from autograd operations
    term = (
        "the fused autograd node of the per-state KL, its mean and the penalty, `_kl_term`"
        if record.get("kl_term") == "fused"
        else "the per-state KL and the penalty, `_per_state_kl` and `_kl_penalty`"
    )
    lines += [
        "",
        "Best ratio: the steps/s of KLPPO against PPO with fused Adam if KLPPO cost nothing beyond the forward pass of"
        f" its KL term ({term}, on one minibatch of the"
        " overhead benchmark's settings), `T_stock / (T_stock + minibatches x t)`: with `t` the measured forward, and"
        " with `t` its aten ops times one small aten op (the dispatch floor of eager PyTorch, with no Python around"
        " it); and with `t` the aten ops of the forward and of its backward as far as the Gaussian's mean or the"
        " categorical's logits (`torch.autograd.grad`) times that op. The rest of the backward (the std's path, the"
        " network), the gSDE features' std and the rest of KLPPO's loop come on top. One torch thread; stock time:"
        " median of the runs, from `learn()`'s call to its end (its setup included, which only raises the best"
        " ratios); the KL term and the aten op: the fastest of five timed batches.",
        "",
        f"Written by `python benchmarks/studies/kl_term_floor.py`; sb3-kl {record['code_version']}, machine:"
        f" {run_records.describe_run_environment(record['run_environment'])}.",
    ]
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=overhead.ENVS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="rewrite the page and its figure from the JSON alone")
    parser.add_argument("--out", type=Path, default=OUT, help="the page (its JSON and figure beside it)")
    parser.add_argument("--count-ops", action="store_true", help="only count the term's aten ops and print them")
    args = parser.parse_args(argv)
    if args.count_ops:
        print("| task | fused node: forward, backward | autograd operations: forward, backward |\n|---|---|---|")
        for row in count_ops(args.envs):
            print(f"| {row['env']} | {row['fused'][0]}, {row['fused'][1]} | {row['autograd'][0]}, {row['autograd'][1]} |")
        return
    path = args.out.with_suffix(".json")
    if not args.report:
        record = dict(
            code_version=run_records.code_version("overhead.py", f"studies/{Path(__file__).name}"),
            run_environment=run_records.run_environment(),
            kl_term="fused",
            rows=[measure(env_id, args.repeats) for env_id in args.envs],
        )
        path.write_text(json.dumps(record, indent=1))
    print(write_report(json.loads(path.read_text()), args.out))


if __name__ == "__main__":
    main()
