"""
Frozen copies of a policy, rebuilt from its constructor information rather than deep-copied.

A reference policy (:mod:`sb3_kl.common.reference`) and the monitor's lagged policy (``kl/drift``,
:class:`~sb3_kl.common.callbacks_monitor.KLMonitorCallback`) are copies of an actor-critic policy that are never
optimized. They are built from the policy's constructor parameters (:func:`reference_spec`), which pickle as plain data
and so are saved with a model, and a gSDE policy, whose distribution holds non-leaf tensors, cannot be deep-copied.
"""

from typing import Any

import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy, BasePolicy
from stable_baselines3.common.utils import ConstantSchedule

from sb3_kl.common.recurrent import is_recurrent_policy, lstm_constructor_parameters

#: Attribute set on the frozen copies built here (so ``_setup_model`` does not copy them again)
_FROZEN_MARK = "_sb3_kl_frozen_reference"

try:  # sb3-contrib is optional: MaskablePPO's policy is an actor-critic policy that does not subclass ActorCriticPolicy
    from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy

    #: Policy classes a reference may have
    ACTOR_CRITIC_POLICIES: tuple[type[BasePolicy], ...] = (ActorCriticPolicy, MaskableActorCriticPolicy)
except ImportError:  # pragma: no cover
    ACTOR_CRITIC_POLICIES = (ActorCriticPolicy,)


def _constant_zero_schedule() -> ConstantSchedule:
    # The reference is never optimized: its optimizer's learning rate is irrelevant (ConstantSchedule pickles cleanly)
    return ConstantSchedule(0.0)


def freeze_policy(policy: ActorCriticPolicy) -> ActorCriticPolicy:
    """
    Freeze a policy in place: eval mode, no gradients, no optimizer.

    :param policy: The policy
    :return: the same object
    """
    policy.set_training_mode(False)
    policy.requires_grad_(False)
    # Its optimizer would only hold references to frozen parameters; the algorithm's optimizer never sees them
    policy.optimizer = None  # type: ignore[assignment]
    setattr(policy, _FROZEN_MARK, True)
    return policy


def is_frozen_reference(policy: Any) -> bool:
    """Whether ``policy`` is a frozen reference built by this module."""
    return isinstance(policy, ACTOR_CRITIC_POLICIES) and getattr(policy, _FROZEN_MARK, False)


def build_reference_policy(
    policy_class: type[ActorCriticPolicy], constructor_kwargs: dict[str, Any], device: th.device | str = "cpu"
) -> ActorCriticPolicy:
    """
    Build a frozen policy skeleton (random weights) from constructor information; the weights are loaded afterwards
    (``set_parameters`` during ``load``, or ``load_state_dict``).

    :param policy_class: The policy class
    :param constructor_kwargs: Its keyword arguments, spaces included (``lr_schedule`` is supplied here)
    :param device: Device of the copy
    :return: The frozen policy
    """
    kwargs = dict(constructor_kwargs)
    kwargs["lr_schedule"] = _constant_zero_schedule()
    policy = policy_class(**kwargs).to(device)
    return freeze_policy(policy)


def reference_spec(policy: ActorCriticPolicy) -> tuple[type[ActorCriticPolicy], dict[str, Any]]:
    """
    The constructor information of a policy, as plain picklable data (no module, no bound method).

    :return: ``(policy_class, constructor_kwargs)``
    """
    kwargs = policy._get_constructor_parameters()
    kwargs.pop("lr_schedule", None)
    # Not part of SB3's constructor parameters, but it changes the module structure (and the state dict's keys)
    kwargs["share_features_extractor"] = policy.share_features_extractor
    if is_recurrent_policy(policy):  # sb3-contrib's LSTM policies leave their LSTM arguments out as well
        kwargs.update(lstm_constructor_parameters(policy))
    return type(policy), kwargs
