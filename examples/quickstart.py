"""
Train KLPPO on CartPole-v1 for a short run and print the KL figures of every update: the KL against its target, its
tail, the learning rate and beta. The rate is ``"auto_1e-3"``: adapted from the KL, starting at rl-zoo's rate, so that
each update's KL meets the target (``--learning-rate 1e-3`` fixes it, as KLPPO's default does).

    python examples/quickstart.py [--steps 20000] [--env CartPole-v1] [--learning-rate auto_1e-3]

Writes no file. ``SB3_KL_EXAMPLE_STEPS=N`` in the environment sets the default of ``--steps`` (the tests run every
example with a small N).
"""

import argparse
import os

import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.evaluation import evaluate_policy

from sb3_kl import KLPPO


class PrintKL(BaseCallback):
    """Prints one line per update: the exact KL of the update against its target, its tail, the learning rate and beta."""

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        # Runs right after train(): its values are still in the logger (they are dumped at the next iteration)
        values = self.model.logger.name_to_value
        if "train/kl" in values:
            rate = f"  lr={values['train/learning_rate']:.3g}" if "train/learning_rate" in values else ""
            print(
                f"steps={self.num_timesteps:>6}  KL={values['train/kl']:.4f} "
                f"({values['train/kl'] / values['train/target_kl']:.2f} x target {values['train/target_kl']:.3f})"
                f"  KL p99={values['train/kl_p99']:.4f}{rate}"
                f"  beta={values['train/kl_coef']:.3g}  ({values['train/kl_convention']})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--steps", type=int, default=int(os.environ.get("SB3_KL_EXAMPLE_STEPS", 20_000)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--learning-rate",
        type=lambda text: text if text.startswith("auto") else float(text),
        default="auto_1e-3",
        help='"auto"/"auto_<start>" (docs/guide/learning_rate.md), or a number',
    )
    args = parser.parse_args()
    th.set_num_threads(1)

    # rl-zoo's PPO settings for CartPole-v1, without ratio clipping: the KL penalty controls the step
    model = KLPPO(
        "MlpPolicy",
        args.env,
        n_steps=256,
        batch_size=256,
        n_epochs=10,
        gamma=0.98,
        gae_lambda=0.8,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    model.learn(args.steps, callback=PrintKL())
    mean_return, std_return = evaluate_policy(model, model.get_env(), n_eval_episodes=10, deterministic=True)
    print(f"evaluation over 10 deterministic episodes: {mean_return:.1f} +/- {std_return:.1f}")
    rate = model.adapted_learning_rate if model.adapts_learning_rate else model.lr_schedule(0.0)
    print(f"final beta={model.kl_coef:.3g} and learning rate {rate:.3g} after {model.kl_controller.n_updates} updates")


if __name__ == "__main__":
    main()
