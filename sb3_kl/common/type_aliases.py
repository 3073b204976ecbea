from typing import NamedTuple

import torch as th
from stable_baselines3.common.type_aliases import TensorDict


class KLRolloutBufferSamples(NamedTuple):
    observations: th.Tensor
    actions: th.Tensor
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    # parameters of the rollout policy's action distribution at each state, (batch, n_params)
    old_dist_params: th.Tensor


class KLDictRolloutBufferSamples(NamedTuple):
    observations: TensorDict
    actions: th.Tensor
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    old_dist_params: th.Tensor
