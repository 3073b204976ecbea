"""
How far the observation normalization alone moves the acting policy over a rollout.

SB3's ``VecNormalize`` updates its running observation statistics at every step of a rollout while the policy's
parameters stay fixed, so the policy that acts at the end of a rollout is not the one that acted at its start, even
though no update happened in between. No per-update KL sees this change. :class:`RolloutNormalization` keeps the raw
observations of one rollout's states and the statistics at the rollout's start, and gives those states normalized
with the statistics at the start and at the end of the rollout: the two inputs on which the same policy parameters
give the start's and the end's acting policy.
"""

import copy
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import VecNormalize

from sb3_kl.common.user_warnings import warn_at_user_frame

#: Largest absolute difference between the model's last observation and the normalizer's own normalization of the raw
#: one for the two to be the same observation (float32 rounding of values clipped to ``clip_obs``)
_SAME_OBSERVATION_ATOL = 1e-4


def _normalized_with(normalizer: VecNormalize, raw: Any, obs_rms: Any) -> Any:
    """``normalizer.normalize_obs(raw)`` with the statistics ``obs_rms`` in place of its current ones."""
    current = normalizer.obs_rms
    normalizer.obs_rms = obs_rms
    try:
        return normalizer.normalize_obs(raw)
    finally:
        normalizer.obs_rms = current


def _normalized_keys(normalizer: VecNormalize, observation: Any) -> list[str] | None:
    """The keys of a Dict observation that the normalizer normalizes; None for an array observation."""
    if isinstance(observation, dict):
        return list(normalizer.norm_obs_keys or [])
    return None


class RolloutNormalization:
    """
    The raw observations of one rollout's states and the normalizer's statistics at its start.

    Call :meth:`start` before the rollout's first step (with the observation the model will act on first), :meth:`step`
    after each environment step, then :meth:`normalized` at the rollout's end.

    :param normalizer: The ``VecNormalize`` of the model's environment (``model.get_vec_normalize_env()``)
    """

    def __init__(self, normalizer: VecNormalize):
        self.normalizer = normalizer
        self._stats_at_start: Any = None
        self._raw: list[Any] = []
        self.active = False

    def start(self, last_obs: Any) -> bool:
        """
        Begin a rollout. The normalizer's normalization of its last raw observation must be ``last_obs`` (the
        observation the model acts on): when another wrapper changes the observations after the normalizer, the
        raw observations do not give the model's inputs, and nothing is recorded.

        :param last_obs: The model's ``_last_obs``
        :return: Whether the rollout is recorded
        """
        raw = self.normalizer.get_original_obs()
        self.active = self._same_observation(self.normalizer.normalize_obs(raw), last_obs)
        self._stats_at_start = copy.deepcopy(self.normalizer.obs_rms) if self.active else None
        self._raw = [raw] if self.active else []
        return self.active

    def step(self) -> None:
        """Keep the raw observation of the last environment step (the next state of the rollout)."""
        if self.active:
            self._raw.append(self.normalizer.get_original_obs())

    def stop(self) -> None:
        """Forget the rollout."""
        self.active = False
        self._stats_at_start = None
        self._raw = []

    def normalized(self, n_steps: int) -> tuple[Any, Any] | None:
        """
        The rollout's first ``n_steps`` states normalized with the statistics at the rollout's start and with the
        current ones, each as the normalizer returns observations: ``(n_steps, n_envs, *shape)`` arrays (a dict of
        them for Dict observations; keys the normalizer does not normalize hold the raw values in both).

        :param n_steps: The number of states of the rollout (the rollout buffer's ``buffer_size``)
        :return: ``(at_start, at_end)``; None when the rollout was not recorded or has fewer states
        """
        if not self.active or len(self._raw) < n_steps:
            return None
        raw = self._raw[:n_steps]
        if isinstance(raw[0], dict):
            stacked: Any = {key: np.stack([obs[key] for obs in raw]) for key in raw[0]}
        else:
            stacked = np.stack(raw)
        at_start = _normalized_with(self.normalizer, stacked, self._stats_at_start)
        at_end = self.normalizer.normalize_obs(stacked)
        return at_start, at_end

    def _same_observation(self, normalized: Any, last_obs: Any) -> bool:
        keys = _normalized_keys(self.normalizer, normalized)
        if keys is None:
            pairs = [(normalized, last_obs)]
        elif isinstance(last_obs, dict):
            pairs = [(normalized[key], last_obs.get(key)) for key in keys]
        else:
            pairs = [(None, None)]
        for ours, theirs in pairs:
            if ours is None or theirs is None or np.shape(ours) != np.shape(theirs):
                return False
            if not np.allclose(ours, theirs, rtol=0.0, atol=_SAME_OBSERVATION_ATOL):
                return False
        return True


def rollout_normalization(model: Any, who: str) -> RolloutNormalization | None:
    """
    A :class:`RolloutNormalization` of the model's ``VecNormalize`` when it normalizes observations, else None.

    :param model: An SB3 algorithm
    :param who: Name used in the warning when the normalizer's observations are not the model's
    """
    normalizer = model.get_vec_normalize_env()
    if normalizer is None or not normalizer.norm_obs:
        return None
    if normalizer.observation_space != model.observation_space:
        warn_at_user_frame(
            f"{who}: a wrapper after VecNormalize changes the observations ({normalizer.observation_space} -> "
            f"{model.observation_space}), so the normalization's own KL is not measured. Put VecNormalize last to "
            "measure it."
        )
        return None
    return RolloutNormalization(normalizer)
