"""
``python -m sb3_kl.zoo train``: the zoo's ``rl_zoo3.train`` with the sb3_kl algorithms registered and, for them,
the shipped config used when no ``-conf`` is given. Every flag of ``rl_zoo3.train`` is passed through unchanged.

Three flags are added for ``-optimize`` on a database ``--storage`` (see :mod:`sb3_kl.zoo.distributed`):
``--heartbeat-interval`` (seconds, default 60, 0 turns it off), ``--heartbeat-grace-period`` (seconds without a
heartbeat before a trial is failed and retried, default twice the interval) and ``--max-retry`` (default 3).
"""

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import gymnasium as gym

from sb3_kl.zoo import distributed
from sb3_kl.zoo.registry import (
    SB3_KL_ALGOS,
    ZooUsageError,
    default_config,
    register,
    shipped_entries,
    with_default_threads,
)


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
    :raises ZooUsageError: ``--env`` has no entry in the shipped config (the zoo would fail with a traceback)
    """
    # Same option strings and defaults as rl_zoo3.train, so abbreviations such as ``--conf`` are understood the same way
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--algo", type=str, default="ppo")
    pre_parser.add_argument("--env", type=str, default="CartPole-v1")
    pre_parser.add_argument("-conf", "--conf-file", type=str, default=None)
    pre_parser.add_argument("-h", "--help", action="store_true")
    known, _ = pre_parser.parse_known_args(list(argv))
    argv = list(argv)
    if known.algo in SB3_KL_ALGOS and known.conf_file is None:
        entries = shipped_entries(known.algo)
        # an id gymnasium does not know (a typo, or a --gym-packages env) is left to the zoo, which suggests names
        if known.env not in entries and known.env in gym.envs.registry and not known.help:
            raise ZooUsageError(
                f"--algo {known.algo} ships no config for --env {known.env} (its config {default_config(known.algo)} "
                f"has {', '.join(entries)}): write an entry for {known.env} in a YAML file and pass it with -conf "
                "my.yml (docs/guide/zoo.md)"
            )
        argv += ["-conf", default_config(known.algo)]
    return argv


def check_storage_flag(argv: Sequence[str]) -> None:
    """
    Check a database ``--storage`` (and with ``-optimize``, an existing study's direction) before the zoo starts:
    the zoo creates the experiment's folder and environments (``0.monitor.csv``) before it opens the study, so a
    problem found then would leave them behind.

    :param argv: Arguments of ``rl_zoo3.train`` (without the program name)
    :raises distributed.StorageError: an unusable ``--storage``, or a study the zoo's search could not continue
    """
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--storage", type=str, default=None)
    pre_parser.add_argument("--study-name", type=str, default=None)
    pre_parser.add_argument("--trial-id", type=int, default=None)
    pre_parser.add_argument("-optimize", "--optimize-hyperparameters", action="store_true", default=False)
    known, _ = pre_parser.parse_known_args(list(argv))
    # the zoo opens --storage only for a search, or to reload a trial (--trial-id with --study-name)
    if not distributed.is_database_url(known.storage):
        return
    if not known.optimize_hyperparameters:
        if known.trial_id is not None and known.study_name is not None:
            distributed.check_storage(known.storage)
        return
    storage = distributed.open_storage(known.storage, distributed.HeartbeatSettings(interval=None))
    try:
        distributed.check_study_direction(storage, known.study_name, "maximize")  # the zoo's search maximizes
    finally:
        storage.remove_session()
        storage.engine.dispose()


#: ``train -h`` prints this before the zoo's own help (the zoo's parser does not know these flags)
HEARTBEAT_HELP = """sb3_kl.zoo train: the flags of rl_zoo3.train (below), and for -optimize on a database --storage:
  --heartbeat-interval SECONDS      heartbeat of a running trial (default 60; 0 turns it and the retry of a dead
                                    worker's trial off)
  --heartbeat-grace-period SECONDS  seconds without a heartbeat before a trial is failed and re-queued (default:
                                    twice the interval)
  --max-retry N                     times one trial is re-queued after its worker died (default 3)
"""


def split_heartbeat_flags(argv: Sequence[str]) -> tuple[distributed.HeartbeatSettings, list[str]]:
    """
    Take sb3_kl's heartbeat flags out of the zoo's arguments.

    :param argv: Arguments of ``python -m sb3_kl.zoo train``
    :return: The heartbeat settings and the remaining arguments (for ``rl_zoo3.train``)
    """
    parser = argparse.ArgumentParser(prog="python -m sb3_kl.zoo train", add_help=False, allow_abbrev=False)
    parser.add_argument("--heartbeat-interval", type=int, default=60)
    parser.add_argument("--heartbeat-grace-period", type=int, default=None)
    parser.add_argument("--max-retry", type=int, default=3)
    known, rest = parser.parse_known_args(list(argv))
    if known.heartbeat_interval < 0:
        parser.error(f"--heartbeat-interval must be >= 0 seconds (0 turns the heartbeat off), got {known.heartbeat_interval}")
    if known.max_retry < 0:
        parser.error(f"--max-retry must be >= 0, got {known.max_retry}")
    if known.heartbeat_interval == 0 and any(arg.split("=")[0] == "--max-total-trials" for arg in rest):
        parser.error(
            "--heartbeat-interval 0 cannot go with --max-total-trials: without a heartbeat the trial of a worker that "
            "dies stays RUNNING, and every worker waits on it to reach the cap, for good. Keep the heartbeat (the "
            "default is 60 s)"
        )
    grace = known.heartbeat_grace_period
    if grace is not None and known.heartbeat_interval and grace <= known.heartbeat_interval:
        parser.error(
            f"--heartbeat-grace-period ({grace} s) must exceed --heartbeat-interval ({known.heartbeat_interval} s), "
            "or every trial is failed between two heartbeats: use at least twice the interval"
        )
    settings = distributed.HeartbeatSettings(known.heartbeat_interval or None, grace, known.max_retry)
    return settings, rest


def train(argv: Sequence[str] | None = None) -> None:
    """
    Train (or tune with ``-optimize``) through the zoo.

    :param argv: Arguments of ``rl_zoo3.train`` (plus the heartbeat flags, see the module docstring) without the
        program name; default: ``sys.argv[1:]``
    :raises distributed.StorageError: an unusable ``--storage`` or ``--study-name``
    :raises ZooUsageError: ``--env`` has no entry in the shipped config of ``--algo`` and no ``-conf`` is given
    """
    from rl_zoo3.train import train as zoo_train

    register()
    heartbeat, args = split_heartbeat_flags(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(HEARTBEAT_HELP)
    args = with_default_threads(with_default_config(args))
    check_storage_flag(args)
    saved = distributed.CURRENT_HEARTBEAT
    distributed.CURRENT_HEARTBEAT = heartbeat
    try:
        with patched_argv(["python -m sb3_kl.zoo train", *args]):
            zoo_train()
    finally:
        distributed.CURRENT_HEARTBEAT = saved


if __name__ == "__main__":
    train()
