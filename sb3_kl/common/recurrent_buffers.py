"""
sb3-contrib's recurrent rollout buffers plus what KL control needs (:class:`~sb3_kl.common.buffers.KLBufferMixin`):
the rollout policy's distribution parameters at every stored step, computed once per update by re-running the
rollout policy over each env's whole sequence (:mod:`sb3_kl.common.recurrent`), and, with a reference policy, the
reference's. Minibatches are RecurrentPPO's padded sequences; the stored parameters are padded the same way.
"""

from collections.abc import Generator
from typing import Any, NamedTuple

import numpy as np
import torch as th
from sb3_contrib.common.recurrent.buffers import RecurrentDictRolloutBuffer, RecurrentRolloutBuffer
from sb3_contrib.common.recurrent.type_aliases import RNNStates
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.type_aliases import TensorDict
from stable_baselines3.common.vec_env import VecNormalize

from sb3_kl.common.buffers import KLBufferMixin
from sb3_kl.common.recurrent import RolloutSequences, SequenceEvaluation, evaluate_sequences


class RecurrentKLRolloutBufferSamples(NamedTuple):
    observations: th.Tensor
    actions: th.Tensor
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    lstm_states: RNNStates
    episode_starts: th.Tensor
    mask: th.Tensor
    old_dist_params: th.Tensor
    ref_dist_params: th.Tensor | None
    ref_log_prob: th.Tensor | None


class RecurrentKLDictRolloutBufferSamples(NamedTuple):
    observations: TensorDict
    actions: th.Tensor
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    lstm_states: RNNStates
    episode_starts: th.Tensor
    mask: th.Tensor
    old_dist_params: th.Tensor
    ref_dist_params: th.Tensor | None
    ref_log_prob: th.Tensor | None


class RecurrentKLBufferMixin(KLBufferMixin):
    """
    The KL fields of a recurrent buffer. All of them are kept flat in ``get()``'s env-major order
    (``index = env * n_steps + step``) and padded per minibatch like the buffer's own arrays, so that padding is
    marked by the minibatch's ``mask`` and can be left out of every mean.

    - ``old_dist_params``: the rollout policy at every stored step, its LSTM re-run over each env's whole sequence;
    - ``ref_dist_params``/``ref_log_prob``: the reference policy at the same steps (set by :meth:`store_reference`);
    - ``ref_states_steps``: how many of the stored steps the algorithm's carried reference LSTM state has advanced over
      (all of them once the reference was evaluated for the update, the stored ones when ``learn()`` stopped within
      the rollout).
    """

    ref_dist_params: np.ndarray | None
    ref_log_prob: np.ndarray | None
    ref_states_steps: int

    def _reset_recurrent_kl_fields(self) -> None:
        self._reset_kl_fields()
        self.ref_dist_params = None
        self.ref_log_prob = None
        self.ref_states_steps = 0

    @property
    def stored_steps(self) -> int:
        """The number of steps stored per env so far (``buffer_size`` once full)."""
        return self.buffer_size if self.full else self.pos

    def sequences(self, with_actions: bool = True, partial: bool = False) -> RolloutSequences:
        """
        One sequence per env, in time order (see :class:`~sb3_kl.common.recurrent.RolloutSequences`).

        :param partial: Whether a rollout that is not complete gives the sequences of the steps stored so far
        """
        return RolloutSequences.from_buffer(self, with_actions=with_actions, partial=partial)

    @staticmethod
    def _flat(values: th.Tensor) -> np.ndarray:
        """``(n_envs, n_steps, ...)`` -> ``(n_envs * n_steps, ...)``, get()'s env-major order."""
        return values.reshape(-1, *values.shape[2:]).cpu().numpy()

    @th.no_grad()
    def compute_old_distribution(self, policy: BasePolicy, chunk_size: int = 4096) -> None:
        """
        Store the rollout policy's distribution parameters at every stored step: its LSTM is re-run over each env's
        sequence from the stored first-step state (the same states as during the rollout). Eval mode, as during the
        rollout.

        :param policy: The policy that collected the data (not yet updated)
        :param chunk_size: About how many states per forward pass
        """
        evaluation = evaluate_sequences(policy, self.sequences(with_actions=False), self.dist_params, chunk_size=chunk_size)
        self.old_dist_params = self._flat(evaluation.params)
        self.old_distribution_ready = True

    def store_reference(self, evaluation: SequenceEvaluation) -> None:
        """
        :param evaluation: The reference policy evaluated on :meth:`sequences` (with log-probabilities when a sample
            estimator needs them)
        """
        self.ref_dist_params = self._flat(evaluation.params)
        self.ref_log_prob = None if evaluation.log_prob is None else self._flat(evaluation.log_prob)

    def ordered_samples(self, chunk_size: int = 4096) -> Generator[Any, None, None]:
        raise NotImplementedError(
            "A recurrent buffer has no per-state samples without LSTM states: evaluate policies on sequences() with "
            "sb3_kl.common.recurrent.evaluate_sequences."
        )

    def _kl_fields(self, batch_inds: np.ndarray) -> dict[str, th.Tensor | None]:
        """The KL fields of a minibatch, padded like its other fields (``self.pad`` was set by ``_get_samples``)."""

        def padded(array: np.ndarray | None) -> th.Tensor | None:
            if array is None:
                return None
            values = self.pad(array[batch_inds])  # type: ignore[attr-defined]  # (n_seq, max_length, ...)
            return values.reshape(-1, *values.shape[2:]) if values.ndim > 2 else values.flatten()

        return {
            "old_dist_params": padded(self.old_dist_params),
            "ref_dist_params": padded(self.ref_dist_params),
            "ref_log_prob": padded(self.ref_log_prob),
        }


class RecurrentKLRolloutBuffer(RecurrentKLBufferMixin, RecurrentRolloutBuffer):
    """
    sb3-contrib's :class:`~sb3_contrib.common.recurrent.buffers.RecurrentRolloutBuffer` plus the rollout policy's
    distribution parameters (and the reference's) at every stored step; see :class:`RecurrentKLBufferMixin`.

    :param buffer_size: Max number of element in the buffer
    :param observation_space: Observation space
    :param action_space: Action space
    :param hidden_state_shape: Shape of the buffer that will collect lstm states
        (n_steps, lstm.num_layers, n_envs, lstm.hidden_size)
    :param device: PyTorch device
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param gamma: Discount factor
    :param n_envs: Number of parallel environments
    """

    def reset(self) -> None:
        self._reset_recurrent_kl_fields()
        super().reset()

    def _get_samples(  # type: ignore[override]
        self, batch_inds: np.ndarray, env_change: np.ndarray, env: VecNormalize | None = None
    ) -> RecurrentKLRolloutBufferSamples:
        samples = super()._get_samples(batch_inds, env_change, env)
        return RecurrentKLRolloutBufferSamples(*samples, **self._kl_fields(batch_inds))


class RecurrentKLDictRolloutBuffer(RecurrentKLBufferMixin, RecurrentDictRolloutBuffer):
    """
    Dict-observation variant of :class:`RecurrentKLRolloutBuffer`.

    :param buffer_size: Max number of element in the buffer
    :param observation_space: Observation space
    :param action_space: Action space
    :param hidden_state_shape: Shape of the buffer that will collect lstm states
    :param device: PyTorch device
    :param gae_lambda: Factor for trade-off of bias vs variance for Generalized Advantage Estimator
    :param gamma: Discount factor
    :param n_envs: Number of parallel environments
    """

    def reset(self) -> None:
        self._reset_recurrent_kl_fields()
        super().reset()

    def _get_samples(  # type: ignore[override]
        self, batch_inds: np.ndarray, env_change: np.ndarray, env: VecNormalize | None = None
    ) -> RecurrentKLDictRolloutBufferSamples:
        samples = super()._get_samples(batch_inds, env_change, env)
        return RecurrentKLDictRolloutBufferSamples(*samples, **self._kl_fields(batch_inds))
