"""
Policies whose output depends on the module's mode: dropout (random in train mode, off in eval mode) and batch norm
(batch statistics in train mode, running statistics in eval mode, updated by every train-mode forward pass).

SB3 trains in train mode and acts in eval mode (``policy.set_training_mode``), so with such modules the KL of the
policy that acts is not the KL a train-mode forward pass sees. The KL figures that promise the acting policy's KL are
measured in eval mode; see ``KLTRPO`` and ``KLPPO``'s ``kl_saturation_stop_factor``.
"""

from collections.abc import Callable
from typing import Any

from torch import nn

#: Module kinds that behave differently in train and eval mode
MODE_DEPENDENT_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
#: Module kinds whose train-mode forward passes change the eval-mode function (running statistics)
RUNNING_STATISTICS_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def _is_mode_dependent(module: nn.Module) -> bool:
    if isinstance(module, nn.RNNBase):  # dropout between stacked layers, in train mode only
        return module.dropout > 0
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return bool(module.track_running_stats)
    return isinstance(module, MODE_DEPENDENT_MODULES)


def has_mode_dependent_modules(module: nn.Module) -> bool:
    """
    :param module: A policy (or any module)
    :return: whether some submodule behaves differently in train and eval mode (dropout, an LSTM/GRU with dropout
        between its layers, batch norm, instance norm with running statistics)
    """
    return any(_is_mode_dependent(m) for m in module.modules())


def modules_run_by(root: nn.Module, forward: Callable[[], Any], kinds: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """
    The submodules of ``root`` of the given kinds that ``forward`` runs (found with forward hooks, so a module shared
    by the actor and the critic counts, a critic-only one does not).

    :param root: The module to search
    :param forward: A call that runs the computation of interest (e.g. the policy's action distribution)
    :param kinds: The module kinds to look for
    """
    ran: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda module, *_: ran.append(module))
        for m in root.modules()
        if isinstance(m, kinds) and _is_mode_dependent(m)
    ]
    try:
        forward()
    finally:
        for hook in hooks:
            hook.remove()
    return list({id(m): m for m in ran}.values())
