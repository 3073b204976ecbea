"""
Warnings that name the user's line (the call of ``learn()``, ``load()``, a constructor) instead of a line inside sb3-kl:
a fixed ``stacklevel`` is wrong as soon as the call depth changes (SB3's ``learn`` calling ``train``, a subclass adding
frames), so the level is found by walking the stack.
"""

import contextlib
import functools
import importlib.util
import os
import sys
import warnings

#: Packages whose frames are never the user's: sb3-kl, the libraries it runs inside (SB3, sb3-contrib) and torch, whose
#: decorators (``th.no_grad()``) wrap sb3-kl methods. rl_zoo3 is not among them: for a zoo user, the zoo is the entry
LIBRARY_PACKAGES = ("sb3_kl", "stable_baselines3", "sb3_contrib", "torch")


@functools.cache
def _library_prefixes() -> tuple[str, ...]:
    """The folders of :data:`LIBRARY_PACKAGES` (each ending with a separator) and the stdlib wrapper modules' files."""
    prefixes = []
    for name in LIBRARY_PACKAGES:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            prefixes.append(os.path.join(os.path.abspath(location), ""))
    # ``@contextmanager`` and ``functools.wraps`` frames sit between two sb3-kl frames
    prefixes += [os.path.abspath(module.__file__) for module in (contextlib, functools)]
    return tuple(prefixes)


def _in_library(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_library_prefixes())


def warn_at_user_frame(message: str, category: type[Warning] = UserWarning) -> None:
    """
    ``warnings.warn(message, category)`` attributed to the first frame outside :data:`LIBRARY_PACKAGES` (the outermost
    frame when all are inside, e.g. under a console script), so that the warning shows the user's line and the user's
    warning filters by module apply.

    :param message: The warning's text
    :param category: The warning's class
    """
    frame, level = sys._getframe(), 1  # stacklevel 1 names this function's own frame
    while frame.f_back is not None and _in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def warn_and_print(message: str, verbose: int) -> None:
    """
    :func:`warn_at_user_frame` for a ``UserWarning``, and the same line printed with ``verbose >= 1`` (SB3 prints what
    an algorithm or callback reports at that level; warnings filters may hide the warning).

    :param message: The warning's text
    :param verbose: The algorithm's or callback's ``verbose``
    """
    warn_at_user_frame(message)
    if verbose >= 1:
        print(message)
