"""
Rollout buffers of :class:`~sb3_kl.MaskableKLPPO`: sb3-contrib's maskable buffers (the action masks of every step)
plus the KL fields of :class:`~sb3_kl.common.buffers.KLBufferMixin` (the rollout policy's distribution, computed
with the stored masks, and the version of the policy that collected the data).
"""

from typing import Any, NamedTuple

import numpy as np
import torch as th
from sb3_contrib.common.maskable.buffers import MaskableDictRolloutBuffer, MaskableRolloutBuffer
from sb3_contrib.common.maskable.distributions import make_masked_proba_distribution
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import TensorDict
from stable_baselines3.common.vec_env import VecNormalize

from sb3_kl.common.buffers import KLBufferMixin
from sb3_kl.common.callbacks_monitor import distribution_params_for_policy
from sb3_kl.common.kl import DistributionParams


class MaskableKLRolloutBufferSamples(NamedTuple):
    observations: th.Tensor
    actions: th.Tensor
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    action_masks: th.Tensor
    # parameters of the rollout policy's (masked) action distribution at each state, (batch, n_params)
    old_dist_params: th.Tensor


class MaskableKLDictRolloutBufferSamples(NamedTuple):
    observations: TensorDict
    actions: th.Tensor
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    action_masks: th.Tensor
    old_dist_params: th.Tensor


class MaskableKLBufferMixin(KLBufferMixin):
    """
    :class:`~sb3_kl.common.buffers.KLBufferMixin` for buffers that store action masks: the rollout policy's
    distribution is evaluated with each state's masks (masked logits are -1e8: probability 0), in the parameter layout
    of sb3-contrib's maskable distributions (``MultiBinary`` is two categories per binary action there).
    """

    action_masks: np.ndarray
    mask_dims: int

    def _distribution_params(self) -> DistributionParams:
        return distribution_params_for_policy(make_masked_proba_distribution(self.action_space))

    def _distribution(self, policy: BasePolicy, obs: Any, rows: slice) -> Distribution:
        # Same flat order as the observations: (step, env) before get() flattens the buffer, env-major after
        masks = self.action_masks.reshape(self.buffer_size * self.n_envs, self.mask_dims)[rows]
        return policy.get_distribution(obs, action_masks=self.to_torch(masks))  # type: ignore[attr-defined]


class MaskableKLRolloutBuffer(MaskableKLBufferMixin, MaskableRolloutBuffer):
    """
    sb3-contrib's :class:`~sb3_contrib.common.maskable.buffers.MaskableRolloutBuffer` plus the rollout policy's
    (masked) distribution parameters and the version of the policy that collected the data.
    Minibatches are :class:`MaskableKLRolloutBufferSamples`.

    :param buffer_size: Max number of element in the buffer
    :param observation_space: Observation space
    :param action_space: Action space
    :param device: PyTorch device
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param gamma: Discount factor
    :param n_envs: Number of parallel environments
    """

    def reset(self) -> None:
        self._reset_kl_fields()
        super().reset()

    def _get_samples(  # type: ignore[override]
        self,
        batch_inds: np.ndarray,
        env: VecNormalize | None = None,
    ) -> MaskableKLRolloutBufferSamples:
        samples = super()._get_samples(batch_inds, env)
        return MaskableKLRolloutBufferSamples(*samples, old_dist_params=self.to_torch(self.old_dist_params[batch_inds]))


class MaskableKLDictRolloutBuffer(MaskableKLBufferMixin, MaskableDictRolloutBuffer):
    """
    Dict-observation variant of :class:`MaskableKLRolloutBuffer`.

    :param buffer_size: Max number of element in the buffer
    :param observation_space: Observation space
    :param action_space: Action space
    :param device: PyTorch device
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param gamma: Discount factor
    :param n_envs: Number of parallel environments
    """

    def reset(self) -> None:
        self._reset_kl_fields()
        super().reset()

    def _get_samples(  # type: ignore[override]
        self,
        batch_inds: np.ndarray,
        env: VecNormalize | None = None,
    ) -> MaskableKLDictRolloutBufferSamples:
        samples = super()._get_samples(batch_inds, env)
        return MaskableKLDictRolloutBufferSamples(*samples, old_dist_params=self.to_torch(self.old_dist_params[batch_inds]))
