"""
The collapse probe (``benchmarks/collapse_probe.py``): it leaves the training as it was, measures the normalization's
own KL exactly, and splits a collapsed run into the rollouts before its best point and those of its fall.
"""

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch as th

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import collapse_probe  # noqa: E402
import learning  # noqa: E402


def test_probe_leaves_the_training_unchanged_and_measures_the_normalization_kl():
    # Acrobot's zoo entry normalizes observations; its rollout is 16 x 256 steps: the tiny budget takes one
    spec = dict(algo="klppo", env="Acrobot-v1", seed=3, lr_mult=1.0, tier="tiny")
    probe = collapse_probe.make_probe()
    measure = probe._on_rollout_end

    def measure_and_keep_the_policy() -> None:  # the parameters the probe measured with, before the update
        measure()
        probe.policy_then = copy.deepcopy(probe.model.policy)

    probe._on_rollout_end = measure_and_keep_the_policy
    probed = learning.train_and_evaluate(spec, probes=[probe])
    assert learning.same_run(probed, learning.train_and_evaluate(spec))
    assert [row["timesteps"] for row in probe.rows] == [4096.0]
    for row in probe.rows:
        assert row["normalization_kl"] > 0.0 and math.isfinite(row["normalization_kl"])
        assert row["kl_coef"] > 0.0 and row["kl_coef_at_floor"] in (0.0, 1.0)
        assert math.isnan(row["velocity"])  # Acrobot reports no forward velocity
    # independent check of the last rollout's value: the same states normalized by hand with both statistics
    normalizer = probe.model.get_vec_normalize_env()
    raw = np.concatenate(probe.raw)
    mean, var = probe.stats_before
    eps, clip = normalizer.epsilon, normalizer.clip_obs

    def dist(m, v):
        obs = th.as_tensor(np.clip((raw - m) / np.sqrt(v + eps), -clip, clip), dtype=th.float32)
        return th.distributions.Categorical(logits=probe.policy_then.get_distribution(obs).distribution.logits.detach())

    expected = th.distributions.kl_divergence(dist(mean, var), dist(normalizer.obs_rms.mean, normalizer.obs_rms.var))
    # float32 KL of a small shift: rounding leaves about 1e-4 of it
    assert probe.rows[-1]["normalization_kl"] == pytest.approx(float(expected.mean()), rel=1e-3)


def test_phases_split_a_collapse_at_its_best_point():
    # 40 rollouts of 100 steps: the curve climbs to 1000 at rollout 29, then falls below half its gain at rollout 33
    times = [100.0 * (i + 1) for i in range(40)]
    returns = [10.0 + 33.0 * i for i in range(31)] + [900.0, 700.0, 400.0, 200.0] + [150.0] * 5
    curve = [[t, r] for t, r in zip(times, returns, strict=True)]
    assert learning.collapse_points(curve) == [(30, 33)]
    # the rollouts after the best one fall; beta, recorded before each update, leaves its floor at the best point
    rollouts = [
        dict(timesteps=t, velocity=0.0 if i <= 30 else -0.5, terminated=0.0 if i <= 30 else 2.0, normalization_kl=0.0003,
             kl_coef_at_floor=1.0 if i < 30 else 0.0)
        for i, t in enumerate(times)
    ]  # fmt: skip
    kl_updates = [dict(timesteps=t, mean=0.015 if i < 30 else 0.06) for i, t in enumerate(times)]
    probed = dict(curve=curve, rollouts=rollouts, kl_updates=kl_updates, target_kl=0.03)
    before, fall = collapse_probe.phases(probed).values()
    assert before["rollouts"] == 20 and fall["rollouts"] == 3
    assert before["velocity"] == 0.0 and fall["velocity"] == -0.5
    assert before["falls_per_1000_steps"] == 0.0 and fall["falls_per_1000_steps"] == pytest.approx(20.0)
    assert before["update_kl"] == pytest.approx(0.5) and fall["update_kl"] == pytest.approx(2.0)
    assert before["normalization_kl"] == pytest.approx(0.01)
    assert before["kl_coef_at_floor"] == 1.0 and fall["kl_coef_at_floor"] == 0.0
