"""RecurrentKLPPO: KLPPO's adaptive KL penalty for sb3-contrib's LSTM policies, a drop-in for RecurrentPPO."""

import copy
import os

import numpy as np
import pytest
import torch as th
from sb3_contrib import RecurrentPPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import SimpleMultiObsEnv
from torch.distributions import Categorical, Normal, kl_divergence

from sb3_kl import RecurrentKLPPO
from sb3_kl.common.buffers import StalePolicyError
from sb3_kl.common.recurrent_buffers import RecurrentKLDictRolloutBuffer, RecurrentKLRolloutBuffer

os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")

POLICY_KWARGS = dict(net_arch=[16], lstm_hidden_size=16)


def _env(env_id, n_envs=2):
    return make_vec_env(env_id, n_envs=n_envs, seed=0)


def _model(env_id="CartPole-v1", n_envs=2, **kwargs):
    kwargs = {"n_steps": 64, "batch_size": 32, "n_epochs": 4, "seed": 0, "policy_kwargs": POLICY_KWARGS, **kwargs}
    return RecurrentKLPPO("MlpLstmPolicy", _env(env_id, n_envs), **kwargs)


def _copy_policy(policy):
    kwargs = policy._get_constructor_parameters()
    kwargs.update(
        lstm_hidden_size=policy.lstm_actor.hidden_size,
        n_lstm_layers=policy.lstm_actor.num_layers,
        shared_lstm=policy.shared_lstm,
        enable_critic_lstm=policy.enable_critic_lstm,
    )
    clone = type(policy)(**kwargs)
    clone.load_state_dict(copy.deepcopy(policy.state_dict()))
    return clone


def _stepwise(policy, observations, episode_starts, states):
    """torch distributions at every stored step, the LSTM stepped one step at a time over all envs (float64)."""
    policy.set_training_mode(False)
    states = (th.as_tensor(states[0]), th.as_tensor(states[1]))
    out = []
    with th.no_grad():
        for t in range(len(episode_starts)):
            dist, states = policy.get_distribution(th.as_tensor(observations[t]), states, th.as_tensor(episode_starts[t]))
            inner = dist.distribution
            if isinstance(inner, Normal):
                out.append(Normal(inner.loc.double(), inner.scale.double()))
            else:
                out.append(Categorical(logits=inner.logits.double()))
    return out


class IndependentUpdateKL(BaseCallback):
    """Copies of the policy before and after each update, stepped over the rollout; KL(old||new) per step."""

    def __init__(self):
        super().__init__()
        self.results = []
        self._pending = None

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        data = (
            buffer.observations.copy(),
            buffer.episode_starts.copy(),
            (buffer.hidden_states_pi[0].copy(), buffer.cell_states_pi[0].copy()),
        )
        self._pending = (_copy_policy(self.model.policy), data)

    def _measure(self) -> None:
        if self._pending is None:
            return
        old, data = self._pending
        self._pending = None
        new = _copy_policy(self.model.policy)
        kls = []
        for p, q in zip(_stepwise(old, *data), _stepwise(new, *data), strict=True):
            kl = kl_divergence(p, q)
            kls.append(kl.sum(dim=-1) if kl.ndim == 2 else kl)
        self.results.append(th.stack(kls).reshape(-1).numpy())

    def _on_rollout_start(self) -> None:
        self._measure()

    def _on_training_end(self) -> None:
        self._measure()


class LoggedKL(BaseCallback):
    """The train/ KL values of each update, read at the next rollout start (before the next dump clears them)."""

    def __init__(self):
        super().__init__()
        self.values = []

    def _on_step(self) -> bool:
        return True

    def _read(self) -> None:
        if "train/kl" in self.model.logger.name_to_value and self.model._n_updates > 0:
            self.values.append(dict(self.model.logger.name_to_value))

    def _on_rollout_start(self) -> None:
        self._read()

    def _on_training_end(self) -> None:
        self._read()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_logged_kl_equals_independent_kl(env_id):
    model = _model(env_id, learning_rate=1e-2)
    reference, logged = IndependentUpdateKL(), LoggedKL()
    model.learn(3 * 128, callback=[reference, logged], log_interval=100)
    assert len(reference.results) == len(logged.values) == 3
    for kl, values in zip(reference.results, logged.values, strict=True):
        assert values["train/kl"] == pytest.approx(kl.mean(), rel=1e-4)
        assert values["train/kl_p99"] == pytest.approx(np.quantile(kl, 0.99), rel=1e-4)
        assert values["train/kl_p50"] == pytest.approx(np.quantile(kl, 0.5), rel=1e-4)
        assert values["train/kl_max"] == pytest.approx(kl.max(), rel=1e-4)
    assert min(v["train/kl"] for v in logged.values) > 1e-4


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_stored_old_distribution_reproduces_rollout_log_probs_and_pads_with_the_minibatches(env_id):
    model = _model(env_id)
    model.learn(128)  # one rollout, one update: the buffer still holds that rollout
    buffer = model.rollout_buffer
    assert buffer.old_distribution_ready
    params = th.as_tensor(buffer.old_dist_params)
    actions = th.as_tensor(buffer.actions)  # flattened env-major by get()
    if env_id == "CartPole-v1":
        log_prob = Categorical(logits=params).log_prob(actions.long().flatten())
    else:
        log_prob = Normal(params[:, :1], params[:, 1:].exp()).log_prob(actions).sum(dim=1)
    np.testing.assert_allclose(log_prob.numpy(), buffer.log_probs.reshape(-1), atol=5e-6)

    # Minibatches: the stored parameters are padded like the other fields (the mask marks the same steps)
    for data in buffer.get(batch_size=40):
        mask = data.mask > 1e-8
        assert data.old_dist_params.shape[0] == data.mask.shape[0]
        if env_id == "CartPole-v1":
            stored_log_prob = Categorical(logits=data.old_dist_params).log_prob(data.actions.long().flatten())
        else:
            p = data.old_dist_params
            stored_log_prob = Normal(p[:, :1], p[:, 1:].exp()).log_prob(data.actions).sum(dim=1)
        np.testing.assert_allclose(stored_log_prob[mask].numpy(), data.old_log_prob[mask].numpy(), atol=5e-6)
        assert th.all(data.old_dist_params[~mask] == 0)


def test_negligible_fixed_penalty_with_clip_is_recurrent_ppo():
    """
    With RecurrentPPO's clip and a fixed negligible KL coefficient, RecurrentKLPPO is RecurrentPPO: same seed, same
    minibatches, same parameters after several updates (Adam as RecurrentPPO's: single-tensor kernel, eps=1e-5).
    """
    common = dict(n_steps=64, batch_size=32, n_epochs=3, seed=3, clip_range=0.2)
    stock = RecurrentPPO("MlpLstmPolicy", _env("CartPole-v1"), policy_kwargs=POLICY_KWARGS, **common).learn(3 * 128)
    ours = RecurrentKLPPO(
        "MlpLstmPolicy",
        _env("CartPole-v1"),
        kl_coef=1e-12,
        kl_controller="fixed",
        kl_coef_bounds=(1e-12, 1.0),
        policy_kwargs=dict(**POLICY_KWARGS, optimizer_kwargs=dict(foreach=False, eps=1e-5)),
        **common,
    ).learn(3 * 128)
    initial = RecurrentPPO("MlpLstmPolicy", _env("CartPole-v1"), policy_kwargs=POLICY_KWARGS, **common).policy.state_dict()
    for key, value in stock.policy.state_dict().items():
        assert th.allclose(value, ours.policy.state_dict()[key], rtol=0, atol=1e-5), key
    assert max(float((stock.policy.state_dict()[k] - initial[k]).abs().max()) for k in initial) > 1e-3
    assert ours.logger.name_to_value["train/kl"] > 0


def test_save_load_keeps_kl_state_and_continues(tmp_path):
    model = _model("Pendulum-v1", target_kl=1e-5, min_std=0.5, learning_rate=1e-2)
    model.learn(2 * 128)
    assert model.kl_coef > 1.0  # the small target made beta grow
    controller_state = copy.deepcopy(model.kl_controller.__dict__)
    model.save(tmp_path / "model")
    loaded = RecurrentKLPPO.load(tmp_path / "model", env=_env("Pendulum-v1"))
    assert loaded.kl_coef == model.kl_coef
    assert loaded.kl_controller.__dict__ == controller_state
    assert loaded.min_std == 0.5 and loaded.clip_range is None
    assert isinstance(loaded.rollout_buffer, RecurrentKLRolloutBuffer)
    for key, value in model.policy.state_dict().items():
        assert th.equal(value, loaded.policy.state_dict()[key])
    loaded.learn(128, reset_num_timesteps=False)
    assert loaded.logger.name_to_value["train/kl_coef"] > 0
    assert float(th.exp(loaded.policy.log_std.detach()).min()) >= 0.5 - 1e-6
    assert RecurrentKLPPO.load(tmp_path / "model", kl_coef=0.25).kl_coef == 0.25


def test_resumed_training_continues_exactly_with_its_lstm_states(tmp_path):
    # A recurrent reference too, whose LSTM state is carried from rollout to rollout like the policy's
    stock = RecurrentPPO("MlpLstmPolicy", _env("CartPole-v1"), n_steps=64, seed=1, policy_kwargs=dict(lstm_hidden_size=8))
    model = _model("CartPole-v1", ref_policy=stock, ref_kl_coef=0.5, n_epochs=2).learn(128)
    assert model._last_ref_lstm_states is not None and float(model._last_lstm_states.pi[0].abs().sum()) > 0
    model.save(tmp_path / "model")
    loaded = RecurrentKLPPO.load(tmp_path / "model", env=copy.deepcopy(model.get_env()), force_reset=False)
    saved = (*model._last_lstm_states.pi, *model._last_lstm_states.vf, *model._last_ref_lstm_states)
    restored = (*loaded._last_lstm_states.pi, *loaded._last_lstm_states.vf, *loaded._last_ref_lstm_states)
    assert all(th.equal(a, b) for a, b in zip(saved, restored, strict=True))
    # the same environment state and random stream: both continue with the same rollout and update
    rng = th.get_rng_state(), np.random.get_state()  # actions; the minibatches' order
    model.learn(128, reset_num_timesteps=False)
    th.set_rng_state(rng[0])
    np.random.set_state(rng[1])
    loaded.learn(128, reset_num_timesteps=False)
    np.testing.assert_array_equal(model.rollout_buffer.actions, loaded.rollout_buffer.actions)
    for key, value in model.policy.state_dict().items():
        assert th.equal(value, loaded.policy.state_dict()[key]), key
    assert loaded.kl_coef == model.kl_coef


def test_drop_in_defaults_policies_and_predict():
    model = _model("CartPole-v1")
    assert isinstance(model, RecurrentPPO)
    assert set(model.policy_aliases) == set(RecurrentPPO.policy_aliases)
    assert model.clip_range is None and model.target_kl(1.0) == 0.02
    obs = model.get_env().reset()
    actions, state = model.predict(obs, state=None, episode_start=np.ones(2, dtype=bool), deterministic=True)
    assert actions.shape == (2,) and state[0].shape == (1, 2, 16)
    actions2, _ = model.predict(obs, state=state, episode_start=np.zeros(2, dtype=bool), deterministic=True)
    assert actions2.shape == (2,)
    model.learn(128)
    model.rollout_buffer.policy_version = -1
    with pytest.raises(StalePolicyError):
        model.train()


def test_multi_input_lstm_policy():
    model = RecurrentKLPPO(
        "MultiInputLstmPolicy",
        make_vec_env(lambda: SimpleMultiObsEnv(random_start=True), n_envs=2, seed=0),
        n_steps=16,
        batch_size=16,
        n_epochs=2,
        seed=0,
        policy_kwargs=dict(lstm_hidden_size=8, net_arch=[8]),
    )
    assert isinstance(model.rollout_buffer, RecurrentKLDictRolloutBuffer)
    model.learn(64)
    assert np.isfinite(model.logger.name_to_value["train/kl"])


class ReferenceStateCheck(BaseCallback):
    """At each rollout end: the reference's carried LSTM state vs the state the rollout stored at its first step."""

    def __init__(self):
        super().__init__()
        self.differences = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        carried = self.model._last_ref_lstm_states
        if carried is not None:
            stored = self.model.rollout_buffer.hidden_states_pi[0]
            self.differences.append(float(np.abs(carried[0].numpy() - stored).max()))


def test_recurrent_reference_is_rerun_over_the_same_sequences(tmp_path):
    """
    The reference is the initial policy itself: on the first update its re-run equals the rollout policy's, so the
    reference KL KL(new||ref) equals the update KL in the reverse direction; and the reference's LSTM state carried
    to the next rollout is the state the (initial) rollout policy stored there.
    """
    initial = _model("CartPole-v1", learning_rate=1e-2)
    initial.save(tmp_path / "initial")
    model = _model("CartPole-v1", learning_rate=1e-2, kl_direction="reverse", ref_policy=initial, ref_kl_coef=0.0)
    check = ReferenceStateCheck()
    model.learn(128, callback=check)
    values = model.logger.name_to_value
    assert values["train/ref_kl"] == pytest.approx(values["train/kl"], rel=1e-5)
    assert values["train/kl"] > 1e-4
    model.learn(128, callback=check, reset_num_timesteps=False)
    assert len(check.differences) == 1 and check.differences[0] < 1e-5

    # A saved RecurrentPPO as reference (other LSTM size), anchoring with a coefficient; kept through save/load
    stock = RecurrentPPO("MlpLstmPolicy", _env("CartPole-v1"), n_steps=64, seed=1, policy_kwargs=dict(lstm_hidden_size=8))
    stock.save(tmp_path / "stock")
    anchored = _model("CartPole-v1", ref_policy=str(tmp_path / "stock.zip"), ref_kl_coef=0.5, ref_kl_estimator="k3")
    assert anchored.ref_policy.lstm_actor.hidden_size == 8
    anchored.learn(128)
    assert np.isfinite(anchored.logger.name_to_value["train/ref_kl"])
    anchored.save(tmp_path / "anchored")
    loaded = RecurrentKLPPO.load(tmp_path / "anchored", env=_env("CartPole-v1"))
    for key, value in anchored.ref_policy.state_dict().items():
        assert th.equal(value, loaded.ref_policy.state_dict()[key])
    loaded.learn(128, reset_num_timesteps=False)
    assert np.isfinite(loaded.logger.name_to_value["train/ref_kl"])


class StopOrSaveAt(BaseCallback):
    """At the ``call``-th step: stop ``learn()`` (no ``path``), or save the model to ``path`` and go on."""

    def __init__(self, call, path=None):
        super().__init__()
        self.call, self.path = call, path

    def _on_step(self) -> bool:
        if self.n_calls == self.call:
            if self.path is None:
                return False
            self.model.save(self.path)
        return True


def _largest_difference(first, second) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True))


def test_a_recurrent_reference_acts_alongside_on_a_rollout_left_or_saved_within():
    """
    The reference is the initial policy itself, so its carried LSTM state equals the policy's wherever both acted on
    the same steps: also when learn() stops within a rollout (whose steps never reach train(), while the policy
    carries its state on from them) and in a model saved within a rollout (CheckpointCallback). Continuing after the
    stop, the reference KL KL(new||ref) of the next update equals the update KL in the reverse direction.
    """
    initial = _model("CartPole-v1", learning_rate=1e-2)
    kwargs = dict(learning_rate=1e-2, kl_direction="reverse", ref_policy=initial, ref_kl_coef=0.0)
    model = _model("CartPole-v1", **kwargs)
    model.learn(256, callback=StopOrSaveAt(23))
    assert model.rollout_buffer.pos == 22 and model.num_timesteps == 46
    assert float(model._last_lstm_states.pi[0].abs().max()) > 1e-3
    assert _largest_difference(model._last_ref_lstm_states, model._last_lstm_states.pi) < 1e-5
    model.learn(64, reset_num_timesteps=False)
    values = model.logger.name_to_value
    assert values["train/kl"] > 1e-4
    assert values["train/ref_kl"] == pytest.approx(values["train/kl"], rel=1e-5)


def test_a_model_saved_within_a_rollout_saves_the_reference_state_of_the_same_steps(tmp_path):
    initial = _model("CartPole-v1")
    model = _model("CartPole-v1", ref_policy=initial, ref_kl_coef=0.1)
    model.learn(64, callback=StopOrSaveAt(23, tmp_path / "within"))  # the rollout and its update go on
    loaded = RecurrentKLPPO.load(tmp_path / "within", env=_env("CartPole-v1"))
    assert float(loaded._last_lstm_states.pi[0].abs().max()) > 1e-3
    assert _largest_difference(loaded._last_ref_lstm_states, loaded._last_lstm_states.pi) < 1e-5
    # the save changed nothing in the live model: the same training as without it
    unsaved = _model("CartPole-v1", ref_policy=initial, ref_kl_coef=0.1).learn(64)
    for key, value in unsaved.policy.state_dict().items():
        assert th.equal(value, model.policy.state_dict()[key]), key
    assert _largest_difference(unsaved._last_ref_lstm_states, model._last_ref_lstm_states) == 0.0


def test_feed_forward_reference():
    from stable_baselines3 import PPO

    reference = PPO("MlpPolicy", "CartPole-v1", policy_kwargs=dict(net_arch=[8]), seed=2)
    model = _model("CartPole-v1", ref_policy=reference, ref_kl_coef=0.1, ref_kl_direction="forward")
    model.learn(128)
    # the reference is evaluated state by state: KL(ref || pi) on the buffer, against torch.distributions
    buffer = model.rollout_buffer
    observations = th.as_tensor(buffer.observations)  # flattened env-major by get()
    with th.no_grad():
        p = Categorical(logits=reference.policy.get_distribution(observations).distribution.logits.double())
        q = Categorical(logits=th.as_tensor(buffer.ref_dist_params).double())
        assert float((kl_divergence(p, q)).abs().max()) < 1e-6
    assert model._last_ref_lstm_states is None
    assert np.isfinite(model.logger.name_to_value["train/ref_kl"]) and model.logger.name_to_value["train/ref_kl"] > 0


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"target_kl": -0.01}, ValueError, "target_kl"),
        ({"kl_coef_bounds": (10.0, 1e-4)}, ValueError, "kl_coef_bounds"),
        ({"kl_estimator": "k2"}, ValueError, "kl_estimator"),
        ({"kl_controller": "pid"}, ValueError, "kl_controller"),
        ({"min_std": 0.1}, ValueError, "min_std"),  # CartPole is discrete: no variance to floor
        ({"kl_stop_factor": 0.0}, ValueError, "kl_stop_factor"),
        ({"kl_saturation_stop_factor": 0.0}, ValueError, "kl_saturation_stop_factor"),
        ({"kl_hinge_coef": -1.0}, ValueError, "kl_hinge_coef"),
        ({"clip_range": -0.2}, ValueError, "clip_range"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"n_steps": 0}, ValueError, "n_steps"),  # RecurrentPPO takes it, then fails in learn() naming nothing
        ({"n_epochs": 0}, ValueError, "n_epochs"),
        ({"kl_quantiles": (0.5, 1.5)}, ValueError, "kl_quantiles"),
        ({"ref_kl_coef": -1.0}, ValueError, "ref_kl_coef"),
        ({"policy": "MlpPolicy"}, ValueError, "MlpPolicy"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", "MlpLstmPolicy")
    with pytest.raises(error, match=match):
        RecurrentKLPPO(policy, "CartPole-v1", **kwargs)


def test_kl_stop_factor_and_hinge():
    model = _model("CartPole-v1", learning_rate=5e-2, target_kl=1e-4, kl_stop_factor=1.0, kl_hinge_coef=10.0, n_epochs=8)
    model.learn(128)
    assert model.logger.name_to_value["train/early_stop_epoch"] < 8


def test_saturation_stop_with_beta_at_its_bound():
    """As in KLPPO: with beta at its upper bound the update ends before the first minibatch step over the threshold."""
    epochs = {}
    for factor in (1.5, None):
        model = _model(
            "CartPole-v1",
            learning_rate=5e-2,
            target_kl=1e-3,
            kl_coef=1.0,
            kl_coef_bounds=(1e-4, 1.0),
            kl_saturation_stop_factor=factor,
            n_epochs=8,
        )
        model.learn(128)
        epochs[factor] = model.logger.name_to_value["train/early_stop_epoch"]
        assert model.logger.name_to_value["train/early_stop_at_kl_coef_bound"] == float(factor is not None)
    assert epochs[1.5] < 8 and epochs[None] == 8


def _kl_gradients(kl, policy):
    names, params = zip(*[(n, p) for n, p in policy.named_parameters() if p.requires_grad], strict=True)
    grads = th.autograd.grad(kl, params, allow_unused=True)
    return {n: th.zeros_like(p) if g is None else g for n, p, g in zip(names, params, grads, strict=True)}


def test_gsde_kl_gradient_reaches_the_lstm_and_latent():
    """
    With gSDE the std of a state is built from the LSTM's latent features (SB3 detaches them from the distribution,
    learn_features=False): the KL in the loss must still be differentiated through them, else the penalty cannot
    hold the std. Checked against a copy of the policy whose distribution keeps the features attached
    (learn_features=True) and torch.distributions' KL on the same padded minibatch.
    """
    model = _model("Pendulum-v1", use_sde=True, learning_rate=1e-2)
    model.learn(128)  # one update: the buffer still holds the rollout and the rollout policy's parameters
    data = next(iter(model.rollout_buffer.get(32)))
    mask = data.mask > 1e-8
    terms = (None, None, model.kl_coef, 0.0, model._current_target_kl())
    kl = model._minibatch_loss(data, *terms)["kl"]

    independent = _copy_policy(model.policy)
    independent.action_dist.learn_features = True
    distribution, _ = independent.get_distribution(data.observations, data.lstm_states.pi, data.episode_starts)
    d = model.action_space.shape[0]
    old = Normal(data.old_dist_params[:, :d], data.old_dist_params[:, d:].exp())
    expected = kl_divergence(old, distribution.distribution).sum(-1)[mask].mean()
    assert kl.item() == pytest.approx(expected.item(), rel=1e-5)
    assert expected.item() > 1e-4

    got, want = _kl_gradients(kl, model.policy), _kl_gradients(expected, independent)
    for name in ("lstm_actor.weight_hh_l0", "mlp_extractor.policy_net.0.weight", "log_std", "action_net.weight"):
        assert want[name].abs().max() > 1e-6, name
        assert th.allclose(got[name], want[name], rtol=1e-4, atol=1e-7), name
