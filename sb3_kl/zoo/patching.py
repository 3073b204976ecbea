"""
How sb3_kl replaces methods of the zoo's ``ExperimentManager``: each replacement is marked, so that patching twice
is harmless (:func:`is_patched`), and keeps the zoo method's docstring.
"""

from collections.abc import Callable
from typing import Any


def is_patched(method: Any) -> bool:
    """Whether ``method`` is a replacement :func:`install_patch` put on the zoo's class (patches are idempotent)."""
    return getattr(method, "_sb3_kl_patched", False)


def install_patch(owner: type, name: str, replacement: Callable[..., Any]) -> None:
    """
    Put ``replacement`` in place of ``owner.<name>`` (a method of the zoo's ``ExperimentManager``), marked for
    :func:`is_patched` and with the zoo method's docstring.
    """
    replacement._sb3_kl_patched = True  # type: ignore[attr-defined]
    replacement.__doc__ = getattr(owner, name).__doc__
    setattr(owner, name, replacement)
