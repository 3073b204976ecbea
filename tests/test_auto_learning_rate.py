"""
``learning_rate="auto"``: the KL of each update meets its target from a rate far too small and from one far too large
(measured by an independent probe: ``torch.distributions`` in float64 on copies of the policy before and after each
update), for KLPPO, ClipKLPPO, MaskableKLPPO and RecurrentKLPPO; the adapted rate is logged, saved and resumed; bad
values fail early; the step scale's search.
"""

import copy
import itertools
import math
import os

import numpy as np
import pytest
import torch as th
from sb3_contrib.common.envs import InvalidActionEnvDiscrete
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from test_ppo_mask import masked_torch_distributions
from test_recurrent_klppo import IndependentUpdateKL
from torch.distributions import Categorical, Normal, kl_divergence

from sb3_kl import TRPL, ClipKLPPO, KLPPO, KLTRPO, MaskableKLPPO, RecurrentKLPPO
from sb3_kl.callbacks import KLAdaptiveLRCallback
from sb3_kl.common.learning_rate import (
    GUARD_BAND,
    MAX_STEP_SCALE,
    VALUE_GROUP_KEY,
    find_step_scale,
    first_epoch_share,
    guard_aim,
    in_guard_band,
    parse_auto_learning_rate,
    rate_factor,
    rate_follows_kl,
    recent_kl,
    value_only_parameters,
)
from sb3_kl.zoo.registry import preprocess_schedules

os.environ.setdefault("SB3_LOGDIR", "/tmp/sb3logs")

FOUR = [KLPPO, ClipKLPPO, MaskableKLPPO, RecurrentKLPPO]


def _env(algo: type, n_envs: int = 2):
    if algo is MaskableKLPPO:
        return make_vec_env(lambda: InvalidActionEnvDiscrete(dim=8, n_invalid_actions=4), n_envs=n_envs, seed=0)
    return make_vec_env("CartPole-v1", n_envs=n_envs, seed=0)


def _model(algo: type, learning_rate, **kwargs):
    policy = "MlpLstmPolicy" if algo is RecurrentKLPPO else "MlpPolicy"
    policy_kwargs = dict(net_arch=[32], lstm_hidden_size=16) if algo is RecurrentKLPPO else dict(net_arch=[32])
    settings = dict(n_steps=128, batch_size=64, n_epochs=4, policy_kwargs=policy_kwargs, seed=0, device="cpu")
    return algo(policy, _env(algo), learning_rate=learning_rate, **{**settings, **kwargs})


def _torch_distribution(policy, obs: th.Tensor):
    """The policy's action distribution as a float64 ``torch.distributions`` object (eval mode)."""
    policy.set_training_mode(False)
    with th.no_grad():
        inner = policy.get_distribution(obs).distribution
    if isinstance(inner, Normal):
        return Normal(inner.loc.double(), inner.scale.double())
    return Categorical(logits=inner.logits.double())


class FeedForwardUpdateKL(BaseCallback):
    """Copies of the policy before and after each update; their exact KL(old||new) on the rollout's states, in float64."""

    def __init__(self):
        super().__init__()
        self.results: list[np.ndarray] = []
        self._pending = None

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        masks = getattr(buffer, "action_masks", None)
        obs = th.as_tensor(buffer.observations.reshape(-1, *self.model.observation_space.shape))
        self._pending = (copy.deepcopy(self.model.policy), obs, None if masks is None else masks.reshape(len(obs), -1).copy())

    def _measure(self) -> None:
        if self._pending is None:
            return
        old, obs, masks = self._pending
        self._pending = None
        if masks is not None:
            n = [int(self.model.action_space.n)]
            kl = sum(
                kl_divergence(p, q)
                for p, q in zip(
                    masked_torch_distributions(old, obs, masks, n),
                    masked_torch_distributions(self.model.policy, obs, masks, n),
                    strict=True,
                )
            )
        else:
            kl = kl_divergence(_torch_distribution(old, obs), _torch_distribution(self.model.policy, obs))
            kl = kl.sum(dim=-1) if kl.ndim == 2 else kl
        self.results.append(kl.numpy())

    def _on_rollout_start(self) -> None:
        self._measure()

    def _on_training_end(self) -> None:
        self._measure()


class Logged(BaseCallback):
    """Each update's logged values, read at the next rollout start."""

    def __init__(self):
        super().__init__()
        self.values: list[dict] = []

    def _on_step(self) -> bool:
        return True

    def _read(self) -> None:
        values = self.model.logger.name_to_value
        if "train/kl" in values and (not self.values or self.model._n_updates != self.values[-1]["n"]):
            self.values.append({**values, "n": self.model._n_updates})

    def _on_rollout_start(self) -> None:
        self._read()

    def _on_training_end(self) -> None:
        self._read()


def _independent_kls(algo: type, learning_rate, updates: int, **kwargs) -> tuple[list[float], list[dict], object]:
    model = _model(algo, learning_rate, **kwargs)
    probe = IndependentUpdateKL() if algo is RecurrentKLPPO else FeedForwardUpdateKL()
    logged = Logged()
    model.learn(updates * model.n_steps * model.n_envs, callback=[probe, logged])
    return [float(kl.mean()) for kl in probe.results], logged.values, model


@pytest.mark.parametrize("algo", FOUR)
@pytest.mark.parametrize("start, settled_from", [(1e-5, 4), (2.0, 1)])
def test_kl_meets_its_target_from_a_rate_far_too_small_or_too_large(algo, start, settled_from):
    """
    Here the rates the four settle at lie between 1e-2 and 0.15. From 1e-5, at least 100x too small (the rate grows by
    at most 16x per update, each step is extended at most 4x), and from 2, at least 10x too large (the first update's
    step is shrunk into the band), the exact KL of the later updates, as the probe measures it, tracks the target: at
    least 80 % of them in [0.5, 2] x target. The logged KL is the probe's.
    """
    kls, logged, model = _independent_kls(algo, f"auto_{start:g}", updates=12, lr_bounds=(1e-6, 10.0))
    target = float(model.target_kl(1.0))
    ratios = [kl / target for kl in kls]
    assert len(ratios) == 12
    settled = np.array(ratios[settled_from:])
    assert np.mean((settled >= 0.5) & (settled <= 2.0)) >= 0.8, [round(r, 3) for r in ratios]
    for kl, values in zip(kls, logged, strict=True):
        assert values["train/kl"] == pytest.approx(kl, rel=1e-4)
    rates = [values["train/learning_rate"] for values in logged]
    if start < 1e-3:
        assert ratios[0] < 0.5  # the starting rate really was too small
        assert logged[0]["train/step_scale"] == MAX_STEP_SCALE
        assert min(rates[settled_from:]) > 100 * start
    else:
        assert logged[0]["train/step_scale"] < 1.0
        assert max(rates[settled_from:]) < start / 4


@pytest.mark.parametrize("n_epochs", [4, 10])
def test_logged_learning_rate_is_the_rate_each_update_used_and_follows_the_first_epoch(n_epochs: int):
    """
    ``train/learning_rate`` is the optimizer's rate during that update; the next one's is it times the factor that would
    have given the first epoch its share of the target, ``1 / n_epochs``.
    """

    class OptimizerRate(BaseCallback):
        def __init__(self):
            super().__init__()
            self.rates: list[float] = []

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:  # after train(): the optimizer still holds the rate it used
            if self.model._n_updates > 0:
                self.rates.append(self.model.policy.optimizer.param_groups[0]["lr"])

    rates, logged = OptimizerRate(), Logged()
    model = _model(KLPPO, "auto_1e-4", n_epochs=n_epochs)
    model.learn(6 * 256, callback=[rates, logged])
    used = [v["train/learning_rate"] for v in logged.values]
    assert used[:5] == pytest.approx(rates.rates[:5])
    assert used[0] == pytest.approx(1e-4)
    history = []
    for this, following in itertools.pairwise(logged.values):
        rate, target = this["train/learning_rate"], this["train/target_kl"]
        history.append((rate, this["train/first_epoch_kl"], this["train/unscaled_kl"]))
        assert following["train/learning_rate"] == pytest.approx(rate * _expected_factor(history, target, n_epochs))


def _expected_factor(history: list[tuple[float, float, float]], target: float, n_epochs: int) -> float:
    """The rule of learning_rate="auto", from the logged values (``sb3_kl.common.learning_rate``)."""
    rate = history[-1][0]
    share = 1.0 / n_epochs
    factor = rate_factor(recent_kl([(r, first) for r, first, _ in history], rate), share * target)
    if history[-1][2] < GUARD_BAND[0] * target:  # the update fell below the band: the rate that meets the target
        factor = max(factor, rate_factor(recent_kl([(r, kl) for r, _, kl in history], rate), target))
    if factor > 1 and not rate_follows_kl([r for r, _, _ in history], [first for _, first, _ in history]):
        factor = 1.0
    return factor


def test_beta_and_the_rate_do_not_fight():
    """
    The rate sets the first epoch's KL, beta the rest of the update's: after the start-up the rate moves by less than 2x
    per update, and neither it nor beta swings back and forth (no run of four or more large moves alternating in sign).
    """
    kls, logged, model = _independent_kls(KLPPO, "auto", updates=16)
    rates = np.array([v["train/learning_rate"] for v in logged[4:]])
    steps = np.diff(np.log(rates))
    assert np.all(np.abs(steps) < math.log(2)), rates
    betas = np.array([v["train/kl_coef"] for v in logged[4:]])
    for values, large in ((rates, math.log(1.2)), (betas, math.log(1.4))):
        moves = np.diff(np.log(values))
        big = moves[np.abs(moves) > large]
        assert not (len(big) >= 4 and np.all(np.sign(big[1:]) != np.sign(big[:-1]))), values
    target = float(model.target_kl(1.0))
    assert np.mean([0.5 <= kl / target <= 2.0 for kl in kls[4:]]) >= 0.8


def test_adapted_rate_is_saved_and_continues_after_load(tmp_path):
    model = _model(KLPPO, "auto_1e-4")
    model.learn(3 * 256)
    adapted = model.adapted_learning_rate
    assert adapted != pytest.approx(1e-4)
    model.save(tmp_path / "model")
    loaded = KLPPO.load(tmp_path / "model", env=_env(KLPPO))
    assert loaded.learning_rate == "auto_1e-4" and loaded.lr_bounds == model.lr_bounds
    assert loaded.adapted_learning_rate == adapted
    assert loaded._rate_history == model._rate_history and len(loaded._rate_history) == 3
    logged = Logged()
    loaded.learn(256, callback=logged, reset_num_timesteps=False)
    assert logged.values[0]["train/learning_rate"] == pytest.approx(adapted)
    # a rate given to load() replaces the saved one
    assert KLPPO.load(tmp_path / "model", learning_rate="auto_5e-3").adapted_learning_rate == 5e-3
    fixed = KLPPO.load(tmp_path / "model", learning_rate=2e-4)
    assert not fixed.adapts_learning_rate and fixed.lr_schedule(1.0) == 2e-4


@pytest.mark.parametrize("algo", FOUR)
def test_value_function_trains_at_the_adapted_or_the_starting_rate_whichever_is_larger(algo):
    """
    The value-only parameters have an optimizer group of their own; during each update it holds the larger of the
    policy's adapted rate and the starting one: from a start far too small both rise, from one far too large only the
    policy's falls.
    """

    class GroupRates(BaseCallback):
        def __init__(self):
            super().__init__()
            self.rates: list[tuple[float, float]] = []

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:  # after train(): the optimizer still holds the rates it used
            if self.model._n_updates > 0:
                groups = self.model.policy.optimizer.param_groups
                self.rates.append((groups[0]["lr"], groups[1]["lr"]))

    for start, rising in ((1e-5, True), (0.5, False)):
        model = _model(algo, f"auto_{start:g}", lr_bounds=(1e-6, 1.0))
        groups = model.policy.optimizer.param_groups
        assert [bool(group.get(VALUE_GROUP_KEY)) for group in groups] == [False, True]
        assert {id(p) for p in groups[1]["params"]} == {id(p) for p in value_only_parameters(model.policy)}
        assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.policy.parameters()))
        rates = GroupRates()
        model.learn(4 * model.n_steps * model.n_envs, callback=rates)
        for policy_rate, value_rate in rates.rates:
            assert value_rate == max(policy_rate, start)
        last_policy_rate = rates.rates[-1][0]
        assert (last_policy_rate > start) if rising else (last_policy_rate < start)


@pytest.mark.parametrize("algo", [KLPPO, RecurrentKLPPO])
def test_a_clip_range_that_holds_the_update_is_warned_about_once(algo):
    """
    A clip range far tighter than the target holds the update; the adapted rate would climb instead of the KL: after 10
    such updates in a row, one warning names `clip_range` and the fix. Without the clip range, none.
    """
    import warnings

    held = _model(algo, "auto_1e-3", clip_range=0.002, n_epochs=2)
    with pytest.warns(UserWarning, match=r"clip range \(0.002\) has held .* `clip_range=None`") as caught:
        held.learn(12 * held.n_steps * held.n_envs)
    assert sum("has held most of the update" in str(w.message) for w in caught) == 1
    assert held.clip_holds_warned
    free = _model(algo, "auto_1e-3", n_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        free.learn(12 * free.n_steps * free.n_envs)
    assert not any("has held most of the update" in str(w.message) for w in caught)


def _adam_state(model) -> dict[str, th.Tensor]:
    """Adam's first moment of each parameter, by the parameter's name."""
    state = model.policy.optimizer.state
    return {name: state[param]["exp_avg"].clone() for name, param in model.policy.named_parameters() if param in state}


@pytest.mark.parametrize(
    "saved, loaded",
    [("fixed", "auto"), ("auto", 1e-4), ("auto", "auto_1e-3"), ("stock", "auto")],
)
@pytest.mark.filterwarnings("ignore:model was saved by PPO")
def test_optimizer_state_of_each_parameter_survives_load_across_rate_modes(tmp_path, saved, loaded):
    """
    A zip saved with one optimizer group (a fixed rate, a stock PPO) loads into a model with the value function's own
    group (``learning_rate="auto"``) and the other way round: every parameter keeps its Adam state.
    """
    from stable_baselines3 import PPO

    if saved == "stock":
        model = PPO("MlpPolicy", _env(KLPPO), n_steps=128, batch_size=64, n_epochs=2, policy_kwargs=dict(net_arch=[32]))
    else:
        model = _model(KLPPO, "auto_1e-3" if saved == "auto" else 1e-3)
    model.learn(256)
    before = _adam_state(model)
    model.save(tmp_path / "model")
    restored = KLPPO.load(tmp_path / "model", env=_env(KLPPO), learning_rate=loaded)
    after = _adam_state(restored)
    assert before.keys() == after.keys() and len(before) == len(list(model.policy.parameters()))
    for name in before:
        assert th.equal(before[name], after[name]), name
    split = [bool(group.get(VALUE_GROUP_KEY)) for group in restored.policy.optimizer.param_groups]
    assert split == ([False, True] if isinstance(loaded, str) else [False])
    restored.learn(256, reset_num_timesteps=False)


@pytest.mark.parametrize("algo", FOUR)
@pytest.mark.parametrize("value", ["auto_-1", "auto_0", "autox", "auto_", "auto_nan", "AUTO"])
def test_bad_auto_values_name_the_argument(algo, value):
    with pytest.raises(ValueError, match="`learning_rate`"):
        _model(algo, value)


@pytest.mark.parametrize("algo", FOUR)
def test_bad_lr_bounds_name_the_argument(algo):
    with pytest.raises(ValueError, match="`lr_bounds` is inverted"):
        _model(algo, "auto", lr_bounds=(1e-2, 1e-5))
    with pytest.raises(ValueError, match="`lr_bounds`"):
        _model(algo, "auto", lr_bounds=(0.0, 1e-2))
    with pytest.raises(ValueError, match="starts outside `lr_bounds`"):
        _model(algo, "auto_1e-3", lr_bounds=(1e-2, 1e-1))


@pytest.mark.parametrize("algo", [KLTRPO, TRPL])
def test_algorithms_whose_step_is_not_the_optimizers_refuse_auto(algo):
    with pytest.raises(ValueError, match="does not adapt its learning rate"):
        algo("MlpPolicy", "CartPole-v1", learning_rate="auto")


def test_the_callback_refuses_a_model_that_adapts_its_own_rate():
    model = _model(KLPPO, "auto")
    with pytest.raises(ValueError, match="already adapts its learning rate"):
        model.learn(256, callback=KLAdaptiveLRCallback(target_kl=0.02))


def test_auto_values_parse():
    assert parse_auto_learning_rate("auto") == 3e-4
    assert parse_auto_learning_rate("auto_1e-3") == 1e-3
    assert parse_auto_learning_rate(1e-3) is None
    assert _model(KLPPO, "auto").lr_schedule(1.0) == 3e-4


def test_zoo_configs_pass_auto_to_the_algorithm():
    hyperparams = preprocess_schedules({"learning_rate": "auto", "clip_range": "lin_0.2"})
    assert hyperparams["learning_rate"] == "auto"
    assert preprocess_schedules({"learning_rate": "auto_1e-3"})["learning_rate"] == "auto_1e-3"


@pytest.mark.parametrize("full_kl, power", [(1e-4, 2.0), (10.0, 2.0), (3.0, 1.3), (0.2, 3.5)])
def test_step_scale_lands_in_the_band(full_kl, power):
    """On a KL that grows as ``c * alpha ** p``, the search lands in the band within its evaluations."""
    calls = []

    def kl_at(alpha: float) -> float:
        calls.append(alpha)
        return full_kl * alpha**power

    scale, kl = find_step_scale(kl_at, full_kl, 1.0, (0.8, 1.25), max_scale=1e3)
    assert 0.8 <= kl <= 1.25 and kl == pytest.approx(full_kl * scale**power)
    assert len(calls) <= 6


def test_step_scale_stops_at_its_cap_and_backs_off_a_non_finite_kl():
    assert find_step_scale(lambda a: 1e-6 * a**2, 1e-6, 1.0, (0.8, 1.25)) == (MAX_STEP_SCALE, pytest.approx(1.6e-5))
    scale, kl = find_step_scale(lambda a: math.inf if a > 0.3 else a**2 * 10, math.inf, 1.0, (0.8, 1.25))
    assert math.isfinite(kl) and 0.8 <= kl <= 1.25 and scale < 0.3
    assert find_step_scale(lambda a: 1.0, 1.0, 1.0, (0.8, 1.25)) == (1.0, 1.0)  # in band: no evaluation


def test_rate_follows_kl_tells_a_clipped_update_from_a_free_one():
    rates = [1e-4 * 1.3**i for i in range(10)]
    assert rate_follows_kl(rates, [r**2 for r in rates])  # a small step: the KL is quadratic in the rate
    assert not rate_follows_kl(rates, [0.02 * r**0.2 for r in rates])  # the clip range holds it
    assert rate_follows_kl(rates[:1], [0.02])  # too few updates to tell
    assert rate_follows_kl([1e-3 * 1.01**i for i in range(10)], [0.02] * 10)  # rates too alike to tell


@pytest.mark.parametrize(
    "algo, policy_kwargs",
    [
        (KLPPO, dict(net_arch=dict(pi=[16], vf=[16]))),
        (KLPPO, dict(net_arch=[16], share_features_extractor=False)),
        (RecurrentKLPPO, dict(net_arch=[16], lstm_hidden_size=8)),
        (RecurrentKLPPO, dict(net_arch=[16], lstm_hidden_size=8, enable_critic_lstm=False)),
    ],
)
def test_value_only_parameters_are_those_the_distribution_does_not_use(algo, policy_kwargs):
    """Checked by autograd: the action distribution has no path to them, the value has a path to each."""
    model = _model(algo, 1e-3, policy_kwargs=policy_kwargs)
    policy = model.policy
    obs = th.as_tensor(model.env.observation_space.sample()[None], dtype=th.float32)
    if algo is RecurrentKLPPO:
        states = policy.initial_state(1) if hasattr(policy, "initial_state") else None
        hidden = (th.zeros(1, 1, 8), th.zeros(1, 1, 8))
        from sb3_contrib.common.recurrent.type_aliases import RNNStates

        states = RNNStates(hidden, hidden)
        starts = th.ones(1)
        distribution, _ = policy.get_distribution(obs, states.pi, starts)
        value = policy.predict_values(obs, states.vf, starts)
    else:
        distribution, value = policy.get_distribution(obs), policy.predict_values(obs)
    params = list(policy.parameters())
    used_by_actor = th.autograd.grad(distribution.distribution.logits.sum(), params, allow_unused=True)
    used_by_value = th.autograd.grad(value.sum(), params, allow_unused=True)
    value_only = {id(p) for p in value_only_parameters(policy)}
    assert value_only
    for param, actor_grad, value_grad in zip(params, used_by_actor, used_by_value, strict=True):
        assert (id(param) in value_only) == (actor_grad is None and value_grad is not None)


def test_step_scale_leaves_the_value_function_at_the_end_of_the_update():
    """Only the parameters the KL depends on are scaled: the value function keeps its whole update."""

    class AtUpdateEnd(KLPPO):
        def _measure_final_update_kl(self, target_kl, measured=None):
            self.before_scale = {id(p): p.detach().clone() for p in self.policy.parameters()}
            return super()._measure_final_update_kl(target_kl, measured)

    model = _model(AtUpdateEnd, "auto_1e-5")
    logged = Logged()
    model.learn(256, callback=logged)
    assert logged.values[0]["train/step_scale"] == MAX_STEP_SCALE
    value_only = {id(p) for p in value_only_parameters(model.policy)}
    for param in model.policy.parameters():
        unchanged = th.equal(param, model.before_scale[id(param)])
        assert unchanged == (id(param) in value_only)


def test_rate_stops_rising_where_a_higher_rate_bought_no_kl():
    """
    Where the clip range holds the update, a higher rate buys little KL: the rate holds instead of climbing to
    ``lr_bounds``. Here recent updates at rates up to 8x lower had the same first-epoch KL as this one, far under its
    goal: without that history the rate would rise 16x.
    """
    rising, held = _model(KLPPO, "auto_1e-5"), _model(KLPPO, "auto_1e-5")
    for model in (rising, held):
        model.learn(256)
    first_epoch_kl = rising._rate_history[-1][1]
    held = _model(KLPPO, "auto_1e-5")
    held._rate_history = [(1e-5 / 8, first_epoch_kl), (1e-5 / 4, first_epoch_kl), (1e-5 / 2, first_epoch_kl)]
    held.learn(256)
    assert rising.adapted_learning_rate == pytest.approx(16e-5)
    assert held._rate_history[-1][:2] == (1e-5, pytest.approx(first_epoch_kl))
    assert held.adapted_learning_rate == pytest.approx(1e-5)
    assert len(held._rate_history) == 4


def test_the_guard_aims_just_inside_the_band_on_the_side_the_update_left_it():
    assert guard_aim(0.1, 1.0) == (0.6, (0.5 / 0.6, 2.0 / 0.6))
    assert guard_aim(5.0, 2.0) == (3.2, (1.0 / 3.2, 4.0 / 3.2))
    assert guard_aim(math.inf, 1.0)[0] == 1.6
    scale, kl = find_step_scale(lambda a: 0.04 * a**2, 0.04, *guard_aim(0.04, 1.0))  # 0.04 x target: extended
    assert 0.5 <= kl <= 0.7 and scale == pytest.approx(math.sqrt(0.6 / 0.04))
    assert in_guard_band(0.5, 1.0) and in_guard_band(2.0, 1.0) and not in_guard_band(math.nan, 1.0)


def test_rate_factor_follows_the_first_epoch_damped_near_its_goal():
    assert rate_factor(1e-6, 1.0) == 16.0 and rate_factor(1e6, 1.0) == 1 / 16  # at most 16x either way
    assert rate_factor(1 / 64, 1.0) == pytest.approx(8.0)  # far below: in full
    assert rate_factor(1 / 4, 1.0) == pytest.approx(math.sqrt(2.0))  # within 16x: the square root
    assert rate_factor(4.0, 1.0) == pytest.approx(1 / math.sqrt(2.0))
    assert rate_factor(math.inf, 1.0) == 1 / 16 and rate_factor(0.0, 1.0) == 16.0


def test_first_epoch_share_spreads_the_target_evenly_over_the_epochs():
    assert first_epoch_share(1) == 1.0 and first_epoch_share(20) == pytest.approx(0.05)
    # at four epochs the share is exactly the quarter of the earlier rule (benchmarks/grid.py counts those runs as today's)
    assert first_epoch_share(4) == 0.25 and 0.25 * 0.03 == first_epoch_share(4) * 0.03


def test_recent_kl_is_a_median_rescaled_to_the_rate():
    # quadratic in the rate: every update says the same, rescaled to the current rate
    history = [(rate, 0.01 * rate**2) for rate in (1.0, 2.0, 4.0)]
    assert recent_kl(history, 4.0) == pytest.approx(0.16)
    # one rollout whose first epoch barely moved the policy does not move the median
    history = [(1.0, 0.01), (1.0, 0.012), (1.0, 1e-6), (1.0, 0.011), (1.0, 0.009)]
    assert recent_kl(history, 1.0) == pytest.approx(0.01)
    assert recent_kl([*history, (1.0, 0.5)], 1.0, window=2) == pytest.approx((0.009 + 0.5) / 2)
    assert math.isnan(recent_kl([], 1.0))


def test_beta_adapts_from_the_kl_the_epochs_left_not_from_the_guards_correction():
    """
    From a rate far too large the update overshoots; the guard scales the step back into the band, and beta still
    rises: it reacts to the KL the epochs left, so the penalty, not the guard, keeps shaping the later updates.
    """
    kls, logged, model = _independent_kls(KLPPO, "auto_2", updates=1, lr_bounds=(1e-6, 10.0))
    target = float(model.target_kl(1.0))
    assert logged[0]["train/step_scale"] < 1.0 and 0.5 <= kls[0] / target <= 2.0
    assert logged[0]["train/kl_coef"] > 1.0  # KLPPO's starting beta


def test_a_one_epoch_update_sets_the_rate_from_its_own_kl():
    """With one epoch there is no first epoch to measure apart: the rate follows the update's KL to the whole target."""
    _, logged, model = _independent_kls(KLPPO, "auto_1e-3", updates=6, n_epochs=1)
    assert not any("train/first_epoch_kl" in values for values in logged)
    history = [(v["train/learning_rate"], v["train/unscaled_kl"], v["train/unscaled_kl"]) for v in logged]
    assert len(model._rate_history) == len(history)
    for saved, logged_entry in zip(model._rate_history, history, strict=True):
        assert saved == pytest.approx(logged_entry)
    assert model.adapted_learning_rate == pytest.approx(
        history[-1][0] * _expected_factor(history, logged[-1]["train/target_kl"], 1)
    )


def test_the_epoch_end_stop_reuses_the_first_epochs_measurement():
    """With ``_kl_stop_judge="epoch_end"`` the first epoch's end is measured once, for the rate and the stop alike."""
    model = _model(KLPPO, "auto_1e-4", n_epochs=3, kl_stop_factor=100.0)
    model._kl_stop_judge = "epoch_end"
    measured_policies = []
    measure = model._measure_update_kl

    def counted(*args, **kwargs):
        measured_policies.append(th.cat([p.detach().flatten() for p in model.policy.parameters()]).clone())
        return measure(*args, **kwargs)

    model._measure_update_kl = counted
    model.learn(2 * 256)
    assert len(measured_policies) >= 2 * 3  # every epoch's end, in each update
    # no policy is measured twice
    for a, b in itertools.combinations(measured_policies, 2):
        assert not th.equal(a, b)
