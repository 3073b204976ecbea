"""
Callbacks that control an SB3 on-policy agent: KLAdaptiveLRCallback (learning rate driven by the exact KL of each
update) and VarianceFloorCallback (std floor of a Gaussian policy after every optimizer step).
Re-exported by :mod:`sb3_kl.callbacks`.
"""

import math
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.distributions import DiagGaussianDistribution, StateDependentNoiseDistribution
from stable_baselines3.common.type_aliases import Schedule
from stable_baselines3.common.utils import update_learning_rate

from sb3_kl.common.callbacks_monitor import KLMonitorCallback, MonitorUser
from sb3_kl.common.keywords import SuggestsKeywords
from sb3_kl.common.learning_rate import AdaptiveLRSchedule
from sb3_kl.common.validation import (
    MIN_TARGET_KL,
    as_schedule,
    check_int,
    check_pair,
    check_positive,
    check_schedule,
    target_kl_value,
)
from sb3_kl.common.variance import min_log_std_parameter


class KLAdaptiveLRCallback(MonitorUser):
    """
    Adapt the learning rate so that the KL of each update, as the monitor measures it (by default exact), tracks
    ``target_kl``: after every measured update,
    if KL > ``band[1] * target_kl`` the learning rate is divided by ``factor``, if KL < ``band[0] * target_kl`` it is
    multiplied by ``factor``, and it is kept within ``lr_bounds``. This is the rule popular in legged-robot training
    (e.g. rsl_rl's "adaptive" schedule), applied per update to the exact KL instead of per minibatch to an estimate.

    While attached, it replaces ``model.lr_schedule`` by an :class:`AdaptiveLRSchedule` (so SB3's
    ``_update_learning_rate`` at the start of ``train()`` uses the adapted value instead of the configured schedule) and
    restores the original schedule at the end of training. The starting learning rate is the configured schedule's
    value at the start of ``learn()`` (clipped to ``lr_bounds``); a callback reused for another ``learn()`` continues
    from its last value. Logs ``kl/learning_rate``, the learning rate chosen for the *next* update, in the same log
    row as the update it was chosen from (SB3's ``train/learning_rate`` in that row is the rate that update used).

    A model saved while the callback is attached (e.g. by ``CheckpointCallback``) saves fine, but ``load()`` rebuilds
    ``lr_schedule`` from the configured ``learning_rate``: to resume with the adapted value, pass the same callback
    to the next ``learn()``, or ``load(path, learning_rate=callback.learning_rate)``.

    It controls the optimizer of ``model.policy``; for sb3-contrib's TRPO that is the critic's optimizer only (TRPO's
    policy step is a line search with its own ``target_kl``), so it has no effect on TRPO's KL.

    :param target_kl: Target of the mean per-state KL (number or schedule of progress remaining), in the convention of the
        monitor (default: forward, analytic, summed over action dimensions)
    :param factor: Multiplicative step (> 1), default 1.5
    :param band: ``(low, high)`` multiples of the target between which the learning rate is left unchanged,
        default ``(0.5, 2.0)``
    :param lr_bounds: ``(min, max)`` learning rate, default ``(1e-6, 0.1)``
    :param monitor: A :class:`KLMonitorCallback` also passed to ``learn()``, whose measurements are used;
        None: measure privately
    :param verbose: Verbosity level: 0 no output, 1 print every change of learning rate
    """

    def __init__(
        self,
        target_kl: float | Schedule,
        factor: float = 1.5,
        band: tuple[float, float] = (0.5, 2.0),
        lr_bounds: tuple[float, float] = (1e-6, 0.1),
        monitor: KLMonitorCallback | None = None,
        verbose: int = 0,
    ):
        super().__init__(monitor, verbose)
        check_schedule("target_kl", target_kl, allow_zero_at_end=True)
        check_positive("factor", factor)
        if factor <= 1.0:
            raise ValueError(f"`factor` must be > 1 (the learning rate is multiplied or divided by it), got {factor!r}.")
        self.target_kl = as_schedule(target_kl)
        self.factor = float(factor)
        self.band = check_pair("band", band)
        self.lr_bounds = check_pair("lr_bounds", lr_bounds)
        self.learning_rate: float | None = None
        self._original_schedule: Schedule | None = None
        self._schedule: AdaptiveLRSchedule | None = None

    def _clip(self, learning_rate: float) -> float:
        return min(max(learning_rate, self.lr_bounds[0]), self.lr_bounds[1])

    def _on_training_start(self) -> None:
        if getattr(self.model, "adapts_learning_rate", False):
            raise ValueError(
                f"{type(self).__name__}: {type(self.model).__name__} already adapts its learning rate "
                f"(learning_rate={self.model.learning_rate!r}); remove the callback, or give the model a number."
            )
        super()._on_training_start()
        if self.learning_rate is None:
            # SB3 updates the progress remaining only after the first rollout: until then it holds the end of the
            # previous learn() (or of the run a loaded model was saved from), so take the value it will compute
            progress = 1.0 - float(self.model.num_timesteps) / float(self.model._total_timesteps)
            self.learning_rate = self._clip(float(self.model.lr_schedule(progress)))
        self._original_schedule = self.model.lr_schedule
        self._schedule = AdaptiveLRSchedule(self.learning_rate)
        self.model.lr_schedule = self._schedule
        update_learning_rate(self.model.policy.optimizer, self.learning_rate)
        self.logger.record("kl/learning_rate", self.learning_rate)

    def _on_kl_measured(self, record: dict[str, Any], per_state: np.ndarray) -> None:
        if not self._active or self.learning_rate is None or self._schedule is None:
            return
        kl = record["mean"]
        value = target_kl_value(self.target_kl, self.model._current_progress_remaining)
        target = max(value, MIN_TARGET_KL)
        self._record_target(target)
        old = self.learning_rate
        if not math.isfinite(kl):
            self.learning_rate = self._clip(old / self.factor)
        elif value > 0:  # a schedule that has decayed to 0 sets no size: the rate is kept
            if kl > self.band[1] * target:
                self.learning_rate = self._clip(old / self.factor)
            elif kl < self.band[0] * target:
                self.learning_rate = self._clip(old * self.factor)
        self._schedule.learning_rate = self.learning_rate
        update_learning_rate(self.model.policy.optimizer, self.learning_rate)
        record["learning_rate"] = self.learning_rate
        self.logger.record("kl/learning_rate", self.learning_rate)
        if self.verbose >= 1 and self.learning_rate != old:
            print(
                f"{type(self).__name__}: KL {kl:.4g} vs target {target:.4g}: "
                f"learning rate {old:.3g} -> {self.learning_rate:.3g}"
            )

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        super()._on_training_end()  # measures the last update (its adaptation is kept for a next learn())
        if self._original_schedule is not None:
            self.model.lr_schedule = self._original_schedule
            self._original_schedule = None


class VarianceFloorCallback(SuggestsKeywords, BaseCallback):
    """
    Keep a Gaussian policy's standard deviation at or above ``min_std`` after every optimizer step.

    An optimizer step post-hook (``torch.optim.Optimizer.register_step_post_hook``) clamps ``policy.log_std`` in place
    after each step of ``model.policy.optimizer``, so neither the rest of the update nor the next rollout sees a
    collapsed Gaussian; the floor is also applied once at the start of training. The hook is removed at the end of
    training. With gSDE the floor applies to the std of the exploration weights (``use_expln`` taken into account,
    with SB3's epsilon; the same floor as the algorithms' ``min_std``, :func:`~sb3_kl.common.variance.min_log_std_parameter`);
    the action std also scales with the state features.

    Logs after each update ``variance/std_min`` (the smallest std parameter) and ``variance/floored_dims`` (how many
    entries of ``log_std`` sit at the floor). A policy without a Gaussian ``log_std`` (discrete actions) raises a
    ``ValueError`` at the start of training.

    :param min_std: The floor of the standard deviation (> 0)
    :param verbose: Verbosity level
    """

    def __init__(self, min_std: float, verbose: int = 0):
        check_int("verbose", verbose, 0)
        super().__init__(verbose)
        check_positive("min_std", min_std)
        self.min_std = float(min_std)
        self.n_clamps = 0
        self._floor: float | None = None
        self._handle: Any = None

    def _init_callback(self) -> None:
        policy = self.model.policy
        action_dist = getattr(policy, "action_dist", None)
        if not isinstance(getattr(policy, "log_std", None), th.Tensor) or not isinstance(
            action_dist, (DiagGaussianDistribution, StateDependentNoiseDistribution)
        ):
            raise ValueError(
                f"VarianceFloorCallback(min_std={self.min_std}) needs a Gaussian policy with a `log_std` parameter (Box "
                f"actions); this policy's action distribution is {type(action_dist).__name__}, which has no variance to "
                "floor. Remove the callback for discrete action spaces."
            )
        self._floor = min_log_std_parameter(action_dist, self.min_std)

    def _clamp(self) -> bool:
        """:return: whether some ``log_std`` was below the floor (and is now at it)"""
        with th.no_grad():
            log_std = self.model.policy.log_std
            if bool((log_std < self._floor).any()):
                self.n_clamps += 1
                log_std.clamp_(min=self._floor)
                return True
        return False

    def _on_training_start(self) -> None:
        self._clamp()
        if self._handle is None:
            self._handle = self.model.policy.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._clamp())

    @th.no_grad()
    def _std(self) -> th.Tensor:
        """The std parameters (gSDE: of the exploration weights, with ``expln`` when set)."""
        policy = self.model.policy
        if isinstance(policy.action_dist, StateDependentNoiseDistribution):
            return policy.action_dist.get_std(policy.log_std.detach())
        return th.exp(policy.log_std.detach())

    def _record(self) -> None:
        std_min = float(self._std().min())
        floored = int((self.model.policy.log_std.detach() <= self._floor + 1e-7).sum())
        self.logger.record("variance/std_min", std_min)
        self.logger.record("variance/floored_dims", floored)

    def _on_rollout_start(self) -> None:
        # A line search (TRPO, KLTRPO) writes the policy's parameters without an optimizer step, so the hook does not
        # see it; with n_critic_updates=0 no step follows either: the floor is applied before every rollout. SB3 draws
        # gSDE's exploration matrix just before this hook: drawn with the std below the floor, it is drawn again
        if self._clamp() and self.model.use_sde:
            self.model.policy.reset_noise(self.model.env.num_envs)
        self._record()

    def _on_training_end(self) -> None:
        self._clamp()
        self._record()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_step(self) -> bool:
        return True
