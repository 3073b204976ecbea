"""
Anchor a policy to a trusted one while it learns a new reward: pretrain PPO on Pendulum-v1, then fine-tune with KLPPO
on Pendulum with a misspecified shaped reward (a bonus for angular speed, which spinning the pendulum round and round
exploits), with a KL penalty toward the pretrained policy (``ref_policy``) whose coefficient is adapted so that
KL(pi || pi_ref) tracks ``ref_target_kl``. Prints the KL to the reference after every update and the original-task
return before and after, then shows that the anchor is saved with the model.

    python examples/reference_anchor.py [--pretrain-steps 100000] [--finetune-steps 40960] [--spin-bonus 1.5]
        [--ref-target-kl 0.05]

(The full measurement, with and without the anchor over 3 seeds, is benchmarks/reference.py.)
"""

import argparse
import os
import tempfile

import gymnasium as gym
import numpy as np
import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor

from sb3_kl import KLPPO

# rl-zoo's Pendulum-v1 settings for PPO
SETTINGS = dict(n_steps=1024, gae_lambda=0.95, gamma=0.9, n_epochs=10, learning_rate=1e-3, use_sde=True, sde_sample_freq=4)


class SpinBonus(gym.Wrapper):
    """The new reward: Pendulum's reward plus ``coef * |angular velocity|`` (hackable: spinning pays more than balancing)."""

    def __init__(self, env: gym.Env, coef: float):
        super().__init__(env)
        self.coef = coef

    def step(self, action: np.ndarray):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, float(reward) + self.coef * abs(float(obs[2])), terminated, truncated, info


class PrintReferenceKL(BaseCallback):
    """One line per update: the KL to the reference (mean and p99 over the buffer's states) and beta_ref."""

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        # Runs right after train(): its values are still in the logger (they are dumped at the next iteration)
        values = self.model.logger.name_to_value
        if "train/ref_kl" in values:
            print(
                f"steps={self.num_timesteps:>6}  KL to ref={values['train/ref_kl']:.4f}  "
                f"p99={values['train/ref_kl_p99']:.4f}  "
                f"beta_ref={values['train/ref_kl_coef']:.3f}  update KL={values['train/kl']:.4f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # SB3_KL_EXAMPLE_STEPS=N in the environment sets both budgets (the tests run every example with a small N)
    budget = os.environ.get("SB3_KL_EXAMPLE_STEPS")
    parser.add_argument("--pretrain-steps", type=int, default=int(budget or 100_000))
    parser.add_argument("--finetune-steps", type=int, default=int(budget or 40_960))
    parser.add_argument("--spin-bonus", type=float, default=1.5)
    parser.add_argument("--ref-target-kl", type=float, default=0.05)
    args = parser.parse_args()
    th.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="sb3_kl_example_")  # the models are written here, never into the repository
    reference_path = os.path.join(workdir, "pendulum_ppo.zip")

    print(f"Pretraining PPO on Pendulum-v1 for {args.pretrain_steps} steps ...")
    pretrained = PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=4, seed=0), seed=0, **SETTINGS)
    pretrained.learn(args.pretrain_steps)
    pretrained.save(reference_path)
    mean, std = evaluate_policy(pretrained, Monitor(gym.make("Pendulum-v1")), n_eval_episodes=10)
    print(f"pretrained: original-task return {mean:.1f} +/- {std:.1f}")

    new_task = make_vec_env(
        "Pendulum-v1", n_envs=4, seed=1, wrapper_class=SpinBonus, wrapper_kwargs=dict(coef=args.spin_bonus)
    )
    model = KLPPO(
        "MlpPolicy",
        new_task,
        target_kl=0.03,
        ref_policy=reference_path,  # a saved model, a model or a policy: a frozen copy becomes model.ref_policy
        ref_target_kl=args.ref_target_kl,  # beta_ref is adapted toward it (None: fixed ref_kl_coef)
        ref_kl_coef=1.0,
        ref_kl_coef_bounds=(1e-3, 100.0),
        seed=1,
        **SETTINGS,
    )
    # Fine-tune from the pretrained weights (the reference is a separate, frozen copy)
    model.policy.load_state_dict(pretrained.policy.state_dict())
    print(
        f"Fine-tuning KLPPO on Pendulum-v1 with reward r + {args.spin_bonus}*|angular velocity|, anchored to the reference ..."
    )
    model.learn(args.finetune_steps, callback=PrintReferenceKL())
    mean, _ = evaluate_policy(model, Monitor(gym.make("Pendulum-v1")), n_eval_episodes=10)
    print(f"fine-tuned: original-task return {mean:.1f} (benchmarks/reference.py compares with and without the anchor)")

    # The reference's weights and beta_ref's controller are saved with the model: the original file is not needed
    model.save(os.path.join(workdir, "finetuned.zip"))
    os.remove(reference_path)
    loaded = KLPPO.load(os.path.join(workdir, "finetuned.zip"))
    obs = th.as_tensor(gym.make("Pendulum-v1").reset(seed=0)[0][None])
    print(
        f"after load: beta_ref={loaded.ref_kl_coef:.3f}, reference mean action on a state: "
        f"{loaded.ref_policy.get_distribution(obs).distribution.mean.item():.3f}"
    )


if __name__ == "__main__":
    main()
