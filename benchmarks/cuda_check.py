"""
sb3-kl on a CUDA device: whether its updates give the same results there as on the CPU, and what its KL control costs
there. Without a CUDA device (``torch.cuda.is_available()`` False) it prints one line saying that the check was
skipped, with torch's version and build, writes nothing and exits 0.

Same results: short KLPPO and KLTRPO runs (CartPole-v1 and Pendulum-v1, n_steps=256, batch_size=64, KLPPO's
n_epochs=4, :data:`CHECK_UPDATES` updates, seed 0), once with ``device="cpu"`` and once with ``device="cuda"``; the
logged ``train/kl`` of every update is collected (``model.train`` wrapped, :func:`record_kl`) and the first
:data:`COMPARED_UPDATES` updates of the two sequences are compared within a relative tolerance of :data:`KL_RTOL`
(absolute :data:`KL_ATOL`). Only the first updates are compared: float results differ in the last bits from one
device to the other, and the two trajectories drift apart slowly as those differences feed back into the rollouts.
Both runs see the same environment data: same seed, same initial weights (SB3 builds the policy on the CPU and
then moves it), and the actions of both are drawn from torch's CPU generator (:func:`sample_on_cpu`), because
CUDA's generator draws another stream than the CPU's from the same seed, so that the same seed alone would give the
CUDA run other actions from the first step.

Speed: environment steps per second of ``learn()`` (``time.perf_counter``, the device synchronized before the clock
stops), both sides with ``device="cuda"``, the same seed and the same settings, after one untimed warm-up rollout of
each: KLPPO vs PPO with ``MlpPolicy`` on CartPole-v1 and with ``CnnPolicy`` on :class:`TinyImageEnv` (64x64 RGB
random images, no Atari ROMs needed), KLTRPO vs sb3-contrib TRPO with ``MlpPolicy`` on CartPole-v1. ``--pairs``
pairs of runs each (pair ``i`` uses seed ``i``; which side runs first alternates from pair to pair); the median
ratio (sb3-kl / stock) is reported. KLPPO runs with its own defaults (no ratio clip, automatic ``target_kl``).

Writes ``benchmarks/results/cuda_check.json`` (the command, torch's version, the device's name, the commit, every
comparison and every pair) and ``benchmarks/results/cuda_check.md`` (small tables), only when a CUDA device is
present. Exits 1 when a compared update does not match.

    python benchmarks/cuda_check.py [--pairs 3]
"""

import argparse
import json
import math
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_records  # noqa: E402

RESULTS = HERE / "results"

CHECK_ENVS = ["CartPole-v1", "Pendulum-v1"]
CHECK_ALGOS = ["KLPPO", "KLTRPO"]
CHECK_UPDATES = 5
COMPARED_UPDATES = 3
KL_RTOL = 1e-3
KL_ATOL = 1e-8
SEED = 0
# settings of every run, check and speed alike (TRPO has no epochs)
PPO_KWARGS: dict[str, Any] = dict(n_steps=256, batch_size=64, n_epochs=4)
TRPO_KWARGS: dict[str, Any] = dict(n_steps=256, batch_size=64)
CNN_KWARGS: dict[str, Any] = dict(n_steps=128, batch_size=64, n_epochs=4)
# (label, sb3-kl class, stock class, policy, env, environment steps per timed run)
SPEED_CASES = [
    ("klppo_mlp", "KLPPO", "PPO", "MlpPolicy", "CartPole-v1", 8_192),
    ("klppo_cnn", "KLPPO", "PPO", "CnnPolicy", "TinyImageEnv", 4_096),
    ("kltrpo_mlp", "KLTRPO", "TRPO", "MlpPolicy", "CartPole-v1", 8_192),
]


class TinyImageEnv(gym.Env):
    """
    Image observations without Atari ROMs: each step shows a random 64x64 RGB image (from the env's seeded generator);
    of the 4 actions, the one naming the image's brightest quadrant earns 1. Episodes are truncated after 100 steps.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    EPISODE_STEPS = 100

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self._steps = 0
        self._image = np.zeros((64, 64, 3), np.uint8)

    def _draw(self) -> np.ndarray:
        self._image = self.np_random.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        return self._image

    def best_action(self) -> int:
        """:return: the quadrant (0: top left, 1: top right, 2: bottom left, 3: bottom right) with the largest mean"""
        quadrants = self._image.reshape(2, 32, 2, 32, 3).mean(axis=(1, 3, 4))
        return int(np.argmax(quadrants))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._steps = 0
        return self._draw(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = 1.0 if int(action) == self.best_action() else 0.0
        self._steps += 1
        return self._draw(), reward, False, self._steps >= self.EPISODE_STEPS, {}


def compare_kl(
    cpu: list[float], cuda: list[float], n_first: int = COMPARED_UPDATES, rtol: float = KL_RTOL, atol: float = KL_ATOL
) -> dict[str, Any]:
    """
    Compare the first updates' KL of two runs.

    :param cpu: ``train/kl`` of each update of the CPU run
    :param cuda: the same of the CUDA run
    :param n_first: Updates compared (the later ones are reported, not judged)
    :param rtol: Relative tolerance
    :param atol: Absolute tolerance
    :return: ``matched`` (per compared update), ``rel_diff`` (per update of both), ``ok`` (every compared update
        matched and both runs made at least ``n_first`` updates)
    """
    # a run may have made fewer updates than the other: the pairs both have
    pairs = list(zip(cpu, cuda, strict=False))
    rel_diff = [abs(a - b) / max(abs(a), abs(b), atol) for a, b in pairs]
    matched = [math.isclose(a, b, rel_tol=rtol, abs_tol=atol) for a, b in pairs[:n_first]]
    return {
        "matched": matched,
        "rel_diff": rel_diff,
        "ok": len(matched) == n_first and all(matched),
        "n_first": n_first,
        "rtol": rtol,
        "atol": atol,
    }


def sample_on_cpu(distribution: Any) -> Any:
    """
    Replacement of an SB3 distribution's ``sample``: draws from torch's CPU generator whatever the device, so that
    runs on different devices with the same seed draw the same actions. Categorical and diagonal Gaussian only.

    :param distribution: The SB3 ``Distribution`` (after ``proba_distribution``)
    :return: the actions, on the distribution's device
    """
    import torch as th

    inner = distribution.distribution
    if isinstance(inner, th.distributions.Categorical):
        logits = inner.logits.detach()
        draw = th.distributions.Categorical(logits=logits.cpu()).sample()
        return draw.to(logits.device)
    if isinstance(inner, th.distributions.Normal):
        mean, std = inner.loc.detach(), inner.scale.detach()
        return (mean.cpu() + std.cpu() * th.randn(mean.shape)).to(mean.device)
    raise TypeError(f"sample_on_cpu: {type(inner).__name__} is not supported")


def record_kl(model: Any) -> list[float]:
    """
    Wrap ``model.train`` so that each update's logged ``train/kl`` is appended to the returned list.

    :param model: An sb3-kl model
    :return: the list the KLs go into
    """
    kls: list[float] = []
    train = model.train

    def train_and_record() -> None:
        train()
        kls.append(float(model.logger.name_to_value["train/kl"]))

    model.train = train_and_record
    return kls


def kl_sequence(algo: str, env_id: str, device: str, updates: int = CHECK_UPDATES, seed: int = SEED) -> list[float]:
    """:return: ``train/kl`` of each of ``updates`` updates of a short run of ``algo`` (an sb3-kl class) on ``device``"""
    from stable_baselines3.common.env_util import make_vec_env

    import sb3_kl

    kwargs = TRPO_KWARGS if algo == "KLTRPO" else PPO_KWARGS
    env = make_vec_env(env_id, n_envs=1, seed=seed)
    model = getattr(sb3_kl, algo)("MlpPolicy", env, seed=seed, device=device, **kwargs)
    action_dist = model.policy.action_dist
    action_dist.sample = types.MethodType(sample_on_cpu, action_dist)
    kls = record_kl(model)
    model.learn(total_timesteps=updates * kwargs["n_steps"])
    env.close()
    return kls


def same_results(devices: tuple[str, str] = ("cpu", "cuda"), updates: int = CHECK_UPDATES) -> list[dict[str, Any]]:
    """:return: per algorithm and environment, both devices' KL sequences and :func:`compare_kl` of them"""
    checks = []
    for algo in CHECK_ALGOS:
        for env_id in CHECK_ENVS:
            first, second = (kl_sequence(algo, env_id, device, updates) for device in devices)
            checks.append({"algo": algo, "env": env_id, devices[0]: first, devices[1]: second, **compare_kl(first, second)})
    return checks


def build(cls_name: str, policy: str, env_id: str, seed: int) -> Any:
    """:return: a model of ``cls_name`` (sb3-kl's, or SB3's PPO, or sb3-contrib's TRPO) on CUDA"""
    from sb3_contrib import TRPO
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    import sb3_kl

    classes = {"PPO": PPO, "TRPO": TRPO, "KLPPO": sb3_kl.KLPPO, "KLTRPO": sb3_kl.KLTRPO}
    env = make_vec_env(TinyImageEnv if env_id == "TinyImageEnv" else env_id, n_envs=1, seed=seed)
    if "TRPO" in cls_name:
        kwargs = TRPO_KWARGS
    else:
        kwargs = CNN_KWARGS if policy == "CnnPolicy" else PPO_KWARGS
    return classes[cls_name](policy, env, seed=seed, device="cuda", **kwargs)


def timed_learn(cls_name: str, policy: str, env_id: str, seed: int, steps: int) -> dict[str, float]:
    """:return: the steps made and the wall-clock seconds of one ``learn()`` on CUDA"""
    import torch as th

    model = build(cls_name, policy, env_id, seed)
    th.cuda.synchronize()
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    th.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.get_env().close()
    return {"steps": model.num_timesteps, "seconds": seconds, "steps_per_s": model.num_timesteps / seconds}


def speed(pairs: int, timer: Callable[..., dict[str, float]] = timed_learn) -> list[dict[str, Any]]:
    """
    Time ``pairs`` pairs of each case of :data:`SPEED_CASES`.

    :param pairs: Pairs of runs per case (pair ``i`` uses seed ``i``; the sb3-kl side runs first in even pairs)
    :param timer: Runs and times one ``learn()`` (:func:`timed_learn`)
    :return: per case, every pair's measurements, the ratios and their median
    """
    cases = []
    for label, ours, stock, policy, env_id, steps in SPEED_CASES:
        for name in (ours, stock):  # warm-up: CUDA context, kernels, cuDNN's choice of algorithms
            n_steps = (CNN_KWARGS if policy == "CnnPolicy" else PPO_KWARGS)["n_steps"]
            timer(name, policy, env_id, SEED, n_steps)
        runs = []
        for i in range(pairs):
            order = (ours, stock) if i % 2 == 0 else (stock, ours)
            measured = {name: timer(name, policy, env_id, i, steps) for name in order}
            runs.append(
                {
                    "seed": i,
                    "first": order[0],
                    "ours": measured[ours],
                    "stock": measured[stock],
                    "ratio": measured[ours]["steps_per_s"] / measured[stock]["steps_per_s"],
                }
            )
        cases.append(
            {
                "case": label,
                "ours": ours,
                "stock": stock,
                "policy": policy,
                "env": env_id,
                "steps": steps,
                "pairs": runs,
                "median_ratio": statistics.median(run["ratio"] for run in runs),
            }
        )
    return cases


def markdown(record: dict[str, Any]) -> list[str]:
    """:return: the lines of the page: the same-results table, then the speed table"""
    lines = [
        "# sb3-kl on CUDA",
        "",
        f"`{record['command']}` at commit `{record['commit']}`, torch {record['torch']}, {record['device']}.",
        "",
        f"Same results (CPU vs CUDA): `train/kl` of the first {COMPARED_UPDATES} updates within a relative tolerance "
        f"of {KL_RTOL:g} (the later updates are shown, not judged; both runs draw their actions from the CPU generator).",
        "",
        "| algorithm | env | matched (update: yes/no) | relative difference per update | result |",
        "|---|---|---|---|---|",
    ]
    for check in record["same_results"]:
        matched = ", ".join(f"{i + 1}: {'yes' if ok else 'no'}" for i, ok in enumerate(check["matched"]))
        diffs = ", ".join(f"{d:.1e}" for d in check["rel_diff"])
        lines.append(f"| {check['algo']} | {check['env']} | {matched} | {diffs} | {'ok' if check['ok'] else 'FAILED'} |")
    lines += [
        "",
        "Speed on CUDA: environment steps per second, sb3-kl over stock (median of the pairs).",
        "",
        "| comparison | policy | env | steps per run | median ratio | per-pair ratios |",
        "|---|---|---|---|---|---|",
    ]
    for case in record["speed"]:
        ratios = ", ".join(f"{run['ratio']:.3f}" for run in case["pairs"])
        lines.append(
            f"| {case['ours']} / {case['stock']} | {case['policy']} | {case['env']} | {case['steps']} | "
            f"{case['median_ratio']:.3f} | {ratios} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """:return: the exit code (0: skipped or every compared update matched, 1: some did not)"""
    import torch as th

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="pairs of timed runs per speed comparison")
    args = parser.parse_args(argv)
    th.set_num_threads(1)
    if not th.cuda.is_available():
        build_text = f"CUDA {th.version.cuda}" if th.version.cuda else "a CPU-only build"
        print(f"CUDA check skipped: no CUDA device is present (torch {th.__version__}, {build_text}).")
        return 0
    record: dict[str, Any] = {
        "command": f"python benchmarks/cuda_check.py --pairs {args.pairs}",
        "torch": th.__version__,
        "torch_cuda": th.version.cuda,
        "device": th.cuda.get_device_name(),
        "commit": run_records.code_version("cuda_check.py"),
        "kl_tolerance": {"rtol": KL_RTOL, "atol": KL_ATOL, "compared_updates": COMPARED_UPDATES},
    }
    record["same_results"] = same_results()
    for check in record["same_results"]:
        matched = [i + 1 for i, ok in enumerate(check["matched"]) if ok]
        print(f"{check['algo']} {check['env']}: updates matched {matched} of the first {COMPARED_UPDATES}")
    record["speed"] = speed(args.pairs)
    for case in record["speed"]:
        print(f"{case['ours']}/{case['stock']} {case['policy']} {case['env']}: median ratio {case['median_ratio']:.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cuda_check.json").write_text(json.dumps(record, indent=2) + "\n")
    (RESULTS / "cuda_check.md").write_text("\n".join(markdown(record)) + "\n")
    return 0 if all(check["ok"] for check in record["same_results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
