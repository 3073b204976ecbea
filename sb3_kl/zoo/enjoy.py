"""
``python -m sb3_kl.zoo enjoy``: the zoo's ``rl_zoo3.enjoy`` with the sb3_kl algorithms registered. Every flag of
``rl_zoo3.enjoy`` is passed through unchanged.
"""

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sb3_kl.zoo import INSTALL_HINT
from sb3_kl.zoo.registry import MASKABLE_ALGOS, SB3_KL_ALGOS, register, with_default_threads
from sb3_kl.zoo.train import patched_argv


@contextmanager
def masked_predictions(algo: str) -> Iterator[None]:
    """
    The zoo's ``enjoy`` calls ``model.predict`` without action masks. For a maskable algorithm, within this context,
    the test env the zoo creates is kept and its current masks are passed to every ``predict`` that gets none.

    :param algo: Zoo name of the algorithm (nothing changes for one that does not mask actions)
    """
    if algo not in MASKABLE_ALGOS:
        yield
        return
    import rl_zoo3.enjoy
    from sb3_contrib.common.maskable.utils import get_action_masks

    algorithm = SB3_KL_ALGOS[algo]
    create_test_env, predict = rl_zoo3.enjoy.create_test_env, algorithm.predict
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

    rl_zoo3.enjoy.create_test_env = keep_env
    algorithm.predict = masked_predict  # type: ignore[method-assign]
    try:
        yield
    finally:
        rl_zoo3.enjoy.create_test_env = create_test_env
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
    argv = list(sys.argv[1:] if argv is None else argv)
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--algo", type=str, default="ppo")
    algo = pre_parser.parse_known_args(argv)[0].algo
    with patched_argv(["sb3_kl.zoo enjoy", *with_default_threads(argv)]), masked_predictions(algo):
        zoo_enjoy()


if __name__ == "__main__":
    enjoy()
