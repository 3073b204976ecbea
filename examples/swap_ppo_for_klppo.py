"""
A stock SB3 script with one change: ``PPO`` became ``KLPPO``. Every keyword argument is PPO's.

    python examples/swap_ppo_for_klppo.py

The model is saved in a new temporary directory (printed). ``SB3_KL_EXAMPLE_STEPS=N`` in the environment sets the
training budget (the tests run every example with a small N).
"""

import os
import tempfile

import torch as th
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

# from stable_baselines3 import PPO
from sb3_kl import KLPPO as PPO  # the only change

th.set_num_threads(1)
env = make_vec_env("Pendulum-v1", n_envs=4, seed=0)
# rl-zoo's PPO settings for Pendulum-v1 (clip_range is kept: KLPPO then clips *and* penalizes the KL)
model = PPO(
    "MlpPolicy",
    env,
    n_steps=1024,
    gae_lambda=0.95,
    gamma=0.9,
    n_epochs=10,
    learning_rate=1e-3,
    clip_range=0.2,
    use_sde=True,
    sde_sample_freq=4,
    verbose=1,
    seed=0,
)
model.learn(total_timesteps=int(os.environ.get("SB3_KL_EXAMPLE_STEPS", 20_000)))
path = os.path.join(tempfile.mkdtemp(prefix="sb3_kl_example_"), "klppo_pendulum")
model.save(path)
print(f"saved to {path}.zip")

del model
model = PPO.load(path, env=env)
print(f"beta restored from disk: {model.kl_coef:.4f}")
mean_return, std_return = evaluate_policy(model, env, n_eval_episodes=10, deterministic=True)
print(f"mean return {mean_return:.1f} +/- {std_return:.1f}")
