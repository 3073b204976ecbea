"""
Bad inputs: one table of every public argument of KLPPO, ClipKLPPO, KLTRPO and the KL callbacks, with bad values
and what each gets at construction. The contract is a ValueError or TypeError whose message names the argument.

Rows say how far the code meets it:

- ``OK``: ValueError/TypeError naming the argument;
- ``COMPAT``: AssertionError naming the argument, exactly as SB3's PPO / sb3-contrib's TRPO raise for the same value
  (kept so that the algorithms stay drop-ins for them);
- ``DELEGATED``: SB3, torch or numpy reject the value with their own error (the type given), which does not name
  the argument: arguments SB3's own algorithms do not validate either;
- ``GAP``: the contract is not met (value accepted, or an error not naming the argument); these tests are
  ``xfail(strict=True)``, so they fail as soon as the owner fixes the check, and the row must then become ``OK``.

The table in docs/misc/bad_inputs.md is generated from :data:`ROWS` (``python tests/test_bad_inputs.py`` rewrites it)
and :func:`test_docs_table_is_current` fails when they differ; :func:`test_every_public_argument_has_a_row` fails
when an argument is added without a row.
"""

import inspect
import math
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch as th
from hypothesis import given, settings
from hypothesis import strategies as st
from stable_baselines3.common.env_util import make_vec_env

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.callbacks import KLAdaptiveLRCallback, KLAlarmCallback, KLMonitorCallback, VarianceFloorCallback
from sb3_kl.common.controllers import make_kl_controller
from sb3_kl.common.kl import BernoulliParams, CategoricalParams, GaussianParams, KLSettings, kl_quantiles, per_state_kl

ALGOS = (KLPPO, ClipKLPPO, KLTRPO)
PPOS = (KLPPO, ClipKLPPO)
CALLBACKS = (KLMonitorCallback, KLAdaptiveLRCallback, VarianceFloorCallback, KLAlarmCallback)
NOT_ARGUMENTS = {"self", "policy", "env", "_init_setup_model"}  # policy/env: SB3 checks them; private flag
NAN, INF = math.nan, math.inf

DOCS = Path(__file__).resolve().parent.parent / "docs" / "misc" / "bad_inputs.md"
TABLE_START, TABLE_END = "<!-- bad-inputs-table:start -->", "<!-- bad-inputs-table:end -->"


@dataclass(frozen=True)
class Row:
    classes: tuple[type, ...]
    arg: str
    value: Any
    outcome: str = "OK"  # OK, COMPAT, DELEGATED, GAP
    error: type[BaseException] | None = None  # DELEGATED: the error raised
    now: str = ""  # GAP: what happens today
    env: str = "discrete"  # "discrete" (CartPole) or "box" (Pendulum)

    @property
    def id(self) -> str:
        return f"{'+'.join(c.__name__ for c in self.classes)}-{self.arg}={self.value!r}"


def ok(classes: tuple[type, ...], arg: str, *values: Any, env: str = "discrete") -> list[Row]:
    return [Row(classes, arg, value, env=env) for value in values]


def gap(classes: tuple[type, ...], arg: str, value: Any, now: str, env: str = "discrete") -> Row:
    return Row(classes, arg, value, "GAP", now=now, env=env)


class Linear:
    """A linear schedule from ``start`` (progress 1) to ``end`` (progress 0), with a stable repr for the table."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end

    def __call__(self, progress_remaining: float) -> float:
        return self.end + progress_remaining * (self.start - self.end)

    def __repr__(self) -> str:
        return f"Linear({self.start}, {self.end})"


ROWS: list[Row] = [
    # --- SB3 on-policy arguments
    *ok(ALGOS, "learning_rate", -1e-3, 0.0, NAN, "0.001"),
    *ok(ALGOS, "learning_rate", Linear(1e-3, -1e-3)),  # a schedule that turns negative
    *ok(PPOS, "learning_rate", "auto_-1", "auto_0", "autox"),  # learning_rate="auto" takes "auto" or "auto_<start>"
    *ok((KLTRPO,), "learning_rate", "auto"),  # its step is not the optimizer's
    *ok(PPOS, "lr_bounds", (1e-2, 1e-5), (0.0, 1e-2), "x"),
    Row(ALGOS, "n_steps", 0, "COMPAT"),
    *ok(ALGOS, "n_steps", 2.5),
    Row(PPOS, "batch_size", 1, "COMPAT"),
    *ok(PPOS, "batch_size", 0),
    *ok((KLTRPO,), "batch_size", 0, 3.5),
    *ok(PPOS, "batch_size", 3.5),
    *ok(PPOS, "n_epochs", 0, 2.5),
    *ok(ALGOS, "gamma", 1.5, -0.1, NAN),
    *ok(ALGOS, "gae_lambda", -0.1, 1.5, NAN),
    *ok(PPOS, "clip_range", 0.0, -0.2),
    *ok(PPOS, "clip_range", NAN),
    Row(PPOS, "clip_range_vf", -0.1, "COMPAT"),
    *ok(PPOS, "clip_range_vf", "0.2", Linear(0.2, -0.2)),
    *ok(PPOS, "normalize_advantage", "yes"),
    *ok((KLTRPO,), "normalize_advantage", "yes"),
    *ok(PPOS, "ent_coef", NAN, "0.01"),
    *ok(PPOS, "vf_coef", -1.0),
    *ok(PPOS, "max_grad_norm", -1.0, 0.0, NAN),
    *ok(ALGOS, "use_sde", "yes", env="box"),
    *ok(ALGOS, "sde_sample_freq", 1.5),
    *ok(ALGOS, "rollout_buffer_class", dict, 5, "KLRolloutBuffer"),
    *ok(ALGOS, "rollout_buffer_kwargs", 5),
    *ok(ALGOS, "stats_window_size", 0, 1.5),
    *ok(ALGOS, "tensorboard_log", 5),
    *ok(ALGOS, "policy_kwargs", "x"),
    *ok(ALGOS, "verbose", "loud", -1),
    *ok(ALGOS, "seed", "abc", -1, 1.5),
    Row(ALGOS, "device", "tpu9", "DELEGATED", RuntimeError),
    # --- KL options shared by the three algorithms
    *ok(ALGOS, "target_kl", 0.0, -0.01, INF, "0.01"),
    *ok(PPOS, "kl_coef", 0.0, NAN, 100.0),
    *ok(PPOS, "kl_controller", "pid"),
    *ok(PPOS, "kl_adapt_factor", 1.0, NAN),
    *ok(PPOS, "kl_band", (1.5, 0.5), (0.5,), 0.8),
    *ok(PPOS, "kl_coef_bounds", (10.0, 1e-4), (0.0, 1.0), 0.5),
    *ok(PPOS, "kl_window", 0, 1.5),
    *ok(PPOS, "kl_horizon", 0),
    *ok(ALGOS, "kl_estimator", "k2"),
    *ok(ALGOS, "kl_direction", "backward"),
    *ok(ALGOS, "kl_reduction", "max"),
    *ok(PPOS, "log_ratio_clip", 0.0, INF),
    *ok(PPOS, "kl_stop_factor", 0.0, NAN),
    *ok(PPOS, "kl_saturation_stop_factor", 0.0, -1.0, NAN),
    *ok(PPOS, "kl_hinge_coef", -1.0, NAN),
    *ok(PPOS, "kl_hinge_factor", 0.0),
    *ok(ALGOS, "min_std", 0.0, NAN, env="box"),
    *ok(ALGOS, "min_std", 0.1),  # no variance floor for a categorical policy
    *ok(ALGOS, "kl_quantiles", (0.5, 1.0), (0.0,)),
    # --- KLTRPO only
    *ok((KLTRPO,), "cg_max_steps", 0),
    *ok((KLTRPO,), "cg_damping", -0.1, NAN),
    *ok((KLTRPO,), "line_search_shrinking_factor", 0.0, 1.0),
    *ok((KLTRPO,), "line_search_max_iter", 0),
    *ok((KLTRPO,), "n_critic_updates", -1),
    *ok((KLTRPO,), "sub_sampling_factor", 0),
    *ok((KLTRPO,), "tail_kl", 0.0),
    *ok((KLTRPO,), "tail_quantile", 1.0),
    *ok((KLTRPO,), "line_search_grow_iter", -1, 1.5),
    # --- reference-policy KL
    *ok(ALGOS, "ref_policy", 5),
    *ok(ALGOS, "ref_policy", "/nonexistent/model.zip"),
    *ok(ALGOS, "ref_kl_coef", -1.0, NAN),
    *ok(ALGOS, "ref_target_kl", 0.0, "0.01"),
    *ok(ALGOS, "ref_kl_controller", "pid"),
    *ok(ALGOS, "ref_kl_coef_bounds", (10.0, 1e-4), 0.5),
    *ok(ALGOS, "ref_kl_direction", "sideways"),
    *ok(ALGOS, "ref_kl_estimator", "k2"),
    # --- callbacks
    *ok((KLMonitorCallback,), "direction", "back"),
    *ok((KLMonitorCallback,), "estimator", "k2"),
    *ok((KLMonitorCallback,), "reduction", "max"),
    *ok((KLMonitorCallback,), "quantiles", (0.5, 1.0)),
    *ok((KLMonitorCallback,), "every", 0, 1.5),
    *ok((KLMonitorCallback,), "per_env", "yes"),
    *ok((KLMonitorCallback,), "normalization_shift", "yes", 1),
    *ok((KLMonitorCallback,), "drift_lag", 0, 2.5, True),
    *ok((KLMonitorCallback,), "top_k", -1, 2.5),
    *ok((KLMonitorCallback,), "top_k_path", "states.npz"),  # a path while top_k=0 keeps nothing
    *ok((KLMonitorCallback,), "top_k_path", 5),
    *ok((KLMonitorCallback,), "background_size", -1),
    *ok((KLMonitorCallback,), "chunk_size", 0),
    *ok((KLMonitorCallback,), "seed", -1),
    *ok((KLMonitorCallback, KLAdaptiveLRCallback, VarianceFloorCallback, KLAlarmCallback), "verbose", "loud"),
    *ok((KLAdaptiveLRCallback, KLAlarmCallback), "target_kl", 0.0, NAN, "0.01", Linear(-0.01, -0.01), Linear(0.02, NAN)),
    *ok((KLAdaptiveLRCallback,), "target_kl", None),
    *ok((KLAdaptiveLRCallback,), "factor", 1.0, NAN),
    *ok((KLAdaptiveLRCallback,), "band", (2.0, 0.5), (0.5,)),
    *ok((KLAdaptiveLRCallback,), "lr_bounds", (0.1, 1e-6), (0.0, 1.0)),
    *ok((KLAdaptiveLRCallback, KLAlarmCallback), "monitor", 5),
    *ok((VarianceFloorCallback,), "min_std", 0.0, -1.0, NAN, None, "0.1"),
    *ok((KLAlarmCallback,), "spike_factor", NAN, -1.0),
    *ok((KLAlarmCallback,), "max_kl_factor", NAN, -1.0, "75"),
    *ok((KLAlarmCallback,), "patience", 0, 1.5),
    *ok((KLAlarmCallback,), "tail_ratio", -1.0),
    *ok((KLAlarmCallback,), "grad_ratio_band", (10.0, 0.01)),
    *ok((KLAlarmCallback,), "negative_tol", -1.0, NAN),
    *ok((KLAlarmCallback,), "min_kl", -1.0),
    *ok((KLAlarmCallback,), "stop_training", "yes"),
]

# Required arguments of the callbacks, filled with good values when another argument is tested
CALLBACK_REQUIRED = {KLAdaptiveLRCallback: {"target_kl": 0.01}, VarianceFloorCallback: {"min_std": 0.1}}

_ENVS: dict[str, Any] = {}


def env_for(kind: str) -> Any:
    if kind not in _ENVS:
        _ENVS[kind] = make_vec_env("Pendulum-v1" if kind == "box" else "CartPole-v1", n_envs=1)
    return _ENVS[kind]


def construct(cls: type, arg: str, value: Any, env: str) -> None:
    if cls in CALLBACKS:
        cls(**{**CALLBACK_REQUIRED.get(cls, {}), arg: value})
        return
    kwargs = dict(n_steps=64, batch_size=64, policy_kwargs=dict(net_arch=[8]), device="cpu")
    kwargs[arg] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. SB3's truncated-minibatch warning
        cls("MlpPolicy", env_for(env), **kwargs)


def names_argument(message: str, arg: str) -> bool:
    """Whether the message names ``arg`` as a whole word (``kl_direction`` does not name ``direction``)."""
    return re.search(rf"(?<![\w]){re.escape(arg)}(?![\w])", message) is not None


def cases() -> list[Any]:
    params = []
    for row in ROWS:
        for cls in row.classes:
            reason = f"{cls.__name__}({row.arg}={row.value!r}): {row.now}"
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if row.outcome == "GAP" else []
            params.append(pytest.param(cls, row, marks=marks, id=f"{cls.__name__}-{row.arg}={row.value!r}"))
    return params


@pytest.mark.parametrize("cls, row", cases())
def test_bad_value_rejected_at_construction(cls: type, row: Row) -> None:
    if row.arg not in inspect.signature(cls.__init__).parameters:
        pytest.skip(f"{cls.__name__} has no argument {row.arg!r} in this version")
    with pytest.raises(Exception) as info:
        construct(cls, row.arg, row.value, row.env)
    error, message = info.value, str(info.value)
    if row.outcome == "DELEGATED":
        assert isinstance(error, row.error), f"expected {row.error.__name__}, got {type(error).__name__}: {message}"
        return
    if row.outcome == "COMPAT":
        assert isinstance(error, AssertionError), f"{type(error).__name__}: {message}"
    else:
        assert isinstance(error, (ValueError, TypeError)), f"{type(error).__name__}: {message}"
    assert names_argument(message, row.arg), f"the message does not name `{row.arg}`: {message}"


@pytest.mark.parametrize("cls", ALGOS + CALLBACKS, ids=lambda c: c.__name__)
def test_every_public_argument_has_a_row(cls: type) -> None:
    arguments = set(inspect.signature(cls.__init__).parameters) - NOT_ARGUMENTS
    covered = {row.arg for row in ROWS if cls in row.classes}
    missing = sorted(arguments - covered)
    assert not missing, f"{cls.__name__}: arguments without a bad-input row in tests/test_bad_inputs.py: {missing}"


def test_schedules_and_edge_values_accepted() -> None:
    """
    The new checks keep what SB3 accepts: linear schedules ending at 0 (rl-zoo's ``lin_``), gamma and gae_lambda
    at 0 and 1, numpy scalars, an infinite max_grad_norm (no clipping) and a path-like tensorboard_log.
    """
    small = dict(batch_size=64, policy_kwargs=dict(net_arch=[8]), device="cpu")
    for cls in ALGOS:
        model = cls(
            "MlpPolicy",
            env_for("discrete"),
            learning_rate=Linear(3e-4, 0.0),
            n_steps=np.int64(64),
            gamma=1.0,
            gae_lambda=0.0,
            tensorboard_log=Path("/tmp/sb3logs"),
            **small,
        )
        assert model.gamma == 1.0 and model.lr_schedule(0.0) == 0.0
    for cls in PPOS:
        model = cls("MlpPolicy", env_for("discrete"), n_steps=64, clip_range=Linear(0.2, 0.0), max_grad_norm=INF, **small)
        assert model.clip_range(0.0) == 0.0
    assert KLMonitorCallback(seed=None, per_env=np.bool_(True)).per_env


def test_good_defaults_construct() -> None:
    """The rows' baseline (the kwargs ``construct`` fills in) is valid, so each row tests only its own argument."""
    for cls in ALGOS:
        construct(cls, "seed", 0, "discrete")
    for cls in CALLBACKS:
        construct(cls, "verbose", 0, "discrete")


# ---------------------------------------------------------------------------------------------------------------
# Random inputs to the controllers and the KL core (what tests/test_controllers.py and test_kl_core.py do not cover:
# random controller settings, targets that follow a schedule, whole trajectories, near-deterministic distributions)


def _adaptive(factor: float, low: float, width: float, window: int) -> tuple[str, dict[str, Any]]:
    return "adaptive", dict(kl_adapt_factor=factor, kl_band=(low, low + width), kl_window=window)


controller_configs = st.one_of(
    st.builds(
        _adaptive,
        st.floats(1.01, 10.0),
        st.floats(0.01, 1.0),
        st.floats(0.01, 5.0),
        st.integers(1, 8),
    ),
    st.builds(lambda horizon: ("proportional", dict(kl_horizon=horizon)), st.integers(1, 100_000)),
    st.just(("fixed", {})),
)
kl_values = st.floats(0.0, 1e30, allow_nan=False, allow_subnormal=True)
bounds = st.tuples(st.floats(1e-8, 1.0), st.floats(1.01, 1e4)).map(lambda b: (b[0], b[0] * b[1]))


@settings(max_examples=150, deadline=None)
@given(
    controller_configs,
    bounds,
    st.floats(0.0, 1.0),
    st.lists(st.tuples(kl_values, st.floats(1e-6, 10.0)), min_size=1, max_size=60),
    st.integers(1, 100_000),
)
def test_controller_never_nan_or_out_of_bounds_with_target_schedule(config, coef_bounds, start, kls_and_targets, n_steps):
    """Any controller setting, any KL (0 to 1e30, subnormals), a different target at every update (a schedule)."""
    kind, kwargs = config
    low, high = coef_bounds
    controller = make_kl_controller(kind, kl_coef=low + start * (high - low), kl_coef_bounds=coef_bounds, **kwargs)
    for kl, target in kls_and_targets:
        beta = controller.update(kl, target, n_steps)
        assert math.isfinite(beta) and low <= beta <= high
    assert len(controller.kl_coef_history) == len(kls_and_targets)
    assert all(math.isfinite(b) and low <= b <= high for b in controller.kl_coef_history)


@settings(max_examples=150, deadline=None)
@given(
    controller_configs,
    st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(1e-4, 1.0)), min_size=1, max_size=40),
)
def test_controller_trajectories_are_monotone_in_kl(config, steps):
    """If one run's KL is never below another's (same targets), its beta is never below the other's, at every update."""
    kind, kwargs = config
    low_run = make_kl_controller(kind, **kwargs)
    high_run = make_kl_controller(kind, **kwargs)
    for kl_a, kl_b, target in steps:
        beta_low = low_run.update(min(kl_a, kl_b), target, 2048)
        beta_high = high_run.update(max(kl_a, kl_b), target, 2048)
        assert beta_low <= beta_high


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["gaussian", "categorical", "bernoulli"]),
    st.sampled_from(["forward", "reverse"]),
    st.floats(-30.0, 30.0),
    st.floats(-30.0, 30.0),
    st.floats(-20.0, 2.0),
    st.floats(-20.0, 2.0),
)
def test_analytic_kl_finite_and_nonnegative_for_near_deterministic_policies(kind, direction, a, b, log_std_a, log_std_b):
    """float32, as in training: logits up to +-30, std down to e^-20 (the edges a collapsing policy reaches)."""
    if kind == "gaussian":
        layout = GaussianParams(2)
        old = th.tensor([[a, -a, log_std_a, log_std_b]], dtype=th.float32)
        new = th.tensor([[b, -b, log_std_b, log_std_a]], dtype=th.float32)
    elif kind == "categorical":
        layout = CategoricalParams(3)
        old = th.log_softmax(th.tensor([[a, 0.0, -a]], dtype=th.float32), dim=-1)
        new = th.log_softmax(th.tensor([[b, 0.0, -b]], dtype=th.float32), dim=-1)
    else:
        layout = BernoulliParams(2)
        old = th.tensor([[a, -a]], dtype=th.float32)
        new = th.tensor([[b, -b]], dtype=th.float32)
    kl = per_state_kl(KLSettings("analytic", direction, "sum", 20.0), layout, old, new)
    assert kl.shape == (1,)
    value = kl.item()
    # +inf is the exact KL only for a zero-probability mismatch, which finite parameters cannot express
    assert math.isfinite(value), (kind, a, b, log_std_a, log_std_b, value)
    assert value >= -1e-4 * max(1.0, abs(value))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_kl_quantiles_ordered(values):
    stats = kl_quantiles(np.array(values), (0.5, 0.9, 0.99))
    assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"] + 1e-9 * stats["max"]
    assert 0.0 <= stats["mean"] <= stats["max"] * (1 + 1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The documentation table, generated from ROWS

OUTCOME_TEXT = {
    "OK": "ValueError/TypeError naming the argument",
    "COMPAT": "AssertionError naming the argument (as SB3's PPO / contrib's TRPO)",
    "DELEGATED": "`{error}` from SB3/torch/numpy, not naming the argument (SB3 does not check it either)",
    "GAP": "**gap**: {now}",
}


def docs_table() -> str:
    """One line per (class, argument, bad value): static, so the table does not depend on the machine."""
    lines = ["| Class | Argument | Bad value | What it gets at construction |", "|---|---|---|---|"]
    for row in ROWS:
        for cls in row.classes:
            text = OUTCOME_TEXT[row.outcome].format(error=row.error.__name__ if row.error else "", now=row.now)
            value = repr(row.value).replace("|", "\\|")
            lines.append(f"| {cls.__name__} | `{row.arg}` | `{value}` | {text} |")
    return "\n".join(lines)


def test_docs_table_is_current() -> None:
    text = DOCS.read_text()
    assert TABLE_START in text and TABLE_END in text, f"{DOCS} lacks the table markers"
    current = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert current == docs_table(), "docs/misc/bad_inputs.md is out of date: run `python tests/test_bad_inputs.py`"


def write_docs_table() -> None:
    text = DOCS.read_text()
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    DOCS.write_text(f"{head}{TABLE_START}\n{docs_table()}\n{TABLE_END}{tail}")


if __name__ == "__main__":
    write_docs_table()
    print(f"rewrote the bad-inputs table in {DOCS}", file=sys.stderr)


@pytest.mark.parametrize(
    "algo, name, value",
    [
        (KLPPO, "max_grad_norm", -1.0),
        (KLPPO, "gamma", 2.0),
        (KLPPO, "normalize_advantage", "yes"),
        (KLPPO, "n_epochs", 0),
        (KLPPO, "n_steps", 0),
        (KLPPO, "min_std", NAN),
        (KLPPO, "kl_quantiles", (0.5, 1.5)),
        (ClipKLPPO, "clip_range", None),
        (KLTRPO, "target_kl", None),
        (KLTRPO, "cg_damping", -5.0),
    ],
)
def test_load_checks_constructor_arguments_as_the_constructor(algo, name, value, tmp_path):
    env = make_vec_env("Pendulum-v1", n_envs=1)
    algo("MlpPolicy", env, n_steps=32, batch_size=16, device="cpu").save(tmp_path / "model")
    with pytest.raises((TypeError, ValueError), match=f"`{name}`|{name}"):
        algo.load(tmp_path / "model.zip", env=env, **{name: value})
    # custom_objects replaces saved objects: rl-zoo's placeholders for a model loaded to act still load
    placeholders = {"learning_rate": 0.0, "lr_schedule": lambda _: 0.0, "clip_range": lambda _: 0.0}
    algo.load(tmp_path / "model.zip", env=env, custom_objects=placeholders)


def test_load_refuses_a_saved_kl_state_it_cannot_unpickle(tmp_path, monkeypatch):
    import cloudpickle

    from sb3_kl.common.controllers import AdaptiveKLController

    class MovedController(AdaptiveKLController):
        """Stands for a user's controller class whose module has moved since the model was saved."""

    env = make_vec_env("CartPole-v1", n_envs=1)
    controller = MovedController(kl_coef=0.3)
    KLPPO("MlpPolicy", env, n_steps=32, batch_size=16, kl_controller=controller, device="cpu").save(tmp_path / "model")
    original_loads = cloudpickle.loads

    def loads(data, *args, **kwargs):
        if b"MovedController" in data:
            raise AttributeError("Can't get attribute 'MovedController'")
        return original_loads(data, *args, **kwargs)

    monkeypatch.setattr(cloudpickle, "loads", loads)
    with pytest.raises(ValueError, match=r"saved `kl_controller` cannot be restored.*custom_objects"):
        KLPPO.load(tmp_path / "model.zip", env=env)
    # replaced at load, as the message says: no error
    model = KLPPO.load(tmp_path / "model.zip", env=env, custom_objects={"kl_controller": AdaptiveKLController(kl_coef=0.3)})
    assert model.kl_coef == pytest.approx(0.3)


def test_numpy_numbers_are_taken_as_python_numbers():
    env = make_vec_env("Pendulum-v1", n_envs=1)
    model = KLPPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=16,
        target_kl=np.float32(0.02),
        clip_range=np.float32(0.2),
        kl_window=np.int64(3),
        min_std=np.float32(0.5),
        log_ratio_clip=np.float32(20.0),
        device="cpu",
    )
    monitor = KLMonitorCallback(drift_lag=np.int64(2))
    callbacks = [monitor, KLAdaptiveLRCallback(np.float32(0.01), monitor=monitor)]
    callbacks.append(KLAlarmCallback(target_kl=np.float32(0.01), monitor=monitor))
    model.learn(64, callback=callbacks)
    assert model.target_kl(1.0) == pytest.approx(0.02) and model.min_std == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["learning_rate", "clip_range", "clip_range_vf"])
@pytest.mark.parametrize("bad", [-0.01, NAN])
def test_a_schedule_value_is_checked_where_it_is_used(name, bad):
    def schedule(progress_remaining: float) -> float:
        # valid at the start and the end (where the constructor samples it), not in between
        return 0.01 if progress_remaining in (0.0, 1.0) else bad

    model = KLPPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=1), n_steps=32, batch_size=16, **{name: schedule})
    with pytest.raises(ValueError, match=f"schedule of `{name}` returned"):
        model.learn(96)


def test_a_callback_target_schedule_is_checked_where_it_is_used():
    monitor = KLMonitorCallback()
    alarm = KLAlarmCallback(target_kl=lambda progress: 0.01 if progress in (0.0, 1.0) else NAN, monitor=monitor)
    model = KLPPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=1), n_steps=32, batch_size=16)
    with pytest.raises(ValueError, match="schedule of `target_kl` returned nan"):
        model.learn(96, callback=[monitor, alarm])


def test_reference_coefficient_outside_its_bounds_names_the_reference_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"`ref_kl_coef`=20\.0 lies outside `ref_kl_coef_bounds`"):
        KLPPO("MlpPolicy", make_vec_env("CartPole-v1"), ref_policy=KLPPO("MlpPolicy", "CartPole-v1"), ref_kl_coef=20.0)


def test_reference_options_without_a_reference_warn():
    with pytest.warns(UserWarning, match="`ref_target_kl`=0.01 set without `ref_policy`"):
        KLPPO("MlpPolicy", make_vec_env("CartPole-v1"), ref_target_kl=0.01)


@pytest.mark.parametrize("algo", ALGOS)
def test_linear_schedules_train_through_the_last_rollout_past_the_budget(algo):
    # learn() ends with the rollout that reaches the budget: its update runs at progress_remaining < 0, where a
    # schedule ``progress * initial`` (SB3's docs, rl-zoo's lin_) is negative; SB3 uses that value, and so do we
    def linear(initial: float):
        return lambda progress_remaining: progress_remaining * initial

    schedules = {"learning_rate": linear(3e-4)}
    if algo in PPOS:
        schedules.update(clip_range=linear(0.2), clip_range_vf=linear(0.2))
    model = algo("MlpPolicy", make_vec_env("CartPole-v1", n_envs=2), n_steps=32, batch_size=32, **schedules)
    model.learn(100)  # 2 rollouts of 64 steps: the second update runs at progress 1 - 128/100 < 0
    assert model._current_progress_remaining < 0


def test_sb3_argument_forms_stay_accepted(tmp_path):
    import types

    env = make_vec_env("CartPole-v1")
    model = KLPPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=32,
        verbose=False,
        policy_kwargs=types.MappingProxyType({"net_arch": [8]}),
        rollout_buffer_kwargs=types.MappingProxyType({}),
    )
    model.save(tmp_path / "model")
    KLPPO.load(tmp_path / "model.zip", env=env, verbose=True, learning_rate=0.0)
