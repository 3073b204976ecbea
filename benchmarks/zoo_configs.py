"""
Run every entry of the zoo configs shipped in ``sb3_kl/hyperparams/{algo}.yml`` through ``python -m sb3_kl.zoo train``,
evaluate the final model, and write the table ``benchmarks/results/zoo_configs.md``.

Each run writes ``benchmarks/results/zoo_runs/{algo}_{env}_seed{seed}.json``; runs whose JSON exists are skipped,
so an interrupted benchmark resumes where it stopped (``--force`` re-runs). ``--table-only`` rebuilds the table.

    nice -n 10 python benchmarks/zoo_configs.py --jobs 2
    python benchmarks/zoo_configs.py --algos kltrpo --envs Pendulum-v1 --seed 1
    python benchmarks/zoo_configs.py --table-only
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch as th
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_records  # noqa: E402

HYPERPARAMS_DIR = ROOT / "sb3_kl" / "hyperparams"
RESULTS_DIR = ROOT / "benchmarks" / "results"
RUNS_DIR = RESULTS_DIR / "zoo_runs"
TABLE = RESULTS_DIR / "zoo_configs.md"
ALGOS = ("klppo", "clip_klppo", "kltrpo", "trpl", "klppo_mask", "klppo_lstm")

#: Return regarded as solved / good, for the table's last column (the zoo's usual reference levels)
REFERENCE_RETURN = {
    "CartPole-v1": 475.0,
    "Acrobot-v1": -100.0,
    "Pendulum-v1": -200.0,
    "LunarLander-v3": 200.0,
    "LunarLanderContinuous-v3": 200.0,
    "HalfCheetah-v5": 3000.0,
    "Hopper-v5": 2500.0,
    "CartPoleNoVel-v1": 475.0,
    "PendulumNoVel-v1": -200.0,
    # 100 steps per episode, reward 1 per correct action (at most 100)
    "InvalidActionMultiDiscrete-v0": 95.0,
}


def shipped_entries(algos: list[str], envs: list[str] | None) -> list[tuple[str, str, dict[str, Any]]]:
    """(algo, env, config) for every entry of the shipped configs, optionally filtered."""
    entries = []
    for algo in algos:
        with open(HYPERPARAMS_DIR / f"{algo}.yml") as file:
            configs = yaml.safe_load(file)
        for env_id, config in configs.items():
            if envs is None or env_id in envs:
                entries.append((algo, env_id, config))
    return entries


def code_version() -> str:
    """The commit of this checkout, with ``+modified`` when the package or this script had uncommitted changes."""
    return run_records.code_version("zoo_configs.py")


def evaluate(model_dir: Path, algo: str, env_id: str, n_episodes: int, seed: int) -> tuple[float, float]:
    """
    Deterministic return of the final model, with the training VecNormalize statistics if any (zoo helpers). A
    maskable algorithm acts with the env's action masks (sb3-contrib's ``evaluate_policy``); SB3's carries an LSTM's
    state across steps for a recurrent one.
    """
    import rl_zoo3
    from sb3_contrib.common.maskable.evaluation import evaluate_policy as evaluate_masked
    from stable_baselines3.common.evaluation import evaluate_policy

    import sb3_kl.zoo

    if algo in sb3_kl.zoo.registry.MASKABLE_ALGOS:
        evaluate_policy = evaluate_masked

    hyperparams, stats_path = rl_zoo3.get_saved_hyperparams(str(model_dir / env_id), test_mode=True)
    env = rl_zoo3.create_test_env(
        env_id, n_envs=1, stats_path=stats_path, seed=seed, log_dir=None, should_render=False, hyperparams=hyperparams
    )
    model = sb3_kl.zoo.SB3_KL_ALGOS[algo].load(model_dir / f"{env_id}.zip", device="cpu")
    mean, std = evaluate_policy(model, env, n_eval_episodes=n_episodes, deterministic=True)
    env.close()
    return float(mean), float(std)


def training_return(model_dir: Path, last: int = 100) -> tuple[float, int]:
    """Mean return of the last ``last`` training episodes (all Monitor files of the run) and the episode count."""
    import pandas as pd

    frames = [pd.read_csv(path, skiprows=1) for path in model_dir.glob("*.monitor.csv")]
    episodes = pd.concat(frames).sort_values("t")
    return float(episodes["r"].tail(last).mean()), len(episodes)


def run_entry(algo: str, env_id: str, config: dict[str, Any], seed: int, log_root: Path, n_eval: int, force: bool) -> dict:
    """Train one entry through the module, evaluate it and store the result JSON."""
    out = RUNS_DIR / f"{algo}_{env_id}_seed{seed}.json"
    if out.exists() and not force:
        return json.loads(out.read_text())
    log_folder = log_root / f"seed{seed}"
    command = [
        "python", "-m", "sb3_kl.zoo", "train", "--algo", algo, "--env", env_id, "--seed", str(seed),
        "--num-threads", "1", "--eval-freq", "-1", "--verbose", "0", "-f", str(log_folder),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    version = code_version()  # the checkout the run starts from
    start = time.time()
    log_file = log_root / f"{algo}_{env_id}_seed{seed}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        # Shared machine: training runs at niceness 10 (counting what this script already has)
        nice = ["nice", "-n", str(10 - os.nice(0))] if os.nice(0) < 10 else []
        status = subprocess.run([*nice, sys.executable, *command[1:]], env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - start
    result: dict[str, Any] = {
        "algo": algo,
        "env": env_id,
        "seed": seed,
        "n_timesteps": int(float(config["n_timesteps"])),
        "config": config,
        "command": " ".join(command),
        "wall_time_s": round(wall, 1),
        "returncode": status.returncode,
        "code_version": version,
        "run_environment": run_records.run_environment(),
    }
    if status.returncode == 0:
        run_dirs = sorted((log_folder / algo).glob(f"{env_id}_*"), key=lambda path: path.stat().st_mtime)
        model_dir = run_dirs[-1]
        result["run_dir"] = str(model_dir)
        result["eval_mean"], result["eval_std"] = evaluate(model_dir, algo, env_id, n_eval, seed + 1000)
        result["eval_episodes"] = n_eval
        result["train_return_last100"], result["train_episodes"] = training_return(model_dir)
    else:
        result["error_tail"] = log_file.read_text()[-2000:]
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(
        f"{algo:10s} {env_id:26s} seed={seed} rc={status.returncode} {result.get('eval_mean', float('nan')):9.1f} {wall:7.0f}s"
    )
    return result


def write_table() -> None:
    """Build ``zoo_configs.md`` from every stored run JSON."""
    results = [json.loads(path.read_text()) for path in sorted(RUNS_DIR.glob("*.json"))]
    order = {algo: i for i, algo in enumerate(ALGOS)}
    env_order = {env_id: i for i, env_id in enumerate(REFERENCE_RETURN)}
    results.sort(key=lambda r: (order.get(r["algo"], 99), env_order.get(r["env"], 99), r["env"], r["seed"]))
    shipped = {(algo, env_id): config for algo, env_id, config in shipped_entries(list(ALGOS), None)}
    lines = [
        "# Zoo configs shipped in `sb3_kl/hyperparams/`: measured returns",
        "",
        "Produced by `benchmarks/zoo_configs.py` (per-run JSON in `benchmarks/results/zoo_runs/`). Each entry was trained",
        "once with the command shown (the shipped config, its own `n_timesteps` budget, `--num-threads 1`, no evaluation",
        "during training) on a shared 2-core CPU machine. *Eval* is the mean ± std return of the **final** model over",
        "the stated number of deterministic episodes (VecNormalize statistics loaded, rewards not normalised);",
        "*train* is the mean return of the last 100 training episodes (stochastic policy). *Reference* is the usual",
        "'solved' level; one seed per entry, so these figures show that a config works, not its expected spread.",
        "*Shipped*: whether `sb3_kl/hyperparams/{algo}.yml` contains exactly this config. Wall times are from a machine",
        "shared with other jobs (load average about 12 on 2 cores), so they overstate the cost of a run.",
        "",
        "*Code*: the sb3-kl commit of the run (older records did not store it).",
        "",
        "| algo | env | budget (steps) | seed | eval return | train return (last 100 ep) | reference | shipped | code "
        "| wall time | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["returncode"] != 0:
            eval_text, train_text = f"FAILED (rc={r['returncode']})", "-"
        else:
            eval_text = f"{r['eval_mean']:.1f} ± {r['eval_std']:.1f} ({r['eval_episodes']} ep)"
            train_text = f"{r['train_return_last100']:.1f}"
        reference = REFERENCE_RETURN.get(r["env"])
        is_shipped = shipped.get((r["algo"], r["env"])) == r["config"]
        lines.append(
            f"| {r['algo']} | {r['env']} | {r['n_timesteps']:,} | {r['seed']} | {eval_text} | {train_text} | "
            f"{reference if reference is not None else '-'} | {'yes' if is_shipped else 'no'} | "
            f"{r.get('code_version', 'unrecorded')} | {r['wall_time_s'] / 60:.1f} min | `{r['command']}` |"
        )
    lines += ["", *summary_matrix(results, shipped), ""]
    TABLE.write_text("\n".join(lines))
    print(f"Wrote {TABLE}")


def summary_matrix(results: list[dict[str, Any]], shipped: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Env x algorithm: the evaluation return of the run behind each shipped entry (its budget in brackets)."""
    lines = [
        "## Shipped entries at a glance",
        "",
        "Evaluation return of the recorded run of each shipped entry (budget in environment steps); *not shipped*: no",
        "entry for this pair in the package.",
        "",
        "| env | " + " | ".join(f"`{algo}`" for algo in ALGOS) + " |",
        "|---|" + "---|" * len(ALGOS),
    ]
    for env_id in REFERENCE_RETURN:
        cells = []
        for algo in ALGOS:
            config = shipped.get((algo, env_id))
            runs = [
                r
                for r in results
                if r["algo"] == algo and r["env"] == env_id and r["returncode"] == 0 and r["config"] == config
            ]
            if config is None:
                cells.append("not shipped")
            elif not runs:
                cells.append("shipped, no run recorded")
            else:
                run = runs[-1]
                cells.append(f"{run['eval_mean']:.1f} ({run['n_timesteps']:.0e})".replace("e+0", "e"))
        lines.append(f"| {env_id} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--envs", nargs="+", default=None, help="Only these env ids (default: every shipped entry)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="Parallel training processes (at most 2 on a shared machine)")
    parser.add_argument("--n-eval-episodes", type=int, default=20)
    parser.add_argument("--log-root", type=Path, default=Path("/tmp/sb3_kl_zoo_bench"), help="Zoo log folder (not kept)")
    parser.add_argument("--force", action="store_true", help="Re-run entries that already have a result JSON")
    parser.add_argument("--table-only", action="store_true", help="Only rebuild the table from stored JSON")
    args = parser.parse_args()
    th.set_num_threads(1)

    if not args.table_only:
        entries = shipped_entries(args.algos, args.envs)
        with ThreadPoolExecutor(max_workers=min(args.jobs, 2)) as pool:
            futures = [
                pool.submit(run_entry, algo, env_id, config, args.seed, args.log_root, args.n_eval_episodes, args.force)
                for algo, env_id, config in entries
            ]
            for future in futures:
                future.result()
    write_table()


if __name__ == "__main__":
    main()
