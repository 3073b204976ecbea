"""
Where the KL of a RecurrentKLPPO update comes from. Per update of a short run with the zoo's ``ppo_lstm`` settings
(as ``recurrent_learning.py`` runs them, without ``clip_range``):

- the KL the loss sees on RecurrentPPO's minibatches (sequences cut at minibatch boundaries and restarted from the
  rollout policy's stored LSTM states), over the first and last epoch and its largest minibatch value;
- the final policy's KL on one more pass of such minibatches beside the exact sequence KL (``train/kl``: each policy's
  LSTM re-run over each env's whole rollout), i.e. what the minibatch cut alone changes;
- beta used and beta after, the epoch the update stopped at;
- for Gaussian policies, the exact KL split into its mean part and its std part (``torch.distributions``), the KL of
  hybrids of the rollout policy and the updated policy (only ``log_std`` moved, only the network moved), and the
  range of the per-state std ratio new/old.

``--detached-sde`` runs the same with the gSDE KL differentiated as before the fix (the std's features detached, as
SB3's distribution has them): the before/after comparison on one committed code version. The same comparison for
feed-forward KLPPO (Pendulum-v1, gSDE, 10x the zoo lr) closes the report.

    python benchmarks/studies/recurrent_kl_probe.py           # the probe runs, then the report
    python benchmarks/studies/recurrent_kl_probe.py --report  # only the report (benchmarks/results/recurrent_kl_probe.md)
    python benchmarks/studies/recurrent_kl_probe.py --feedforward-only  # only feed-forward KLPPO on Pendulum-v1 at 10x lr
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch as th

HERE = Path(__file__).resolve().parents[1]  # benchmarks/: the modules and results/ the study shares
sys.path.insert(0, str(HERE))

from recurrent_learning import ZOO_ONLY, code_version, zoo_settings  # noqa: E402

import run_records  # noqa: E402
from grid_runs import scale_learning_rate  # noqa: E402

RESULTS = HERE / "results"
RUNS = RESULTS / "recurrent_kl_probe"
#: (env, learning-rate multiplier, updates, gSDE KL detached as before the fix)
PROBES = [
    ("PendulumNoVel-v1", 10.0, 3, True),
    ("PendulumNoVel-v1", 10.0, 3, False),
    ("PendulumNoVel-v1", 1.0, 3, True),
    ("PendulumNoVel-v1", 1.0, 3, False),
    ("CartPoleNoVel-v1", 1.0, 12, False),
]


def copy_policy(policy: Any) -> Any:
    """A fresh recurrent policy with the same modules and weights (``deepcopy`` fails on gSDE's cached latents)."""
    from sb3_kl.common.recurrent import lstm_constructor_parameters

    clone = type(policy)(**policy._get_constructor_parameters(), **lstm_constructor_parameters(policy))
    clone.load_state_dict(policy.state_dict())
    return clone


def make_probe_class(base: type) -> type:
    """``base`` (RecurrentKLPPO) that keeps, per update, what its loss saw and what the update did."""
    from sb3_kl.common.recurrent import evaluate_sequences

    class Probe(base):  # type: ignore[misc, valid-type]
        def _setup_model(self) -> None:
            super()._setup_model()
            self.probe: list[dict[str, Any]] = []
            self._minibatch_kls: list[float] = []

        def _minibatch_loss(self, data: Any, *args: Any) -> dict[str, Any]:
            out = super()._minibatch_loss(data, *args)
            self._minibatch_kls.append(float(out["kl"].detach()))
            return out

        @th.no_grad()
        def _minibatch_view_kl(self) -> float:
            """The final policy's KL on one pass of RecurrentPPO minibatches (padding masked out)."""
            total, count = 0.0, 0
            for data in self.rollout_buffer.get(self.batch_size):
                mask = data.mask > 1e-8
                distribution, _ = self.policy.get_distribution(data.observations, data.lstm_states.pi, data.episode_starts)
                kl = self._per_state_kl(data.old_dist_params, distribution, None)[mask]
                total, count = total + float(kl.sum()), count + int(mask.sum())
            return total / max(count, 1)

        def train(self) -> None:
            self._minibatch_kls = []
            beta = self.kl_coef
            old_policy = copy_policy(self.policy) if hasattr(self.policy, "log_std") else None
            super().train()
            values = self.logger.name_to_value
            kls = np.array(self._minibatch_kls)
            epochs = int(values["train/early_stop_epoch"])
            n_minibatches = len(kls) // max(epochs, 1)
            record = dict(
                update=len(self.probe) + 1,
                kl_coef_used=beta,
                kl_coef_after=self.kl_coef,
                early_stop_epoch=epochs,
                exact_sequence_kl=float(values["train/kl"]),
                exact_sequence_kl_p99=float(values["train/kl_p99"]),
                minibatch_kl_first_epoch=float(kls[:n_minibatches].mean()),
                minibatch_kl_last_epoch=float(kls[-n_minibatches:].mean()),
                minibatch_kl_max=float(kls.max()),
                final_policy_minibatch_view_kl=self._minibatch_view_kl(),
            )
            if old_policy is not None:
                record.update(self._gaussian_split(old_policy))
            self.probe.append(record)
            print(json.dumps(record), flush=True)

        @th.no_grad()
        def _gaussian_split(self, old_policy: Any) -> dict[str, float]:
            """The exact sequence KL split by part of the distribution and by part of the policy."""
            buffer = self.rollout_buffer
            sequences = buffer.sequences(with_actions=False)
            old = th.as_tensor(buffer.old_dist_params).double()
            d = self.dist_params.action_dim
            p = th.distributions.Normal(old[:, :d], old[:, d:].exp())

            def kl_to(policy: Any) -> th.Tensor:
                new = evaluate_sequences(policy, sequences, self.dist_params).params
                new = new.reshape(-1, new.shape[-1]).double()
                return th.distributions.kl_divergence(p, th.distributions.Normal(new[:, :d], new[:, d:].exp())).sum(-1)

            new = evaluate_sequences(self.policy, sequences, self.dist_params).params
            new = new.reshape(-1, new.shape[-1]).double()
            total = th.distributions.kl_divergence(p, th.distributions.Normal(new[:, :d], new[:, d:].exp())).sum(-1)
            std_part = th.distributions.kl_divergence(p, th.distributions.Normal(old[:, :d], new[:, d:].exp())).sum(-1)
            only_log_std = copy_policy(old_policy)
            only_log_std.log_std.copy_(self.policy.log_std)
            only_network = copy_policy(self.policy)
            only_network.log_std.copy_(old_policy.log_std)
            ratio = (new[:, d:] - old[:, d:]).exp()
            return dict(
                exact_kl_torch=float(total.mean()),
                kl_std_part=float(std_part.mean()),
                kl_mean_part=float((total - std_part).mean()),
                kl_only_log_std_moved=float(kl_to(only_log_std).mean()),
                kl_only_network_moved=float(kl_to(only_network).mean()),
                std_ratio_min=float(ratio.min()),
                std_ratio_max=float(ratio.max()),
            )

    return Probe


def run_probe(env_id: str, lr_mult: float, updates: int, detached_sde: bool, seed: int = 0) -> dict[str, Any]:
    import rl_zoo3.import_envs  # noqa: F401  (registers the NoVel tasks)
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    import sb3_kl.ppo_recurrent.ppo_recurrent as recurrent_module
    from sb3_kl import RecurrentKLPPO

    th.set_num_threads(1)
    version = code_version()
    entry = zoo_settings(env_id)
    kwargs = {key: value for key, value in entry.items() if key not in ZOO_ONLY}
    kwargs.pop("clip_range", None)
    if lr_mult != 1.0:
        scale_learning_rate(kwargs, lr_mult)
    env = make_vec_env(env_id, n_envs=entry["n_envs"], seed=seed)
    if entry.get("normalize"):
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    attach = recurrent_module.attach_sde_features
    if detached_sde:
        recurrent_module.attach_sde_features = lambda *args: None  # the KL differentiated as before the fix
    try:
        model = make_probe_class(RecurrentKLPPO)(entry["policy"], env, seed=seed, device="cpu", **kwargs)
        model.learn(updates * model.n_steps * model.n_envs)
    finally:
        recurrent_module.attach_sde_features = attach
    record = dict(
        env=env_id,
        lr_mult=lr_mult,
        seed=seed,
        detached_sde=detached_sde,
        use_sde=bool(kwargs.get("use_sde", False)),
        target_kl=model._current_target_kl(),
        kl_band=list(model.kl_controller.kl_band),
        kl_hinge_coef=model.kl_hinge_coef,
        kl_stop_factor=model.kl_stop_factor,
        batch_size=model.batch_size,
        n_steps=model.n_steps,
        n_envs=model.n_envs,
        updates=model.probe,
        code_version=version,
        run_environment=run_records.run_environment(),
    )
    RUNS.mkdir(parents=True, exist_ok=True)
    name = f"{env_id}__lr{lr_mult:g}__{'detached' if detached_sde else 'attached'}.json"
    (RUNS / name).write_text(json.dumps(record, indent=1))
    return record


#: Feed-forward KLPPO on Pendulum-v1 (the zoo's ppo settings without clip_range, gSDE) at 10x the zoo learning rate:
#: (seeds, updates), each with the gSDE KL detached and attached
FEEDFORWARD = ([0, 1], 8)


def run_feedforward(seed: int, updates: int, detached_sde: bool) -> dict[str, Any]:
    """KLPPO's exact per-update KL (``train/kl``) on Pendulum-v1 at 10x the zoo lr, the gSDE KL detached or attached."""
    import rl_zoo3
    import yaml
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    import sb3_kl.common.on_policy_algorithm as algorithm_module
    from sb3_kl import KLPPO

    th.set_num_threads(1)
    version = code_version()
    entry = dict(yaml.safe_load((Path(rl_zoo3.__file__).parent / "hyperparams" / "ppo.yml").read_text())["Pendulum-v1"])
    kwargs = {key: value for key, value in entry.items() if key not in ZOO_ONLY and key != "clip_range"}
    scale_learning_rate(kwargs, 10.0)
    env = make_vec_env("Pendulum-v1", n_envs=entry["n_envs"], seed=seed)
    if entry.get("normalize"):
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    kls: list[float] = []

    class UpdateKL(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            if self.model._n_updates > 0 and "train/kl" in self.model.logger.name_to_value:
                kls.append(float(self.model.logger.name_to_value["train/kl"]))

        def _on_training_end(self) -> None:
            self._on_rollout_start()

    attach = algorithm_module.attach_sde_features
    if detached_sde:
        algorithm_module.attach_sde_features = lambda *args: None
    try:
        model = KLPPO(entry["policy"], env, seed=seed, device="cpu", **kwargs)
        model.learn(updates * model.n_steps * model.n_envs, callback=UpdateKL())
    finally:
        algorithm_module.attach_sde_features = attach
    record = dict(
        algo="klppo",
        env="Pendulum-v1",
        lr_mult=10.0,
        seed=seed,
        detached_sde=detached_sde,
        kl_updates=kls,
        target_kl=model._current_target_kl(),
        code_version=version,
        run_environment=run_records.run_environment(),
    )
    RUNS.mkdir(parents=True, exist_ok=True)
    name = f"feedforward__Pendulum-v1__lr10__s{seed}__{'detached' if detached_sde else 'attached'}.json"
    (RUNS / name).write_text(json.dumps(record, indent=1))
    return record


def feedforward_lines() -> list[str]:
    records = [json.loads(p.read_text()) for p in sorted(RUNS.glob("feedforward__*.json"))]
    if not records:
        return []
    lines = [
        "",
        "## Feed-forward KLPPO, Pendulum-v1, 10x the zoo learning rate",
        "",
        "The zoo's `ppo` settings for Pendulum-v1 (gSDE) without `clip_range`, KLPPO's KL defaults (target "
        f"{records[0]['target_kl']:g}); exact KL of each update (`train/kl`), code versions "
        f"{', '.join(sorted({r['code_version'] for r in records}))}.",
        "",
        "| seed | gSDE KL | KL per update | mean | max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in records:
        kls = r["kl_updates"]
        lines.append(
            f"| {r['seed']} | {'detached' if r['detached_sde'] else 'attached'} | {', '.join(f'{k:.3g}' for k in kls)} | "
            f"{np.mean(kls):.3g} | {np.max(kls):.3g} |"
        )
    return lines


def probe_series(records: list[dict[str, Any]], feedforward: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    Every run's exact KL per update, recurrent probes and feed-forward runs alike, in the report's order.

    :return: per run, its task label, learning rate multiple, gSDE KL (``attached``, ``detached`` or ``n/a``), seed,
        target and the exact KL of each update
    """
    series = []
    for r in records:
        sde = ("detached" if r["detached_sde"] else "attached") if r["use_sde"] else "n/a"
        kls = [u["exact_sequence_kl"] for u in r["updates"]]
        series.append(dict(task=r["env"], lr_mult=r["lr_mult"], sde=sde, seed=r["seed"], target=r["target_kl"], kl=kls))
    for r in feedforward:
        sde = "detached" if r["detached_sde"] else "attached"
        task, kls = f"{r['env']} (feed-forward)", r["kl_updates"]
        series.append(dict(task=task, lr_mult=r["lr_mult"], sde=sde, seed=r["seed"], target=r["target_kl"], kl=kls))
    return series


def plot_kl(series: list[dict[str, Any]], path: Path) -> None:
    """
    Draw, per task and learning rate, each run's exact KL / target per update, gSDE KL detached and attached, to a PNG.

    :param series: :func:`probe_series`
    :param path: The PNG to write
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = list(dict.fromkeys((s["task"], s["lr_mult"]) for s in series))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.0), squeeze=False, sharey=True)
    colors = {"attached": "tab:blue", "detached": "tab:orange", "n/a": "0.4"}
    for ax, (task, lr_mult) in zip(axes[0], panels, strict=True):
        for s in series:
            if (s["task"], s["lr_mult"]) == (task, lr_mult):
                ratios = np.array(s["kl"]) / s["target"]
                label = "no gSDE" if s["sde"] == "n/a" else f"gSDE KL {s['sde']}"
                ax.plot(range(1, len(ratios) + 1), ratios, "o-", ms=3, color=colors[s["sde"]], label=label)
        ax.axhline(1.0, color="0.6", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("update", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{task} x{lr_mult:g}", fontsize=8)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(dict(zip(labels, handles, strict=True)).values(), dict.fromkeys(labels), fontsize=7)
    axes[0][0].set_ylabel("exact KL of the update / target")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def summary_table(series: list[dict[str, Any]]) -> list[str]:
    """:return: the page's opening table: per run, its exact KL per update (mean and max) over its target"""
    lines = [
        "| task | lr | gSDE KL | seed | updates | exact KL / target, mean | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in series:
        ratios = np.array(s["kl"]) / s["target"]
        lines.append(
            f"| {s['task']} | x{s['lr_mult']:g} | {s['sde']} | {s['seed']} | {len(ratios)} | {ratios.mean():.3g} "
            f"| {ratios.max():.3g} |"
        )
    return lines


def report() -> str:
    records = [json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json")) if not p.name.startswith("feedforward__")]
    feedforward = [json.loads(p.read_text()) for p in sorted(RUNS.glob("feedforward__*.json"))]
    versions = sorted({r["code_version"] for r in records})
    series = probe_series(records, feedforward)
    opening = []
    if series:
        plot_kl(series, RESULTS / "recurrent_kl_probe.png")
        opening = ["![exact KL per update, gSDE KL detached and attached](recurrent_kl_probe.png)", ""]
        opening += [*summary_table(series), ""]
    lines = [
        "# Where the KL of a RecurrentKLPPO update comes from",
        "",
        *opening,
        "Generated by `python benchmarks/studies/recurrent_kl_probe.py` (code versions: "
        f"{', '.join(versions) or 'none'}). Short runs with the zoo's `ppo_lstm` settings (RecurrentKLPPO without "
        "`clip_range`, KL defaults as recorded below), seed 0, one process with one torch thread. The probe's extra "
        "minibatch pass draws from numpy's generator, so later updates differ from a plain run of the same seed.",
        "",
        "- *minibatch KL*: the mean KL the loss saw on RecurrentPPO's minibatches (sequences cut at minibatch "
        "boundaries and restarted from the rollout's stored LSTM states), first and last epoch, and the largest "
        "minibatch value of the update;",
        "- *final, minibatch view*: the updated policy's KL on one more pass of such minibatches; *exact*: `train/kl`, "
        "each LSTM re-run over each env's whole rollout; the difference is what the minibatch cut changes;",
        "- *std part*: KL(N(m_old, s_old) || N(m_old, s_new)), the KL the std change alone makes; *only log_std / only "
        "network*: the exact KL of the rollout policy with only the updated `log_std`, and of the updated policy with "
        "the rollout's `log_std` (the network, hence the gSDE features, moved); *std ratio*: range of s_new / s_old;",
        "- *gSDE KL*: `detached` is the loss as before the fix (its KL differentiated only through the mean and "
        "`log_std`, the std's features detached as SB3's distribution has them), `attached` the current code.",
        "",
        "| task | lr | gSDE KL | update | beta used | minibatch KL epoch 1 / last / max | final, minibatch view | "
        "exact KL (p99) | std part | only log_std / only network | std ratio min-max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for record in records:
        sde = ("detached" if record["detached_sde"] else "attached") if record["use_sde"] else "n/a"
        for u in record["updates"]:
            gaussian = "kl_std_part" in u
            lines.append(
                f"| {record['env']} | x{record['lr_mult']:g} | {sde} | {u['update']} | {u['kl_coef_used']:.3g} | "
                f"{u['minibatch_kl_first_epoch']:.3g} / {u['minibatch_kl_last_epoch']:.3g} / {u['minibatch_kl_max']:.3g} | "
                f"{u['final_policy_minibatch_view_kl']:.3g} | "
                f"{u['exact_sequence_kl']:.3g} ({u['exact_sequence_kl_p99']:.3g}) | "
                + (
                    f"{u['kl_std_part']:.3g} | {u['kl_only_log_std_moved']:.3g} / {u['kl_only_network_moved']:.3g} | "
                    f"{u['std_ratio_min']:.3g}-{u['std_ratio_max']:.3g} |"
                    if gaussian
                    else "- | - | - |"
                )
            )
    settings = sorted(
        {
            f"{r['env']}: target {r['target_kl']:g}, kl_band {tuple(r['kl_band'])}, kl_hinge_coef {r['kl_hinge_coef']:g}, "
            f"kl_stop_factor {r['kl_stop_factor']}, {r['n_envs']} envs x {r['n_steps']} steps, batch_size {r['batch_size']}"
            for r in records
        }
    )
    lines += ["", "Settings: " + "; ".join(settings) + ".", *feedforward_lines(), ""]
    text = "\n".join(lines)
    (RESULTS / "recurrent_kl_probe.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="only regenerate the table")
    parser.add_argument("--feedforward-only", action="store_true", help="only the feed-forward KLPPO runs, then the report")
    args = parser.parse_args(argv)
    if not args.report:
        if not args.feedforward_only:
            for env_id, lr_mult, updates, detached in PROBES:
                run_probe(env_id, lr_mult, updates, detached)
        seeds, updates = FEEDFORWARD
        for seed in seeds:
            for detached in (True, False):
                run_feedforward(seed, updates, detached)
    print(report())


if __name__ == "__main__":
    main()
