import math
import pickle
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sb3_kl.common.controllers import (
    AdaptiveKLController,
    FixedKLController,
    ProportionalKLController,
    make_kl_controller,
)


def test_adaptive_band_rule():
    controller = AdaptiveKLController(kl_coef=1.0, kl_adapt_factor=1.5, kl_band=(0.5, 1.5), kl_coef_bounds=(1e-4, 10.0))
    target = 0.02
    assert controller.update(0.031, target) == pytest.approx(1.5)  # above 1.5 x target: grow
    assert controller.update(0.02, target) == pytest.approx(1.5)  # in band: unchanged
    assert controller.update(0.0099, target) == pytest.approx(1.0)  # below 0.5 x target: shrink
    assert controller.kl_history == [0.031, 0.02, 0.0099]
    assert controller.kl_coef_history == pytest.approx([1.5, 1.5, 1.0])
    assert controller.n_updates == 3


def test_adaptive_bounds_are_respected():
    controller = AdaptiveKLController(kl_coef=1.0, kl_adapt_factor=2.0, kl_coef_bounds=(0.25, 4.0))
    for _ in range(10):
        controller.update(1.0, 0.01)
    assert controller.kl_coef == 4.0
    assert controller.at_upper_bound
    for _ in range(10):
        controller.update(0.0, 0.01)
    assert controller.kl_coef == 0.25


def test_near_upper_bound_is_one_step_below_it():
    """The stop at beta's bound stays armed one adaptation step below it (KLPPO's kl_saturation_stop_factor)."""
    adaptive = AdaptiveKLController(kl_coef=4.0, kl_adapt_factor=2.0, kl_coef_bounds=(0.25, 4.0))
    assert adaptive.at_upper_bound and adaptive.near_upper_bound
    adaptive.update(0.0, 0.01)  # one low-KL update: 2.0, one step below the bound
    assert not adaptive.at_upper_bound and adaptive.near_upper_bound
    adaptive.update(0.0, 0.01)  # 1.0: two steps below
    assert not adaptive.near_upper_bound
    # 10 / 1.5 * 1.5 is not exactly 10 in floating point
    assert AdaptiveKLController(kl_coef=10 / 1.5, kl_adapt_factor=1.5).near_upper_bound
    # the proportional controller's largest step is a factor 1 + kl_error_clip (1.2)
    assert ProportionalKLController(kl_coef=3.9, kl_coef_bounds=(0.25, 4.0)).near_upper_bound
    assert ProportionalKLController(kl_coef=4.0 / 1.2, kl_coef_bounds=(0.25, 4.0)).near_upper_bound
    assert not ProportionalKLController(kl_coef=3.0, kl_coef_bounds=(0.25, 4.0)).near_upper_bound
    assert ProportionalKLController(kl_coef=4.0, kl_coef_bounds=(0.25, 4.0)).near_upper_bound
    assert not FixedKLController(kl_coef=4.0, kl_coef_bounds=(0.25, 4.0)).near_upper_bound


def test_ppo_paper_rule():
    """PPO paper: factor 2 and band (1/1.5, 1.5)."""
    controller = AdaptiveKLController(kl_coef=1.0, kl_adapt_factor=2.0, kl_band=(1 / 1.5, 1.5))
    assert controller.update(0.016, 0.01) == 2.0
    assert controller.update(0.0066, 0.01) == 1.0


def test_window_averages_recent_kls():
    controller = AdaptiveKLController(kl_coef=1.0, kl_window=3, kl_band=(0.5, 1.5))
    controller.update(0.0, 0.01)  # mean 0 -> shrink
    assert controller.kl_coef == pytest.approx(1 / 1.5)
    controller.update(0.03, 0.01)  # mean 0.015: in band
    assert controller.kl_coef == pytest.approx(1 / 1.5)
    controller.update(0.03, 0.01)  # mean 0.02 > 0.015: grow
    assert controller.kl_coef == pytest.approx(1.0)


def test_fixed_and_proportional():
    fixed = FixedKLController(kl_coef=0.3)
    assert fixed.update(10.0, 0.01) == 0.3
    proportional = ProportionalKLController(kl_coef=1.0, kl_horizon=1000, kl_error_clip=0.2)
    # error clipped to +0.2, 100 steps over a horizon of 1000: x1.02
    assert proportional.update(1.0, 0.01, n_steps=100) == pytest.approx(1.02)
    assert proportional.update(0.0, 0.01, n_steps=100) == pytest.approx(1.02 * 0.98)


def test_proportional_rate_limit_holds_for_batches_beyond_the_horizon():
    # 2048 steps x 32 envs against the default horizon of 10,000: the paper's rule, 1 - 0.2 x 6.55, would pass zero
    for kl, factor in ((0.5e-2, 0.8), (2e-2, 1.2)):  # a full error either way, target 1e-2
        controller = ProportionalKLController(kl_coef=1.0, kl_coef_bounds=(1e-4, 10.0))
        assert controller.update(kl, 1e-2, n_steps=2048 * 32) == pytest.approx(factor)


def test_a_controller_object_says_which_arguments_it_ignores():
    with pytest.warns(UserWarning, match=r"`kl_coef`=0.5, `kl_window`=5 is ignored"):
        controller = make_kl_controller(AdaptiveKLController(1.0), kl_coef=0.5, kl_window=5)
    assert controller.kl_coef == 1.0 and controller.kl_window == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_kl_controller(AdaptiveKLController(1.0))  # nothing else given: nothing to say
    # the same for the reference's controller, and the warning names the user's line
    from sb3_kl import KLPPO

    with pytest.warns(UserWarning, match=r"`ref_kl_coef`=0.3 is ignored") as caught:
        KLPPO("MlpPolicy", "CartPole-v1", ref_kl_controller=AdaptiveKLController(1.0), ref_kl_coef=0.3, ref_target_kl=0.1)
    assert caught[0].filename == __file__


@pytest.mark.parametrize(
    "kl_controller,kwargs,match",
    [
        ("fixed", {"kl_adapt_factor": 2.0}, r"'fixed' does not use `kl_adapt_factor`=2.0 \(used by 'adaptive'\)"),
        (
            "fixed",
            {"kl_band": (0.5, 2.0), "kl_horizon": 500},
            r"`kl_band`=\(0.5, 2.0\).*`kl_horizon`=500 \(used by 'proportional'\)",
        ),
        ("proportional", {"kl_window": 4}, r"'proportional' does not use `kl_window`=4"),
        ("adaptive", {"kl_horizon": 500}, r"'adaptive' does not use `kl_horizon`=500"),
    ],
)
def test_a_named_controller_says_which_arguments_it_does_not_use(kl_controller, kwargs, match):
    with pytest.warns(UserWarning, match=match):
        make_kl_controller(kl_controller, **kwargs)


def test_a_named_controller_is_silent_about_the_arguments_it_uses():
    from sb3_kl import KLPPO

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_kl_controller("adaptive", kl_adapt_factor=2.0, kl_band=(0.5, 2.0), kl_window=3)
        make_kl_controller("proportional", kl_horizon=500)
        make_kl_controller("fixed", kl_coef=0.3, kl_coef_bounds=(0.1, 1.0))
        KLPPO("MlpPolicy", "CartPole-v1", kl_controller="fixed", kl_band=[0.8, 1.25])  # a list of the defaults is no choice
    # from the algorithm, the warning names the user's line
    with pytest.warns(UserWarning, match="does not use `kl_adapt_factor`") as caught:
        KLPPO("MlpPolicy", "CartPole-v1", kl_controller="fixed", kl_adapt_factor=3.0)
    assert caught[0].filename == __file__


def test_state_survives_pickle():
    controller = AdaptiveKLController(kl_coef=1.0, kl_window=4)
    for kl in (0.1, 0.001, 0.02):
        controller.update(kl, 0.02)
    restored = pickle.loads(pickle.dumps(controller))
    assert restored.kl_coef == controller.kl_coef
    assert list(restored.recent_kls) == list(controller.recent_kls)
    assert restored.kl_history == controller.kl_history
    assert restored.update(0.5, 0.02) == controller.update(0.5, 0.02)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kl_adapt_factor": 1.0}, "kl_adapt_factor"),
        ({"kl_adapt_factor": 0.5}, "kl_adapt_factor"),
        ({"kl_band": (1.5, 0.5)}, "kl_band"),
        ({"kl_band": (0.0, 1.5)}, "kl_band"),
        ({"kl_coef_bounds": (10.0, 1e-4)}, "kl_coef_bounds"),
        ({"kl_coef_bounds": (-1.0, 1.0)}, "kl_coef_bounds"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_coef": 100.0}, "kl_coef"),
        ({"kl_window": 0}, "kl_window"),
    ],
)
def test_adaptive_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(**kwargs)


def test_unknown_controller_name():
    with pytest.raises(ValueError, match="kl_controller"):
        make_kl_controller("pid")


def test_nonfinite_kl_is_rejected():
    with pytest.raises(ValueError, match="non-finite"):
        AdaptiveKLController().update(float("nan"), 0.01)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(1e-4, 1.0),
    st.sampled_from(["adaptive", "proportional", "fixed"]),
)
def test_coefficient_stays_in_bounds_and_finite(kls, target, kind):
    controller = make_kl_controller(kind, kl_coef=1.0, kl_coef_bounds=(1e-3, 5.0))
    for kl in kls:
        coef = controller.update(kl, target, n_steps=2048)
        assert math.isfinite(coef)
        assert 1e-3 <= coef <= 5.0


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-6, 10.0), st.floats(1e-6, 10.0), st.floats(1e-3, 1.0))
def test_response_is_monotone_in_kl(kl_a, kl_b, target):
    """A larger KL never yields a smaller coefficient from the same state."""
    low, high = sorted((kl_a, kl_b))
    for kind in ("adaptive", "proportional"):
        a, b = make_kl_controller(kind), make_kl_controller(kind)
        assert a.update(low, target, n_steps=1000) <= b.update(high, target, n_steps=1000)
