"""
Keeping the minibatch loop free of host synchronisations. On a GPU every ``.item()``, ``bool(tensor)`` or ``.cpu()``
waits for the device to finish its queue; the algorithms' minibatch loops keep what they log on the device
(:class:`DeviceLog`) and read it once per update. Measured in ``benchmarks/results/overhead.md``; counted in
``tests/test_host_syncs.py``.
"""

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch as th
from torch.distributions import Distribution as TorchDistribution

_validation_lock = threading.Lock()
_validation_depth = 0
_validation_saved = True


@contextmanager
def no_distribution_validation() -> Iterator[None]:
    """
    Turn off ``torch.distributions``' argument checks (each is a ``bool(tensor)``, one host synchronisation) while the
    losses build their distributions. They check the network's outputs for NaN; the optimizer step checks the
    gradient norm, which a non-finite output makes non-finite, and skips the step (``train/nonfinite_steps``).
    Nested and threaded uses restore the user's default once the last one leaves.
    """
    global _validation_depth, _validation_saved
    with _validation_lock:
        if _validation_depth == 0:
            _validation_saved = TorchDistribution._validate_args
            TorchDistribution.set_default_validate_args(False)
        _validation_depth += 1
    try:
        yield
    finally:
        with _validation_lock:
            _validation_depth -= 1
            if _validation_depth == 0:
                TorchDistribution.set_default_validate_args(_validation_saved)


F = TypeVar("F", bound=Callable[..., Any])


def without_distribution_validation(method: F) -> F:
    """Run ``method`` (an algorithm's ``train``) inside :func:`no_distribution_validation`."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with no_distribution_validation():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class DeviceLog:
    """
    Per-minibatch scalars kept as tensors on the device, read in one transfer by :meth:`means`: the logged means are
    those of the same float32 values read one by one (``np.mean`` of float64 conversions).
    """

    def __init__(self, *names: str) -> None:
        self.values: dict[str, list[th.Tensor]] = {name: [] for name in names}

    def add(self, name: str, value: th.Tensor) -> None:
        self.values[name].append(value.detach().reshape(()))

    def clear(self, name: str) -> None:
        self.values[name] = []

    def means(self) -> dict[str, float]:
        """:return: each name's mean over its values (NaN for a name with none, as ``np.mean([])``)"""
        filled = [name for name, values in self.values.items() if values]
        means = {name: float("nan") for name in self.values}
        if filled:
            flat = th.cat([th.stack(self.values[name]).float() for name in filled]).cpu().numpy().astype(np.float64)
            start = 0
            for name in filled:
                count = len(self.values[name])
                means[name] = float(np.mean(flat[start : start + count]))
                start += count
        return means
