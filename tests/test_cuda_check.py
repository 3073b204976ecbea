"""
``benchmarks/cuda_check.py``: its skip without a CUDA device, and its helpers (the KL comparison, the image env, the
CPU sampler, the KL recorder, the alternation of the timed pairs, the page).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cuda_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would run the check")
def test_skipped_without_cuda():
    outputs = [BENCHMARKS / "results" / name for name in ("cuda_check.json", "cuda_check.md")]
    before = [path.stat().st_mtime if path.exists() else None for path in outputs]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "cuda_check.py")], cwd=BENCHMARKS.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA check skipped" in result.stdout
    assert "no CUDA device" in result.stdout
    assert torch.__version__ in result.stdout
    assert [path.stat().st_mtime if path.exists() else None for path in outputs] == before


def test_compare_kl():
    same = cuda_check.compare_kl([0.01, 0.02, 0.03, 0.04], [0.01, 0.02, 0.03, 0.04])
    assert same["ok"] and same["matched"] == [True, True, True] and same["rel_diff"] == [0.0] * 4
    # within the relative tolerance; the 4th update, not judged, may drift apart
    close = cuda_check.compare_kl([0.01, 0.02, 0.03, 0.04], [0.01 * (1 + 5e-4), 0.02, 0.03, 0.08])
    assert close["ok"] and close["rel_diff"][3] == pytest.approx(0.5)
    off = cuda_check.compare_kl([0.01, 0.02, 0.03], [0.01, 0.0201, 0.03])
    assert not off["ok"] and off["matched"] == [True, False, True]
    assert not cuda_check.compare_kl([0.01, 0.02], [0.01, 0.02])["ok"]  # fewer updates than compared
    assert cuda_check.compare_kl([0.0, 0.0, 0.0], [1e-9, 0.0, 0.0])["ok"]  # absolute tolerance near 0


def test_tiny_image_env():
    env = cuda_check.TinyImageEnv()
    assert env.observation_space == cuda_check.gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    assert env.action_space == cuda_check.gym.spaces.Discrete(4)
    first, _ = env.reset(seed=3)
    assert env.observation_space.contains(first)
    again, _ = cuda_check.TinyImageEnv().reset(seed=3)
    assert np.array_equal(first, again)
    best = env.best_action()
    obs, reward, terminated, truncated, _ = env.step(best)
    assert reward == 1.0 and not terminated and not truncated and env.observation_space.contains(obs)
    _, reward, *_ = env.step((env.best_action() + 1) % 4)
    assert reward == 0.0
    for step in range(3, env.EPISODE_STEPS + 1):
        _, _, terminated, truncated, _ = env.step(0)
        assert not terminated and truncated == (step == env.EPISODE_STEPS)


def test_best_action_names_the_brightest_quadrant():
    env = cuda_check.TinyImageEnv()
    env.reset(seed=0)
    for quadrant in range(4):
        row, col = divmod(quadrant, 2)
        env._image = np.zeros((64, 64, 3), np.uint8)
        env._image[32 * row : 32 * row + 32, 32 * col : 32 * col + 32] = 200
        assert env.best_action() == quadrant


def test_sample_on_cpu_follows_the_cpu_generator():
    from stable_baselines3.common.distributions import CategoricalDistribution, DiagGaussianDistribution

    categorical = CategoricalDistribution(4).proba_distribution(torch.zeros(1000, 4))
    gaussian = DiagGaussianDistribution(2)
    gaussian.proba_distribution(torch.ones(1000, 2), torch.zeros(2))
    for distribution, shape in ((categorical, (1000,)), (gaussian, (1000, 2))):
        torch.manual_seed(7)
        draw = cuda_check.sample_on_cpu(distribution)
        torch.manual_seed(7)
        assert torch.equal(draw, cuda_check.sample_on_cpu(distribution)) and draw.shape == shape
    assert set(cuda_check.sample_on_cpu(categorical).tolist()) == {0, 1, 2, 3}
    assert abs(cuda_check.sample_on_cpu(gaussian).mean().item() - 1.0) < 0.1


def test_kl_sequences_of_two_cpu_runs_match():
    torch.set_num_threads(1)
    first, second = (cuda_check.kl_sequence("KLPPO", "CartPole-v1", "cpu", updates=2) for _ in range(2))
    assert len(first) == 2 and all(kl > 0 for kl in first)
    assert first == second


def test_speed_alternates_and_takes_the_median():
    calls = []

    def timer(name, policy, env_id, seed, steps):
        calls.append((name, seed, steps))
        per_s = {"KLPPO": 90.0, "PPO": 100.0, "KLTRPO": 100.0, "TRPO": 100.0}[name] * (1 + seed)
        return {"steps": steps, "seconds": steps / per_s, "steps_per_s": per_s}

    cases = cuda_check.speed(3, timer)
    assert [case["case"] for case in cases] == [label for label, *_ in cuda_check.SPEED_CASES]
    timed = [call for call in calls if call[2] == cuda_check.SPEED_CASES[0][5]][:6]
    assert [name for name, *_ in timed] == ["KLPPO", "PPO", "PPO", "KLPPO", "KLPPO", "PPO"]
    assert cases[0]["median_ratio"] == pytest.approx(0.9) and cases[2]["median_ratio"] == pytest.approx(1.0)
    record = {
        "command": "python benchmarks/cuda_check.py --pairs 3",
        "commit": "abc1234",
        "torch": "2.x",
        "device": "a GPU",
        "same_results": [{"algo": "KLPPO", "env": "CartPole-v1", **cuda_check.compare_kl([0.1] * 3, [0.1] * 3)}],
        "speed": cases,
    }
    page = "\n".join(cuda_check.markdown(record))
    assert "| KLPPO | CartPole-v1 | 1: yes, 2: yes, 3: yes |" in page and "| KLPPO / PPO | CnnPolicy | TinyImageEnv |" in page
