from collections.abc import Generator
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer
from stable_baselines3.common.distributions import Distribution
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.vec_env import VecNormalize

from sb3_kl.common.kl import DistributionParams, distribution_params_for_space
from sb3_kl.common.modes import acting_mode
from sb3_kl.common.type_aliases import KLDictRolloutBufferSamples, KLRolloutBufferSamples


class StalePolicyError(RuntimeError):
    """Raised when a rollout buffer is used to update a policy other than the one that collected it."""


class KLBufferMixin:
    """
    What KL control adds to SB3's rollout buffers:

    - ``old_dist_params``: the rollout policy's action-distribution parameters at every stored state,
      computed **once** per update by :meth:`compute_old_distribution` (before the first gradient step,
      never again during the epochs) and returned with every minibatch, aligned with its observations;
    - ``policy_version``: the version of the policy that collected the data, checked by :meth:`check_policy_version`.
    """

    buffer_size: int
    n_envs: int
    full: bool
    generator_ready: bool
    action_space: spaces.Space
    device: th.device
    old_dist_params: np.ndarray
    policy_version: int | None
    old_distribution_ready: bool
    dist_params: DistributionParams

    def _distribution_params(self) -> DistributionParams:
        """The parameter layout of the policy's action distribution (SB3's default one for the action space)."""
        return distribution_params_for_space(self.action_space)

    def _distribution(self, policy: BasePolicy, obs: Any, rows: slice) -> Distribution:
        """
        ``policy``'s action distribution on the buffer's states ``obs``.

        :param policy: The rollout policy
        :param obs: Observations (tensor or dict of tensors)
        :param rows: Which rows of the flat buffer (in :meth:`_flat_observations`'s order) ``obs`` holds
        """
        return policy.get_distribution(obs)  # type: ignore[attr-defined]

    def _device_fields(self) -> list[th.Tensor]:
        """
        The flattened buffer's fields as tensors on the device, in :class:`KLRolloutBufferSamples`' order (a dict's
        observations first, one per key), made once per rollout: a minibatch then indexes them instead of copying
        each field from numpy (on CPU they share the arrays' memory). Remade whenever an array is replaced
        (``get()`` flattens into new arrays, ``reset()`` and :meth:`compute_old_distribution` make new ones).
        """
        observations = self.observations  # type: ignore[attr-defined]
        arrays = [*(observations.values() if isinstance(observations, dict) else [observations])]
        arrays += [self.actions, self.values, self.log_probs, self.advantages, self.returns]  # type: ignore[attr-defined]
        arrays.append(self.old_dist_params)
        cached = getattr(self, "_device_cache", None)
        if cached is None or len(cached[0]) != len(arrays) or any(a is not b for a, b in zip(cached[0], arrays, strict=True)):
            n_obs = len(arrays) - 6
            converted = [
                *arrays[:n_obs],
                # as SB3's _get_samples: actions cast to float32, values and the rest flattened
                arrays[n_obs].astype(np.float32, copy=False),
                *(array.reshape(-1) for array in arrays[n_obs + 1 : n_obs + 5]),
                arrays[-1],
            ]
            self._device_cache = (arrays, [th.as_tensor(array, device=self.device) for array in converted])
        return self._device_cache[1]

    def _reset_kl_fields(self) -> None:
        self._device_cache: tuple[list[np.ndarray], list[th.Tensor]] | None = None
        self.dist_params = self._distribution_params()
        # Flat layout (buffer_size * n_envs, n_params), in the order ``get()`` uses once it has flattened the buffer
        self.old_dist_params = np.zeros((self.buffer_size * self.n_envs, self.dist_params.n_params), dtype=np.float32)
        self.old_distribution_ready = False
        self.policy_version = None

    def check_policy_version(self, policy_version: int) -> None:
        """
        :param policy_version: The version of the policy about to be updated
        :raises StalePolicyError: when the data was collected by another version of the policy
        """
        if not self.full:
            raise StalePolicyError("The rollout buffer is not full: collect a rollout before calling train().")
        if self.policy_version != policy_version:
            raise StalePolicyError(
                f"The rollout buffer was collected by policy version {self.policy_version}, but the policy is now at "
                f"version {policy_version}: its old log-probabilities and KL reference no longer describe the "
                "policy that acted. Collect a new rollout (model.learn() does) before calling train() again."
            )

    def _flat_observations(self) -> tuple[Any, bool]:
        """
        :return: the observations as one flat batch (views, no copy) and whether they are already in
            ``get()``'s flattened (env-major) order; otherwise they are in (step, env) order
        """
        n_samples = self.buffer_size * self.n_envs
        observations = self.observations  # type: ignore[attr-defined]
        if isinstance(observations, dict):
            flat = {
                key: obs.reshape(n_samples, *obs.shape[(1 if self.generator_ready else 2) :])
                for key, obs in observations.items()
            }
        else:
            flat = observations.reshape(n_samples, *observations.shape[(1 if self.generator_ready else 2) :])
        return flat, self.generator_ready

    def ordered_samples(
        self, chunk_size: int = 4096
    ) -> Generator[KLRolloutBufferSamples | KLDictRolloutBufferSamples, None, None]:
        """
        The whole buffer in chunks of ``chunk_size`` samples, in ``get()``'s flattened order but not shuffled.
        Unlike ``get()``, it draws nothing from numpy's global random generator, so measuring the buffer after an
        update leaves the next update's minibatches as they would be without the measurement (a seeded run draws
        the same permutations as the stock SB3 / sb3-contrib algorithm).

        :param chunk_size: Samples per chunk
        """
        assert self.full, "The rollout buffer is not full"
        if not self.generator_ready:
            # get() flattens the buffer on its first call; the permutation it draws is kept out of the global stream
            state = np.random.get_state()
            try:
                next(self.get(batch_size=1))  # type: ignore[attr-defined]
            finally:
                np.random.set_state(state)
        n_samples = self.buffer_size * self.n_envs
        for start in range(0, n_samples, chunk_size):
            yield self._get_samples(np.arange(start, min(start + chunk_size, n_samples)))  # type: ignore[attr-defined]

    @th.no_grad()
    def compute_old_distribution(self, policy: BasePolicy, chunk_size: int = 4096) -> None:
        """
        Store the action-distribution parameters of ``policy`` (the rollout policy) at every state of the buffer.
        The policy is evaluated in eval mode, as it was while collecting the rollout.

        :param policy: The policy that collected the data (not yet updated)
        :param chunk_size: States per forward pass
        """
        flat_obs, env_major = self._flat_observations()
        n_samples = self.buffer_size * self.n_envs
        params = np.empty((n_samples, self.dist_params.n_params), dtype=np.float32)
        with acting_mode(policy):
            for start in range(0, n_samples, chunk_size):
                end = min(start + chunk_size, n_samples)
                if isinstance(flat_obs, dict):
                    obs = {key: self.to_torch(value[start:end]) for key, value in flat_obs.items()}  # type: ignore[attr-defined]
                else:
                    obs = self.to_torch(flat_obs[start:end])  # type: ignore[attr-defined]
                distribution = self._distribution(policy, obs, slice(start, end))
                params[start:end] = self.dist_params.extract(distribution).cpu().numpy()
        if not env_major:
            params = self.swap_and_flatten(params.reshape(self.buffer_size, self.n_envs, -1))  # type: ignore[attr-defined]
        self.old_dist_params = params
        self.old_distribution_ready = True


class KLRolloutBuffer(KLBufferMixin, RolloutBuffer):
    """
    SB3's :class:`~stable_baselines3.common.buffers.RolloutBuffer` plus the rollout policy's distribution parameters
    and the version of the policy that collected the data (see :class:`KLBufferMixin`).
    Filled by the unmodified ``collect_rollouts``; minibatches are :class:`KLRolloutBufferSamples`.

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
    ) -> KLRolloutBufferSamples:
        if not self.generator_ready:
            samples = super()._get_samples(batch_inds, env)
            return KLRolloutBufferSamples(*samples, old_dist_params=self.to_torch(self.old_dist_params[batch_inds]))
        # the same values as SB3's copies from numpy, taken from the fields kept on the device (_device_fields)
        index = th.as_tensor(batch_inds, device=self.device)
        return KLRolloutBufferSamples(*(field[index] for field in self._device_fields()))


class KLDictRolloutBuffer(KLBufferMixin, DictRolloutBuffer):
    """
    Dict-observation variant of :class:`KLRolloutBuffer`.

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
    ) -> KLDictRolloutBufferSamples:
        if not self.generator_ready:
            samples = super()._get_samples(batch_inds, env)
            return KLDictRolloutBufferSamples(*samples, old_dist_params=self.to_torch(self.old_dist_params[batch_inds]))
        index = th.as_tensor(batch_inds, device=self.device)
        fields = [field[index] for field in self._device_fields()]
        n_obs = len(fields) - 6
        observations = dict(zip(self.observations, fields[:n_obs], strict=True))
        return KLDictRolloutBufferSamples(observations, *fields[n_obs:])
