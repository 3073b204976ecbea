"""
Train KLPPO (or stock PPO watched by the KL monitor) briefly with TensorBoard logging, then draw the KL/return
timeline, print the KL report and the drill-down into the highest-KL states.

This is how the figures of ``docs/guide/diagnostics.md`` were produced (about a minute each on one CPU core)::

    python examples/plot_kl_timeline.py --logdir benchmarks/results/diagnostics_runs/timeline --out docs/img/kl_timeline.png
    python examples/plot_kl_timeline.py --algo ppo --learning-rate 3e-3 --n-epochs 30 \\
        --logdir benchmarks/results/diagnostics_runs/compare
    python examples/plot_kl_timeline.py --learning-rate 3e-3 --n-epochs 30 \\
        --logdir benchmarks/results/diagnostics_runs/compare --overlay
    sb3-kl plot benchmarks/results/diagnostics_runs/compare --overlay --target 0.02 --out docs/img/kl_timeline_overlay.png

(``--target``: stock PPO logs no target KL, so its band is drawn from the one given.) No band is given: KLPPO logs the
band its controller used, the code's default ``kl_band``, and the figure draws that one.

The same figure from any existing log directory: ``sb3-kl plot LOGDIR --out FILE.png`` (or ``python -m sb3_kl.plot``).

Without ``--logdir`` the run is logged in a new temporary directory, and the figure goes there too unless ``--out``
is given. ``SB3_KL_EXAMPLE_STEPS=N`` in the environment sets the default of ``--timesteps``.
"""

import argparse
import os
import tempfile

import torch as th
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env

from sb3_kl import KLPPO
from sb3_kl.callbacks import KLAlarmCallback, KLMonitorCallback
from sb3_kl.cli import main as sb3_kl_main

TARGET_KL = 0.02


def train(
    algo: str, env_id: str, timesteps: int, logdir: str, seed: int, learning_rate: float = 1e-3, n_epochs: int = 10
) -> str:
    """
    Train on ``env_id`` with TensorBoard logging into ``logdir``. A KL monitor and an alarm callback run alongside
    (the ``kl/alarms`` count becomes the red markers of the figure); the monitor saves the 8 highest-KL states
    of every update, with a background sample, for ``sb3-kl states``.

    :param algo: ``"klppo"`` or ``"ppo"`` (stock SB3 PPO with its clipped surrogate, clip range 0.2)
    :param env_id: Gymnasium environment id
    :param timesteps: Total environment steps
    :param logdir: TensorBoard log directory (a ``KLPPO_<n>`` / ``PPO_<n>`` run folder is created inside)
    :param seed: Random seed
    :param learning_rate: Adam step size
    :param n_epochs: Passes over each rollout
    :return: Path of the saved high-KL states (``.npz``), and the run's own log folder (``<logdir>/KLPPO_<n>``)
    """
    env = make_vec_env(env_id, n_envs=4, seed=seed)
    kwargs = dict(
        n_steps=256,
        batch_size=64,
        n_epochs=n_epochs,
        gamma=0.9,
        gae_lambda=0.95,
        learning_rate=learning_rate,
        policy_kwargs=dict(net_arch=[64, 64]),
        tensorboard_log=logdir,
        seed=seed,
        verbose=0,
    )
    if algo == "klppo":
        model = KLPPO("MlpPolicy", env, target_kl=TARGET_KL, **kwargs)
    else:
        model = PPO("MlpPolicy", env, **kwargs)  # PPO's own target_kl stays None: no early stopping
    states_path = os.path.join(logdir, f"{algo}_top_states.npz")
    monitor = KLMonitorCallback(top_k=8, top_k_path=states_path)
    alarms = KLAlarmCallback(target_kl=TARGET_KL, monitor=monitor)
    model.learn(total_timesteps=timesteps, callback=[monitor, alarms])
    # SB3 writes an iteration's values when the next one starts: write the last update's KL too
    model.logger.dump(model.num_timesteps)
    return states_path, model.logger.get_dir()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=["klppo", "ppo"], default="klppo")
    parser.add_argument("--env", default="Pendulum-v1")
    parser.add_argument("--timesteps", type=int, default=int(os.environ.get("SB3_KL_EXAMPLE_STEPS", 60_000)))
    parser.add_argument("--logdir", default=None, help="TensorBoard log directory (default: a new temporary directory)")
    parser.add_argument("--out", default=None, help="image file (default: kl_timeline.png in --logdir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--n-epochs", type=int, default=10)
    parser.add_argument("--overlay", action="store_true", help="draw every run of --logdir in one figure")
    parser.add_argument("--skip-training", action="store_true", help="only plot and report an existing --logdir")
    args = parser.parse_args()

    th.set_num_threads(1)
    if args.logdir is None:
        if args.skip_training:
            parser.error("--skip-training needs --logdir (the run to plot)")
        args.logdir = tempfile.mkdtemp(prefix="sb3_kl_example_")
    if args.out is None:
        args.out = os.path.join(args.logdir, "kl_timeline.png")
    states = os.path.join(args.logdir, f"{args.algo}_top_states.npz")
    # the run just trained, not older runs of the same folder (every run of it with --overlay or --skip-training)
    runs = args.logdir
    if not args.skip_training:
        states, run = train(args.algo, args.env, args.timesteps, args.logdir, args.seed, args.learning_rate, args.n_epochs)
        runs = args.logdir if args.overlay else run
    status = sb3_kl_main(["plot", runs, "--out", args.out, *(["--overlay"] if args.overlay else [])])
    status = status or sb3_kl_main(["report", runs])
    status = status or sb3_kl_main(["states", states, "--top", "3"])
    raise SystemExit(status)
