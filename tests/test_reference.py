import copy
import os

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from stable_baselines3 import PPO, SAC
from stable_baselines3.common.distributions import kl_divergence, sum_independent_dims

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.common.controllers import AdaptiveKLController, FixedKLController

POLICY_KWARGS = dict(net_arch=[16])
ALGOS = [KLPPO, ClipKLPPO, KLTRPO]
REF_KEYS = ("train/ref_kl", "train/ref_kl_p99", "train/ref_kl_coef")


def make_model(algo, env_id="Pendulum-v1", seed=0, **kwargs):
    extra = dict(batch_size=32) if algo is not KLTRPO else dict(batch_size=32, n_critic_updates=1)
    return algo("MlpPolicy", env_id, n_steps=64, policy_kwargs=dict(POLICY_KWARGS), seed=seed, device="cpu", **extra, **kwargs)


@pytest.fixture(scope="module")
def saved_reference(tmp_path_factory):
    """A small PPO model trained for one rollout on Pendulum, saved as a zip."""
    path = tmp_path_factory.mktemp("ref") / "ref.zip"
    PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, policy_kwargs=dict(POLICY_KWARGS), seed=1, device="cpu").learn(
        64
    ).save(path)
    return path


def shifted_reference(model, shift=1.0):
    """A copy of the model's policy with every action mean moved by ``shift``: KL(pi || pi_ref) = shift^2 / (2 std^2)."""
    reference = PPO("MlpPolicy", "Pendulum-v1", policy_kwargs=dict(POLICY_KWARGS), device="cpu")
    reference.policy.load_state_dict(model.policy.state_dict())
    with th.no_grad():
        reference.policy.action_net.bias += shift
    return reference


@pytest.mark.parametrize("algo", ALGOS)
def test_anchor_pulls_toward_reference(algo):
    # Two identical models (same seed, same weights, same rollout); only one pays for the KL to the reference.
    # Each is built and trained before the next is built: the rollout's actions come from torch's global generator,
    # which the model's seed sets at construction
    base = make_model(algo)
    reference = shifted_reference(base)
    trained = {}
    for coef in (0.0, 5.0):
        model = make_model(algo, ref_policy=reference, ref_kl_coef=coef)
        model.policy.load_state_dict(base.policy.state_dict())
        obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(64)]))
        ref_params, _ = model._reference_distribution(obs)
        initial = model._reference_kl(ref_params, model.policy.get_distribution(obs)).mean().item()
        assert initial == pytest.approx(0.5, rel=1e-4)  # unit mean shift, std 1
        trained[coef] = model.learn(64)
    free, anchored = trained[0.0], trained[5.0]
    np.testing.assert_array_equal(free.rollout_buffer.actions, anchored.rollout_buffer.actions)  # the same rollout
    free_kl = free.logger.name_to_value["train/ref_kl"]
    anchored_kl = anchored.logger.name_to_value["train/ref_kl"]
    assert free.logger.name_to_value["train/ref_kl_coef"] == 0.0
    assert anchored_kl < free_kl
    assert anchored_kl < initial


def test_penalty_gradient_points_toward_reference():
    model = make_model(KLPPO, ref_policy=None)
    reference = shifted_reference(model, shift=1.0)
    anchored = make_model(KLPPO, ref_policy=reference)
    anchored.policy.load_state_dict(model.policy.state_dict())
    obs = th.as_tensor(np.stack([anchored.observation_space.sample() for _ in range(32)]))
    distribution = anchored.policy.get_distribution(obs)
    actions = distribution.sample()
    penalty = anchored._reference_penalty(obs, actions, distribution, distribution.log_prob(actions))
    penalty.backward()
    # The reference's means are one unit higher: descending the penalty raises the action-net bias
    assert anchored.policy.action_net.bias.grad.item() < 0
    assert all(p.grad is None for p in anchored.ref_policy.parameters())


def test_reference_kl_direction_matches_sb3():
    model = make_model(KLPPO, ref_policy=None)
    reference = shifted_reference(model, shift=0.7)
    with th.no_grad():
        reference.policy.log_std += 0.3
    obs = th.as_tensor(np.stack([model.observation_space.sample() for _ in range(16)]))
    for direction in ("reverse", "forward"):
        anchored = make_model(KLPPO, ref_policy=reference, ref_kl_direction=direction)
        anchored.policy.load_state_dict(model.policy.state_dict())
        ref_params, _ = anchored._reference_distribution(obs)
        ours = anchored._reference_kl(ref_params, anchored.policy.get_distribution(obs))
        pi = model.policy.get_distribution(obs)
        pi_ref = reference.policy.get_distribution(obs)
        first, second = (pi, pi_ref) if direction == "reverse" else (pi_ref, pi)
        expected = sum_independent_dims(kl_divergence(first, second))
        assert th.allclose(ours, expected, atol=1e-5), direction


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sample_estimators_run(algo, estimator):
    model = make_model(algo, ref_policy=None)
    anchored = make_model(algo, ref_policy=shifted_reference(model, shift=0.3), ref_kl_estimator=estimator, ref_kl_coef=1.0)
    anchored.learn(64)
    values = anchored.logger.name_to_value
    assert np.isfinite(values["train/ref_kl"])
    assert values["train/ref_kl_convention"] == f"reverse/{estimator}/sum"


@pytest.mark.parametrize("algo", ALGOS)
def test_reference_is_frozen(algo, saved_reference):
    model = make_model(algo, ref_policy=saved_reference, ref_target_kl=0.01)
    ref = model.ref_policy
    before = {name: tensor.clone() for name, tensor in ref.state_dict().items()}
    model.learn(128)
    assert model.ref_policy is ref
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    optimized = {id(p) for group in model.policy.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in ref.parameters()}
    for name, tensor in ref.state_dict().items():
        assert th.equal(tensor, before[name]), name
    for key in REF_KEYS:
        assert key in model.logger.name_to_value, key


def test_source_model_is_not_modified():
    source = PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, policy_kwargs=dict(POLICY_KWARGS), device="cpu")
    model = make_model(KLPPO, ref_policy=source)
    assert model.ref_policy is not source.policy
    assert all(p.requires_grad for p in source.policy.parameters())
    for name, tensor in source.policy.state_dict().items():
        assert th.equal(tensor, model.ref_policy.state_dict()[name])
    # A policy works as a source too
    assert make_model(KLPPO, ref_policy=source.policy).ref_policy is not source.policy


@pytest.mark.parametrize("algo", ALGOS)
def test_save_load_keeps_anchor_without_source_file(algo, saved_reference, tmp_path):
    source = tmp_path / "source.zip"
    source.write_bytes(saved_reference.read_bytes())
    model = make_model(algo, ref_policy=source, ref_target_kl=0.001)
    model.learn(128)
    controller = model.ref_kl_controller
    assert isinstance(controller, AdaptiveKLController) and controller.n_updates == 2
    model.save(tmp_path / "model.zip")
    os.remove(source)

    loaded = algo.load(tmp_path / "model.zip", device="cpu")
    for name, tensor in model.ref_policy.state_dict().items():
        assert th.equal(tensor, loaded.ref_policy.state_dict()[name]), name
    assert not loaded.ref_policy.training
    assert all(not p.requires_grad for p in loaded.ref_policy.parameters())
    assert loaded.ref_kl_coef == model.ref_kl_coef != 1.0
    assert loaded.ref_kl_controller.n_updates == 2
    assert loaded.ref_target_kl == 0.001
    obs = th.as_tensor(np.stack([loaded.observation_space.sample() for _ in range(4)]))
    expected = model.ref_policy.get_distribution(obs).distribution.mean
    assert th.allclose(loaded.ref_policy.get_distribution(obs).distribution.mean, expected)
    assert algo.load(tmp_path / "model.zip", device="cpu", ref_kl_coef=0.123).ref_kl_coef == 0.123
    # Training continues with the restored anchor
    loaded.set_env(model.get_env())
    loaded.learn(64, reset_num_timesteps=False)
    assert loaded.ref_kl_controller.n_updates == 3


def test_load_model_without_reference(tmp_path):
    model = make_model(KLPPO)
    model.learn(64)
    model.save(tmp_path / "plain.zip")
    loaded = KLPPO.load(tmp_path / "plain.zip", device="cpu")
    assert loaded.ref_policy is None
    assert "train/ref_kl" not in model.logger.name_to_value


def test_fixed_coefficient_and_measure_only(saved_reference):
    fixed = make_model(KLPPO, ref_policy=saved_reference, ref_kl_coef=0.3)
    fixed.learn(128)
    assert isinstance(fixed.ref_kl_controller, FixedKLController)
    assert fixed.logger.name_to_value["train/ref_kl_coef"] == 0.3
    measured = make_model(KLPPO, ref_policy=saved_reference, ref_kl_coef=0.0)
    measured.learn(64)
    assert measured.ref_kl_controller is None
    assert measured.logger.name_to_value["train/ref_kl"] > 0


@pytest.mark.parametrize("algo", ALGOS)
def test_mismatched_action_space_raises(algo):
    discrete = PPO("MlpPolicy", "CartPole-v1", policy_kwargs=dict(POLICY_KWARGS), device="cpu")
    with pytest.raises(ValueError, match="action space"):
        make_model(algo, ref_policy=discrete)
    # Same shape, other bounds (and other observations): still a different action space
    box = PPO("MlpPolicy", "MountainCarContinuous-v0", policy_kwargs=dict(POLICY_KWARGS), device="cpu")
    with pytest.raises(ValueError, match="ref_policy"):
        make_model(algo, ref_policy=box)


@pytest.mark.parametrize("algo", ALGOS)
def test_a_reference_that_squashes_differently_raises(algo, tmp_path):
    # a tanh-squashed gSDE Gaussian and a plain one share the parameter layout; their pre-tanh KL is not the actions'
    squashed = dict(POLICY_KWARGS, squash_output=True)
    plain_ref = PPO("MlpPolicy", "Pendulum-v1", use_sde=True, policy_kwargs=dict(POLICY_KWARGS), device="cpu")
    squashed_ref = PPO("MlpPolicy", "Pendulum-v1", use_sde=True, policy_kwargs=squashed, device="cpu")
    squashed_ref.save(tmp_path / "squashed.zip")
    with pytest.raises(ValueError, match=r"`ref_policy` has squash_output=False and this model's policy squash_output=True"):
        algo("MlpPolicy", "Pendulum-v1", n_steps=64, use_sde=True, policy_kwargs=squashed, ref_policy=plain_ref, device="cpu")
    for source in (squashed_ref, tmp_path / "squashed.zip"):  # also when rebuilt from a saved model
        with pytest.raises(ValueError, match=r"squash_output=True and this model's policy squash_output=False"):
            make_model(algo, use_sde=True, ref_policy=source)
    # the same setting on both sides is accepted
    model = algo("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, use_sde=True, policy_kwargs=squashed,
                 ref_policy=squashed_ref, device="cpu")  # fmt: skip
    assert model.ref_policy.squash_output


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="ref_kl_coef"):
        make_model(KLPPO, ref_kl_coef=-1.0)
    with pytest.raises(ValueError, match="ref_target_kl"):
        make_model(KLPPO, ref_target_kl=0.0)
    with pytest.raises(ValueError, match="ref_kl_direction"):
        make_model(KLPPO, ref_kl_direction="sideways")
    with pytest.raises(TypeError, match="ref_policy"):
        make_model(KLPPO, ref_policy=42)
    sac_path = tmp_path / "sac.zip"
    SAC("MlpPolicy", "Pendulum-v1", policy_kwargs=dict(POLICY_KWARGS), device="cpu").save(sac_path)
    with pytest.raises(ValueError, match="ActorCriticPolicy"):
        make_model(KLPPO, ref_policy=sac_path)


@pytest.mark.parametrize("estimator", ["analytic", "k1", "k3"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_logged_reference_kl_is_the_documented_quantity(direction, estimator):
    """
    ``train/ref_kl`` (which drives beta_ref) after an update, recomputed with ``torch.distributions`` from the
    buffer: analytic, the exact mean KL between the updated policy and the reference over the buffer's states;
    k1/k3, the mean over the buffer of the importance-weighted estimate at each stored action (drawn by the
    rollout policy, weight pi/pi_old for reverse, pi_ref/pi_old for forward).
    """
    model = make_model(KLPPO, ref_policy=None)
    anchored = make_model(
        KLPPO,
        ref_policy=shifted_reference(model, shift=0.4),
        ref_kl_direction=direction,
        ref_kl_estimator=estimator,
        ref_kl_coef=1.0,
        learning_rate=3e-3,
    )
    anchored.learn(64)
    logged = anchored.logger.name_to_value["train/ref_kl"]
    buffer = anchored.rollout_buffer
    obs = th.as_tensor(buffer.observations.reshape(-1, *anchored.observation_space.shape))
    actions = th.as_tensor(buffer.actions.reshape(len(obs), -1))
    old_log_prob = th.as_tensor(buffer.log_probs.reshape(-1))
    with th.no_grad():
        pi_normal = anchored.policy.get_distribution(obs).distribution
        pi = th.distributions.Normal(pi_normal.loc.clone(), pi_normal.scale.clone())
        ref_normal = anchored.ref_policy.get_distribution(obs).distribution
        pi_ref = th.distributions.Normal(ref_normal.loc.clone(), ref_normal.scale.clone())
    if estimator == "analytic":
        first, second = (pi, pi_ref) if direction == "reverse" else (pi_ref, pi)
        expected = th.distributions.kl_divergence(first, second).sum(-1).mean().item()
    else:
        log_pi, log_ref = pi.log_prob(actions).sum(-1), pi_ref.log_prob(actions).sum(-1)
        if direction == "reverse":
            weight, log_rho = th.exp(log_pi - old_log_prob), log_ref - log_pi
        else:
            weight, log_rho = th.exp(log_ref - old_log_prob), log_pi - log_ref
        k = -log_rho if estimator == "k1" else th.exp(log_rho) - 1 - log_rho
        expected = (weight * k).mean().item()
    assert anchored.policy_version > 0 and logged > 0
    assert logged == pytest.approx(expected, rel=1e-4, abs=1e-7)


@pytest.fixture(scope="module")
def saved_recurrent_reference(tmp_path_factory):
    """A small sb3-contrib RecurrentPPO model on Pendulum, saved as a zip."""
    from sb3_contrib import RecurrentPPO

    path = tmp_path_factory.mktemp("recurrent") / "recurrent.zip"
    kwargs = dict(net_arch=[8], lstm_hidden_size=8)
    RecurrentPPO("MlpLstmPolicy", "Pendulum-v1", n_steps=32, batch_size=32, policy_kwargs=kwargs, device="cpu").save(path)
    return path


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("form", ["model", "policy", "zip"])
def test_recurrent_reference_is_refused_at_construction(algo, form, saved_recurrent_reference):
    from sb3_contrib import RecurrentPPO

    recurrent = RecurrentPPO.load(saved_recurrent_reference, device="cpu")
    source = {"model": recurrent, "policy": recurrent.policy, "zip": saved_recurrent_reference}[form]
    with pytest.raises(ValueError, match=r"recurrent policy .*RecurrentActorCriticPolicy.*feed-forward reference"):
        make_model(algo, ref_policy=source)


def test_recurrent_reference_check_is_overridable(saved_recurrent_reference):
    """A recurrent algorithm accepts one by overriding ``_check_reference_policy``."""

    class AcceptsRecurrent(KLPPO):
        def _check_reference_policy(self, policy):
            pass

    model = make_model(AcceptsRecurrent, ref_policy=saved_recurrent_reference)
    assert type(model.ref_policy).__name__ == "RecurrentActorCriticPolicy"


def test_ref_kl_coef_override_at_load_keeps_its_bounds(saved_reference, tmp_path):
    model = make_model(KLPPO, ref_policy=saved_reference, ref_kl_coef_bounds=(1e-3, 10.0))
    model.save(tmp_path / "model.zip")
    with pytest.raises(ValueError, match="ref_kl_coef_bounds"):
        KLPPO.load(tmp_path / "model.zip", device="cpu", ref_kl_coef=100.0)
    with pytest.raises(ValueError, match="ref_kl_coef_bounds"):
        KLPPO.load(tmp_path / "model.zip", device="cpu", custom_objects={"ref_kl_coef": 1e-6})
    assert KLPPO.load(tmp_path / "model.zip", device="cpu", custom_objects={"ref_kl_coef": 0.5}).ref_kl_coef == 0.5


def test_ref_target_kl_at_load_is_applied_or_refused(saved_reference, tmp_path):
    adaptive = make_model(KLPPO, ref_policy=saved_reference, ref_target_kl=0.01)
    adaptive.save(tmp_path / "adaptive.zip")
    # a new target for an adapting controller: checked as in the constructor, then beta_ref adapts toward it
    loaded = KLPPO.load(tmp_path / "adaptive.zip", env=gym.make("Pendulum-v1"), device="cpu", ref_target_kl=1e-6)
    assert loaded.ref_target_kl == 1e-6
    coef = loaded.ref_kl_coef
    loaded.learn(64, reset_num_timesteps=False)
    assert loaded.logger.name_to_value["train/ref_target_kl"] == 1e-6
    assert loaded.ref_kl_coef > coef  # the KL to the reference is far above 1e-6
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="ref_target_kl"):
            KLPPO.load(tmp_path / "adaptive.zip", device="cpu", ref_target_kl=bad)
    with pytest.raises(ValueError, match="ref_target_kl"):
        KLPPO.load(tmp_path / "adaptive.zip", device="cpu", custom_objects={"ref_target_kl": -1.0})

    fixed = make_model(KLPPO, ref_policy=saved_reference, ref_kl_coef=0.5)
    fixed.save(tmp_path / "fixed.zip")
    # a fixed coefficient: no target adapts it, so a target alone is refused, and accepted with an adapting controller
    with pytest.raises(ValueError, match=r"ref_target_kl.*ref_kl_controller"):
        KLPPO.load(tmp_path / "fixed.zip", device="cpu", ref_target_kl=1e-4)
    assert KLPPO.load(tmp_path / "fixed.zip", device="cpu", ref_target_kl=None).ref_target_kl is None
    controller = AdaptiveKLController(0.5)
    loaded = KLPPO.load(
        tmp_path / "fixed.zip", env=gym.make("Pendulum-v1"), device="cpu", ref_target_kl=1e-6, ref_kl_controller=controller
    )
    loaded.learn(64, reset_num_timesteps=False)
    assert loaded.ref_kl_controller is controller and loaded.ref_kl_coef > 0.5


def test_ref_policy_at_load_must_be_the_saved_one(saved_reference, tmp_path):
    model = make_model(KLPPO, ref_policy=saved_reference)
    model.save(tmp_path / "model.zip")
    # the same reference again (an rl-zoo config passed with its trained agent) is accepted
    loaded = KLPPO.load(tmp_path / "model.zip", device="cpu", ref_policy=saved_reference)
    assert all(th.equal(t, loaded.ref_policy.state_dict()[k]) for k, t in model.ref_policy.state_dict().items())
    # another one would be overwritten by the saved weights: refused
    other = shifted_reference(model)
    with pytest.raises(ValueError, match=r"ref_policy.*set_parameters"):
        KLPPO.load(tmp_path / "model.zip", device="cpu", ref_policy=other)
    with pytest.raises(ValueError, match="ref_policy"):
        KLPPO.load(tmp_path / "model.zip", device="cpu", ref_policy=None)
    plain = make_model(KLPPO)
    plain.save(tmp_path / "plain.zip")
    assert KLPPO.load(tmp_path / "plain.zip", device="cpu", ref_policy=None).ref_policy is None
    with pytest.raises(ValueError, match="ref_policy"):
        KLPPO.load(tmp_path / "plain.zip", device="cpu", ref_policy=saved_reference)


def _state_equal(a: th.nn.Module, b: th.nn.Module) -> bool:
    return all(th.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())


@pytest.mark.parametrize("algo", ALGOS)
def test_set_parameters_keeps_the_models_own_reference(algo, saved_reference, tmp_path):
    # What load()'s refusal above advises: a new model with another reference, the trained weights set into it
    trained = make_model(algo, ref_policy=saved_reference).learn(64)
    trained.save(tmp_path / "trained.zip")
    other = shifted_reference(trained)
    model = make_model(algo, seed=1, ref_policy=other)
    anchor = {k: t.clone() for k, t in model.ref_policy.state_dict().items()}
    model.set_parameters(tmp_path / "trained.zip")
    assert _state_equal(trained.policy, model.policy)  # the trained weights
    assert all(th.equal(t, model.ref_policy.state_dict()[k]) for k, t in anchor.items())  # its own anchor, not the saved one
    # weights saved without a reference (a stock PPO zip, a model without one) load with exact_match too
    model.set_parameters(saved_reference)
    assert all(th.equal(t, model.ref_policy.state_dict()[k]) for k, t in anchor.items())
    plain = make_model(algo, seed=2)
    plain.set_parameters(tmp_path / "trained.zip")
    assert plain.ref_policy is None and _state_equal(trained.policy, plain.policy)
    # and the model still saves its own anchor, which load() restores
    model.save(tmp_path / "reanchored.zip")
    assert _state_equal(model.ref_policy, algo.load(tmp_path / "reanchored.zip", device="cpu").ref_policy)


@pytest.mark.parametrize("algo", ALGOS)
def test_a_measured_reference_leaves_the_training_unchanged(algo, saved_reference):
    # ref_kl_coef=0 only measures: building the reference must not shift the seeded random stream either
    without = make_model(algo).learn(128)
    measured = make_model(algo, ref_policy=saved_reference, ref_kl_coef=0.0).learn(128)
    assert _state_equal(without.policy, measured.policy)


def test_kltrpo_gsde_anchor_gradient_is_the_reference_kls(monkeypatch):
    """
    With gSDE, KLTRPO's natural-gradient right-hand side carries -beta_ref * grad KL(pi || pi_ref), the gradient of
    the exact KL of the Gaussians the policies act with, std through the features included (the constraint keeps
    SB3's detached features, as TRPO's does). Checked against central finite differences of that KL.
    """
    import sb3_kl.kltrpo.kltrpo as kltrpo_module

    reference = PPO("MlpPolicy", "Pendulum-v1", n_steps=64, use_sde=True, seed=1, policy_kwargs=dict(net_arch=[16]))
    with th.no_grad():  # a reference away from the policy: its own weights, a larger exploration std
        reference.policy.log_std.add_(0.5)
    solver = kltrpo_module.conjugate_gradient_solver

    def right_hand_side(ref_kl_coef: float) -> tuple[th.Tensor, KLTRPO]:
        model = KLTRPO(
            "MlpPolicy",
            "Pendulum-v1",
            n_steps=64,
            use_sde=True,
            seed=3,
            ref_policy=reference,
            ref_kl_coef=ref_kl_coef,
            policy_kwargs=dict(net_arch=[16]),
        )
        captured = {}

        def capture(fvp, b, **kwargs):
            if "b" not in captured:
                captured["b"], captured["state"] = b.detach().clone(), copy.deepcopy(model.policy.state_dict())
            return solver(fvp, b, **kwargs)

        monkeypatch.setattr(kltrpo_module, "conjugate_gradient_solver", capture)
        model.learn(64)
        model.policy.load_state_dict(captured["state"])
        return captured["b"], model

    coef = 2.0
    anchored, model = right_hand_side(coef)
    free, _ = right_hand_side(0.0)
    gradient = (free - anchored) / coef  # grad KL_ref as the algorithm uses it
    observations = th.as_tensor(model.rollout_buffer.observations.reshape(-1, 3))
    parameters = model._actor_parameters()
    assert sum(p.numel() for p in parameters) == gradient.numel()
    model.policy.set_training_mode(False)

    def exact_kl() -> float:
        with th.no_grad():
            p = model.policy.get_distribution(observations).distribution
            q = model.ref_policy.get_distribution(observations).distribution
            p = th.distributions.Normal(p.loc.double(), p.scale.double())
            q = th.distributions.Normal(q.loc.double(), q.scale.double())
            return float(th.distributions.kl_divergence(p, q).sum(-1).mean())

    flat = th.nn.utils.parameters_to_vector(parameters).detach().clone()
    generator = th.Generator().manual_seed(0)
    for _ in range(3):
        direction = th.randn(flat.numel(), generator=generator)
        values = []
        for sign in (1.0, -1.0):
            th.nn.utils.vector_to_parameters(flat + sign * 1e-3 * direction, parameters)
            values.append(exact_kl())
        th.nn.utils.vector_to_parameters(flat, parameters)
        expected = (values[0] - values[1]) / 2e-3
        assert float(gradient @ direction) == pytest.approx(expected, rel=1e-2, abs=1e-5)
