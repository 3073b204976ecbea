"""
Recurrent (LSTM) policies: re-running a policy over a rollout buffer's sequences.

A recurrent policy's action distribution at a stored step depends on the LSTM state, i.e. on every earlier step of
the same episode. To compare two policies at the states of a rollout, each policy's LSTM is re-run over each env's
rollout **in time order**, starting from the LSTM state the rollout stored at that env's first step, with the stored
episode starts resetting it: one sequence per env, never cut anywhere else. (sb3-contrib's
``RecurrentRolloutBuffer.get()`` also cuts sequences at minibatch boundaries and restarts them from the *rollout*
policy's stored states: right for RecurrentPPO's loss, wrong for measuring an updated policy.)

The re-run calls the policy's own ``get_distribution(obs, lstm_states, episode_starts)`` with one sequence per env, so
it is the code that acted during the rollout: re-running the rollout policy gives back the rollout's log-probabilities
(up to float32 round-off). Sequences have no padding, so no padding can enter a mean or a quantile.

Used by the KL callbacks (on sb3-contrib's ``RecurrentPPO``) and by :class:`~sb3_kl.RecurrentKLPPO`.
"""

import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib.common.recurrent.type_aliases import RNNStates

from sb3_kl.common.kl import DistributionParams, actions_for_log_prob
from sb3_kl.common.modes import acting_mode

#: Constructor arguments of sb3-contrib's ``RecurrentActorCriticPolicy`` that its ``_get_constructor_parameters``
#: leaves out although they shape the network
LSTM_CONSTRUCTOR_KEYS = ("lstm_hidden_size", "n_lstm_layers", "shared_lstm", "enable_critic_lstm", "lstm_kwargs")


def is_recurrent_policy(policy: Any) -> bool:
    """
    Whether ``policy`` needs a recurrent state besides the observations to give its action distribution:
    a recurrent (LSTM) actor-critic policy such as sb3-contrib's ``MlpLstmPolicy``, or any policy whose
    ``get_distribution`` has a required argument after ``obs`` (e.g. ``lstm_states``).
    """
    if isinstance(getattr(policy, "lstm_actor", None), th.nn.Module):
        return True
    get_distribution = getattr(policy, "get_distribution", None)
    if get_distribution is None:
        return False
    extra = list(inspect.signature(get_distribution).parameters.values())[1:]
    return any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in extra)


def lstm_constructor_parameters(policy: Any) -> dict[str, Any]:
    """
    The LSTM arguments of a recurrent policy (those ``_get_constructor_parameters`` omits), so a copy of the policy
    can be rebuilt with the same modules.

    :param policy: A recurrent policy
    :return: ``lstm_hidden_size``, ``n_lstm_layers``, ``shared_lstm``, ``enable_critic_lstm``, ``lstm_kwargs``
    """
    lstm = policy.lstm_actor
    return {
        "lstm_hidden_size": int(lstm.hidden_size),
        "n_lstm_layers": int(lstm.num_layers),
        "shared_lstm": bool(policy.shared_lstm),
        "enable_critic_lstm": bool(policy.enable_critic_lstm),
        "lstm_kwargs": dict(policy.lstm_kwargs),
    }


def _env_major(array: np.ndarray, n_steps: int, n_envs: int, flattened: bool) -> np.ndarray:
    """
    ``(n_steps, n_envs, ...)``, or ``(n_envs * n_steps, ...)`` once ``get()`` flattened the buffer,
    -> ``(n_envs, n_steps, ...)``.
    """
    if flattened:
        return array.reshape(n_envs, n_steps, *array.shape[1:])
    return array.swapaxes(0, 1)


def _as_tensor(array: np.ndarray, device: th.device) -> th.Tensor:
    # th.tensor copies: the sequences never share memory with the buffer (which the next rollout overwrites)
    return th.tensor(np.ascontiguousarray(array), device=device)


@dataclass
class RolloutSequences:
    """
    A recurrent rollout buffer as one sequence per env, in time order. Shapes are env-major.

    :param observations: ``(n_envs, n_steps, *obs_shape)`` (a dict of them for Dict observation spaces)
    :param episode_starts: ``(n_envs, n_steps)``, 1.0 where an episode starts (the LSTM state is reset there)
    :param lstm_states: Actor LSTM ``(hidden, cell)`` stored before each env's first step, ``(n_layers, n_envs, size)``
    :param actions: ``(n_envs, n_steps, *action_shape)`` as stored (Discrete actions as floats ``(..., 1)``), or None
    """

    observations: th.Tensor | dict[str, th.Tensor]
    episode_starts: th.Tensor
    lstm_states: tuple[th.Tensor, th.Tensor]
    actions: th.Tensor | None = None

    @property
    def n_envs(self) -> int:
        return int(self.episode_starts.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.episode_starts.shape[1])

    @classmethod
    def from_buffer(cls, buffer: Any, with_actions: bool = True, partial: bool = False) -> "RolloutSequences":
        """
        Copy the sequences out of an sb3-contrib ``RecurrentRolloutBuffer`` (or its Dict variant): a full one, whether
        or not its ``get()`` already flattened it, or with ``partial`` the steps stored so far.

        :param buffer: The rollout buffer
        :param with_actions: Whether to copy the stored actions too (needed for log-probabilities)
        :param partial: Whether a buffer that is not full (a rollout that ``learn()`` left, or that is still being
            collected) gives the sequences of the steps it stores so far
        """
        if buffer.full:
            n_steps = buffer.buffer_size
        elif partial and buffer.pos > 0 and not buffer.generator_ready:
            n_steps = buffer.pos
        else:
            raise RuntimeError("The rollout buffer is not full: the sequences of a partial rollout are not defined.")
        if not hasattr(buffer, "hidden_states_pi"):
            raise TypeError(
                f"{type(buffer).__name__} stores no LSTM states: a recurrent policy needs sb3-contrib's "
                "RecurrentRolloutBuffer (RecurrentPPO's) or a subclass."
            )
        n_envs, flattened = buffer.n_envs, buffer.generator_ready
        device = buffer.device

        def stored(array: np.ndarray) -> np.ndarray:
            # (only a full buffer is ever flattened; a partial one holds its first n_steps rows)
            return _env_major(array if flattened else array[:n_steps], n_steps, n_envs, flattened)

        if isinstance(buffer.observations, dict):
            observations: Any = {key: _as_tensor(stored(obs), device) for key, obs in buffer.observations.items()}
        else:
            observations = _as_tensor(stored(buffer.observations), device)
        episode_starts = stored(buffer.episode_starts)
        states = []
        for state in (buffer.hidden_states_pi, buffer.cell_states_pi):
            if flattened:  # (n_envs * n_steps, n_layers, size): each env's first step, -> (n_layers, n_envs, size)
                first = state.reshape(n_envs, n_steps, *state.shape[1:])[:, 0].swapaxes(0, 1)
            else:  # (n_steps, n_layers, n_envs, size)
                first = state[0]
            states.append(_as_tensor(first, device))
        actions = _as_tensor(stored(buffer.actions), device) if with_actions else None
        return cls(observations, _as_tensor(episode_starts, device).float(), (states[0], states[1]), actions)

    def envs(self, selection: slice) -> "RolloutSequences":
        """The sequences of a subset of envs (views, no copy)."""
        if isinstance(self.observations, dict):
            observations: Any = {key: value[selection] for key, value in self.observations.items()}
        else:
            observations = self.observations[selection]
        return RolloutSequences(
            observations,
            self.episode_starts[selection],
            (self.lstm_states[0][:, selection], self.lstm_states[1][:, selection]),
            None if self.actions is None else self.actions[selection],
        )

    def flat_observations(self) -> th.Tensor | dict[str, th.Tensor]:
        """Observations as one batch in env-major order, ``(n_envs * n_steps, *obs_shape)``."""
        if isinstance(self.observations, dict):
            return {key: value.reshape(-1, *value.shape[2:]) for key, value in self.observations.items()}
        return self.observations.reshape(-1, *self.observations.shape[2:])


class SequenceEvaluation(NamedTuple):
    """
    What a policy gives on the sequences.

    :param params: Distribution parameters, ``(n_envs, n_steps, n_params)``
    :param log_prob: Log-probabilities of the stored actions, ``(n_envs, n_steps)``, or None
    :param lstm_states: The LSTM ``(hidden, cell)`` after each env's last step, ``(n_layers, n_envs, size)``
        (the state the policy would carry into the next rollout); None for a feed-forward policy
    """

    params: th.Tensor
    log_prob: th.Tensor | None
    lstm_states: tuple[th.Tensor, th.Tensor] | None


def _actions_for_log_prob(actions: th.Tensor, action_space: spaces.Space) -> th.Tensor:
    """Sequence-major stored actions ``(n_seq, seq_len, ...)`` as ``log_prob`` takes them, flattened over states."""
    if not isinstance(action_space, spaces.Discrete):
        actions = actions.reshape(-1, *actions.shape[2:])
    return actions_for_log_prob(actions, action_space)


@th.no_grad()
def evaluate_sequences(
    policy: Any,
    sequences: RolloutSequences,
    dist_params: DistributionParams,
    lstm_states: tuple[th.Tensor, th.Tensor] | None = None,
    with_log_prob: bool = False,
    chunk_size: int = 4096,
) -> SequenceEvaluation:
    """
    Re-run ``policy`` over each env's sequence (eval mode, no gradients) and collect its action distribution at every
    stored step. A feed-forward policy (e.g. a feed-forward reference) is evaluated on the same states without state.

    :param policy: A recurrent actor-critic policy (``get_distribution(obs, lstm_states, episode_starts)``), or a
        feed-forward one (``get_distribution(obs)``)
    :param sequences: The rollout's sequences
    :param dist_params: Parameter layout of the policy's action distribution
    :param lstm_states: LSTM ``(hidden, cell)`` before each env's first step, ``(n_layers, n_envs, size)``; None: the
        states the rollout stored (right for the policy that collected the rollout and for its updates)
    :param with_log_prob: Also return the log-probabilities of the stored actions
    :param chunk_size: About how many states per forward pass (whole sequences of several envs at a time)
    :return: a :class:`SequenceEvaluation`
    """
    recurrent = is_recurrent_policy(policy)
    if with_log_prob and sequences.actions is None:
        raise ValueError("The log-probabilities of the stored actions need the sequences' actions (with_actions=True).")
    if recurrent and lstm_states is None:
        lstm_states = sequences.lstm_states
    n_envs, n_steps = sequences.n_envs, sequences.n_steps
    envs_per_chunk = max(1, chunk_size // max(n_steps, 1))
    params, log_probs, hidden, cell = [], [], [], []
    with acting_mode(policy):
        for start in range(0, n_envs, envs_per_chunk):
            selection = slice(start, min(start + envs_per_chunk, n_envs))
            chunk = sequences.envs(selection)
            observations = chunk.flat_observations()
            if recurrent:
                assert lstm_states is not None
                states = (lstm_states[0][:, selection].contiguous(), lstm_states[1][:, selection].contiguous())
                # One sequence per env (n_seq = envs of the chunk): the policy resets its state at the episode starts
                distribution, final_states = policy.get_distribution(observations, states, chunk.episode_starts.reshape(-1))
                hidden.append(final_states[0])
                cell.append(final_states[1])
            else:
                distribution = policy.get_distribution(observations)
            n_chunk = chunk.n_envs
            params.append(dist_params.extract(distribution).reshape(n_chunk, n_steps, -1))
            if with_log_prob:
                assert chunk.actions is not None
                log_prob = distribution.log_prob(_actions_for_log_prob(chunk.actions, policy.action_space))
                log_probs.append(log_prob.reshape(n_chunk, n_steps))
    final = (th.cat(hidden, dim=1), th.cat(cell, dim=1)) if recurrent else None
    return SequenceEvaluation(th.cat(params), th.cat(log_probs) if with_log_prob else None, final)


def zero_lstm_states(policy: Any, n_envs: int) -> tuple[th.Tensor, th.Tensor]:
    """
    :return: A zero actor-LSTM state for ``n_envs`` envs, ``(n_layers, n_envs, size)`` each
    """
    lstm = policy.lstm_actor
    shape = (lstm.num_layers, n_envs, lstm.hidden_size)
    device = next(policy.parameters()).device
    return th.zeros(shape, device=device), th.zeros(shape, device=device)


def restored_lstm_states(saved: Any, fresh: RNNStates, device: th.device) -> RNNStates:
    """
    The LSTM states a loaded model continues from: those saved with it, on ``device``, when they have the shapes of
    the freshly built (zero) states, else the fresh ones (no saved states, or another number of envs).

    :param saved: The ``_last_lstm_states`` restored from the saved data (None: not saved)
    :param fresh: The zero states the recurrent set-up built
    :param device: The model's device
    :return: The states to continue from
    """
    if not isinstance(saved, RNNStates):
        return fresh
    if len(saved.pi) != len(fresh.pi) or len(saved.vf) != len(fresh.vf):
        return fresh
    pairs = [*zip(saved.pi, fresh.pi, strict=True), *zip(saved.vf, fresh.vf, strict=True)]
    if any(a.shape != b.shape for a, b in pairs):
        return fresh
    return RNNStates(tuple(t.to(device) for t in saved.pi), tuple(t.to(device) for t in saved.vf))


def step_major(values: th.Tensor) -> th.Tensor:
    """``(n_envs, n_steps, ...)`` -> ``(n_steps * n_envs, ...)``, index ``step * n_envs + env`` (the buffer's own order)."""
    return values.transpose(0, 1).reshape(-1, *values.shape[2:])
