"""
Where the KL of a RecurrentKLPPO update comes from: per update, the KL the loss sees on RecurrentPPO's minibatches
(sequences cut at minibatch boundaries, restarted from the rollout policy's stored LSTM states) beside the exact
sequence KL (``train/kl``: each policy's LSTM re-run over each env's whole rollout), beta, the early stop, and for
Gaussian policies the share of the exact KL that comes from the mean and from the std.

    python benchmarks/recurrent_kl_probe.py --env PendulumNoVel-v1 --lr-mult 10 --updates 3 --out probe.json
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch as th

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from recurrent_learning import ZOO_ONLY, code_version, zoo_settings  # noqa: E402

from learning import scale_learning_rate  # noqa: E402


def make_probe_class(base: type) -> type:
    """``base`` (RecurrentKLPPO) that keeps, per update, what its loss saw and what the update did."""
    from sb3_kl.common.recurrent import evaluate_sequences

    class Probe(base):  # type: ignore[misc, valid-type]
        def _setup_model(self) -> None:
            super()._setup_model()
            self.probe: list[dict[str, Any]] = []
            self._minibatch_kls: list[tuple[float, int]] = []

        def _minibatch_loss(self, data: Any, *args: Any) -> dict[str, Any]:
            out = super()._minibatch_loss(data, *args)
            self._minibatch_kls.append((float(out["kl"].detach()), int((data.mask > 1e-8).sum())))
            return out

        @th.no_grad()
        def _minibatch_view_kl(self) -> float:
            """The final policy's KL on one pass of RecurrentPPO minibatches (what the loss would see next)."""
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
            super().train()
            values = self.logger.name_to_value
            kls = np.array([k for k, _ in self._minibatch_kls])
            n_mb = len(kls) // max(int(values["train/early_stop_epoch"]), 1)
            record = dict(
                update=len(self.probe) + 1,
                kl_coef_used=beta,
                kl_coef_after=self.kl_coef,
                early_stop_epoch=int(values["train/early_stop_epoch"]),
                exact_sequence_kl=float(values["train/kl"]),
                exact_sequence_kl_p99=float(values["train/kl_p99"]),
                minibatch_kl_first_epoch=float(kls[:n_mb].mean()),
                minibatch_kl_last_epoch=float(kls[-n_mb:].mean()),
                minibatch_kl_max=float(kls.max()),
                final_policy_minibatch_view_kl=self._minibatch_view_kl(),
            )
            if hasattr(self.policy, "log_std"):
                record.update(self._gaussian_split())
            self.probe.append(record)
            print(json.dumps(record), flush=True)

        @th.no_grad()
        def _gaussian_split(self) -> dict[str, float]:
            """The exact sequence KL split into its mean part and its std part (torch.distributions on both)."""
            buffer = self.rollout_buffer
            new = evaluate_sequences(self.policy, buffer.sequences(with_actions=False), self.dist_params).params
            new = new.reshape(-1, new.shape[-1]).double()
            old = th.as_tensor(buffer.old_dist_params).double()
            d = self.dist_params.action_dim
            p = th.distributions.Normal(old[:, :d], old[:, d:].exp())
            q = th.distributions.Normal(new[:, :d], new[:, d:].exp())
            q_same_mean = th.distributions.Normal(old[:, :d], new[:, d:].exp())
            total = th.distributions.kl_divergence(p, q).sum(-1)
            std_part = th.distributions.kl_divergence(p, q_same_mean).sum(-1)
            ratio = (new[:, d:] - old[:, d:]).exp()
            return dict(
                exact_kl_torch=float(total.mean()),
                kl_std_part=float(std_part.mean()),
                kl_mean_part=float((total - std_part).mean()),
                std_ratio_min=float(ratio.min()),
                std_ratio_max=float(ratio.max()),
                old_std_median=float(old[:, d:].exp().median()),
                old_std_min=float(old[:, d:].exp().min()),
                log_std_param_mean=float(self.policy.log_std.mean()),
            )

    return Probe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="PendulumNoVel-v1")
    parser.add_argument("--lr-mult", type=float, default=1.0)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="extra constructor arguments, key=python-literal")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import rl_zoo3.import_envs  # noqa: F401
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from sb3_kl import RecurrentKLPPO

    th.set_num_threads(1)
    entry = zoo_settings(args.env)
    kwargs = {key: value for key, value in entry.items() if key not in ZOO_ONLY}
    kwargs.pop("clip_range", None)
    if args.lr_mult != 1.0:
        scale_learning_rate(kwargs, args.lr_mult)
    for item in args.set:
        key, value = item.split("=", 1)
        kwargs[key] = eval(value)
    env = make_vec_env(args.env, n_envs=entry["n_envs"], seed=args.seed)
    if entry.get("normalize"):
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
    model = make_probe_class(RecurrentKLPPO)(entry["policy"], env, seed=args.seed, device="cpu", **kwargs)
    model.learn(args.updates * model.n_steps * model.n_envs)
    args.out.write_text(
        json.dumps(
            dict(
                env=args.env,
                lr_mult=args.lr_mult,
                seed=args.seed,
                extra=args.set,
                code_version=code_version(),
                updates=model.probe,
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
