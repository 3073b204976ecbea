"""
The loss's KL term as one autograd node (``sb3_kl/common/kl_term.py``): for every distribution, direction, estimator,
reduction, hinge state and log-ratio clamp, its values and gradients equal (float64, ~1e-10) those of the term built
from autograd operations (the per-state KL of ``sb3_kl.common.kl``, its mean, KLPPO's penalty), and ``gradcheck``
passes; where it does not apply the caller is told so. Short KLPPO, ClipKLPPO and MaskableKLPPO runs with the node
log the same update KLs (1e-6 relative) and end with the same parameters (1e-5 relative) as with the autograd path; in
float32 the node is the more accurate where the autograd term cancels; and it dispatches fewer operations.
"""

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from sb3_contrib.common.maskable.distributions import make_masked_proba_distribution
from stable_baselines3.common.distributions import make_proba_distribution
from stable_baselines3.common.env_util import make_vec_env

import sb3_kl
from sb3_kl.common.callbacks_monitor import distribution_params_for_policy
from sb3_kl.common.host_sync import no_distribution_validation
from sb3_kl.common.kl import KLSettings, attach_sde_features, make_distribution_params, per_state_kl, per_state_kl_to
from sb3_kl.common.kl_term import fused_kl_term
from sb3_kl.klppo import klppo as klppo_module

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BATCH = 6
KL_COEF = 0.7
HINGE_COEF = 1000.0
# name: (action space, gSDE)
LAYOUTS = {
    "gaussian": (spaces.Box(-1, 1, (3,)), False),
    "gsde": (spaces.Box(-1, 1, (3,)), True),
    "categorical": (spaces.Discrete(4), False),
    "multicategorical": (spaces.MultiDiscrete([3, 2, 4]), False),
    "bernoulli": (spaces.MultiBinary(3), False),
}
# estimator: (name, log_ratio_clip); 0.4 clamps about half of the test's log-ratios (drawn at a scale of 0.8)
ESTIMATORS = {"analytic": ("analytic", 20.0), "k1": ("k1", 20.0), "k3": ("k3", 20.0), "k1_clamped": ("k1", 0.4)}
ESTIMATORS["k3_clamped"] = ("k3", 0.4)


class Case:
    """A layout's distribution built from raw float64 inputs (the differentiated ones), and stored old parameters."""

    def __init__(self, layout_name: str, seed: int = 0, batch: int = BATCH) -> None:
        space, self.use_sde = LAYOUTS[layout_name]
        self.dist = make_proba_distribution(space, use_sde=self.use_sde)
        self.layout = make_distribution_params(self.dist)
        generator = th.Generator().manual_seed(seed)

        def draw(*shape: int, scale: float = 1.0) -> th.Tensor:
            return scale * th.randn(*shape, generator=generator, dtype=th.float64)

        if isinstance(space, spaces.Box):
            d, latent = 3, 4
            self.inputs = [draw(batch, d), draw(latent, d, scale=0.5) if self.use_sde else draw(d, scale=0.5)]
            if self.use_sde:
                self.inputs.append(draw(batch, latent))
        else:
            self.inputs = [draw(batch, self.layout.n_params)]
        old_inputs = [x + draw(*x.shape, scale=0.3) for x in self.inputs]
        with th.no_grad():
            self.old_params = self.layout.extract(self.distribution(*old_inputs))
        self.inputs = [x.requires_grad_() for x in self.inputs]
        self.log_ratio = draw(batch, scale=0.8).requires_grad_()

    def distribution(self, *inputs: th.Tensor) -> Any:
        """The current policy's distribution on ``inputs`` (for gSDE with the features attached, as the loss has it)."""
        if self.use_sde:
            mean, log_std, latent = inputs
            distribution = self.dist.proba_distribution(mean, log_std, latent)
            attach_sde_features(distribution, latent, log_std)
            return distribution
        if len(inputs) == 2:
            return self.dist.proba_distribution(*inputs)
        return self.dist.proba_distribution(inputs[0])


def autograd_term(case: Case, settings: KLSettings, distribution: Any, log_ratio: th.Tensor, hinge_kl: float) -> tuple:
    """The term from differentiable operations: the per-state KL on extracted parameters, its mean, KLPPO's penalty."""
    new_params = case.layout.extract(distribution)
    kl = per_state_kl(settings, case.layout, case.old_params, new_params, log_ratio).mean()
    return kl, KL_COEF * kl + HINGE_COEF * th.clamp(kl - hinge_kl, min=0.0) ** 2


def hinge_at(kl: float, active: bool) -> float:
    """A hinge threshold clearly below (active) or above (inactive) the KL, so finite differences stay on one side."""
    return kl - 0.5 * abs(kl) - 0.01 if active else kl + 0.5 * abs(kl) + 0.01


@pytest.mark.parametrize("hinge", ["inactive", "active"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_fused_term_equals_autograd_term_in_value_and_gradient(layout_name, direction, estimator, reduction, hinge):
    case = Case(layout_name)
    name, clip = ESTIMATORS[estimator]
    settings = KLSettings(estimator=name, direction=direction, reduction=reduction, log_ratio_clip=clip)
    with th.no_grad():
        reference_kl = autograd_term(case, settings, case.distribution(*case.inputs), case.log_ratio, 0.0)[0].item()
    hinge_kl = hinge_at(reference_kl, hinge == "active")
    inputs = [*case.inputs, case.log_ratio]

    def fused(*args: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        result = fused_kl_term(
            settings, case.layout, case.old_params, case.distribution(*args[:-1]), args[-1], KL_COEF, HINGE_COEF, hinge_kl
        )
        assert result is not None
        return result

    def reference(*args: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        return autograd_term(case, settings, case.distribution(*args[:-1]), args[-1], hinge_kl)

    kl, penalty = fused(*inputs)
    assert type(penalty.grad_fn).__name__.endswith("KLTermBackward")
    expected_kl, expected_penalty = reference(*inputs)
    assert (expected_kl.item() > hinge_kl) == (hinge == "active")
    th.testing.assert_close(kl, expected_kl, rtol=1e-10, atol=1e-12)
    th.testing.assert_close(penalty, expected_penalty, rtol=1e-10, atol=1e-12)
    # today's loss path (per_state_kl_to, with its own one-node Gaussian KL) gives the same KL
    th.testing.assert_close(
        kl,
        per_state_kl_to(settings, case.layout, case.old_params, case.distribution(*case.inputs), case.log_ratio).mean(),
        rtol=1e-10,
        atol=1e-12,
    )
    # the gradients of both outputs, alone and together
    for weights in ((1.0, 0.0), (0.0, 1.0), (0.3, 1.0)):
        got = th.autograd.grad(weights[0] * kl + weights[1] * penalty, inputs, retain_graph=True, allow_unused=True)
        want = th.autograd.grad(
            weights[0] * expected_kl + weights[1] * expected_penalty, inputs, retain_graph=True, allow_unused=True
        )
        for a, b in zip(got, want, strict=True):
            if b is None:
                assert a is None or not a.any()
            else:
                th.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert th.autograd.gradcheck(fused, tuple(inputs))


def test_clamped_log_ratios_get_no_gradient_but_forward_k1_is_not_clamped():
    case = Case("gaussian")
    log_ratio = th.tensor([-1.0, -0.2, 0.1, 0.3, 2.0, float("inf")], dtype=th.float64, requires_grad=True)
    distribution = case.distribution(*case.inputs)
    for settings, zero in ((KLSettings(estimator="k3", log_ratio_clip=0.4), [0, 4, 5]), (KLSettings(estimator="k1"), [])):
        kl, _ = fused_kl_term(settings, case.layout, case.old_params, distribution, log_ratio, 1.0)
        (grad,) = th.autograd.grad(kl, log_ratio)
        assert (grad[zero] == 0).all() and (grad[[i for i in range(6) if i not in zero]] != 0).all()


def test_masked_categorical_term_equals_autograd_term():
    distribution_class = make_masked_proba_distribution(spaces.MultiDiscrete([3, 4]))
    layout = distribution_params_for_policy(distribution_class)  # the layout MaskableKLPPO uses
    generator = th.Generator().manual_seed(0)
    masks = th.rand(BATCH, 7, generator=generator) > 0.3
    masks[:, 0] = masks[:, 3] = True

    def masked(logits: th.Tensor) -> Any:
        distribution = distribution_class.proba_distribution(logits)
        distribution.apply_masking(masks)
        return distribution

    with th.no_grad():
        old = layout.extract(masked(th.randn(BATCH, 7, generator=generator, dtype=th.float64)))
    logits = th.randn(BATCH, 7, generator=generator, dtype=th.float64, requires_grad=True)
    for direction in ("forward", "reverse"):
        settings = KLSettings(direction=direction)
        kl, penalty = fused_kl_term(settings, layout, old, masked(logits), None, KL_COEF)
        expected = per_state_kl(settings, layout, old, layout.extract(masked(logits))).mean()
        th.testing.assert_close(kl, expected, rtol=1e-10, atol=1e-12)
        th.testing.assert_close(th.autograd.grad(penalty, logits)[0], th.autograd.grad(KL_COEF * expected, logits)[0])


def test_fused_term_says_where_it_does_not_apply():
    case = Case("categorical")
    settings = KLSettings()
    distribution = case.distribution(*case.inputs)
    # stored parameters that require a gradient, an empty minibatch, a sample estimator without a log-ratio
    assert fused_kl_term(settings, case.layout, case.old_params.clone().requires_grad_(), distribution, None, 1.0) is None
    empty = Case("categorical")
    with no_distribution_validation():
        empty_distribution = empty.dist.proba_distribution(th.zeros(0, 4, dtype=th.float64))
    assert fused_kl_term(settings, empty.layout, th.zeros(0, 4, dtype=th.float64), empty_distribution, None, 1.0) is None
    assert fused_kl_term(KLSettings(estimator="k3"), case.layout, case.old_params, distribution, None, 1.0) is None

    class OtherLayout(type(case.layout)):  # a layout that computes another KL
        def kl_per_dim(self, p: th.Tensor, q: th.Tensor) -> th.Tensor:
            return 2 * super().kl_per_dim(p, q)

    assert fused_kl_term(settings, OtherLayout(4), case.old_params, distribution, None, 1.0) is None
    # first-order only: refused, where a second derivative through the categorical's normalization would miss the node
    _, penalty = fused_kl_term(settings, case.layout, case.old_params, distribution, None, 1.0)
    with pytest.raises(RuntimeError, match="first-order only"):
        th.autograd.grad(penalty, case.inputs[0], create_graph=True)


def make_env(env_id: str) -> Any:
    """Two copies of a registered task, or of sb3-contrib's action-masked one, or of SB3's MultiDiscrete or
    MultiBinary identity tasks."""
    if env_id == "masked":
        from sb3_contrib.common.envs import InvalidActionEnvDiscrete

        return make_vec_env(lambda: InvalidActionEnvDiscrete(dim=20, n_invalid_actions=10), n_envs=2, seed=0)
    if env_id in ("multidiscrete", "multibinary"):
        from stable_baselines3.common.envs import IdentityEnvMultiBinary, IdentityEnvMultiDiscrete

        identity = IdentityEnvMultiDiscrete if env_id == "multidiscrete" else IdentityEnvMultiBinary
        return make_vec_env(lambda: identity(dim=3), n_envs=2, seed=0)
    return make_vec_env(env_id, n_envs=2, seed=0)


class ShortRun:
    """
    Two updates (3 epochs of 4 minibatches each) of a small network, with the fused node or with the autograd term:
    the logged KL of every update (``train/kl``), the final parameters, how many minibatch terms the fused node built
    and in how many the hinge acted.
    """

    def __init__(self, algo: str, env_id: str, fused: bool, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> None:
        kwargs = dict(n_steps=64, batch_size=32, n_epochs=3, policy_kwargs=dict(net_arch=[16]), seed=0, device="cpu")
        model = getattr(sb3_kl, algo)("MlpPolicy", make_env(env_id), **{**kwargs, **extra})
        monkeypatch.setattr(model, "_fused_kl_term", fused)
        self.update_kls: list[float] = []
        self.fused_terms = self.hinged_terms = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = fused_kl_term(*args, **kwargs)
            self.fused_terms += result is not None
            return result

        kl_term, record = model._kl_term, model._record_update_kl

        def term(*args: Any) -> tuple[th.Tensor, th.Tensor]:
            kl, penalty = kl_term(*args)
            self.hinged_terms += kl.item() > model.kl_hinge_factor * args[-1]
            return kl, penalty

        def recorded(*args: Any, **kwargs: Any) -> Any:
            stats = record(*args, **kwargs)
            self.update_kls.append(stats["mean"])
            return stats

        monkeypatch.setattr(klppo_module, "fused_kl_term", counted)
        monkeypatch.setattr(model, "_kl_term", term)
        monkeypatch.setattr(model, "_record_update_kl", recorded)
        model.learn(2 * 64 * 2)
        monkeypatch.undo()
        self.params = {key: value.detach().numpy().copy() for key, value in model.policy.state_dict().items()}


# Learning rates that move the policy by a KL within two orders of the target, as beta holds it in training: with the
# default rate these two updates end 3-4 orders below it, where the logged KL, a quadratic in the small difference of
# two parameter vectors, magnifies their rounding. Training amplifies the rounding of the two terms' different
# operations: across model seeds 0-9 these runs differed by at most 8.4e-7 in an update's KL and 4.3e-6 in a parameter.
# Not among them, since the decision's tolerances do not hold there (test_fused_term_is_more_accurate_where_autograd_
# cancels says why): the sample estimators (the autograd term's k3 gradient is 100-1000x further from float64's) and
# the hinge acting (so is the autograd term's Gaussian KL value, to which the hinge's gradient is proportional), which
# differed by up to 2.5e-6 (k3) and 3.5e-5 (hinge) in an update's KL.
RUNS = {
    "klppo_pendulum": ("KLPPO", "Pendulum-v1", dict(learning_rate=3e-3)),
    "klppo_pendulum_reverse": ("KLPPO", "Pendulum-v1", dict(kl_direction="reverse", learning_rate=3e-3)),
    "klppo_pendulum_gsde": ("KLPPO", "Pendulum-v1", dict(use_sde=True, sde_sample_freq=4, learning_rate=3e-3)),
    "clip_klppo_cartpole": ("ClipKLPPO", "CartPole-v1", dict(learning_rate=3e-3)),
    "klppo_multidiscrete_reverse": ("KLPPO", "multidiscrete", dict(kl_direction="reverse", learning_rate=3e-3)),
    "klppo_multibinary": ("KLPPO", "multibinary", dict(learning_rate=3e-3)),
    "maskable_klppo": ("MaskableKLPPO", "masked", dict(learning_rate=3e-3)),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_short_run_logs_the_update_kls_and_ends_with_the_parameters_of_the_autograd_term(name, monkeypatch):
    algo, env_id, extra = RUNS[name]
    fused = ShortRun(algo, env_id, True, monkeypatch, **extra)
    autograd = ShortRun(algo, env_id, False, monkeypatch, **extra)
    assert fused.fused_terms == 2 * 3 * 4 and autograd.fused_terms == 0
    assert fused.hinged_terms == autograd.hinged_terms == 0
    assert len(fused.update_kls) == 2 and min(fused.update_kls) > 1e-4
    np.testing.assert_allclose(fused.update_kls, autograd.update_kls, rtol=1e-6, atol=0)
    for key, value in fused.params.items():
        np.testing.assert_allclose(value, autograd.params[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_fused_term_is_more_accurate_where_autograd_cancels(direction):
    """
    In float32, on a small update (parameters 1e-3 apart), against float64 on the same float32 values: the autograd
    term's Gaussian KL subtracts nearly equal terms (``(var_old + d^2) / scale^2`` and 1), the node's takes ``expm1``
    (its value: measured 1e-6 to 3e-5 relative off, the autograd term's 2e-4 to 2e-2); autograd differentiates k3
    through ``exp`` and ``expm1`` separately, whose derivatives cancel, the node writes their sum out (its gradient:
    3e-8 against 5e-6 to 3e-5).
    """
    generator = th.Generator().manual_seed(0)
    case = Case("gaussian", batch=256)
    inputs = [x.detach().float() for x in case.inputs]
    old = case.layout.extract(case.distribution(*[x + 1e-3 * th.randn(x.shape, generator=generator) for x in inputs]))
    log_ratio = 1e-3 * th.randn(256, generator=generator)

    def term(dtype: th.dtype, fused: bool, settings: KLSettings) -> tuple[th.Tensor, th.Tensor]:
        differentiated = [x.to(dtype).requires_grad_() for x in (*inputs, log_ratio)]
        distribution = case.distribution(*differentiated[:-1])
        if fused:
            _, value = fused_kl_term(settings, case.layout, old.detach().to(dtype), distribution, differentiated[-1], 1.0)
        else:
            value = per_state_kl_to(settings, case.layout, old.detach().to(dtype), distribution, differentiated[-1]).mean()
        grads = th.autograd.grad(value, differentiated, allow_unused=True)
        return value.double(), th.cat([g.double().flatten() for g in grads if g is not None])

    def errors(settings: KLSettings, index: int) -> list[float]:
        """:return: the relative error of the node and of the autograd term (value: index 0, gradient: 1)"""
        exact = term(th.float64, False, settings)[index]
        return [
            (term(th.float32, fused, settings)[index] - exact).norm().item() / exact.norm().item() for fused in (True, False)
        ]

    fused_error, autograd_error = errors(KLSettings(direction=direction), 0)
    assert fused_error < 2e-4 and fused_error < autograd_error
    fused_error, autograd_error = errors(KLSettings(estimator="k3", direction=direction), 1)
    assert fused_error < 1e-6 and fused_error < autograd_error / 30


def test_a_subclass_overriding_the_penalty_gets_its_penalty(monkeypatch):
    seen = []

    class OwnPenalty(sb3_kl.KLPPO):
        def _kl_penalty(self, kl: th.Tensor, kl_coef: float, target_kl: float) -> th.Tensor:
            seen.append(kl.detach())
            return super()._kl_penalty(kl, kl_coef, target_kl)

    model = OwnPenalty("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, n_epochs=1, policy_kwargs=dict(net_arch=[8]))
    model.learn(64)
    assert len(seen) == 2  # two minibatches, each through the subclass's penalty
    assert not OwnPenalty._stock_kl_hooks()
    assert all(cls._stock_kl_hooks() for cls in (sb3_kl.KLPPO, sb3_kl.ClipKLPPO, sb3_kl.MaskableKLPPO))


def test_floor_study_counts_fewer_ops_for_the_fused_term(capsys):
    """``kl_term_floor.py --count-ops`` (counts only, no timing): fewer aten ops forward and backward than autograd's."""
    sys.path.insert(0, str(BENCHMARKS))
    sys.path.insert(0, str(BENCHMARKS / "studies"))
    import kl_term_floor

    kl_term_floor.main(["--count-ops", "--envs", "CartPole-v1"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    fused, autograd = ([int(n) for n in cell.split(",")] for cell in row.strip("| ").split(" | ")[1:])
    assert fused[0] < autograd[0] and fused[1] < autograd[1]
