"""
Train KLPPO briefly with TensorBoard logging, then draw its KL/return timeline and print the KL report.

This is how ``docs/img/kl_timeline.png`` was produced::

    python examples/plot_kl_timeline.py --env Pendulum-v1 --timesteps 60000 --logdir /tmp/sb3kl_timeline \
        --out docs/img/kl_timeline.png

The same figure from any existing log directory: ``sb3-kl plot LOGDIR --out FILE.png`` (or ``python -m sb3_kl.plot``).
"""

import argparse

import torch as th
from stable_baselines3.common.env_util import make_vec_env

from sb3_kl import KLPPO
from sb3_kl.cli import main as sb3_kl_main


def train(env_id: str, timesteps: int, logdir: str, seed: int) -> None:
    """
    Train KLPPO on ``env_id`` with TensorBoard logging into ``logdir``.

    :param env_id: Gymnasium environment id
    :param timesteps: Total environment steps
    :param logdir: TensorBoard log directory (a ``KLPPO_<n>`` run folder is created inside)
    :param seed: Random seed
    """
    env = make_vec_env(env_id, n_envs=4, seed=seed)
    model = KLPPO(
        "MlpPolicy",
        env,
        n_steps=256,
        batch_size=64,
        n_epochs=10,
        gamma=0.9,
        gae_lambda=0.95,
        learning_rate=1e-3,
        target_kl=0.02,
        policy_kwargs=dict(net_arch=[64, 64]),
        tensorboard_log=logdir,
        seed=seed,
        verbose=0,
    )
    model.learn(total_timesteps=timesteps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--timesteps", type=int, default=60_000)
    parser.add_argument("--logdir", default="/tmp/sb3kl_timeline")
    parser.add_argument("--out", default="kl_timeline.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-training", action="store_true", help="only plot an existing --logdir")
    args = parser.parse_args()

    th.set_num_threads(1)
    if not args.skip_training:
        train(args.env, args.timesteps, args.logdir, args.seed)
    status = sb3_kl_main(["plot", args.logdir, "--out", args.out])
    status = status or sb3_kl_main(["report", args.logdir])
    raise SystemExit(status)
