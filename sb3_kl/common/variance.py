"""
The variance floor of Gaussian policies, shared by the algorithms (``min_std``) and ``VarianceFloorCallback``:
one definition of the ``log_std`` value whose standard deviation is ``min_std``.
"""

import math

from stable_baselines3.common.distributions import Distribution, StateDependentNoiseDistribution


def min_log_std_parameter(action_dist: Distribution, min_std: float) -> float:
    """
    The value of ``policy.log_std`` whose standard deviation is ``min_std``: ``log(min_std)``, except for gSDE with
    ``use_expln=True``, whose std of the exploration weights is SB3's ``expln``: ``exp(x)`` for ``x <= 0`` and
    ``log1p(x + epsilon) + 1`` above (``StateDependentNoiseDistribution.get_std``), so that for ``min_std > 1`` the
    floor is ``expm1(min_std - 1) - epsilon``. Clamping ``log_std`` at this value makes the std exactly ``min_std``
    (to float precision) wherever it was below. With gSDE the action std also scales with the state features.

    :param action_dist: The policy's ``action_dist``
    :param min_std: The floor of the std (> 0)
    :return: the lower bound of ``log_std``
    """
    if isinstance(action_dist, StateDependentNoiseDistribution) and action_dist.use_expln and min_std > 1.0:
        floor = math.expm1(min_std - 1.0) - action_dist.epsilon
        # Between 1 and 1 + ~epsilon expln jumps (1 at x = 0, log1p(epsilon) + 1 just above): take a tiny x > 0
        # (representable in float32), whose std is log1p(epsilon) + 1 >= min_std
        return floor if floor > 0.0 else 1e-30
    return math.log(min_std)
