"""
Expected values and expected gradients of the sample KL estimators, by exact enumeration of every action of small
Discrete and MultiDiscrete policies (no Monte-Carlo): the stored actions are drawn by the rollout policy pi_old, so
an estimator is right when the sum over actions weighted by pi_old of its value (and of its gradient, states fixed)
equals the KL it names (and that KL's gradient), computed independently with ``torch.distributions``.
"""

import copy
import itertools

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3 import PPO

from sb3_kl import KLPPO, ClipKLPPO

N_STATES = 3
ACTION_SPACES = {"Discrete(5)": spaces.Discrete(5), "MultiDiscrete([3,4])": spaces.MultiDiscrete([3, 4])}


class TinyEnv(gym.Env):
    """Three-dimensional observations, the given action space, random rewards."""

    def __init__(self, action_space: spaces.Space):
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), dtype=np.float32)
        self.action_space = action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), float(self.np_random.normal()), False, False, {}


def perturb(policy, scale: float, seed: int):
    """A copy of ``policy`` with Gaussian noise added to every parameter (another distribution at every state)."""
    generator = th.Generator().manual_seed(seed)
    other = copy.deepcopy(policy)
    with th.no_grad():
        for param in other.parameters():
            param.add_(scale * th.randn(param.shape, generator=generator))
    return other


def all_actions(action_space: spaces.Space) -> th.Tensor:
    """Every action of the space, in the format the rollout buffer hands to ``log_prob``."""
    if isinstance(action_space, spaces.Discrete):
        return th.arange(action_space.n)
    return th.tensor(list(itertools.product(*(range(n) for n in action_space.nvec))), dtype=th.float32)


def torch_kl(policy_p, policy_q, obs: th.Tensor, action_space: spaces.Space) -> th.Tensor:
    """Per-state KL(p || q) of two SB3 policies with ``torch.distributions`` (summed over sub-actions)."""

    def categoricals(policy):
        logits = policy.action_net(
            policy.mlp_extractor.forward_actor(policy.extract_features(obs, policy.pi_features_extractor))
        )
        sizes = [action_space.n] if isinstance(action_space, spaces.Discrete) else [int(n) for n in action_space.nvec]
        return [th.distributions.Categorical(logits=chunk) for chunk in th.split(logits, sizes, dim=-1)]

    pairs = zip(categoricals(policy_p), categoricals(policy_q), strict=True)
    return sum(th.distributions.kl_divergence(p, q) for p, q in pairs)


def flat_grad(value: th.Tensor, policy) -> th.Tensor:
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = th.autograd.grad(value, params, allow_unused=True)
    return th.cat([th.zeros_like(p).flatten() if g is None else g.flatten() for p, g in zip(params, grads, strict=True)])


def expectation_over_old(model, old_policy, obs: th.Tensor, per_sample) -> th.Tensor:
    """
    ``mean_s sum_a pi_old(a|s) L(s, a)`` for the per-sample loss ``per_sample(obs_s, action_a, distribution,
    log_prob, old_log_prob)`` evaluated on one (state, action) pair at a time, as a minibatch of one.
    """
    actions = all_actions(model.action_space)
    total = th.zeros(())
    for i in range(len(obs)):
        state = obs[i : i + 1]
        with th.no_grad():
            old_log_probs = old_policy.get_distribution(state.expand(len(actions), -1)).log_prob(actions)
        assert th.exp(old_log_probs).sum().item() == pytest.approx(1.0, abs=1e-5)  # every action enumerated
        for action, old_log_prob in zip(actions, old_log_probs, strict=True):
            distribution = model.policy.get_distribution(state)
            log_prob = distribution.log_prob(action[None])
            total = total + th.exp(old_log_prob) * per_sample(state, action[None], distribution, log_prob, old_log_prob[None])
    return total / len(obs)


def make_model(algo, action_space, **kwargs):
    return algo(
        "MlpPolicy", TinyEnv(action_space), n_steps=16, batch_size=16, policy_kwargs=dict(net_arch=[8]), seed=0, **kwargs
    )


@pytest.mark.parametrize("same_old", [False, True], ids=["old!=theta", "old=theta"])
@pytest.mark.parametrize("estimator", ["analytic", "k1", "k3"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("space", list(ACTION_SPACES))
def test_reference_penalty_expected_gradient_is_the_named_kl_gradient(space, direction, estimator, same_old):
    """
    The reference penalty on actions drawn by pi_old: its expectation over pi_old is the KL to the reference it names
    and its expected gradient is that KL's gradient, for every direction x estimator, with pi_old = pi_theta (the
    first minibatch of an update) and pi_old != pi_theta (later minibatches).
    """
    action_space = ACTION_SPACES[space]
    reference = PPO("MlpPolicy", TinyEnv(action_space), policy_kwargs=dict(net_arch=[8]), seed=1)
    model = make_model(KLPPO, action_space, ref_policy=reference, ref_kl_direction=direction, ref_kl_estimator=estimator)
    # Move the reference and pi_old well away from pi_theta (the default init gives near-uniform policies)
    model.policy.load_state_dict(perturb(model.policy, 0.5, seed=2).state_dict())
    model.ref_policy.load_state_dict(perturb(model.ref_policy, 0.8, seed=3).state_dict())
    old_policy = model.policy if same_old else perturb(model.policy, 0.3, seed=4)
    obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(N_STATES)]))

    expected_penalty = expectation_over_old(model, old_policy, obs, model._reference_penalty)
    pi, pi_ref = model.policy, model.ref_policy
    exact = (
        torch_kl(pi, pi_ref, obs, action_space) if direction == "reverse" else torch_kl(pi_ref, pi, obs, action_space)
    ).mean()

    assert expected_penalty.item() == pytest.approx(exact.item(), rel=1e-4)
    expected_grad, exact_grad = flat_grad(expected_penalty, pi), flat_grad(exact, pi)
    assert exact_grad.norm() > 1e-2  # a real gradient to compare
    th.testing.assert_close(expected_grad, exact_grad, rtol=1e-3, atol=1e-3 * exact_grad.abs().max().item())


@pytest.mark.parametrize("algo", [KLPPO, ClipKLPPO])
@pytest.mark.parametrize("estimator", ["analytic", "k1", "k3"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("space", list(ACTION_SPACES))
def test_update_kl_expected_value_and_gradient(algo, space, direction, estimator):
    """
    The update KL inside KLPPO's and ClipKLPPO's loss, where pi_old really is the sampler: its expectation over
    pi_old is KL(old || theta) (forward) or KL(theta || old) (reverse), and its expected gradient that KL's gradient.
    """
    action_space = ACTION_SPACES[space]
    model = make_model(algo, action_space, kl_direction=direction, kl_estimator=estimator)
    old_policy = perturb(model.policy, 0.4, seed=5)
    obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(N_STATES)]))

    def update_kl(state, action, distribution, log_prob, old_log_prob):
        with th.no_grad():
            old_params = model.dist_params.extract(old_policy.get_distribution(state))
        return model._per_state_kl(old_params, distribution, log_prob - old_log_prob).mean()

    expected_kl = expectation_over_old(model, old_policy, obs, update_kl)
    pi = model.policy
    exact = (
        torch_kl(old_policy, pi, obs, action_space) if direction == "forward" else torch_kl(pi, old_policy, obs, action_space)
    ).mean()

    assert expected_kl.item() == pytest.approx(exact.item(), rel=1e-4)
    expected_grad, exact_grad = flat_grad(expected_kl, pi), flat_grad(exact, pi)
    assert exact_grad.norm() > 1e-3
    th.testing.assert_close(expected_grad, exact_grad, rtol=1e-3, atol=1e-3 * exact_grad.abs().max().item())
