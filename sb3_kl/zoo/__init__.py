"""
RL Baselines3 Zoo integration: importing this package registers the sb3_kl algorithms in ``rl_zoo3.ALGOS``,
their Optuna samplers in ``rl_zoo3.hyperparams_opt`` and a schedule pre-processing step for them.

Command line: ``python -m sb3_kl.zoo train|enjoy ...`` (or the ``sb3-kl-zoo`` script), which accepts every flag of
``rl_zoo3.train`` / ``rl_zoo3.enjoy`` and uses the configs shipped in ``sb3_kl/hyperparams/`` when no ``-conf``
is given. See ``docs/guide/zoo.md``. ``-optimize`` on a database ``--storage`` (PostgreSQL) goes through
:mod:`sb3_kl.zoo.distributed` (heartbeat and retry of killed workers' trials, exact ``--max-total-trials``), and
``python -m sb3_kl.zoo export`` writes a trial as a config: see ``docs/guide/distributed.md``.
"""

import itertools
import os
import sys

#: How to install what ``sb3_kl.zoo`` needs (the package is installed from a checkout, not from an index)
INSTALL_HINT = 'from the sb3-kl checkout: pip install -e ".[zoo]" (or pip install "sb3_kl-<version>-py3-none-any.whl[zoo]")'


def _run_as_command() -> bool:
    """Whether this import comes from ``python -m sb3_kl.zoo`` or the ``sb3-kl-zoo`` script (not from user code)."""
    orig_argv = getattr(sys, "orig_argv", [])
    commands = ("sb3_kl.zoo", "sb3_kl.zoo.train", "sb3_kl.zoo.enjoy")
    as_module = any(flag == "-m" and name in commands for flag, name in itertools.pairwise(orig_argv))
    return as_module or os.path.basename(sys.argv[0] if sys.argv else "") == "sb3-kl-zoo"


try:
    import optuna  # noqa: F401
    import rl_zoo3
    import rl_zoo3.exp_manager
    import rl_zoo3.hyperparams_opt  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    _message = f"sb3_kl.zoo needs the RL Baselines3 Zoo and Optuna ({e}); install them {INSTALL_HINT}"
    if _run_as_command():
        raise SystemExit(_message) from None  # one line on stderr and exit status 1, no traceback
    raise ImportError(_message) from e

from sb3_kl.zoo.registry import (  # noqa: E402 (after the check that the zoo is installed)
    HYPERPARAMS_DIR,
    SB3_KL_ALGOS,
    SCHEDULE_KEYS,
    default_config,
    preprocess_schedules,
    register,
)

register()

__all__ = [
    "HYPERPARAMS_DIR",
    "SB3_KL_ALGOS",
    "SCHEDULE_KEYS",
    "default_config",
    "preprocess_schedules",
    "register",
]
