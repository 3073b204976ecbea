"""
Callbacks that measure and control the KL of each update of any SB3 on-policy agent
(``PPO``, ``A2C``, sb3-contrib ``TRPO`` and ``MaskablePPO``, and the sb3_kl algorithms).

- :class:`KLMonitorCallback` measures the per-state KL between the rollout and the updated policy of every update
  on the rollout's states (by default the exact KL(pi_rollout || pi_updated), summed over action dimensions) and logs
  its mean, quantiles, tail, entropy and more under ``kl/``.
- :class:`KLAdaptiveLRCallback` multiplies the learning rate up or down after each update so that this KL tracks a
  target.
- :class:`VarianceFloorCallback` keeps a Gaussian policy's std above a floor after every optimizer step.
- :class:`KLAlarmCallback` turns known failure signs (negative KL, runaway KL, pinned beta, heavy tail,
  gradient-ratio drift) into logged, warned and recorded alarms, and can stop training.

When the KL is measured (see SB3's hook order): the rollout policy's distribution parameters are snapshotted on the
rollout buffer's observations in ``_on_rollout_end`` (right before ``train()``); the updated policy is evaluated on the
same states in the next ``_on_rollout_start`` (the first hook after ``train()``), or in ``_on_training_end`` for the
last update. Values are recorded with the model's logger, so they are written by the next ``dump_logs``, together
with SB3's own ``train/`` values of the same update; the last update of ``learn()`` is never dumped (as for SB3's
``train/`` keys) but stays in ``model.logger.name_to_value``. The statistics of every measured update, including the
last one, are kept in ``KLMonitorCallback.history``.
"""

from sb3_kl.common.callbacks_alarm import KLAlarm, KLAlarmCallback
from sb3_kl.common.callbacks_control import AdaptiveLRSchedule, KLAdaptiveLRCallback, VarianceFloorCallback
from sb3_kl.common.callbacks_monitor import (
    HISTORY_KEYS,
    KLMonitorCallback,
    distribution_params_for_policy,
    model_target_kl,
    target_kl_settings,
)

__all__ = [
    "HISTORY_KEYS",
    "AdaptiveLRSchedule",
    "KLAdaptiveLRCallback",
    "KLAlarm",
    "KLAlarmCallback",
    "KLMonitorCallback",
    "VarianceFloorCallback",
    "distribution_params_for_policy",
    "model_target_kl",
    "target_kl_settings",
]
