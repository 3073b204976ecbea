"""
What KLPPO, ClipKLPPO and KLTRPO share: KL options and their validation, the KL-coefficient controller,
the KL rollout buffer with its policy-version check, the frozen rollout distribution, the per-state KL
measurement after each update with its logs, the variance floor and the count of non-finite steps.
"""

import base64
import functools
import importlib
import importlib.util
import inspect
import io
import math
import pathlib
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import cloudpickle
import gymnasium as gym
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.policies import ActorCriticPolicy, BasePolicy
from stable_baselines3.common.save_util import load_from_zip_file
from stable_baselines3.common.type_aliases import GymEnv, PyTorchObs, Schedule
from stable_baselines3.common.vec_env import VecEnv

from sb3_kl.common.buffers import KLBufferMixin, KLDictRolloutBuffer, KLRolloutBuffer
from sb3_kl.common.callbacks_monitor import distribution_params_for_policy
from sb3_kl.common.controllers import KL_CONTROLLERS, KLController, make_kl_controller
from sb3_kl.common.learning_rate import (
    DEFAULT_LR_BOUNDS,
    GUARD_BAND,
    AdaptiveLRSchedule,
    RATE_RESPONSE_WINDOW,
    VALUE_GROUP_KEY,
    find_step_scale,
    first_epoch_share,
    guard_aim,
    in_guard_band,
    optimizer_state_in_layout,
    parse_auto_learning_rate,
    rate_factor,
    rate_follows_kl,
    recent_kl,
    split_value_group,
    value_only_parameters,
)
from sb3_kl.common.modes import acting_mode
from sb3_kl.common.reference import LOADED_REFERENCE_OPTIONS, ReferenceKLMixin, ReferenceSource
from sb3_kl.common.save_util import (
    SAVED_BY_KEY,
    guess_stock_algorithm,
    read_saved_data,
    saved_kl_algorithm,
    saved_with_sb3_buffer,
    saved_without_kl_state,
)
from sb3_kl.common.threads import warn_if_many_threads
from sb3_kl.common.validation import (  # MIN_TARGET_KL: kept importable from here
    MIN_TARGET_KL,  # noqa: F401
    as_schedule,
    check_bool,
    check_int,
    check_pair,
    check_path,
    check_probability,
    check_quantiles,
    check_schedule,
    is_number,
    scheduled_target_kl,
    scheduled_value,
    target_kl_value,
)
from sb3_kl.common.variance import min_log_std_parameter
from sb3_kl.common.keywords import SuggestsKeywords, closest_keyword, unexpected_keyword_error
from sb3_kl.common.kl import (
    DistributionParams,
    attach_sde_features,
    GaussianParams,
    KLSettings,
    actions_for_log_prob,
    as_float64,
    kl_log_prob,
    kl_quantiles,
    per_state_kl,
    per_state_kl_to,
)
from sb3_kl.common.user_warnings import warn_and_print, warn_at_user_frame

#: Constructor options folded into the KL convention (``kl_settings``, ``ref_kl_settings``) or into the KL controllers
#: when the model is built, by the object and attribute that hold them: ``load()`` would store them where nothing reads
#: them, so it compares them with the saved model and refuses a different value
FIXED_AT_CONSTRUCTION = {
    "kl_estimator": ("kl_settings", "estimator"),
    "kl_direction": ("kl_settings", "direction"),
    "kl_reduction": ("kl_settings", "reduction"),
    "log_ratio_clip": ("kl_settings", "log_ratio_clip"),
    "kl_controller": ("kl_controller", None),
    "kl_adapt_factor": ("kl_controller", "kl_adapt_factor"),
    "kl_band": ("kl_controller", "kl_band"),
    "kl_coef_bounds": ("kl_controller", "kl_coef_bounds"),
    "kl_window": ("kl_controller", "kl_window"),
    "kl_horizon": ("kl_controller", "kl_horizon"),
    "ref_kl_direction": ("ref_kl_settings", "direction"),
    "ref_kl_estimator": ("ref_kl_settings", "estimator"),
    "ref_kl_controller": ("ref_kl_controller", None),
    "ref_kl_coef_bounds": ("ref_kl_controller", "kl_coef_bounds"),
}


def _comparable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def take_fixed_kl_options(kwargs: dict[str, Any], custom_objects: dict[str, Any]) -> dict[str, Any]:
    """
    Take out of ``load()``'s keyword arguments and ``custom_objects`` the options in :data:`FIXED_AT_CONSTRUCTION`
    (a controller given as an object stays: it replaces the saved one, as SB3's ``load`` does with attributes).

    :return: the options taken, to be checked by :meth:`KLOnPolicyAlgorithm._check_fixed_kl_options` once loaded
    """
    taken = {}
    for source in (custom_objects, kwargs):
        for name in FIXED_AT_CONSTRUCTION:
            if name in source and not isinstance(source[name], KLController):
                taken[name] = source.pop(name)
    return taken


def _zip_name(path: Any) -> str:
    """How messages name a saved model given to ``load()`` as a path or an open file."""
    if isinstance(path, (str, pathlib.Path)):
        return str(path)
    return str(getattr(path, "name", None) or "The saved model")


def _loaded_class(name: str | None) -> "type[KLOnPolicyAlgorithm] | None":
    """The sb3-kl algorithm ``module:qualname`` when its module is imported (a name read from a zip imports nothing)."""
    if name is None:
        return None
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, KLOnPolicyAlgorithm) else None


def saved_target_kl(data: dict[str, Any]) -> float | None:
    """The KL target saved in a model's data, at its saved progress (None when it cannot be read)."""
    item = data.get("target_kl")
    try:
        schedule = cloudpickle.loads(base64.b64decode(item[":serialized:"].encode()))  # type: ignore[index]
        return target_kl_value(schedule, float(data.get("_current_progress_remaining", 1.0)))
    except Exception:
        return None


def saved_kl_name(data: dict[str, Any]) -> str:
    """The KL a model's data is measured in, ``KL(old||new)`` or ``KL(new||old)`` (``the KL`` when it does not say)."""
    settings = data.get("kl_settings")
    direction = settings.get("direction") if isinstance(settings, dict) else None
    return {"forward": "KL(old||new)", "reverse": "KL(new||old)"}.get(direction, "the KL")  # type: ignore[arg-type]


SelfKLOnPolicyAlgorithm = TypeVar("SelfKLOnPolicyAlgorithm", bound="KLOnPolicyAlgorithm")

#: Default ``target_kl`` when ``None`` is passed, by kind of action space
DEFAULT_TARGET_KL = {"discrete": 0.02, "continuous": 0.03}


def register_zoo_envs_if_unknown(env: Any) -> None:
    """
    Make the RL Zoo's own environments (``CartPoleNoVel-v1``, ``PendulumNoVel-v1``, ...: registered by importing
    ``rl_zoo3.import_envs``) known to gymnasium when ``env`` is an id it does not know and rl_zoo3 is installed, so that
    an algorithm given that id builds its env as it would inside the zoo. An id that stays unknown is left to
    gymnasium's own error when SB3 makes the env.

    :param env: The ``env`` argument of an algorithm (only an id string is looked at)
    """
    if not isinstance(env, str):
        return
    try:
        gym.spec(env)
        return
    except gym.error.UnregisteredEnv:
        pass
    except Exception:  # e.g. "module:Env-v0" with a module that does not import: gym.make reports it
        return
    if importlib.util.find_spec("rl_zoo3") is None:
        return
    try:
        importlib.import_module("rl_zoo3.import_envs")
    except ImportError:  # a broken zoo install: gymnasium's NameNotFound says what the user asked for
        pass


def check_on_policy_arguments(arguments: dict[str, Any], min_n_steps: int = 0) -> None:
    """
    Check the arguments KLPPO, ClipKLPPO and KLTRPO pass on to SB3's ``OnPolicyAlgorithm`` that SB3 itself does
    not check (or checks only later, with an error not naming them). Arguments absent from ``arguments`` are
    skipped; the ``n_steps * n_envs > 1`` check stays SB3's assert in the algorithms.

    :param arguments: The keyword arguments given to ``OnPolicyAlgorithm.__init__``
    :param min_n_steps: The smallest ``n_steps`` accepted: the constructor leaves 0 to SB3's assert on
        ``n_steps * n_envs``, once the env is known (SB3's tests expect that assert); ``load()``, whose overrides meet
        no such assert, passes 1
    :raises TypeError: for a value of the wrong type
    :raises ValueError: for a value out of range
    """
    if "learning_rate" in arguments:
        # a linear schedule (e.g. rl-zoo's ``lin_3e-4``) reaches exactly 0 at the end of training
        check_schedule("learning_rate", arguments["learning_rate"], allow_zero_at_end=True)
    if "n_steps" in arguments:
        n_steps = check_int("n_steps", arguments["n_steps"])
        if n_steps < min_n_steps:
            raise ValueError(f"`n_steps` must be a positive integer (steps per env per rollout), got {n_steps!r}.")
    for name in ("gamma", "gae_lambda"):
        if name in arguments:
            check_probability(name, arguments[name])
    if "use_sde" in arguments:
        check_bool("use_sde", arguments["use_sde"])
    if "sde_sample_freq" in arguments:
        check_int("sde_sample_freq", arguments["sde_sample_freq"])  # -1: sample the noise at the start of a rollout only
    if "stats_window_size" in arguments:
        check_int("stats_window_size", arguments["stats_window_size"], 1)
    if "tensorboard_log" in arguments:
        check_path("tensorboard_log", arguments["tensorboard_log"])
    if "verbose" in arguments and not isinstance(arguments["verbose"], (bool, np.bool_)):  # SB3 takes True/False
        check_int("verbose", arguments["verbose"], 0)
    if arguments.get("seed") is not None:
        check_int("seed", arguments["seed"], 0)
    for name in ("policy_kwargs", "rollout_buffer_kwargs"):
        if arguments.get(name) is not None and not isinstance(arguments[name], Mapping):
            raise TypeError(f"`{name}` must be a dict of keyword arguments (or None), got {arguments[name]!r}.")
    if arguments.get("rollout_buffer_class") is not None and not isinstance(arguments["rollout_buffer_class"], type):
        raise TypeError(
            "`rollout_buffer_class` must be a class (a subclass of sb3-kl's KLRolloutBuffer), or None for the one "
            f"that fits the observation space; got {arguments['rollout_buffer_class']!r}."
        )


class NonFiniteUpdateError(RuntimeError):
    """Raised when every optimizer step of an update had a non-finite loss or gradient."""


class NonFiniteEnvError(NonFiniteUpdateError, ValueError):
    """
    Raised when the environment returns a NaN/inf observation or reward during a rollout. A ``ValueError`` (the
    environment's output is invalid) and a :class:`NonFiniteUpdateError` (the update it would have fed is lost).
    """


class NonFiniteEnvCheck:
    """
    Stands in for the training ``VecEnv`` during ``collect_rollouts``: every ``step`` is forwarded, then its
    observations (and, on episode end, terminal observations) are checked, so that a NaN/inf from the environment
    stops training with a message naming the env and the step instead of reaching the policy (a NaN action
    distribution). Rewards only reach the policy through ``train()``: they are checked once per rollout, on the
    filled buffer (:meth:`check_rewards`). Integer observations (e.g. images) cannot be NaN and are not checked.
    Everything else is delegated to the env.

    The per-step test is one dot product with a zero array (``x . 0`` is 0 when ``x`` is finite, NaN as soon as one
    entry is NaN or inf, and cannot overflow); ``np.isfinite`` then locates the culprit, on failure only.

    :param venv: The training environment
    :param start_timestep: ``model.num_timesteps`` at the start of the rollout
    """

    def __init__(self, venv: VecEnv, start_timestep: int):
        self.venv = venv
        self.num_envs = venv.num_envs  # read by collect_rollouts at every step: no __getattr__ detour
        self.start_timestep = start_timestep
        self.n_steps = 0
        self._zeros: np.ndarray | None = None  # zero array shaped like the (Box) observations, reused at every step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.venv, name)

    def _fail(self, env_idx: int, what: str, values: np.ndarray, step: int) -> None:
        kind = "NaN" if np.isnan(values).any() else "inf"
        timestep = self.start_timestep + step * self.num_envs
        raise NonFiniteEnvError(
            f"env {env_idx} returned a {kind} {what} at step {step} of the rollout (timestep {timestep}); "
            "training stopped before it reached the policy. Wrap the env in "
            "stable_baselines3.common.vec_env.VecCheckNan(env, raise_exception=True) to find the action that caused it, "
            "and fix the environment (or clip/normalize its outputs, e.g. VecNormalize)."
        )

    def check_observation(self, obs: Any, what: str = "observation", env_idx: int | None = None) -> None:
        """
        :param obs: A batch of observations (one row per env), or one env's observation batched as 1 row
        :param env_idx: The env of a single-row batch (None: the row index is the env index)
        :raises NonFiniteEnvError: (a ValueError) if a floating-point observation is not finite
        """
        for array in obs.values() if isinstance(obs, dict) else (obs,):
            if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
                continue
            if math.isfinite(np.vdot(array, np.zeros_like(array))):
                continue
            bad_rows = ~np.isfinite(array.reshape(array.shape[0], -1)).all(axis=1)
            first = int(np.flatnonzero(bad_rows)[0])
            self._fail(first if env_idx is None else env_idx, what, array[first], self.n_steps)

    def check_rewards(self, rewards: np.ndarray) -> None:
        """
        :param rewards: The rollout's rewards, ``(n_steps, n_envs)``
        :raises NonFiniteEnvError: (a ValueError) naming the first env and step with a non-finite reward
        """
        if not math.isfinite(np.vdot(rewards, np.zeros_like(rewards))):
            step, env_idx = (int(i) for i in np.argwhere(~np.isfinite(rewards))[0])
            self._fail(env_idx, "reward", rewards[step, env_idx : env_idx + 1], step)

    def step(self, actions: np.ndarray) -> Any:
        new_obs, rewards, dones, infos = self.venv.step(actions)
        # Fast path for the common case (one float array): no allocation, one BLAS call
        zeros = self._zeros
        if zeros is not None and type(new_obs) is np.ndarray and new_obs.shape == zeros.shape and new_obs.dtype is zeros.dtype:
            if not math.isfinite(np.vdot(new_obs, zeros)):
                self.check_observation(new_obs)
        else:
            self.check_observation(new_obs)
            if type(new_obs) is np.ndarray and new_obs.dtype.kind == "f":
                self._zeros = np.zeros_like(new_obs)
        for idx, info in enumerate(infos):
            terminal_obs = info.get("terminal_observation")
            if terminal_obs is not None:
                if isinstance(terminal_obs, dict):
                    batched: Any = {key: np.asarray(value)[None] for key, value in terminal_obs.items()}
                else:
                    batched = np.asarray(terminal_obs)[None]
                self.check_observation(batched, what="terminal observation", env_idx=idx)
        self.n_steps += 1
        return new_obs, rewards, dones, infos


# It stands in for a VecEnv (everything not overridden is the env's): code that asks ``isinstance(env, VecEnv)``, such
# as sb3-contrib's ``get_action_masks``, must treat it as one
VecEnv.register(NonFiniteEnvCheck)


@functools.cache
def _fused_adam_available(device: th.device) -> bool:
    """Whether this PyTorch build has the fused Adam kernel for ``device`` (CPU support came with PyTorch 2.4)."""
    try:
        probe = th.zeros(1, device=device, requires_grad=True)
        probe.grad = th.zeros_like(probe)
        th.optim.Adam([probe], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


#: Consecutive updates with beta at the lower bound of ``kl_coef_bounds`` and the update's KL below
#: :data:`STALLED_KL_FRACTION` of the target after which the algorithm warns (once) that beta cannot help
STALLED_AT_FLOOR_UPDATES = 10
#: An update's KL below this fraction of the target counts as stalled
STALLED_KL_FRACTION = 0.1
#: With ``learning_rate="auto"`` and a clip range: an update whose clip fraction is at least this counts as held by the
#: clip range; after :data:`STALLED_AT_FLOOR_UPDATES` such updates in a row, a warning (the adapted rate climbs instead)
CLIP_HOLDS_FRACTION = 0.5


class KLOnPolicyAlgorithm(SuggestsKeywords, ReferenceKLMixin, OnPolicyAlgorithm):
    """
    Base class of the sb3_kl algorithms. See :class:`~sb3_kl.KLPPO` for the meaning of the KL arguments.

    :param target_kl: Target KL per update (number or schedule of progress remaining); ``None`` = 0.02 for discrete
        action spaces, 0.03 for ``Box``
    :param kl_coef: Initial KL coefficient beta
    :param kl_controller: ``"adaptive"``, ``"fixed"``, ``"proportional"`` or a :class:`~sb3_kl.common.controllers.KLController`
    :param kl_adapt_factor: Multiplicative step of the adaptive controller (> 1)
    :param kl_band: Band (low, high) around the target, as multiples of it, where beta stays unchanged
        (default ``(0.8, 1.25)``)
    :param kl_coef_bounds: Bounds (min, max) of beta
    :param kl_window: Number of recent update KLs averaged to drive the adaptive controller
    :param kl_horizon: Horizon (environment steps) of the proportional controller
    :param kl_estimator: ``"analytic"``, ``"k1"`` or ``"k3"``
    :param kl_direction: ``"forward"`` = KL(old||new) or ``"reverse"`` = KL(new||old)
    :param kl_reduction: ``"sum"`` (joint KL) or ``"mean"`` over action dimensions
    :param log_ratio_clip: Log-ratios are clamped to +/- this value before exponentiation (the sample estimators that
        exponentiate them, k3 and the reverse direction, are evaluated at the clamped value; forward k1 is never clamped)
    :param min_std: Variance floor for Gaussian policies: std >= min_std after every optimizer step
    :param kl_quantiles: Quantiles of the per-state KL that are logged after each update (with a sample
        ``kl_estimator``, quantiles of the one-action estimates, of which only the mean estimates the KL)
    :param ref_policy: Frozen reference policy to anchor to (path of a saved SB3 model, a model or a policy), or None
    :param ref_kl_coef: Coefficient beta_ref of the reference KL (initial value when ``ref_target_kl`` is set;
        0 with ``ref_target_kl=None``: the KL to the reference is only measured and logged)
    :param ref_target_kl: Target of the reference KL for an adaptive beta_ref; None = fixed ``ref_kl_coef``
    :param ref_kl_controller: Controller of beta_ref when ``ref_target_kl`` is set (same choices as ``kl_controller``)
    :param ref_kl_coef_bounds: Bounds (min, max) of beta_ref
    :param ref_kl_direction: ``"reverse"`` = KL(pi || pi_ref) (default) or ``"forward"`` = KL(pi_ref || pi)
    :param ref_kl_estimator: ``"analytic"`` (default), ``"k1"`` or ``"k3"``
    :param lr_bounds: ``(min, max)`` of the adapted learning rate with ``learning_rate="auto"`` (algorithms with
        :attr:`supports_auto_learning_rate`; see :mod:`sb3_kl.common.learning_rate`)
    """

    rollout_buffer: KLRolloutBuffer | KLDictRolloutBuffer  # type: ignore[assignment]
    policy: ActorCriticPolicy
    #: The policies the algorithm works with (sb3-contrib's maskable policies are not ``ActorCriticPolicy`` subclasses)
    policy_base: ClassVar[type[BasePolicy]] = ActorCriticPolicy
    #: Whether the loss carries a KL penalty whose coefficient beta ``kl_controller`` adapts (``train/kl_coef``);
    #: False for a hard constraint (KLTRPO), whose controller is never used: ``kl/coef`` and the beta-bound alarms skip it
    has_kl_coef: ClassVar[bool] = True
    #: Whether ``learning_rate="auto"`` is accepted (the KLPPO family: the step it scales is the optimizer's)
    supports_auto_learning_rate: ClassVar[bool] = False

    def __init__(
        self,
        *args: Any,
        target_kl: "float | Schedule | None" = None,
        kl_coef: float = 1.0,
        kl_controller: "str | KLController" = "adaptive",
        kl_adapt_factor: float = 1.5,
        kl_band: tuple[float, float] = (0.8, 1.25),
        kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
        kl_window: int = 1,
        kl_horizon: int = 10_000,
        kl_estimator: str = "analytic",
        kl_direction: str = "forward",
        kl_reduction: str = "sum",
        log_ratio_clip: float = 20.0,
        min_std: float | None = None,
        kl_quantiles: tuple[float, ...] = (0.5, 0.9, 0.99),
        ref_policy: ReferenceSource | None = None,
        ref_kl_coef: float = 1.0,
        ref_target_kl: float | None = None,
        ref_kl_controller: "str | KLController" = "adaptive",
        ref_kl_coef_bounds: tuple[float, float] = (1e-4, 10.0),
        ref_kl_direction: str = "reverse",
        ref_kl_estimator: str = "analytic",
        lr_bounds: tuple[float, float] = DEFAULT_LR_BOUNDS,
        **kwargs: Any,
    ):
        learning_rate = kwargs.get("learning_rate")
        lr_bounds = check_pair("lr_bounds", lr_bounds)
        auto_start = self._check_auto_learning_rate(learning_rate, lr_bounds)
        if auto_start is not None:
            kwargs["learning_rate"] = auto_start  # SB3 builds the optimizer at the starting rate
        check_on_policy_arguments(kwargs)
        register_zoo_envs_if_unknown(kwargs["env"] if "env" in kwargs else args[1] if len(args) > 1 else None)
        super().__init__(*args, **kwargs)
        if auto_start is not None:
            self.learning_rate = learning_rate
        # the rate the next update uses with learning_rate="auto" (saved with the model), None otherwise
        self.adapted_learning_rate = auto_start
        if auto_start is not None and getattr(self, "policy", None) is not None:
            split_value_group(self.policy)
        # recent (rate, first-epoch KL, unscaled KL) of learning_rate="auto"
        self._rate_history: list[tuple[float, ...]] = []
        self.lr_bounds = lr_bounds
        check_schedule("target_kl", target_kl, allow_none=True, allow_zero_at_end=True)
        self.kl_settings = KLSettings(kl_estimator, kl_direction, kl_reduction, log_ratio_clip)
        self.kl_controller = make_kl_controller(
            # (the controllers check the pairs, lists from a config file included, and name a value that is no pair)
            kl_controller,
            kl_coef,
            kl_adapt_factor,
            kl_band,
            kl_coef_bounds,
            kl_window,
            kl_horizon,
        )
        self._init_reference(
            ref_policy,
            ref_kl_coef,
            ref_target_kl,
            ref_kl_controller,
            ref_kl_direction,
            ref_kl_estimator,
            ref_kl_coef_bounds,
            kl_reduction,
            log_ratio_clip,
        )
        if min_std is not None:
            if not is_number(min_std) or not math.isfinite(min_std) or min_std <= 0:
                raise ValueError(
                    f"`min_std` must be a positive finite number (or None to disable the floor), got {min_std!r}."
                )
            action_space = getattr(self, "action_space", None)  # unknown until load() when env=None
            if action_space is not None and not isinstance(action_space, spaces.Box):
                raise ValueError(
                    f"`min_std`={min_std} sets a variance floor, which only exists for Gaussian policies (Box actions); "
                    f"this action space is {type(action_space).__name__}: pass min_std=None."
                )
        kl_quantiles = check_quantiles("kl_quantiles", kl_quantiles)
        self.target_kl = target_kl
        self.min_std = None if min_std is None else float(min_std)
        self.kl_quantiles = kl_quantiles
        # Incremented each time the policy's parameters change; the rollout buffer records the version that acted
        self.policy_version = 0
        self.nonfinite_steps_total = 0
        # Consecutive updates with beta at its floor and the KL far below the target, and whether that was warned about
        self.kl_coef_floor_updates = 0
        self.kl_coef_floor_warned = False
        # Consecutive updates of learning_rate="auto" held by the clip range, and whether that was warned about
        self.clip_holds_updates = 0
        self.clip_holds_warned = False
        self.dist_params: DistributionParams

    # ----------------------------------------------------------------------------------------------------------
    # Set-up and persistence

    def _setup_model(self) -> None:
        if self.rollout_buffer_class is None:
            self.rollout_buffer_class = (
                KLDictRolloutBuffer if isinstance(self.observation_space, spaces.Dict) else KLRolloutBuffer
            )
        elif not issubclass(self.rollout_buffer_class, KLBufferMixin):
            raise TypeError(
                f"`rollout_buffer_class`={self.rollout_buffer_class.__name__} does not store the rollout policy's "
                "distribution: pass a subclass of sb3_kl.common.buffers.KLRolloutBuffer (or KLDictRolloutBuffer)."
            )
        super()._setup_model()
        if not isinstance(self.policy, self.policy_base):
            raise ValueError(f"Policy must subclass {self.policy_base.__module__}.{self.policy_base.__name__}")
        self.dist_params = distribution_params_for_policy(self.policy.action_dist)
        if self.adapts_learning_rate:
            split_value_group(self.policy)
        self._use_fused_adam()
        self.target_kl = self._target_kl_schedule(self.target_kl)
        self._target_kl_is_schedule = True  # from now on, an assigned target_kl is converted (``__setattr__``)
        if self.min_std is not None and not isinstance(self.dist_params, GaussianParams):
            raise ValueError("`min_std` is set but the policy's action distribution is not Gaussian: pass min_std=None.")
        # Saved as JSON lists: ``load`` gives back the tuples the constructor stores
        self.kl_quantiles = tuple(self.kl_quantiles)
        self.lr_bounds = tuple(self.lr_bounds)  # type: ignore[assignment]
        self._rate_history = [tuple(float(value) for value in entry) for entry in getattr(self, "_rate_history", [])]
        # ``Algo.load(path, kl_coef=x)`` puts ``kl_coef`` in ``__dict__`` before calling ``_setup_model``: apply it
        if "kl_coef" in self.__dict__:
            self.kl_coef = self.__dict__.pop("kl_coef")
        self._setup_reference()

    @classmethod
    def _check_auto_learning_rate(cls, learning_rate: Any, bounds: tuple[float, float]) -> float | None:
        """
        :param bounds: ``lr_bounds``, already checked
        :return: the starting rate of ``learning_rate="auto"``/``"auto_<start>"``, None for a number or a schedule
        :raises ValueError: naming the argument, for a malformed ``"auto..."`` string, an algorithm without it, or a
            start outside ``lr_bounds``
        """
        start = parse_auto_learning_rate(learning_rate)
        if start is None:
            return None
        if not cls.supports_auto_learning_rate:
            raise ValueError(
                f"`learning_rate`={learning_rate!r}: {cls.__name__} does not adapt its learning rate (its step is not the "
                "optimizer's); give a number or a schedule."
            )
        if not bounds[0] <= start <= bounds[1]:
            raise ValueError(
                f"`learning_rate`={learning_rate!r} starts outside `lr_bounds`={bounds}: start inside them, or widen them."
            )
        return start

    @property
    def adapts_learning_rate(self) -> bool:
        """Whether the learning rate is adapted from the KL (``learning_rate="auto"``)."""
        return isinstance(self.learning_rate, str)

    def _setup_lr_schedule(self) -> None:
        if not self.adapts_learning_rate:
            super()._setup_lr_schedule()
            return
        if getattr(self, "adapted_learning_rate", None) is None:  # loaded from a model that had a fixed rate
            self.adapted_learning_rate = parse_auto_learning_rate(self.learning_rate)
        self.lr_schedule = AdaptiveLRSchedule(self.adapted_learning_rate)  # type: ignore[arg-type]

    @property
    def kl_coef(self) -> float:
        """
        The current KL coefficient beta (held by ``kl_controller``).

        :raises AttributeError: on an algorithm without a KL penalty (:attr:`has_kl_coef` False, e.g. ``KLTRPO``), where
            the controller's value would be one that nothing uses
        """
        if not self.has_kl_coef:
            raise AttributeError(self._no_kl_coef_message())
        return self.kl_controller.kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        if not self.has_kl_coef:
            raise AttributeError(self._no_kl_coef_message())
        # The constructor's checks (KLController.__init__): a positive finite number within ``kl_coef_bounds``
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`kl_coef` must be a positive finite number, got {value!r}.")
        low, high = getattr(self.kl_controller, "kl_coef_bounds", (0.0, math.inf))
        if not low <= value <= high:
            raise ValueError(
                f"`kl_coef`={value!r} lies outside `kl_coef_bounds`={(low, high)} of the KL controller: pass a value "
                "within the bounds, or give the model a controller with wider bounds (e.g. "
                "`model.kl_controller = AdaptiveKLController(kl_coef, kl_coef_bounds=(low, high))`, or the same as a "
                "keyword of `load`)."
            )
        self.kl_controller.kl_coef = float(value)

    @classmethod
    def _no_kl_coef_message(cls) -> str:
        """Why an algorithm without a KL penalty (:attr:`has_kl_coef` False) has no ``kl_coef``, and what to set instead."""
        return f"{cls.__name__} has no KL penalty, so no `kl_coef` or KL controller."

    def _excluded_save_params(self) -> list[str]:
        # rebuilt from the policy by _setup_model; the reference's weights go to ref_policy.pth (below)
        excluded = ["dist_params", "ref_policy", "ref_dist_params"]
        # flags of set-up and set_parameters, not state
        flags = ["_reference_awaits_weights", "_reference_in_parameters", "_target_kl_is_schedule", "_step_start"]
        flags += ["_first_epoch_measured", "_unscaled_update_kl"]  # learning_rate="auto": one update's measurements
        return [*super()._excluded_save_params(), *excluded, *flags]

    def _get_torch_save_params(self) -> tuple[list[str], list[str]]:
        state_dicts, torch_variables = super()._get_torch_save_params()
        if self.ref_policy is not None and getattr(self, "_reference_in_parameters", True):
            state_dicts = [*state_dicts, "ref_policy"]
        return state_dicts, torch_variables

    def _use_fused_adam(self) -> None:
        """
        Step the policy's Adam with PyTorch's fused kernel (``fused=True``) unless ``optimizer_kwargs`` chooses an
        implementation (``foreach`` or ``fused``). On CPU, Adam's default runs a dozen small kernels per parameter
        tensor, which for PPO-sized networks costs more than a minibatch's forward pass; the fused kernel applies
        the same update rule in one call. Also re-applied after ``load()``, whose optimizer state carries the
        saved settings.
        """
        optimizer = getattr(self.policy, "optimizer", None)
        optimizer_kwargs = getattr(self.policy, "optimizer_kwargs", None) or {}
        if type(optimizer) is not th.optim.Adam or "foreach" in optimizer_kwargs or "fused" in optimizer_kwargs:
            return
        if self.device.type not in ("cpu", "cuda") or not _fused_adam_available(self.device):
            return
        # the fused kernel takes floating-point parameters only and has no differentiable or capturable mode
        if any(
            group.get("differentiable") or group.get("capturable") or not all(p.is_floating_point() for p in group["params"])
            for group in optimizer.param_groups
        ):
            return
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        for state in optimizer.state.values():
            # the fused kernel keeps Adam's step counter as a float32 tensor on the parameters' device
            if "step" in state:
                state["step"] = th.as_tensor(state["step"], dtype=th.float32, device=self.device).reshape(())

    def set_parameters(
        self,
        load_path_or_dict: str | pathlib.Path | io.BufferedIOBase | dict[str, Any],
        exact_match: bool = True,
        device: th.device | str = "auto",
    ) -> None:
        """
        SB3's ``set_parameters``, except for the frozen reference policy: its saved weights (``ref_policy``) are
        loaded only into the skeleton that ``load()`` rebuilds for them. A model built with its own ``ref_policy``
        keeps it (the anchor is never replaced by another model's), and the reference is not among the parameters
        that ``exact_match`` requires, so the weights of a model saved without one (a stock ``PPO`` zip) load too.
        Arguments as in SB3's ``BaseAlgorithm.set_parameters``.
        """
        params = load_path_or_dict
        if not isinstance(params, dict):
            _, params, _ = load_from_zip_file(params, device=device, load_data=False)
        if "policy.optimizer" in params:
            # learning_rate="auto" gives the value function an optimizer group of its own: a zip saved with the other
            # layout (a fixed rate, a stock PPO) loads with each parameter's state kept
            params = {**params, "policy.optimizer": optimizer_state_in_layout(params["policy.optimizer"], self.policy)}
        reference_loads = getattr(self, "_reference_awaits_weights", False)
        if not reference_loads:
            params = {name: value for name, value in params.items() if name != "ref_policy"}
        self._reference_in_parameters = reference_loads
        try:
            super().set_parameters(params, exact_match=exact_match, device=device)
        finally:
            self._reference_in_parameters = True
        self._reference_awaits_weights = False
        self._use_fused_adam()
        # New weights: a rollout collected before no longer describes the policy
        self.policy_version += 1

    def save(
        self,
        path: str | pathlib.Path | io.BufferedIOBase,
        exclude: Iterable[str] | None = None,
        include: Iterable[str] | None = None,
    ) -> None:
        """
        SB3's ``save``; the data also names the class that saved the model (``SAVED_BY_KEY``), by which ``load()``
        tells a zip of another KL family (:attr:`kl_family`). Arguments as in SB3's ``BaseAlgorithm.save``.
        """
        self.__dict__[SAVED_BY_KEY] = f"{type(self).__module__}:{type(self).__qualname__}"
        try:
            super().save(path, exclude=exclude, include=include)
        finally:
            del self.__dict__[SAVED_BY_KEY]

    @classmethod
    def load(  # type: ignore[override]
        cls: type[SelfKLOnPolicyAlgorithm],
        path: str | pathlib.Path | io.BufferedIOBase,
        env: GymEnv | None = None,
        device: th.device | str = "auto",
        custom_objects: dict[str, Any] | None = None,
        print_system_info: bool = False,
        force_reset: bool = True,
        **kwargs: Any,
    ) -> SelfKLOnPolicyAlgorithm:
        """
        SB3's ``load``, which also takes a model saved by a stock algorithm (SB3's ``PPO``/``A2C``, sb3-contrib's
        ``TRPO``): its weights, optimizer state and hyperparameters are loaded, SB3's rollout buffer is replaced by
        sb3-kl's, and the KL state (beta, controller) starts fresh; a ``UserWarning`` says so once. A corrupt zip
        raises a ``ValueError`` naming the file. Arguments as in SB3's ``BaseAlgorithm.load``.

        A zip saved by an sb3-kl algorithm of another KL family (:attr:`kl_family`, e.g. TRPL's into KLPPO) loads the same
        way, with a warning naming it and what its ``target_kl`` meant: the weights, optimizer state, shared
        hyperparameters, ``target_kl`` and reference policy are kept, the KL convention and controller start fresh.

        ``kl_coef`` and ``ref_kl_coef`` live in their controllers, not in the saved data, where SB3's
        ``custom_objects`` (which only replaces saved entries) would ignore them silently: given there, they are
        applied like keyword overrides (``load(path, kl_coef=x)``), with the constructor's checks (bounds included).
        The options folded into the saved KL convention and controllers at construction (``kl_direction``,
        ``kl_band``, ... see :data:`FIXED_AT_CONSTRUCTION`) would be ignored the same way: the saved value is accepted,
        a different one raises a ``ValueError`` naming the option (a ready controller object,
        ``kl_controller=AdaptiveKLController(...)``, replaces the saved one). An algorithm without a KL penalty
        (:attr:`has_kl_coef` False: ``KLTRPO``) refuses ``kl_coef`` and the KL controller's options with a ``ValueError``.
        """
        if not cls.has_kl_coef:
            # no penalty: beta and its controller's options would only reach a controller nothing uses
            given = [
                name
                for name in ("kl_coef", *(n for n, (holder, _) in FIXED_AT_CONSTRUCTION.items() if holder == "kl_controller"))
                if name in {**(custom_objects or {}), **kwargs}
            ]
            if given:
                raise ValueError(
                    f"{cls.__name__}.load() got {', '.join(f'`{name}`' for name in given)}: {cls._no_kl_coef_message()} "
                    f"Drop {'it' if len(given) == 1 else 'them'} from load()'s keywords and custom_objects."
                )
        data = read_saved_data(path)
        stock = saved_without_kl_state(data)
        cls._check_saved_policy_family(path, data)
        cls._check_load_keywords(kwargs, data)
        other_family = cls._saved_by_other_family(data)
        custom_objects = dict(custom_objects or {})
        given = set(custom_objects) | set(kwargs)
        cls._check_saved_kl_state_restores(path, data, {**custom_objects, **kwargs})
        fixed_options = take_fixed_kl_options(kwargs, custom_objects)
        reference_options = {
            name: source.pop(name)
            for source in (custom_objects, kwargs)
            for name in LOADED_REFERENCE_OPTIONS
            if name in source
        }
        for name in ("kl_coef", "ref_kl_coef"):
            if name in custom_objects:
                kwargs.setdefault(name, custom_objects.pop(name))
        cls._check_load_overrides(kwargs)
        if stock and saved_with_sb3_buffer(data) and "rollout_buffer_class" not in {**custom_objects, **kwargs}:
            custom_objects["rollout_buffer_class"] = None  # _setup_model picks the KL buffer for the observation space
        model = super().load(
            path,
            env=env,
            device=device,
            custom_objects=custom_objects,
            print_system_info=print_system_info,
            force_reset=force_reset,
            **kwargs,
        )
        model.__dict__.pop(SAVED_BY_KEY, None)
        if stock and fixed_options:
            model._build_kl_state(fixed_options, given_coefficients={"kl_coef", "ref_kl_coef"} & set(kwargs))
        elif other_family is not None:
            own = {name: value for name, value in fixed_options.items() if not name.startswith("ref_")}
            model._build_kl_state(own, given_coefficients={"kl_coef"} & set(kwargs), keep_reference=True)
            model._check_fixed_kl_options({name: fixed_options[name] for name in fixed_options.keys() - own.keys()})
        else:
            model._check_fixed_kl_options(fixed_options)
        model._apply_loaded_reference_options(reference_options)
        if "learning_rate" in kwargs:  # a rate given to load() replaces the saved adapted one
            model.adapted_learning_rate = parse_auto_learning_rate(kwargs["learning_rate"])
            model._rate_history = []
            model._setup_lr_schedule()
        if stock:
            model._warn_loaded_without_kl_state(path, guess_stock_algorithm(data), set(data) | set(kwargs))
        elif other_family is not None:
            model._warn_loaded_from_other_family(path, other_family, data, given)
        return model

    #: What ``target_kl`` is to the algorithm: ``"penalty"``, the target toward which an adaptive penalty steers the
    #: update's mean KL (the KLPPO family); ``"constraint"``, a bound on it (KLTRPO); ``"projection"``, a bound on every
    #: state's KL (TRPL). ``load()`` of a zip saved by another family warns and starts the KL state fresh
    kl_family: ClassVar[str] = "penalty"

    @classmethod
    def _saved_by_other_family(cls, data: dict[str, Any]) -> "type[KLOnPolicyAlgorithm] | None":
        """
        :return: the sb3-kl class that saved ``data`` (as recorded, else guessed for older zips) when its
            :attr:`kl_family` differs from this class's; None for a stock zip or one of the same family (this class, a
            subclass, or a sibling such as ClipKLPPO for KLPPO)
        """
        if saved_without_kl_state(data):
            return None
        recorded, guessed = saved_kl_algorithm(data)
        saved = _loaded_class(recorded) or _loaded_class(guessed)
        return None if saved is None or saved.kl_family == cls.kl_family else saved

    #: Saved entries that hold the KL state: restored as saved, or ``load()`` refuses (never a silent default)
    _saved_kl_state: ClassVar[tuple[str, ...]] = (
        "kl_controller",
        "kl_settings",
        "target_kl",
        "ref_kl_controller",
        "ref_kl_settings",
    )

    @classmethod
    def _check_load_overrides(cls, overrides: dict[str, Any]) -> None:
        """
        Check the constructor arguments given to ``load()`` as keyword overrides as the constructor checks them:
        SB3's ``load`` sets them on the model unchecked, so a value the constructor refuses (``max_grad_norm=-1``,
        ``n_epochs=0``, ``min_std=nan``, ...) would otherwise train, or fail later without naming the argument.
        Entries that are not constructor arguments (SB3 lets ``load`` set any attribute) are left to SB3, and
        ``kl_coef``/``ref_kl_coef`` are checked against the saved bounds once loaded. ``custom_objects`` is not
        checked: it replaces saved objects that may not unpickle, and placeholders such as rl-zoo's
        ``learning_rate=0.0`` for a model loaded to act are its common use.

        :param overrides: ``load()``'s keyword arguments
        :raises TypeError, ValueError: as the constructor would, naming the argument
        """
        parameters = inspect.signature(cls.__init__).parameters
        skipped = {"self", "policy", "env", "device", "_init_setup_model", "kl_coef", "ref_kl_coef"}
        given = {name: value for name, value in overrides.items() if name in parameters and name not in skipped}
        if given.get("learning_rate") == 0:
            del given["learning_rate"]  # a model loaded to act, or to be frozen, as SB3's load takes it
        if not given:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the constructor's advice on unused options is not about the saved model
            # verbose=0: the throwaway model prints nothing (SB3 would announce its device)
            cls(policy=cls._default_policy_class(), env=None, device="cpu", _init_setup_model=False, **{**given, "verbose": 0})
        # the throwaway model's verbose was 0, and its n_steps=0 is left to SB3's assert, which needs an env
        check_on_policy_arguments({name: given[name] for name in ("verbose", "n_steps") if name in given}, min_n_steps=1)

    @classmethod
    def _check_load_keywords(cls, kwargs: dict[str, Any], data: dict[str, Any]) -> None:
        """
        SB3's ``load`` sets any keyword as an attribute, so a misspelled one (``kl_coeff=0.1``) would be set where
        nothing reads it: refuse, as the constructor does, a name that is no parameter, saved entry or attribute of the
        class but close to a parameter or saved entry (a name not close to any may be a deliberate new attribute).

        :raises TypeError: naming the closest parameter or saved entry
        """
        parameters = inspect.signature(cls.__init__).parameters
        for name in kwargs:
            if name in parameters or name in data or hasattr(cls, name):
                continue
            if closest_keyword(name, [*parameters, *data]) is not None:
                raise unexpected_keyword_error(f"{cls.__name__}.load()", name, [*parameters, *data])

    @classmethod
    def _default_policy_class(cls) -> type[BasePolicy]:
        """The class of the algorithm's first policy alias (e.g. ``MlpPolicy``, ``MlpLstmPolicy``)."""
        return next(iter(cls.policy_aliases.values()))

    @classmethod
    def _check_saved_policy_family(cls, path: Any, data: dict[str, Any]) -> None:
        """
        Refuse a zip whose policy is of another family (recurrent, maskable, feed-forward) than this algorithm's:
        SB3's ``load`` would build the model, which then fails in ``learn()`` with an error that does not say why.

        :raises ValueError: naming the algorithm that saved it and the class to load it with
        """
        saved = data.get("policy_class")
        module = saved.get("__module__", "") if isinstance(saved, dict) else ""
        families = {"sb3_contrib.common.recurrent": "recurrent", "sb3_contrib.common.maskable": "maskable"}
        saved_family = next((family for prefix, family in families.items() if module.startswith(prefix)), None)
        if saved_family is None and module == "stable_baselines3.common.policies":
            saved_family = "feed-forward"
        if saved_family is None:
            return  # a custom policy class: SB3's own checks apply
        own_module = cls._default_policy_class().__module__
        own_family = next((family for prefix, family in families.items() if own_module.startswith(prefix)), "feed-forward")
        if saved_family != own_family:
            loaders = {
                "recurrent": "RecurrentKLPPO",
                "maskable": "MaskableKLPPO",
                "feed-forward": "KLPPO, ClipKLPPO or KLTRPO",
            }
            raise ValueError(
                f"{_zip_name(path)} holds a {saved_family} policy ({module}); {cls.__name__} trains a {own_family} "
                f"one: load it with {loaders[saved_family]}."
            )

    @classmethod
    def _check_saved_kl_state_restores(cls, path: Any, data: dict[str, Any], given: dict[str, Any]) -> None:
        """
        SB3's ``load`` drops, with a warning, a saved object it cannot unpickle (a controller class or a schedule
        function that was moved or renamed, a lambda saved under another Python): the model would then continue with
        the constructor's default controller, beta and target instead of its saved KL state. Refuse that instead.

        :param given: ``load()``'s keyword arguments and ``custom_objects``: an entry given there replaces the saved one
        :raises ValueError: naming the entry and how to supply it
        """
        for name in cls._saved_kl_state:
            item = data.get(name)
            if name in given or not isinstance(item, dict) or ":serialized:" not in item:
                continue
            try:
                cloudpickle.loads(base64.b64decode(item[":serialized:"].encode()))
            except Exception as error:
                raise ValueError(
                    f"{_zip_name(path)}: the saved `{name}` cannot be restored ({type(error).__name__}: "
                    f"{error}). Without it the model would go on with the constructor's default instead of its saved KL "
                    f"state. Make the class or function it names importable again, or replace it at load: "
                    f"load(..., custom_objects={{'{name}': ...}})."
                ) from error

    #: The attributes the constructor builds from the KL options (:data:`FIXED_AT_CONSTRUCTION`)
    _kl_state_attributes: ClassVar[tuple[str, ...]] = ("kl_settings", "kl_controller", "ref_kl_settings", "ref_kl_controller")

    def _build_kl_state(self, options: dict[str, Any], given_coefficients: set[str], keep_reference: bool = False) -> None:
        """
        A model loaded from a stock zip (no KL state) got the constructor's default KL convention and controllers:
        build them from ``load()``'s KL options instead, as the constructor would (with its checks), e.g.
        ``KLTRPO.load("trpo.zip", kl_reduction="sb3_contrib")`` to keep TRPO's constraint. A zip of another KL family
        gets its KL convention and controller built the same way, its reference KL state kept (``keep_reference``).

        :param options: The options taken from ``load()``'s arguments by :func:`take_fixed_kl_options`
        :param given_coefficients: Which of ``kl_coef``/``ref_kl_coef`` ``load()`` was given (already applied to the
            default controllers: carried over to the new ones)
        :param keep_reference: Keep the reference policy's KL convention and controller as loaded
        """
        built = type(self)(policy=self.policy_class, env=None, device=self.device, _init_setup_model=False, **options)
        old = {name: getattr(self, name) for name in ("kl_controller", "ref_kl_controller")}
        for name in self._kl_state_attributes:
            if not (keep_reference and name.startswith("ref_")):
                setattr(self, name, getattr(built, name))
        self._resolve_kl_convention()
        for name in ("kl_controller", "ref_kl_controller"):
            coefficient = name.replace("_controller", "_coef")
            if coefficient in given_coefficients and old[name] is not None and getattr(self, name) is not None:
                getattr(self, name).kl_coef = old[name].kl_coef

    def _resolve_kl_convention(self) -> None:
        """Resolve a KL convention that depends on the action space, once it is known (none here)."""

    def _check_fixed_kl_options(self, options: dict[str, Any]) -> None:
        """
        Compare options given to ``load()`` that the model folded into its KL convention or controllers when it was
        built (:data:`FIXED_AT_CONSTRUCTION`) with the loaded model: the same value (an rl-zoo config passed again with
        ``--trained-agent``) is accepted, a different one raises a ``ValueError`` naming the option, as load() cannot
        apply it.

        :param options: The options taken from ``load()``'s arguments by :func:`take_fixed_kl_options`
        """
        for name, value in options.items():
            holder_name, attribute = FIXED_AT_CONSTRUCTION[name]
            holder = getattr(self, holder_name, None)
            if attribute is not None and not hasattr(holder, attribute):
                continue  # an option the saved controller's kind does not use (the constructor ignores it too)
            if attribute is None:  # a controller by name
                saved = next((key for key, kind in KL_CONTROLLERS.items() if type(holder) is kind), None)
            else:
                saved = getattr(holder, attribute)
            if _comparable(value) == _comparable(saved) or self._same_kl_option(name, value):
                continue
            if holder_name.endswith("controller"):
                fix = (
                    f"pass a controller object built with it instead ({holder_name}=...Controller(...) from "
                    "sb3_kl.common.controllers), which replaces the saved one"
                )
            else:
                fix = "build a new model with it (the saved run's KL figures were measured in the saved convention)"
            raise ValueError(
                f"`{name}`={value!r} cannot be applied by load(): the model was built with {name}={saved!r}, which is "
                f"part of its `{holder_name}`, restored as saved; {fix}."
            )

    def _same_kl_option(self, name: str, value: Any) -> bool:
        """
        Whether a ``load()`` option that does not equal the loaded model's setting still describes the same model: a
        reference controller's kind is not used with a fixed reference coefficient (``ref_target_kl=None``).
        """
        return name == "ref_kl_controller" and getattr(self, "ref_target_kl", None) is None

    def _warn_loaded_without_kl_state(self, path: Any, saved_by: str, given: set[str]) -> None:
        """
        Tell the user, once per load, that a stock model was loaded and its KL state starts fresh.

        :param path: What was loaded
        :param saved_by: The stock algorithm that most likely saved it
        :param given: Names of the attributes set by the saved data or by ``load()``'s keyword arguments
        """
        name = getattr(path, "name", path)
        if self.has_kl_coef:
            fresh = (
                f"the KL control starts fresh (kl_coef={self.kl_coef:g}"
                + ("" if "kl_coef" in given else ", pass kl_coef= to load() to choose it")
                + f", a new {type(self.kl_controller).__name__}, target_kl={self._current_target_kl():g}, on the KL "
                f"{self.kl_settings.convention})."
            )
        else:
            target = self._current_target_kl()  # None: TRPL bounding a W2 or Frobenius distance
            fresh = "it has no KL target."
            if target is not None:
                fresh = f"its KL constraint is target_kl={target:g} on the KL {self.kl_settings.convention}."
        notes = [
            f"{name} was saved by {saved_by}, without a KL state: its weights, optimizer state and hyperparameters are "
            f"loaded into {type(self).__name__} and {fresh}",
            *self._stock_convention_notes(saved_by, given),
        ]
        # e.g. an A2C model has no batch_size or n_epochs: the algorithm's defaults apply
        defaults = [
            f"{parameter.name}={parameter.default!r}"
            for parameter in inspect.signature(type(self).__init__).parameters.values()
            if parameter.name in ("batch_size", "n_epochs", "cg_max_steps", "n_critic_updates") and parameter.name not in given
        ]
        if defaults:
            notes.append(f"Not in the saved model, so {type(self).__name__}'s defaults: {', '.join(defaults)}.")
        clip_range = getattr(self, "clip_range", None)
        clip_parameter = inspect.signature(type(self).__init__).parameters.get("clip_range")
        if clip_range is not None and clip_parameter is not None and clip_parameter.default is None:
            notes.append(
                f"The saved ratio clip is kept (clip_range={clip_range(1.0):g}); pass clip_range=None to load() for "
                f"{type(self).__name__}'s default of no clipping."
            )
        notes.append("Saving the model stores the KL state with it.")
        warn_at_user_frame(" ".join(notes))

    def _stock_convention_notes(self, saved_by: str, given: set[str]) -> list[str]:
        """
        :param saved_by: The stock algorithm that most likely saved the loaded zip
        :param given: Names of the attributes set by the saved data or by ``load()``'s keyword arguments
        :return: what the stock-load warning says about a KL convention other than the stock algorithm's (none here)
        """
        return []

    @classmethod
    def _target_kl_meaning(cls, kl: str) -> str:
        """
        What ``target_kl`` is to the algorithm (:attr:`kl_family`), for the warning of a load across families.

        :param kl: The KL it is stated in, e.g. ``"KL(old||new)"``
        """
        return f"the target of the update's mean {kl}, toward which the adaptive penalty steers"

    @classmethod
    def _saved_target_note(cls, data: dict[str, Any]) -> str:
        """What the KL target meant to the model of this class that saved ``data`` (follows the class's name)."""
        target = saved_target_kl(data)
        return f"target_kl{'' if target is None else f' {target:g}'} was {cls._target_kl_meaning(saved_kl_name(data))}"

    def _loaded_target_note(self, given: set[str]) -> str:
        """
        :param given: Names given to ``load()`` as keyword arguments or ``custom_objects``
        :return: how the loaded model reads its ``target_kl``, and how to choose it
        """
        kl = "KL(old||new)" if self.kl_settings.direction == "forward" else "KL(new||old)"
        meaning = self._target_kl_meaning(kl)
        if "target_kl" in given:
            return f"{type(self).__name__} takes the target_kl given to load(), {self._current_target_kl():g}, as {meaning}"
        return f"{type(self).__name__} reads it as {meaning}: pass target_kl= to load() to choose it"

    def _warn_loaded_from_other_family(
        self, path: Any, saved_by: "type[KLOnPolicyAlgorithm]", data: dict[str, Any], given: set[str]
    ) -> None:
        """
        Tell the user, once per load, that a zip of another KL family was loaded: what its target meant, how this model
        reads it, and that the KL convention and controller start fresh.

        :param path: What was loaded
        :param saved_by: The class that saved it
        :param data: Its saved data
        :param given: Names given to ``load()`` as keyword arguments or ``custom_objects``
        """
        name = type(self).__name__
        configurable = "kl_direction" in inspect.signature(type(self).__init__).parameters
        notes = [
            f"{_zip_name(path)} was saved by {saved_by.__name__}, whose KL target means something else: its weights, "
            f"optimizer state and the hyperparameters {name} shares are loaded, its KL convention and controller are not.",
            f"{saved_by.__name__}'s {saved_by._saved_target_note(data)}; {self._loaded_target_note(given)}.",
            f"{name}'s KL is {self.kl_settings.description}"
            + (" (its default)" if configurable and not {"kl_direction", "kl_estimator", "kl_reduction"} & given else ""),
        ]
        if self.has_kl_coef:
            notes[-1] += f", and beta starts at kl_coef={self.kl_coef:g}" + (
                "" if "kl_coef" in given else " (pass kl_coef= to load() to choose it)"
            )
        notes[-1] += ". Saving the model stores its KL state with it."
        warn_at_user_frame(" ".join(notes))

    def _setup_learn(self, *args: Any, **kwargs: Any) -> Any:
        warn_if_many_threads(self.policy, self.device)  # once per process: see sb3_kl.common.threads
        return super()._setup_learn(*args, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    # Rollouts

    def collect_rollouts(
        self,
        env: VecEnv,
        callback: BaseCallback,
        rollout_buffer: RolloutBuffer,
        n_rollout_steps: int,
        *args: Any,
        **kwargs: Any,
    ) -> bool:
        """
        SB3's rollout collection; afterwards the buffer records which policy version collected it.
        Observations (including terminal ones) are checked for NaN/inf as they come out of ``env.step``, before the
        policy sees them, and the rewards once the rollout is complete, before ``train()`` (:class:`NonFiniteEnvCheck`).
        Further arguments (MaskablePPO's ``use_masking``) go to the parent class's collection.
        """
        check = NonFiniteEnvCheck(env, self.num_timesteps)
        check.check_observation(self._last_obs, what="observation (carried over from the last reset or step)")
        continue_training = super().collect_rollouts(check, callback, rollout_buffer, n_rollout_steps, *args, **kwargs)  # type: ignore[arg-type]
        if continue_training:
            check.check_rewards(rollout_buffer.rewards)
        if isinstance(rollout_buffer, KLBufferMixin):
            rollout_buffer.policy_version = self.policy_version
        return continue_training

    def _prepare_rollout_distribution(self) -> None:
        """
        Check the buffer belongs to the current policy and freeze the rollout distribution's parameters on it,
        once, before the first gradient step of the update.
        """
        self.rollout_buffer.check_policy_version(self.policy_version)
        if not self.rollout_buffer.old_distribution_ready:
            self.rollout_buffer.compute_old_distribution(self.policy)
        # learning_rate="auto": where the update's step starts (the rollout policy's parameters)
        self._step_start = [p.detach().clone() for p in self.policy.parameters()] if self.adapts_learning_rate else None

    def _finish_update(self) -> None:
        """Mark the policy as changed: the buffer just used is now stale."""
        self.policy_version += 1

    def _optimizer_step(self, loss: th.Tensor, optimizer: th.optim.Optimizer | None = None) -> th.Tensor:
        """
        zero_grad, backward, clip and step, then the variance floor (``min_std``); a non-finite loss or gradient norm
        skips the step. With fused Adam the skip is decided on the device (the kernel's ``found_inf``, as AMP's
        ``GradScaler`` uses it: no step, no moment or step-count change), so no host synchronisation is needed;
        other optimizers read the norm.

        :param loss: The loss to minimise
        :param optimizer: The optimizer to step; default the policy's
        :return: whether the step was applied (a boolean tensor on the device)
        """
        optimizer = self.policy.optimizer if optimizer is None else optimizer
        optimizer.zero_grad()
        loss.backward()
        # A non-finite loss gives non-finite gradients: one check of the norm covers both
        grad_norm = th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        finite = th.isfinite(grad_norm)
        if all(group.get("fused") for group in optimizer.param_groups) and type(optimizer) is th.optim.Adam:
            optimizer.found_inf = (~finite).float()  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        elif finite.item():
            optimizer.step()
        else:
            optimizer.zero_grad()
            return finite
        self._apply_variance_floor()
        return finite

    def _warn_if_truncated_minibatch(self, batch_size: int) -> None:
        """SB3's PPO warning: the rollout buffer is not a multiple of ``batch_size`` (each epoch ends on a short minibatch)."""
        if self.env is None:
            return
        buffer_size = self.env.num_envs * self.n_steps
        untruncated_batches = buffer_size // batch_size
        if buffer_size % batch_size > 0:
            warn_at_user_frame(
                f"You have specified a mini-batch size of {batch_size},"
                f" but because the `RolloutBuffer` is of size `n_steps * n_envs = {buffer_size}`,"
                f" after every {untruncated_batches} untruncated mini-batches,"
                f" there will be a truncated mini-batch of size {buffer_size % batch_size}\n"
                f"We recommend using a `batch_size` that is a factor of `n_steps * n_envs`.\n"
                f"Info: (n_steps={self.n_steps} and n_envs={self.env.num_envs})"
            )

    def _count_nonfinite_steps(self, applied_steps: th.Tensor | int, steps: int) -> None:
        """
        Add the update's skipped (non-finite) optimizer steps to ``nonfinite_steps_total`` (and keep them in
        ``_last_nonfinite_steps`` for ``train/nonfinite_steps``), or fail when no step of the update was applied.

        :param applied_steps: The update's applied optimizer steps (summed on the device: read here, once)
        :param steps: The optimizer steps it tried (:meth:`_optimizer_step`)
        """
        nonfinite_steps = steps - int(applied_steps)
        self._last_nonfinite_steps = nonfinite_steps
        if nonfinite_steps == steps and nonfinite_steps > 0:
            raise NonFiniteUpdateError(
                f"All {nonfinite_steps} optimizer steps of this update had a non-finite loss or gradient, so none was "
                "applied. Check the environment's observations and rewards for NaN/inf (wrap it with VecCheckNan), "
                "normalize them (VecNormalize), lower the learning rate, or set max_grad_norm."
            )
        self.nonfinite_steps_total += nonfinite_steps

    # ----------------------------------------------------------------------------------------------------------
    # KL pieces used inside the losses

    def _forward(self, obs: PyTorchObs) -> tuple[th.Tensor, Distribution]:
        """
        One forward pass of actor and critic.

        :param obs: Observations
        :return: the values ``(batch,)`` and the action distribution (with gradients)
        """
        features = self.policy.extract_features(obs)
        if self.policy.share_features_extractor:
            latent_pi, latent_vf = self.policy.mlp_extractor(features)
        else:
            pi_features, vf_features = features
            latent_pi = self.policy.mlp_extractor.forward_actor(pi_features)
            latent_vf = self.policy.mlp_extractor.forward_critic(vf_features)
        values = self.policy.value_net(latent_vf).flatten()
        return values, self._distribution_from_latent(latent_pi)

    def _distribution_from_latent(self, latent_pi: th.Tensor) -> Distribution:
        """
        The policy's action distribution on its actor latent; with gSDE the KL terms of the loss are differentiated
        through the features its std is built from (:func:`~sb3_kl.common.kl.attach_sde_features`).
        """
        distribution = self.policy._get_action_dist_from_latent(latent_pi)
        attach_sde_features(distribution, latent_pi, getattr(self.policy, "log_std", None))
        return distribution

    @staticmethod
    def _sample_masks(data: Any) -> th.Tensor | None:
        """The action masks a buffer sample carries (sb3-contrib's maskable buffers); None when it has none."""
        return getattr(data, "action_masks", None)

    def _forward_samples(self, data: Any) -> tuple[th.Tensor, Distribution]:
        """
        :meth:`_forward` on a buffer sample's observations, with the sample's action masks applied when it has some.

        :param data: A minibatch from the rollout buffer
        :return: the values ``(batch,)`` and the action distribution (with gradients)
        """
        values, distribution = self._forward(data.observations)
        masks = self._sample_masks(data)
        if masks is not None:
            distribution.apply_masking(masks)  # type: ignore[attr-defined]
        return values, distribution

    def _samples_distribution(self, policy: BasePolicy, data: Any) -> Distribution:
        """
        ``policy``'s action distribution on a buffer sample's states, masked with the sample's action masks if any.

        :param policy: The policy (the algorithm's or a reference)
        :param data: Samples from the rollout buffer
        """
        masks = self._sample_masks(data)
        if masks is None:
            return policy.get_distribution(data.observations)  # type: ignore[attr-defined]
        return policy.get_distribution(data.observations, action_masks=masks)  # type: ignore[attr-defined]

    def _normalized_advantages(self, advantages: th.Tensor) -> th.Tensor:
        """Normalize the minibatch's advantages when ``normalize_advantage`` (not for a single sample, see SB3 GH#325)."""
        if self.normalize_advantage and len(advantages) > 1:  # type: ignore[attr-defined]
            return (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        return advantages

    def _actions_for_log_prob(self, actions: th.Tensor) -> th.Tensor:
        """Stored actions as ``log_prob`` takes them (:func:`sb3_kl.common.kl.actions_for_log_prob`)."""
        return actions_for_log_prob(actions, self.action_space)

    def _per_state_kl(self, old_params: th.Tensor, distribution: Distribution, log_ratio: th.Tensor | None) -> th.Tensor:
        """
        Per-state KL between the rollout policy and ``distribution``, in the algorithm's convention.

        :param old_params: Rollout-policy parameters from the buffer
        :param distribution: The current policy's distribution on the same states
        :param log_ratio: log pi_new(a|s) - log pi_old(a|s) of the stored actions (needed by k1/k3)
        :return: ``(batch,)``
        """
        return per_state_kl_to(self.kl_settings, self.dist_params, old_params, distribution, log_ratio)

    def _log_probs_for_kl(
        self, distribution: Distribution, actions: th.Tensor, log_prob: th.Tensor, old_log_prob: th.Tensor
    ) -> tuple[th.Tensor, th.Tensor]:
        """
        The log-probabilities of the stored actions and the log-ratio that the loss's KL terms (the sample estimates
        of the update KL and the reference KL) are built from: ``log_prob`` and ``log_prob - old_log_prob`` in value,
        with gSDE differentiable through the features as the analytic KL is (:func:`~sb3_kl.common.kl.kl_log_prob`).
        When no KL term of the loss is a sample estimate (analytic ``kl_estimator``, and no reference policy or an
        analytic ``ref_kl_estimator``), nothing differentiates them: ``log_prob`` itself is returned and gSDE's
        log-probabilities are not computed a second time.

        :param distribution: The current policy's distribution
        :param actions: The stored actions, as ``distribution.log_prob`` takes them
        :param log_prob: ``distribution.log_prob(actions)``
        :param old_log_prob: The rollout policy's log-probabilities of the actions
        :return: ``(log_prob, log_ratio)`` for the KL terms
        """
        sampled = self.kl_settings.estimator != "analytic" or (
            self.ref_policy is not None and self.ref_kl_settings.estimator != "analytic"
        )
        attached = kl_log_prob(distribution, actions, log_prob) if sampled else log_prob
        return attached, attached - old_log_prob

    def __setattr__(self, name: str, value: Any) -> None:
        # ``model.target_kl = 0.05`` after construction, as SB3's PPO takes it: checked as the constructor does and
        # kept as the schedule the algorithm (and ``model.target_kl(progress)``) reads
        if name == "target_kl" and self.__dict__.get("_target_kl_is_schedule", False):
            check_schedule("target_kl", value, allow_none=True, allow_zero_at_end=True)
            value = self._target_kl_schedule(value)
        super().__setattr__(name, value)

    def _target_kl_schedule(self, target_kl: float | Schedule | None) -> Schedule:
        """
        :param target_kl: A ``target_kl`` as the constructor takes it (None: the default of the action space)
        :return: it as a schedule (SB3's picklable ``FloatSchedule``)
        """
        if target_kl is None:
            target_kl = DEFAULT_TARGET_KL["continuous" if isinstance(self.action_space, spaces.Box) else "discrete"]
        return as_schedule(target_kl)

    def _update_learning_rate(self, optimizers: list[th.optim.Optimizer] | th.optim.Optimizer) -> None:
        if self.adapts_learning_rate and isinstance(self.lr_schedule, AdaptiveLRSchedule):
            self.lr_schedule.learning_rate = self.adapted_learning_rate  # type: ignore[assignment]
        # the schedule's value is checked where it is used (a negative one would ascend the loss)
        scheduled_value("learning_rate", self.lr_schedule, self._current_progress_remaining, allow_zero=True)
        super()._update_learning_rate(optimizers)
        if self.adapts_learning_rate:
            # the value function's own group: its loss has no KL, so the policy's rate falling to meet the target does
            # not slow it below the starting rate; it rises with the policy's
            value_rate = max(parse_auto_learning_rate(self.learning_rate), self.adapted_learning_rate)  # type: ignore[type-var]
            for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
                for group in optimizer.param_groups:
                    if group.get(VALUE_GROUP_KEY):
                        group["lr"] = value_rate

    def _current_clip_ranges(self) -> tuple[float | None, float | None]:
        """
        ``clip_range`` and ``clip_range_vf`` (the PPO family's) at the current progress, None where not set: the
        schedules' values are checked where they are used (a linear schedule may reach 0 at the end).
        """
        progress = self._current_progress_remaining
        return tuple(  # type: ignore[return-value]
            None if schedule is None else scheduled_value(name, schedule, progress, allow_zero=True)
            for name, schedule in (
                ("clip_range", getattr(self, "clip_range", None)),
                ("clip_range_vf", getattr(self, "clip_range_vf", None)),
            )
        )

    def _current_target_kl(self) -> float:
        """
        The KL target of the current update (:func:`~sb3_kl.common.validation.scheduled_target_kl`: past the budget a
        schedule is read at its end). Where a schedule decays to 0 (rl-zoo's ``lin_0.02``) the last update uses the
        floor :data:`~sb3_kl.common.validation.MIN_TARGET_KL` (KLTRPO's step is then almost 0; KLPPO's beta, set after
        each update, follows the target one update late, as always).
        """
        return scheduled_target_kl(self.target_kl, self._current_progress_remaining)

    # ----------------------------------------------------------------------------------------------------------
    # After the update

    @th.no_grad()
    def _measure_update_kl(self, chunk_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """
        One no-grad pass over the whole buffer with the updated policy (eval mode, as it will act). The KL is computed
        in float64 from the two policies' (float32) distribution parameters: a per-state KL is a small difference of
        log-probabilities, and in float32 the logged quantiles of states that barely moved, and the KL that drives
        beta and KLTRPO's bound near a target close to 0, would carry rounding of up to ~1e-4 of their value.

        :return: the per-state KL in the algorithm's convention (float64), and the updated policy's distribution
            parameters
        """
        kls, params = [], []
        with acting_mode(self.policy):
            for data in self.rollout_buffer.ordered_samples(chunk_size):
                distribution = self._samples_distribution(self.policy, data)
                log_ratio = distribution.log_prob(self._actions_for_log_prob(data.actions)) - data.old_log_prob
                new_params = self.dist_params.extract(distribution)
                inputs = as_float64(data.old_dist_params, new_params, log_ratio)
                kls.append(per_state_kl(self.kl_settings, self.dist_params, *inputs))
                params.append(new_params)
        return th.cat(kls).cpu().numpy(), th.cat(params).cpu().numpy()

    @th.no_grad()
    def _measure_first_epoch_kl(self, epoch: int) -> None:
        """
        With ``learning_rate="auto"``, at the end of the update's first epoch (``epoch`` 0) of several: the exact KL over
        the rollout's states (one no-grad pass), from which the next update's rate is set (see
        :mod:`~sb3_kl.common.learning_rate`).

        :param epoch: Index of the epoch just finished
        """
        if epoch == 0 and self.adapts_learning_rate and self.n_epochs > 1:
            # also read by the epoch-end stop's judgement of the same policy (KLPPO._kl_ran_away): one pass, not two
            self._first_epoch_measured = self._measure_update_kl()

    @th.no_grad()
    def _measure_final_update_kl(
        self, target_kl: float, measured: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """
        The update's KL as :meth:`_measure_update_kl` gives it (or ``measured``, already taken on the final policy).
        With ``learning_rate="auto"``, an update whose KL ends outside the guard's band has its whole parameter change
        first scaled just inside it (:func:`~sb3_kl.common.learning_rate.find_step_scale`, logged as
        ``train/step_scale``), and the next update's learning rate is this one times the factor that would have given
        the first epoch its share of the target (:func:`~sb3_kl.common.learning_rate.rate_factor`, the first epoch's
        KL logged as ``train/first_epoch_kl``), within ``lr_bounds``.

        :return: the per-state KL and the distribution parameters of the policy the update leaves
        """
        per_state, new_params = measured or self._measure_update_kl()
        start, self._step_start = getattr(self, "_step_start", None), None
        first_epoch, self._first_epoch_measured = getattr(self, "_first_epoch_measured", None), None
        first_epoch_kl = None if first_epoch is None else float(np.mean(first_epoch[0]))
        if not self.adapts_learning_rate or start is None:
            return per_state, new_params
        kl_full = float(np.mean(per_state))
        # beta adapts from the KL the epochs left (read by _record_update_kl), not from the guard's correction
        self._unscaled_update_kl = kl_full if math.isfinite(kl_full) else None
        scale, kept = 1.0, (per_state, new_params)
        if not in_guard_band(kl_full, target_kl):
            scale, kept = self._scale_step(start, target_kl, kl_full, kept)
        goal = first_epoch_share(self.n_epochs) * target_kl
        if first_epoch_kl is None:  # one epoch, or stopped within the first: the update's own KL
            first_epoch_kl = kl_full
        else:
            self.logger.record("train/first_epoch_kl", first_epoch_kl)
        # (rate, first-epoch KL, unscaled KL) of recent updates (saved with the model)
        rate = self.adapted_learning_rate
        history = [*self._rate_history[1 - RATE_RESPONSE_WINDOW :], (rate, first_epoch_kl, kl_full)]
        self._rate_history = history
        first_epochs = [(entry[0], entry[1]) for entry in history]
        updates = [(entry[0], entry[2] if len(entry) > 2 else math.nan) for entry in history]
        # the first epoch's share of the target; where the later epochs leave the update below the band, the rate that
        # brings the update to the target if larger
        factor = max(
            rate_factor(recent_kl(first_epochs, rate), goal),  # type: ignore[arg-type]
            rate_factor(recent_kl(updates, rate), target_kl) if kl_full < GUARD_BAND[0] * target_kl else 0.0,  # type: ignore[arg-type]
        )
        if factor > 1.0 and not rate_follows_kl(*zip(*first_epochs, strict=True)):
            factor = 1.0  # the clip range holds the update: a higher rate would buy no KL
        low, high = self.lr_bounds
        self.adapted_learning_rate = min(max(rate * factor, low), high)  # type: ignore[operator]
        self.logger.record("train/unscaled_kl", kl_full)
        self.logger.record("train/step_scale", scale)
        return kept

    def _scale_step(
        self, start: list[th.Tensor], target_kl: float, kl_full: float, measured: tuple[np.ndarray, np.ndarray]
    ) -> tuple[float, tuple[np.ndarray, np.ndarray]]:
        """
        Scale the update's parameter change (from ``start``, the rollout policy's parameters) so that its KL lands just
        inside the guard's band (:func:`~sb3_kl.common.learning_rate.guard_aim`); the value-only parameters keep theirs.

        :param measured: The KL and distribution parameters of the whole step (scale 1)
        :return: the chosen scale, and the KL and distribution parameters of the policy it leaves
        """
        value_only = {id(param) for param in value_only_parameters(self.policy)}
        pairs = zip(self.policy.parameters(), start, strict=True)
        moved = [(param, first) for param, first in pairs if id(param) not in value_only]
        end = [param.detach().clone() for param, _ in moved]
        measurements = {1.0: measured}

        def move_to(scale: float) -> None:
            for (param, first), last in zip(moved, end, strict=True):
                param.copy_(last if scale == 1.0 else th.lerp(first, last, scale))
            self._apply_variance_floor()

        def kl_at(scale: float) -> float:
            move_to(scale)
            measurements[scale] = self._measure_update_kl()
            return float(np.mean(measurements[scale][0]))

        scale, _ = find_step_scale(kl_at, kl_full, *guard_aim(kl_full, target_kl))
        move_to(scale)
        return scale, measurements[scale]

    def _record_update_kl(
        self,
        per_state: np.ndarray,
        new_params: np.ndarray,
        target_kl: float | None,
        hold_kl_coef: bool = False,
    ) -> dict[str, float]:
        """
        Log the KL of the update (``train/kl``, quantiles, max), adjust beta from its mean and log it (only for an
        algorithm with a KL coefficient, :attr:`has_kl_coef`).

        :param per_state: Per-state KL of the update
        :param new_params: Updated policy's distribution parameters on the buffer
        :param target_kl: Current target (None: the algorithm has no KL target, ``train/target_kl`` is not logged)
        :param hold_kl_coef: Do not lower beta: the update was ended by the stop at beta's upper bound
            (``kl_saturation_stop_factor``), so its KL is the stop's doing, not beta's, and lowering beta after a stop
            that came early would only let the next update run away. The controller still records the KL and may
            raise beta (from one step below its bound, to the bound)
        :return: the KL statistics
        """
        stats = kl_quantiles(per_state, self.kl_quantiles)
        if not math.isfinite(stats["mean"]):
            raise NonFiniteUpdateError(
                "The KL between the rollout and the updated policy is not finite: the policy's outputs overflowed. "
                "Check observations and rewards for NaN/inf (VecCheckNan), lower the learning rate or set max_grad_norm."
            )
        for name, value in stats.items():
            self.logger.record("train/kl" if name == "mean" else f"train/kl_{name}", value)
        self.logger.record("train/kl_convention", self.kl_settings.convention, exclude="tensorboard")
        if target_kl is not None:
            self.logger.record("train/target_kl", target_kl)
        if self.has_kl_coef and target_kl is not None:
            # learning_rate="auto": the KL the epochs left, before the guard's step scale
            controller_kl, self._unscaled_update_kl = getattr(self, "_unscaled_update_kl", None), None
            controller_kl = stats["mean"] if controller_kl is None else controller_kl
            self.kl_controller.update(controller_kl, target_kl, self.n_steps * self.n_envs, allow_decrease=not hold_kl_coef)
            self.logger.record("train/kl_coef", self.kl_coef)
            self._check_kl_coef_floor(stats["mean"], target_kl)
            band = getattr(self.kl_controller, "kl_band", None)
            if band is not None:  # read by ``sb3-kl plot/report``, which draw the band the run used
                self.logger.record("train/kl_band_low", float(band[0]), exclude="stdout")
                self.logger.record("train/kl_band_high", float(band[1]), exclude="stdout")
        if isinstance(self.dist_params, GaussianParams):
            # the per-state action std (with gSDE it differs from ``train/std``, SB3's std of the exploration weights)
            action_std = np.exp(new_params[:, self.dist_params.action_dim :])
            self.logger.record("train/action_std_min", float(action_std.min()))
            self.logger.record("train/action_std_mean", float(action_std.mean()))
        return stats

    def _check_kl_coef_floor(self, update_kl: float, target_kl: float) -> None:
        """
        Count the consecutive updates with beta at the lower bound of ``kl_coef_bounds`` and the update's KL below
        :data:`STALLED_KL_FRACTION` of the target; at :data:`STALLED_AT_FLOOR_UPDATES`, warn once (and print with
        ``verbose >= 1``): beta cannot lower the penalty further, so the KL is held down by something else.

        :param update_kl: The update's mean KL
        :param target_kl: The update's target
        """
        low = getattr(self.kl_controller, "kl_coef_bounds", (None, None))[0]
        at_floor = low is not None and self.kl_coef <= low * (1 + 1e-9)
        if not (at_floor and update_kl < STALLED_KL_FRACTION * target_kl):
            self.kl_coef_floor_updates = 0
            return
        self.kl_coef_floor_updates += 1
        if self.kl_coef_floor_updates < STALLED_AT_FLOOR_UPDATES or self.kl_coef_floor_warned:
            return
        self.kl_coef_floor_warned = True
        message = (
            f"{type(self).__name__}: beta (kl_coef) has sat at the lower bound {low:g} of `kl_coef_bounds` for "
            f"{self.kl_coef_floor_updates} consecutive updates, each with a KL below {STALLED_KL_FRACTION:g} x "
            f"target_kl (last update: {update_kl:.3g} against {target_kl:.3g}). The penalty is not what holds the KL "
            "down: most likely the learning rate is too small, or decays too fast, for this target (or `target_kl` "
            "is too large). Fixes: "
            + (
                'learning_rate="auto", which adapts the learning rate to the target (docs: learning_rate="auto"), '
                if self.supports_auto_learning_rate
                else ""
            )
            + "sb3_kl.callbacks.KLAdaptiveLRCallback, which does so from outside, or a smaller `target_kl`."
        )
        warn_and_print(message, self.verbose)

    def _check_clip_holds_rate(self, clip_fraction: float, clip_range: float) -> None:
        """
        With ``learning_rate="auto"``, count the consecutive updates whose clip fraction is at least
        :data:`CLIP_HOLDS_FRACTION`; at :data:`STALLED_AT_FLOOR_UPDATES`, warn once (and print with ``verbose >= 1``):
        where the clip range holds the update, a higher rate buys little KL and the adapted rate climbs instead.

        :param clip_fraction: The update's mean clip fraction
        :param clip_range: The update's clip range
        """
        if not (self.adapts_learning_rate and clip_fraction >= CLIP_HOLDS_FRACTION):
            self.clip_holds_updates = 0
            return
        self.clip_holds_updates += 1
        if self.clip_holds_updates < STALLED_AT_FLOOR_UPDATES or self.clip_holds_warned:
            return
        self.clip_holds_warned = True
        start = parse_auto_learning_rate(self.learning_rate)
        message = (
            f"{type(self).__name__}: with learning_rate={self.learning_rate!r}, the clip range ({clip_range:g}) has held "
            f"most of the update (clip fraction >= {CLIP_HOLDS_FRACTION:g}) for {self.clip_holds_updates} consecutive "
            "updates: a higher learning rate then buys little KL, and the adapted rate climbs instead (now "
            f"{self.adapted_learning_rate:.3g}, {self.adapted_learning_rate / start:.3g} x its start). Fixes: "  # type: ignore[operator]
            "`clip_range=None` (KLPPO's default: beta and the step scale hold each update's KL), or a `target_kl` the "
            "clip range allows."
        )
        warn_and_print(message, self.verbose)

    # ----------------------------------------------------------------------------------------------------------
    # Variance floor

    def _min_log_std_parameter(self) -> float | None:
        """
        The value below which ``policy.log_std`` is clamped so that std >= min_std (None without a floor).
        For gSDE this floors the std of the exploration weights (``expln`` and its epsilon taken into account): the
        same definition as ``VarianceFloorCallback``'s, :func:`~sb3_kl.common.variance.min_log_std_parameter`.
        """
        if self.min_std is None:
            return None
        return min_log_std_parameter(self.policy.action_dist, self.min_std)

    @th.no_grad()
    def _apply_variance_floor(self) -> None:
        """Clamp ``log_std`` in place so the Gaussian's std is at least ``min_std``."""
        floor = self._min_log_std_parameter()
        if floor is not None:
            self.policy.log_std.clamp_(min=floor)
