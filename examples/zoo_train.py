"""
Train KLPPO through the RL Baselines3 Zoo from Python, then load and evaluate the saved agent without the zoo.

Same as ``python -m sb3_kl.zoo train --algo klppo --env CartPole-v1 ...`` on the command line. Needs the zoo extra
(from the sb3-kl checkout: ``pip install -e ".[zoo]"``). The zoo's run folder goes to ``--log-folder`` (default: a new
temporary directory); ``SB3_KL_EXAMPLE_STEPS=N`` in the environment sets the default of ``--n-timesteps``.

    python examples/zoo_train.py                       # shipped CartPole-v1 config, 30k steps
    python examples/zoo_train.py --algo kltrpo --env Pendulum-v1 --n-timesteps 100000
"""

import argparse
import os
import tempfile
from pathlib import Path

from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

import sb3_kl.zoo  # registers klppo, clip_klppo, kltrpo, klppo_mask and klppo_lstm in rl_zoo3
from sb3_kl.zoo.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="klppo", choices=sorted(sb3_kl.zoo.SB3_KL_ALGOS))
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--n-timesteps", type=int, default=int(os.environ.get("SB3_KL_EXAMPLE_STEPS", 30_000)))
    parser.add_argument("--log-folder", default=None, help="zoo log folder (default: a new temporary directory)")
    args = parser.parse_args()
    if args.log_folder is None:
        args.log_folder = tempfile.mkdtemp(prefix="sb3_kl_example_")

    # Any rl_zoo3.train flag can be added here: -params, --vec-env subproc, -tb, -optimize, --storage, ...
    # Without -conf, the config shipped in sb3_kl/hyperparams/{algo}.yml is used.
    train(
        [
            "--algo", args.algo, "--env", args.env, "-n", str(args.n_timesteps), "--seed", "0",
            "-f", args.log_folder, "--eval-freq", "-1", "--verbose", "0",
        ]
    )  # fmt: skip

    # The zoo's layout: {log_folder}/{algo}/{env}_{run id}/{env}.zip, with {env}/config.yml and args.yml next to it
    runs = sorted(Path(args.log_folder, args.algo).glob(f"{args.env}_*"), key=lambda path: path.stat().st_mtime)
    model_path = runs[-1] / f"{args.env}.zip"
    # Our schedules are SB3's picklable classes: the model loads with the algorithm class alone
    model = sb3_kl.zoo.SB3_KL_ALGOS[args.algo].load(model_path)
    if (runs[-1] / args.env / "vecnormalize.pkl").exists():
        print("This config normalises observations: evaluate with `python -m sb3_kl.zoo enjoy`, which loads the statistics")
        return
    mean, std = evaluate_policy(model, make_vec_env(args.env, n_envs=1, seed=1), n_eval_episodes=10, deterministic=True)
    print(f"{model_path}: mean return over 10 episodes {mean:.1f} +/- {std:.1f}")
    print(f"Watch it: python -m sb3_kl.zoo enjoy --algo {args.algo} --env {args.env} -f {args.log_folder}")


if __name__ == "__main__":
    main()
