"""
Policies whose output depends on the module's mode: dropout (random in train mode, off in eval mode) and batch norm
(batch statistics in train mode, running statistics in eval mode, updated by every train-mode forward pass).

SB3 trains in train mode and acts in eval mode (``policy.set_training_mode``), so with such modules the KL of the
policy that acts is not the KL a train-mode forward pass sees. The KL figures that promise the acting policy's KL are
measured in eval mode (:func:`acting_mode`); see ``KLTRPO`` and ``KLPPO``'s ``kl_saturation_stop_factor``.

Modules are recognized by their class (torch's private bases ``_DropoutNd``, ``_BatchNorm`` and ``_InstanceNorm``,
which every dropout and normalization layer of ``torch.nn`` derives from): dropout applied as a function
(``F.dropout(x, training=self.training)``) in a custom network is not seen.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch as th
from stable_baselines3.common.policies import BasePolicy
from torch import nn

#: Module kinds that may behave differently in train and eval mode
MODE_DEPENDENT_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
#: Module kinds whose train-mode forward passes change the eval-mode function (when they track running statistics)
RUNNING_STATISTICS_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def is_mode_dependent(module: nn.Module) -> bool:
    """
    :param module: One module (its submodules are not looked at)
    :return: whether its output depends on its mode: dropout, an LSTM/GRU with dropout between its layers, batch or
        instance norm that tracks running statistics (without them, it normalizes by the batch in both modes)
    """
    if isinstance(module, nn.RNNBase):
        return module.dropout > 0
    if isinstance(module, RUNNING_STATISTICS_MODULES):
        return bool(module.track_running_stats)
    return isinstance(module, MODE_DEPENDENT_MODULES)


def has_mode_dependent_modules(module: nn.Module) -> bool:
    """
    :param module: A policy (or any module)
    :return: whether one of its submodules is mode-dependent (:func:`is_mode_dependent`)
    """
    return any(is_mode_dependent(m) for m in module.modules())


@contextmanager
def acting_mode(policy: BasePolicy) -> Iterator[None]:
    """
    Put ``policy`` in eval mode, the mode it acts in, and back in the mode it was in on leaving (also on an exception).

    :param policy: The policy
    """
    was_training = policy.training
    policy.set_training_mode(False)
    try:
        yield
    finally:
        policy.set_training_mode(was_training)


#: Saved running statistics: each module with its buffers (:func:`save_running_statistics`)
RunningStatistics = list[tuple[nn.Module, dict[str, th.Tensor]]]


def _running_statistics_modules(root: nn.Module) -> Iterator[nn.Module]:
    """:return: the batch and instance norm modules of ``root`` that track running statistics"""
    return (m for m in root.modules() if isinstance(m, RUNNING_STATISTICS_MODULES) and is_mode_dependent(m))


def has_running_statistics(root: nn.Module) -> bool:
    """:return: whether a batch or instance norm module of ``root`` tracks running statistics"""
    return any(True for _ in _running_statistics_modules(root))


def save_running_statistics(root: nn.Module) -> RunningStatistics:
    """
    :param root: The module (e.g. the policy)
    :return: copies of the running statistics of ``root``'s batch and instance norm modules (``running_mean``,
        ``running_var``, ``num_batches_tracked``), for :func:`restore_running_statistics`
    """
    return [
        (module, {name: buffer.clone() for name, buffer in module.named_buffers(recurse=False)})
        for module in _running_statistics_modules(root)
    ]


def restore_running_statistics(saved: RunningStatistics) -> None:
    """Put back the running statistics :func:`save_running_statistics` copied."""
    with th.no_grad():
        for module, buffers in saved:
            for name, value in buffers.items():
                getattr(module, name).copy_(value)


@contextmanager
def kept_running_statistics(root: nn.Module) -> Iterator[None]:
    """
    Restore the running statistics of ``root``'s batch and instance norm modules on leaving: for a train-mode forward
    pass that must leave the policy as it is, such as a diagnostic after an update's last optimizer step (otherwise it
    would move the policy that acts next).

    :param root: The module (e.g. the policy)
    """
    saved = save_running_statistics(root)
    try:
        yield
    finally:
        restore_running_statistics(saved)


def modules_run_by(root: nn.Module, forward: Callable[[], Any], kinds: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """
    The mode-dependent submodules of ``root`` of the given kinds that ``forward`` calls (found with forward hooks, so a
    module shared by the actor and the critic counts and a critic-only one does not; a module whose ``forward`` is
    called directly, bypassing ``__call__``, is not seen).

    :param root: The module to search
    :param forward: A call that runs the computation of interest (e.g. the policy's action distribution)
    :param kinds: The module kinds to look for
    :return: the modules found, each once
    """
    ran: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda module, *_: ran.append(module))
        for m in root.modules()
        if isinstance(m, kinds) and is_mode_dependent(m)
    ]
    try:
        forward()
    finally:
        for hook in hooks:
            hook.remove()
    return list({id(m): m for m in ran}.values())
