"""
A misspelled keyword argument (``KLPPO(..., kl_coeff=0.1)``) raises Python's ``TypeError`` naming the closest parameter,
for the algorithms and callbacks whose constructors list their parameters, and for ``load()``.
"""

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any


def unexpected_keyword_error(owner: str, name: str, candidates: Iterable[str]) -> TypeError:
    """
    :param owner: What was called, as Python names it (``"KLPPO()"``, ``"KLPPO.load()"``)
    :param name: The unexpected keyword
    :param candidates: The names it may have meant (names starting with ``_`` are never suggested)
    :return: Python's ``TypeError`` for it, with the closest candidate when one is close
    """
    close = closest_keyword(name, candidates)
    hint = "" if close is None else f" Did you mean '{close}'?"
    return TypeError(f"{owner} got an unexpected keyword argument '{name}'.{hint}")


def closest_keyword(name: str, candidates: Iterable[str]) -> str | None:
    """:return: the candidate closest to ``name`` (``difflib``'s default cutoff), if any; ``_`` names left out"""
    close = difflib.get_close_matches(name, [c for c in candidates if not c.startswith("_")], n=1)
    return close[0] if close else None


def _with_keyword_hint(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` checking its keyword arguments first (unless it takes ``**kwargs``, which it then checks itself)."""
    parameters = inspect.signature(init).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return init
    names = frozenset(
        name
        for name, parameter in parameters.items()
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in names:
                raise unexpected_keyword_error(f"{type(self).__name__}()", name, names - {"self"})
        init(self, *args, **kwargs)

    return __init__


class SuggestsKeywords:
    """
    Mixin of the sb3-kl algorithms and callbacks: the ``__init__`` of every subclass raises, for a keyword that none of
    its parameters takes, Python's ``TypeError`` with the closest parameter name (``difflib.get_close_matches``).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _with_keyword_hint(cls.__dict__["__init__"])  # type: ignore[method-assign]
