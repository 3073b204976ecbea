"""
``python -m sb3_kl.zoo enjoy``: the zoo's ``rl_zoo3.enjoy`` with the sb3_kl algorithms registered. Every flag of
``rl_zoo3.enjoy`` is passed through unchanged.
"""

import sys
from collections.abc import Sequence

from sb3_kl.zoo import INSTALL_HINT
from sb3_kl.zoo.registry import register, with_default_threads
from sb3_kl.zoo.train import patched_argv


def enjoy(argv: Sequence[str] | None = None) -> None:
    """
    Load a model trained through the zoo and run it.

    :param argv: Arguments of ``rl_zoo3.enjoy`` without the program name; default: ``sys.argv[1:]``
    """
    try:
        from rl_zoo3.enjoy import enjoy as zoo_enjoy
    except ImportError as e:  # rl_zoo3.enjoy imports ``requests`` through its Hugging Face download helper
        raise ImportError(f"`enjoy` needs a dependency rl_zoo3 does not declare ({e}); install it {INSTALL_HINT}") from e

    register()
    with patched_argv(["sb3_kl.zoo enjoy", *with_default_threads(sys.argv[1:] if argv is None else argv)]):
        zoo_enjoy()


if __name__ == "__main__":
    enjoy()
