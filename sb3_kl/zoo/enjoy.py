"""
``python -m sb3_kl.zoo enjoy`` and ``record_video``: the zoo's ``rl_zoo3.enjoy`` and ``rl_zoo3.record_video`` with the
sb3_kl algorithms registered. Every flag of the zoo's script is passed through unchanged.
"""

import argparse
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from sb3_kl.zoo import INSTALL_HINT
from sb3_kl.zoo.registry import MASKABLE_ALGOS, SB3_KL_ALGOS, register, with_default_threads
from sb3_kl.zoo.train import patched_argv


@contextmanager
def masked_predictions(algo: str, script: ModuleType | None = None) -> Iterator[None]:
    """
    The zoo's ``enjoy`` and ``record_video`` call ``model.predict`` without action masks. For a maskable algorithm,
    within this context, the test env the zoo creates is kept and its current masks are passed to every ``predict``
    that gets none.

    :param algo: Zoo name of the algorithm (nothing changes for one that does not mask actions)
    :param script: The module whose ``create_test_env`` the zoo's script calls (default: ``rl_zoo3.enjoy``)
    """
    if algo not in MASKABLE_ALGOS:
        yield
        return
    from sb3_contrib.common.maskable.utils import get_action_masks

    if script is None:
        import rl_zoo3.enjoy as script
    algorithm = SB3_KL_ALGOS[algo]
    create_test_env, predict = script.create_test_env, algorithm.predict
    envs: list[Any] = []

    def keep_env(*args: Any, **kwargs: Any) -> Any:
        envs.append(create_test_env(*args, **kwargs))
        return envs[-1]

    def masked_predict(
        self: Any,
        observation: Any,
        state: Any = None,
        episode_start: Any = None,
        deterministic: bool = False,
        action_masks: Any = None,
    ) -> Any:
        if action_masks is None and envs:
            action_masks = get_action_masks(envs[-1])
        return predict(self, observation, state, episode_start, deterministic, action_masks=action_masks)

    script.create_test_env = keep_env  # type: ignore[attr-defined]
    algorithm.predict = masked_predict  # type: ignore[method-assign]
    try:
        yield
    finally:
        script.create_test_env = create_test_env  # type: ignore[attr-defined]
        algorithm.predict = predict  # type: ignore[method-assign]


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
    argv = with_default_folder(list(sys.argv[1:] if argv is None else argv))
    with patched_argv(["python -m sb3_kl.zoo enjoy", *with_default_threads(argv)]), masked_predictions(_algo(argv)):
        zoo_enjoy()


def record_video(argv: Sequence[str] | None = None) -> None:
    """
    Load a model trained through the zoo and record a video of it (``rl_zoo3.record_video``, which runs as a script:
    its module is executed as ``__main__`` with the sb3_kl algorithms registered).

    :param argv: Arguments of ``rl_zoo3.record_video`` without the program name; default: ``sys.argv[1:]``
    """
    import rl_zoo3.utils

    register()
    argv = with_default_folder(list(sys.argv[1:] if argv is None else argv))
    # the script imports create_test_env from rl_zoo3.utils when it runs: the masked env is swapped in there
    with patched_argv(["python -m sb3_kl.zoo record_video", *argv]), masked_predictions(_algo(argv), rl_zoo3.utils):
        runpy.run_module("rl_zoo3.record_video", run_name="__main__", alter_sys=False)


def with_default_folder(argv: Sequence[str]) -> list[str]:
    """
    Append ``-f logs`` (where ``python -m sb3_kl.zoo train`` writes by default) when ``--algo`` is an sb3_kl algorithm
    and no ``-f`` is given: the zoo's default, ``rl-trained-agents``, holds the zoo's published agents and makes it try
    a Hugging Face download of ``sb3/{algo}-{env}``, which does not exist for these algorithms.

    :param argv: Arguments of ``rl_zoo3.enjoy`` or ``rl_zoo3.record_video`` (without the program name)
    :return: The arguments, possibly with ``-f logs`` appended
    """
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("-f", "--folder", type=str, default=None)
    argv = list(argv)
    if _algo(argv) in SB3_KL_ALGOS and pre_parser.parse_known_args(argv)[0].folder is None:
        argv += ["-f", "logs"]
    return argv


def _algo(argv: Sequence[str]) -> str:
    """The ``--algo`` of a zoo script's arguments (the zoo's default ``ppo`` without one)."""
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--algo", type=str, default="ppo")
    return pre_parser.parse_known_args(list(argv))[0].algo


if __name__ == "__main__":
    enjoy()
