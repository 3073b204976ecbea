"""
``python -m sb3_kl.zoo train``: the zoo's ``rl_zoo3.train`` with the sb3_kl algorithms registered and, for them,
the shipped config used when no ``-conf`` is given. Every flag of ``rl_zoo3.train`` is passed through unchanged.
"""

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sb3_kl.zoo.registry import SB3_KL_ALGOS, default_config, register, with_default_threads


@contextmanager
def patched_argv(argv: Sequence[str]) -> Iterator[None]:
    """
    Temporarily replace ``sys.argv``: the zoo's scripts parse it themselves.

    :param argv: Full argument vector, program name first
    """
    saved = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved


def with_default_config(argv: Sequence[str]) -> list[str]:
    """
    Append ``-conf sb3_kl/hyperparams/{algo}.yml`` to the zoo's arguments when ``--algo`` is an sb3_kl algorithm and
    no config was given (the zoo would otherwise look for ``{algo}.yml`` inside rl_zoo3, where it does not exist).

    :param argv: Arguments of ``rl_zoo3.train`` (without the program name)
    :return: The arguments, possibly with ``-conf <path>`` appended
    """
    # Same option strings as rl_zoo3.train, so abbreviations such as ``--conf`` are understood the same way
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--algo", type=str, default="ppo")
    pre_parser.add_argument("-conf", "--conf-file", type=str, default=None)
    known, _ = pre_parser.parse_known_args(list(argv))
    argv = list(argv)
    if known.algo in SB3_KL_ALGOS and known.conf_file is None:
        argv += ["-conf", default_config(known.algo)]
    return argv


def train(argv: Sequence[str] | None = None) -> None:
    """
    Train (or tune with ``-optimize``) through the zoo.

    :param argv: Arguments of ``rl_zoo3.train`` without the program name; default: ``sys.argv[1:]``
    """
    from rl_zoo3.train import train as zoo_train

    register()
    args = with_default_threads(with_default_config(sys.argv[1:] if argv is None else argv))
    with patched_argv(["sb3_kl.zoo train", *args]):
        zoo_train()


if __name__ == "__main__":
    train()
