"""
Policies with dropout or batch norm act in eval mode and train in train mode (SB3's ``set_training_mode``): the KL
figures that promise the acting policy's KL are checked here against ``torch.distributions`` on eval-mode snapshots of
the policy before and after each update (KLTRPO's constraint) or before each minibatch step (KLPPO's stop at beta's
bound, whatever the estimator).
"""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from sb3_kl import KLPPO, KLTRPO
from sb3_kl.common.modes import has_mode_dependent_modules
from sb3_kl.kltrpo.policies import MlpPolicy as KLTRPOMlpPolicy


class NormalizedFeatures(BaseFeaturesExtractor):
    """A features extractor with a mode-dependent layer (dropout or batch norm) in front."""

    def __init__(self, observation_space: gym.spaces.Box, layer: str = "dropout", features_dim: int = 16):
        super().__init__(observation_space, features_dim)
        n_inputs = int(np.prod(observation_space.shape))
        first = nn.Dropout(0.5) if layer == "dropout" else nn.BatchNorm1d(n_inputs)
        self.net = nn.Sequential(first, nn.Linear(n_inputs, features_dim), nn.Tanh())

    def forward(self, observations: th.Tensor) -> th.Tensor:
        return self.net(observations)


def _policy_kwargs(layer: str) -> dict:
    return dict(
        features_extractor_class=NormalizedFeatures,
        features_extractor_kwargs=dict(layer=layer),
        net_arch=dict(pi=[16], vf=[16]),
    )


class Snapshots:
    """Eval-mode copies of a model's policy at chosen moments (state dicts loaded into a copy made before training)."""

    def __init__(self, policy: nn.Module):
        self.template = copy.deepcopy(policy)

    @staticmethod
    def take(policy: nn.Module) -> dict[str, th.Tensor]:
        return {name: value.detach().clone() for name, value in policy.state_dict().items()}

    @th.no_grad()
    def acting_normal(self, state: dict[str, th.Tensor], observations: th.Tensor) -> th.distributions.Normal:
        """The policy's Gaussian on ``observations`` as it acts (eval mode), in float64."""
        self.template.load_state_dict(state)
        self.template.set_training_mode(False)
        distribution = self.template.get_distribution(observations).distribution
        return th.distributions.Normal(distribution.loc.double(), distribution.scale.double())

    def exact_kl(self, before: dict[str, th.Tensor], after: dict[str, th.Tensor], observations: th.Tensor) -> float:
        """Mean over states of the joint KL(before || after) of the acting policies."""
        kl = th.distributions.kl_divergence(self.acting_normal(before, observations), self.acting_normal(after, observations))
        return float(kl.sum(-1).mean())


def test_mode_dependent_modules_are_detected():
    assert has_mode_dependent_modules(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert has_mode_dependent_modules(nn.Sequential(nn.BatchNorm1d(2)))
    assert has_mode_dependent_modules(nn.LSTM(2, 2, num_layers=2, dropout=0.2))
    assert not has_mode_dependent_modules(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.LSTM(2, 2)))
    assert not has_mode_dependent_modules(nn.InstanceNorm1d(2))  # no running statistics: the same in both modes


@th.no_grad()
def _eval_mode_objective(snapshots: Snapshots, state: dict[str, th.Tensor], buffer) -> float:
    """TRPO's surrogate E[A r] (normalized advantages) of a policy as it acts, on the whole buffer."""
    observations = th.as_tensor(buffer.observations.reshape(-1, buffer.obs_shape[0]))
    actions = th.as_tensor(buffer.actions.reshape(-1, buffer.action_dim)).double()
    advantages = th.as_tensor(buffer.advantages.flatten()).double()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    log_prob = snapshots.acting_normal(state, observations).log_prob(actions).sum(-1)
    return float((advantages * th.exp(log_prob - th.as_tensor(buffer.log_probs.flatten()).double())).mean())


def test_kltrpo_constrains_the_acting_policy_with_dropout():
    # measured in train mode, dropout alone put the unchanged policy above target_kl: every candidate was rejected
    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = KLTRPO(
        "MlpPolicy", env, n_steps=128, target_kl=0.01, seed=0, device="cpu", policy_kwargs=_policy_kwargs("dropout")
    )
    updates, critic_modes, snapshots = [], [], Snapshots(model.policy)
    original_train, original_fit_critic = model.train, model._fit_critic

    def fit_critic(actor_params):
        critic_modes.append(model.policy.training)
        return original_fit_critic(actor_params)

    def train() -> None:
        before = snapshots.take(model.policy)
        original_train()
        assert model.policy.training  # left in train mode, as SB3's train() leaves it
        after, buffer, logs = snapshots.take(model.policy), model.rollout_buffer, model.logger.name_to_value
        observations = th.as_tensor(buffer.observations.reshape(-1, 3))
        exact = snapshots.exact_kl(before, after, observations)
        objective = _eval_mode_objective(snapshots, after, buffer)
        updates.append((exact, logs["train/line_search_success"], logs["train/kl"], logs["train/policy_objective"], objective))

    model.train, model._fit_critic = train, fit_critic
    model.learn(128 * 2 * 4)
    assert len(updates) == 4 and critic_modes == [True] * 4  # the critic is fitted in train mode, as SB3 trains
    for exact, _, logged, objective, independent in updates:
        assert exact <= 0.01 * (1 + 1e-5)
        assert logged == pytest.approx(exact, rel=1e-4, abs=1e-7)
        # the objective the line search compared and kept is the acting policy's (for a rejected update: the
        # unchanged policy's, whose train-mode value dropout would move)
        assert objective == pytest.approx(independent, rel=1e-4, abs=1e-6)
    accepted = [exact for exact, success, *_ in updates if success == 1.0]
    assert len(accepted) >= 3 and min(accepted) > 0.5 * 0.01  # the steps grow toward the bound
    # an update whose candidates were all rejected leaves the acting policy exactly as it was
    assert all(exact == 0.0 for exact, success, *_ in updates if success == 0.0)


def test_kltrpo_refuses_batch_norm_on_the_actor(tmp_path):
    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    with pytest.raises(ValueError, match=r"features_extractor\.net\.0.*running statistics.*`policy_kwargs`"):
        KLTRPO("MlpPolicy", env, n_steps=64, device="cpu", policy_kwargs=_policy_kwargs("batch_norm"))
    separate = dict(_policy_kwargs("batch_norm"), share_features_extractor=False)
    with pytest.raises(ValueError, match=r"pi_features_extractor\.net\.0"):
        KLTRPO("MlpPolicy", env, n_steps=64, device="cpu", policy_kwargs=separate)
    # a model saved before the refusal still loads (to predict); learning with it is refused
    model = KLTRPO(
        "MlpPolicy", env, n_steps=64, device="cpu", policy_kwargs=_policy_kwargs("dropout"), _init_setup_model=False
    )
    model.policy_kwargs = _policy_kwargs("batch_norm")
    model._setup_model()
    model.save(tmp_path / "batch_norm")
    loaded = KLTRPO.load(tmp_path / "batch_norm", env=env, custom_objects=dict(policy_kwargs=_policy_kwargs("batch_norm")))
    loaded.predict(env.reset(), deterministic=True)
    with pytest.raises(ValueError, match="running statistics"):
        loaded.learn(64)


def test_kltrpo_accepts_batch_norm_without_running_statistics():
    # it normalizes by the batch in both modes: nothing moves the acting policy between updates
    class BatchStatistics(NormalizedFeatures):
        def __init__(self, observation_space: gym.spaces.Box, features_dim: int = 16):
            super().__init__(observation_space, "batch_norm", features_dim)
            self.net[0] = nn.BatchNorm1d(observation_space.shape[0], track_running_stats=False)

    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = KLTRPO("MlpPolicy", env, n_steps=64, device="cpu", policy_kwargs=dict(features_extractor_class=BatchStatistics))
    model.learn(128)


class CriticBatchNormPolicy(KLTRPOMlpPolicy):
    """Batch norm in front of the value head only: the critic's business, not the constraint's."""

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        self.value_net = nn.Sequential(nn.BatchNorm1d(self.mlp_extractor.latent_dim_vf), self.value_net)
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)


def test_kltrpo_accepts_batch_norm_in_the_critic_only():
    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = KLTRPO(CriticBatchNormPolicy, env, n_steps=64, target_kl=0.01, seed=0, device="cpu")
    model.learn(64 * 2 * 2)
    assert model.logger.name_to_value["train/kl"] <= 0.01 * (1 + 1e-5)


@pytest.mark.parametrize("estimator, layer", [("k1", None), ("k3", None), ("analytic", "dropout")])
def test_stop_at_beta_bound_judges_the_exact_kl_of_the_acting_policy(estimator, layer):
    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    policy_kwargs = _policy_kwargs(layer) if layer else dict(net_arch=dict(pi=[16], vf=[16]))
    # beta starts at the top of its bounds, so the stop is armed from the first update; a high rate makes it fire
    model = KLPPO(
        "MlpPolicy", env, n_steps=128, batch_size=64, learning_rate=3e-2, target_kl=0.002, kl_coef=10.0,
        kl_estimator=estimator, seed=0, device="cpu", policy_kwargs=policy_kwargs,
    )  # fmt: skip
    judged, taken, snapshots = [], [], Snapshots(model.policy)
    original_train, original_stops, original_ran_away = model.train, model._stops_at_bound, model._minibatch_kl_ran_away

    def train() -> None:
        taken.append(("update", snapshots.take(model.policy)))
        original_train()

    def stops_at_bound(kl, rollout_data, distribution, stop_kl, epoch):
        taken.append(("minibatch", (rollout_data.observations.clone(), snapshots.take(model.policy))))
        return original_stops(kl, rollout_data, distribution, stop_kl, epoch)

    def ran_away(kl, stop_kl, epoch):
        judged.append(float(kl))
        return original_ran_away(kl, stop_kl, epoch)

    step_modes, original_step = [], model._optimizer_step

    def optimizer_step(loss):
        step_modes.append(model.policy.training)
        return original_step(loss)

    model.train, model._stops_at_bound, model._minibatch_kl_ran_away = train, stops_at_bound, ran_away
    model._optimizer_step = optimizer_step
    model.learn(128 * 2 * 3)
    assert step_modes and all(step_modes)  # every step is taken in train mode, after the stop's eval-mode look
    minibatches, before = [], None
    for kind, item in taken:
        if kind == "update":
            before = item
        else:
            observations, current = item
            minibatches.append(snapshots.exact_kl(before, current, observations))
    assert len(judged) == len(minibatches) > 0
    np.testing.assert_allclose(judged, minibatches, rtol=1e-4, atol=1e-7)
    stopped = [i for i, kl in enumerate(judged) if kl > 1.5 * 0.002]
    assert stopped, "the stop never fired: the check would not exercise it"
    # the first minibatch of an update is judged on the unchanged policy: exactly 0, even with dropout
    assert judged[0] == pytest.approx(0.0, abs=1e-7)


@th.no_grad()
def _sequence_normal(snapshots: Snapshots, state: dict[str, th.Tensor], data) -> th.distributions.Normal:
    """sb3-contrib's own sequence evaluation of a minibatch (from its stored LSTM states), as the policy acts."""
    snapshots.template.load_state_dict(state)
    snapshots.template.set_training_mode(False)
    distribution, _ = snapshots.template.get_distribution(data.observations, data.lstm_states.pi, data.episode_starts)
    return th.distributions.Normal(distribution.distribution.loc.double(), distribution.distribution.scale.double())


def test_recurrent_stop_at_beta_bound_judges_the_exact_kl_of_the_acting_policy():
    from sb3_kl import RecurrentKLPPO

    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    # k1 in the loss, and dropout between two LSTM layers: neither may reach the judged KL
    model = RecurrentKLPPO(
        "MlpLstmPolicy", env, n_steps=64, batch_size=64, learning_rate=3e-2, target_kl=0.002, kl_coef=10.0,
        kl_estimator="k1", seed=0, device="cpu",
        policy_kwargs=dict(lstm_hidden_size=8, n_lstm_layers=2, lstm_kwargs=dict(dropout=0.5), net_arch=dict(pi=[8], vf=[8])),
    )  # fmt: skip
    judged, expected, snapshots = [], [], Snapshots(model.policy)
    before: list[dict[str, th.Tensor]] = []
    original_train, original_stops, original_ran_away = model.train, model._stops_at_bound, model._minibatch_kl_ran_away

    def train() -> None:
        before[:] = [snapshots.take(model.policy)]
        original_train()

    def stops_at_bound(kl, rollout_data, distribution, stop_kl, epoch):
        old = _sequence_normal(snapshots, before[0], rollout_data)
        new = _sequence_normal(snapshots, snapshots.take(model.policy), rollout_data)
        valid = rollout_data.mask > 1e-8
        expected.append(float(th.distributions.kl_divergence(old, new).sum(-1)[valid].mean()))
        return original_stops(kl, rollout_data, distribution, stop_kl, epoch)

    def ran_away(kl, stop_kl, epoch):
        judged.append(float(kl))
        return original_ran_away(kl, stop_kl, epoch)

    model.train, model._stops_at_bound, model._minibatch_kl_ran_away = train, stops_at_bound, ran_away
    model.learn(64 * 2 * 3)
    assert len(judged) == len(expected) > 0
    np.testing.assert_allclose(judged, expected, rtol=1e-4, atol=1e-7)
    assert judged[0] == pytest.approx(0.0, abs=1e-7) and max(judged) > 1.5 * 0.002


def _record_epoch_stop_kl(model, on_epoch=None) -> list[float]:
    """
    The KL ``kl_stop_factor``'s per-epoch rule judges, one value per epoch, recorded as ``model._kl_ran_away`` gets it.

    :param on_epoch: Called after each recording (e.g. to take the independent value of the same epoch)
    """
    judged: list[float] = []
    original_ran_away = model._kl_ran_away

    def ran_away(epoch_kl_sum, epoch_states, target_kl, epoch):
        judged.append(float(epoch_kl_sum) / epoch_states)
        if on_epoch is not None:
            on_epoch()
        return original_ran_away(epoch_kl_sum, epoch_states, target_kl, epoch)

    model._kl_ran_away = ran_away
    return judged


@pytest.mark.parametrize("algo", ["KLPPO", "ClipKLPPO"])
def test_epoch_stop_judges_the_kl_of_the_acting_policy_with_dropout(algo):
    """
    ``kl_stop_factor``'s per-epoch rule adds up each minibatch's KL to the rollout policy before its step. With dropout
    the loss's train-mode KL is noisy (above 2 x target for an unchanged policy, so the stop ended every update at its
    first epoch): the rule takes it with the policy as it acts, which the eval-mode snapshots check here.
    """
    import sb3_kl

    cls = getattr(sb3_kl, algo)
    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    policy_kwargs = dict(_policy_kwargs("dropout"), log_std_init=-2.0, ortho_init=False)
    kwargs = dict(n_steps=128, batch_size=64, n_epochs=4, target_kl=0.01, kl_stop_factor=2.0, seed=0, device="cpu")

    # An unchanged policy (learning rate ~0): the judged KL is 0 and no update stops early
    model = cls("MlpPolicy", env, learning_rate=1e-30, policy_kwargs=policy_kwargs, **kwargs)
    judged = _record_epoch_stop_kl(model)
    model.learn(128 * 2 * 2)
    assert len(judged) == 2 * 4 and max(judged) == pytest.approx(0.0, abs=1e-7)
    assert model.logger.name_to_value["train/early_stop_epoch"] == 4

    # A learning policy: each epoch's judged KL is the mean over its minibatches of the exact KL between the acting
    # policy before the update and the acting policy before the minibatch's step
    model = cls("MlpPolicy", env, learning_rate=3e-3, policy_kwargs=policy_kwargs, **kwargs)
    snapshots, expected, minibatches = Snapshots(model.policy), [], []
    before: list[dict[str, th.Tensor]] = []
    original_train, original_stop_kl = model.train, model._epoch_stop_kl

    def train() -> None:
        before[:] = [snapshots.take(model.policy)]
        original_train()

    def epoch_stop_kl(kl, rollout_data, acting_mode_differs):
        observations = rollout_data.observations.clone()
        minibatches.append((len(observations), snapshots.exact_kl(before[0], snapshots.take(model.policy), observations)))
        return original_stop_kl(kl, rollout_data, acting_mode_differs)

    def expect_epoch() -> None:
        sizes, kls = np.array(minibatches).T
        expected.append(float(np.sum(sizes * kls) / np.sum(sizes)))
        minibatches.clear()

    model.train, model._epoch_stop_kl = train, epoch_stop_kl
    judged = _record_epoch_stop_kl(model, on_epoch=expect_epoch)
    model.learn(128 * 2 * 3)
    assert len(judged) >= 3 and max(expected) > 0
    np.testing.assert_allclose(judged, expected, rtol=1e-4, atol=1e-7)


def test_recurrent_epoch_stop_judges_the_acting_policy_with_dropout():
    """The same rule in RecurrentKLPPO, with dropout between two LSTM layers: an unchanged policy is never stopped."""
    from sb3_kl import RecurrentKLPPO

    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = RecurrentKLPPO(
        "MlpLstmPolicy", env, n_steps=64, batch_size=64, n_epochs=4, learning_rate=1e-30, target_kl=0.01,
        kl_stop_factor=2.0, seed=0, device="cpu",
        policy_kwargs=dict(
            lstm_hidden_size=8, n_lstm_layers=2, lstm_kwargs=dict(dropout=0.9), net_arch=dict(pi=[8], vf=[8]),
            log_std_init=-2.0, ortho_init=False,
        ),
    )  # fmt: skip
    judged = _record_epoch_stop_kl(model)
    model.learn(64 * 2 * 2)
    assert len(judged) == 2 * 4 and max(judged) == pytest.approx(0.0, abs=1e-7)


def _watch_last_step(model) -> list[tuple[bool, list[str]]]:
    """
    Wrap ``model.train`` to record, per update, whether an early stop ended it and the state-dict entries that changed
    between the update's last optimizer step and the end of ``train()``.
    """
    seen: list[tuple[bool, list[str]]] = []
    train = model.train

    def watched_train() -> None:
        optimizer = model.policy.optimizer
        step = optimizer.step
        # the policy as the last step left it (the start of the update, until its first step)
        after = {name: value.clone() for name, value in model.policy.state_dict().items()}

        def recorded_step(*args, **kwargs):
            out = step(*args, **kwargs)
            after.update({name: value.clone() for name, value in model.policy.state_dict().items()})
            return out

        optimizer.step = recorded_step
        try:
            train()
        finally:
            del optimizer.step
        now = model.policy.state_dict()
        logged = model.logger.name_to_value
        stopped = logged["train/early_stop_epoch"] < model.n_epochs or logged["train/early_stop_at_kl_coef_bound"] > 0
        seen.append((bool(stopped), [n for n in now if not th.equal(now[n], after[n])]))

    model.train = watched_train
    return seen


@pytest.mark.parametrize("stop", ["epoch", "bound"])
@pytest.mark.parametrize("recurrent", [False, True])
def test_an_early_stop_leaves_the_policy_as_the_last_step_left_it_with_batch_norm(recurrent, stop):
    """
    An early stop leaves the policy as its last optimizer step left it, batch norm's running statistics included:
    neither the train-mode pass that takes the gradient ratio again with the final parameters (both stops) nor the
    pass of the minibatch the stop at beta's bound refuses (which takes no step) may move them.
    """
    from sb3_kl import RecurrentKLPPO

    common = dict(n_epochs=4, seed=0, target_kl=0.001)
    if stop == "epoch":
        common.update(learning_rate=1e-2, kl_stop_factor=1.5, kl_saturation_stop_factor=None)
    else:  # beta starts at its upper bound, where the stop at the bound is armed
        common.update(learning_rate=3e-2, kl_stop_factor=None, kl_coef=1e-3, kl_coef_bounds=(1e-4, 1e-3))
    kwargs = _policy_kwargs("batch_norm")
    if recurrent:
        kwargs.update(net_arch=[8], lstm_hidden_size=8)
        env = make_vec_env("CartPole-v1", n_envs=2, seed=0)
        model = RecurrentKLPPO("MlpLstmPolicy", env, n_steps=64, batch_size=32, policy_kwargs=kwargs, **common)
    else:
        model = KLPPO("MlpPolicy", "CartPole-v1", n_steps=128, batch_size=32, policy_kwargs=kwargs, **common)
    seen = _watch_last_step(model)
    model.learn(512)
    assert any(stopped for stopped, _ in seen), seen  # the stop ended some update
    assert all(not changed for _, changed in seen), seen
