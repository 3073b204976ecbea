"""
RL Baselines3 Zoo integration: importing this package registers the sb3_kl algorithms in ``rl_zoo3.ALGOS``,
their Optuna samplers in ``rl_zoo3.hyperparams_opt`` and a schedule pre-processing step for them.

Command line: ``python -m sb3_kl.zoo train|enjoy ...`` (or the ``sb3-kl-zoo`` script), which accepts every flag of
``rl_zoo3.train`` / ``rl_zoo3.enjoy`` and uses the configs shipped in ``sb3_kl/hyperparams/`` when no ``-conf``
is given. See ``docs/zoo.md``. ``-optimize`` on a database ``--storage`` (PostgreSQL) goes through
:mod:`sb3_kl.zoo.distributed` (heartbeat and retry of killed workers' trials, exact ``--max-total-trials``), and
``python -m sb3_kl.zoo export`` writes a trial as a config: see ``docs/distributed.md``.
"""

try:
    import optuna  # noqa: F401
    import rl_zoo3
    import rl_zoo3.exp_manager
    import rl_zoo3.hyperparams_opt  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f'sb3_kl.zoo needs the RL Baselines3 Zoo and Optuna ({e}). Install them with: pip install "sb3-kl[zoo]"'
    ) from e

from sb3_kl.zoo.registry import (
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
