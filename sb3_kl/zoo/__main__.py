"""
Command line entry point: ``python -m sb3_kl.zoo train|enjoy|record_video|export [flags]`` (console script
``sb3-kl-zoo``).

Examples::

    python -m sb3_kl.zoo train --algo klppo --env Pendulum-v1
    python -m sb3_kl.zoo train --algo klppo --env CartPole-v1 -optimize --n-trials 20 --storage sqlite:///kl.db
    python -m sb3_kl.zoo enjoy --algo klppo --env Pendulum-v1 -f logs/
    python -m sb3_kl.zoo record_video --algo klppo --env Pendulum-v1 -f logs/ -n 1000
    python -m sb3_kl.zoo export --algo klppo --env CartPole-v1 --storage sqlite:///kl.db --study-name S -o best.yml
"""

import sys
from collections.abc import Sequence

USAGE = """usage: python -m sb3_kl.zoo {train,enjoy,record_video,export} [flags ...]

  train   rl_zoo3.train with klppo/clip_klppo/kltrpo/klppo_mask/klppo_lstm registered;
          uses sb3_kl/hyperparams/{algo}.yml unless -conf is given
          (+ --heartbeat-interval, --heartbeat-grace-period, --max-retry for -optimize on a database --storage)
  enjoy   rl_zoo3.enjoy with the same algorithms registered
  record_video  rl_zoo3.record_video with the same algorithms registered
  export  write a trial of a study (the best by default) as a zoo config: -o best.yml

Run `python -m sb3_kl.zoo train -h` for the zoo's flags."""


def main(argv: Sequence[str] | None = None) -> None:
    """
    Dispatch to :func:`sb3_kl.zoo.train.train`, :func:`sb3_kl.zoo.enjoy.enjoy`, :func:`sb3_kl.zoo.enjoy.record_video` or
    :func:`sb3_kl.zoo.export.export`.

    :param argv: Arguments without the program name; default: ``sys.argv[1:]``
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    from sb3_kl.zoo.distributed import StorageError
    from sb3_kl.zoo.registry import ZooUsageError

    try:
        if command == "train":
            from sb3_kl.zoo.train import train

            train(rest)
        elif command == "enjoy":
            from sb3_kl.zoo.enjoy import enjoy

            enjoy(rest)
        elif command == "record_video":
            from sb3_kl.zoo.enjoy import record_video

            record_video(rest)
        elif command == "export":
            from sb3_kl.zoo.export import export

            export(rest)
        else:
            raise SystemExit(f"Unknown command {command!r}: use `train`, `enjoy`, `record_video` or `export`.\n\n{USAGE}")
    except (StorageError, ZooUsageError) as e:
        # a storage problem or a missing config is the user's to fix: one line that names the flag and the fix
        raise SystemExit(f"sb3_kl.zoo {command}: error: {e}") from None


if __name__ == "__main__":
    main()
