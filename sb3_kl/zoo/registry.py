"""
Registration of the sb3_kl algorithms in the RL Baselines3 Zoo, and the schedule pre-processing they need.

The zoo keeps three module-level registries that its ``train``/``enjoy`` scripts read at call time:
``rl_zoo3.ALGOS`` (one dict object shared by ``rl_zoo3.utils``, ``rl_zoo3.train`` and ``rl_zoo3.exp_manager``),
``rl_zoo3.hyperparams_opt.HYPERPARAMS_SAMPLER`` and ``HYPERPARAMS_CONVERTER``. :func:`register` adds our entries to
them in place, which is the extension route the zoo documents for SBX.
"""

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import rl_zoo3
import yaml
from rl_zoo3 import exp_manager, hyperparams_opt
from rl_zoo3.callbacks import TrialEvalCallback
from rl_zoo3.exp_manager import ExperimentManager
from sb3_contrib.common.maskable.callbacks import MaskableEvalCallback
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.logger import CSVOutputFormat
from stable_baselines3.common.utils import LinearSchedule

import sb3_kl
from sb3_kl import KLPPO, KLTRPO, TRPL, ClipKLPPO, MaskableKLPPO, RecurrentKLPPO
from sb3_kl.common.controllers import KLController
from sb3_kl.zoo.distributed import patch_experiment_manager
from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_CONVERTER, HYPERPARAMS_SAMPLER, TUNED_HYPERPARAMS
from sb3_kl.zoo.patching import install_patch, is_patched

#: Folder of the configs shipped with the package (``{algo}.yml``)
HYPERPARAMS_DIR = Path(sb3_kl.__file__).parent / "hyperparams"

#: Zoo name -> algorithm class
SB3_KL_ALGOS: dict[str, type[BaseAlgorithm]] = {
    "klppo": KLPPO,
    "clip_klppo": ClipKLPPO,
    "kltrpo": KLTRPO,
    "klppo_mask": MaskableKLPPO,
    "klppo_lstm": RecurrentKLPPO,  # the zoo's name for RecurrentPPO is ppo_lstm
    "trpl": TRPL,
}

#: Zoo names of the algorithms that act with action masks (``enjoy`` passes the env's masks to ``predict``, and the
#: evaluations during ``train`` and ``-optimize`` use sb3-contrib's masked evaluation)
MASKABLE_ALGOS = ("klppo_mask",)

#: Masked tasks registered in Gymnasium for the zoo (which has none): id -> (entry point, keyword arguments).
#: sb3-contrib's identity task with invalid actions: 3 sub-actions of 10 choices, 15 of the 30 masked at each step.
MASKED_ENVS: dict[str, tuple[str, dict[str, Any]]] = {
    "InvalidActionMultiDiscrete-v0": (
        "sb3_contrib.common.envs:InvalidActionEnvMultiDiscrete",
        dict(dims=[10, 10, 10], n_invalid_actions=15),
    ),
}

#: Hyperparameters that accept the zoo's ``lin_<float>`` syntax (and ``lin_<start>_<end>``) for our algorithms.
#: The zoo itself parses the first three (into ``rl_zoo3.utils.SimpleLinearSchedule``); for sb3_kl algorithms all of
#: them become SB3's picklable ``LinearSchedule``, so a saved model loads without rl_zoo3 installed.
SCHEDULE_KEYS = ("learning_rate", "clip_range", "clip_range_vf", "target_kl")
#: Name of the CSV log written in the zoo's run folder (``logs/{algo}/{env}_{n}/``) for sb3_kl algorithms
PROGRESS_CSV = "progress.csv"


def with_default_threads(argv: Sequence[str]) -> list[str]:
    """
    Append ``--num-threads 1`` to the zoo's arguments unless ``--num-threads`` is given or ``OMP_NUM_THREADS`` is set:
    small policies train many times faster on one torch thread (``benchmarks/results/torch_threads_small_mlp.md``).
    ``--num-threads -1`` gives torch's default back.

    :param argv: Arguments of ``rl_zoo3.train`` / ``rl_zoo3.enjoy`` (without the program name)
    :return: The arguments, possibly with ``--num-threads 1`` appended
    """
    argv = list(argv)
    given = any(arg == "--num-threads" or arg.startswith("--num-threads=") for arg in argv)
    if not given and not os.environ.get("OMP_NUM_THREADS"):
        argv += ["--num-threads", "1"]
    return argv


class ProgressCSVCallback(BaseCallback):
    """
    Adds a CSV output (``progress.csv``, every value the model logs, ``train/kl`` included) to the model's logger for
    the duration of ``learn``: the zoo logs to stdout only unless ``-tb`` is given, and ``sb3-kl plot/report`` need a
    file. The zoo wrapper adds it for sb3_kl algorithms, with the run's folder.

    :param folder: Folder of the CSV file
    """

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.output: CSVOutputFormat | None = None

    def _on_training_start(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        self.output = CSVOutputFormat(os.path.join(self.folder, PROGRESS_CSV))
        self.model.logger.output_formats.append(self.output)

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        if self.output is None:
            return
        if self.output in self.model.logger.output_formats:
            self.model.logger.output_formats.remove(self.output)
        self.output.close()
        self.output = None


class ZooUsageError(ValueError):
    """A zoo command the user must change (e.g. an environment without a shipped config); the message is one line."""


def shipped_entries(algo: str) -> list[str]:
    """:return: The environments of the config shipped for ``algo`` (:func:`default_config`)"""
    return list(yaml.safe_load(Path(default_config(algo)).read_text()) or {})


def default_config(algo: str) -> str:
    """
    Path of the config shipped with sb3_kl for ``algo`` (used when no ``-conf`` is given).

    :param algo: Zoo name of an sb3_kl algorithm, e.g. ``"klppo"``
    :return: Path of ``sb3_kl/hyperparams/{algo}.yml``
    """
    if algo not in SB3_KL_ALGOS:
        raise ValueError(f"`algo`={algo!r} is not an sb3_kl algorithm; choose one of {sorted(SB3_KL_ALGOS)}.")
    return str(HYPERPARAMS_DIR / f"{algo}.yml")


def parse_linear_schedule(key: str, value: str) -> LinearSchedule:
    """
    Turn the zoo's schedule syntax into SB3's picklable ``LinearSchedule``:
    ``"lin_<start>"`` decreases linearly from ``start`` (beginning of training) to 0 (end), as in the zoo;
    ``"lin_<start>_<end>"`` decreases (or increases) linearly from ``start`` to ``end``.

    :param key: Name of the hyperparameter, used in error messages
    :param value: The string from the config, e.g. ``"lin_3e-4"`` or ``"lin_0.02_0.005"``
    :return: The schedule
    """
    kind, *numbers = value.split("_")
    try:
        values = [float(number) for number in numbers]
    except ValueError:
        values = []
    if kind != "lin" or len(values) not in (1, 2):
        raise ValueError(
            f"Invalid value for `{key}`: {value!r}. Use a number, 'lin_<start>' (e.g. 'lin_3e-4', linear decay to 0) "
            "or 'lin_<start>_<end>' (e.g. 'lin_0.02_0.005', linear from start to end over training), or None."
        )
    start, end = values[0], values[1] if len(values) == 2 else 0.0
    return LinearSchedule(start=start, end=end, end_fraction=1.0)


def schedule_value(key: str, value: str) -> float | LinearSchedule | str | None:
    """
    :param key: Name of the hyperparameter, used in error messages
    :param value: A string of a zoo config for one of :data:`SCHEDULE_KEYS`
    :return: None for ``"None"`` (Python's spelling, which YAML reads as a string: its null is ``null`` or ``~``; a
        zoo config's ``clip_range: None``), the number for a number YAML read as a string (``2e-2``: YAML 1.1 needs a
        dot, ``2.0e-2``), ``learning_rate``'s ``"auto"``/``"auto_<start>"`` as it is (the algorithm reads it), else
        the schedule of :func:`parse_linear_schedule`
    """
    if value.strip() == "None":
        return None
    if key == "learning_rate" and value.startswith("auto"):
        return value
    try:
        return float(value)
    except ValueError:
        return parse_linear_schedule(key, value)


def preprocess_schedules(hyperparams: dict[str, Any]) -> dict[str, Any]:
    """
    Replace every ``"lin_..."`` string of :data:`SCHEDULE_KEYS` by an SB3 ``LinearSchedule`` (and a number that YAML
    read as a string, such as ``2e-2``, by the number). Other values (numbers, None, schedule objects) are left
    unchanged.

    :param hyperparams: Hyperparameters as read from a zoo config
    :return: A new dict
    """
    processed = dict(hyperparams)
    for key in SCHEDULE_KEYS:
        if isinstance(processed.get(key), str):
            processed[key] = schedule_value(key, processed[key])
    return processed


def _patch_experiment_manager() -> None:
    """
    Make ``ExperimentManager._preprocess_hyperparams`` parse our schedules for sb3_kl algorithms (and only those).
    The string schedules are converted before the zoo sees them and handed back afterwards, because the zoo rejects
    schedule objects for the keys it parses itself. Idempotent.
    """
    original = ExperimentManager._preprocess_hyperparams
    if is_patched(original):
        return

    def _preprocess_hyperparams(self: ExperimentManager, hyperparams: dict[str, Any]) -> Any:
        if self.algo not in SB3_KL_ALGOS:
            return original(self, hyperparams)
        # None passes through to the algorithm (e.g. clip_range: None, KLPPO's default: no ratio clipping), which
        # the zoo's own schedule parsing refuses; the algorithm's validation refuses None where it is not allowed
        converted = {
            key: None if value is None else schedule_value(key, value)
            for key, value in hyperparams.items()
            if key in SCHEDULE_KEYS and (value is None or isinstance(value, str))
        }
        remaining = {key: value for key, value in hyperparams.items() if key not in converted}
        processed, *rest = original(self, remaining)
        processed.update(converted)
        return (processed, *rest)

    install_patch(ExperimentManager, "_preprocess_hyperparams", _preprocess_hyperparams)


class MaskableTrialEvalCallback(TrialEvalCallback, MaskableEvalCallback):
    """
    The zoo's :class:`~rl_zoo3.callbacks.TrialEvalCallback` (reports each evaluation to the Optuna trial, prunes)
    evaluating with the env's action masks, as :class:`~sb3_contrib.common.maskable.callbacks.MaskableEvalCallback`
    does: the tuning objective of a maskable algorithm is the return it gets when it acts as it will be used.
    """


def masked_eval_callback(callback: EvalCallback) -> MaskableEvalCallback:
    """
    :param callback: An ``EvalCallback`` the zoo built for a run
    :return: The same evaluation (env, frequency, episodes, best-model and log paths, new-best callback) with masks
    """
    log_path = os.path.dirname(callback.log_path) if callback.log_path is not None else None
    return MaskableEvalCallback(
        callback.eval_env,
        callback_on_new_best=callback.callback_on_new_best,
        n_eval_episodes=callback.n_eval_episodes,
        eval_freq=callback.eval_freq,
        log_path=log_path,
        best_model_save_path=callback.best_model_save_path,
        deterministic=callback.deterministic,
        render=callback.render,
        verbose=callback.verbose,
        warn=callback.warn,
    )


def _patch_create_callbacks() -> None:
    """
    Make ``ExperimentManager.create_callbacks`` add a :class:`ProgressCSVCallback` writing ``progress.csv`` into the
    run's folder when training an sb3_kl algorithm (not during ``-optimize``), and evaluate a maskable algorithm with
    its masks (the zoo's ``EvalCallback`` would let it pick masked actions, and keep the best model by that return).
    Idempotent.
    """
    original = ExperimentManager.create_callbacks
    if is_patched(original):
        return

    def create_callbacks(self: ExperimentManager) -> None:
        original(self)
        if self.algo in MASKABLE_ALGOS:
            self.callbacks = [
                masked_eval_callback(callback) if type(callback) is EvalCallback else callback for callback in self.callbacks
            ]
        if self.algo in SB3_KL_ALGOS and not self.optimize_hyperparameters:
            self.callbacks.append(ProgressCSVCallback(self.save_path))

    install_patch(ExperimentManager, "create_callbacks", create_callbacks)


class TrialHyperparams(dict):
    """
    The config's hyperparameters as the zoo's objective copies them into each trial (``self._hyperparams.copy()``),
    with every controller object (``kl_controller``, ``ref_kl_controller``) copied deeply: the zoo's shallow copy
    would hand one object to every trial, each starting from the beta and history the previous one left (and
    concurrent trials changing it together).
    """

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        return {key: copy.deepcopy(value) if isinstance(value, KLController) else value for key, value in self.items()}


def _patch_objective() -> None:
    """
    Make ``ExperimentManager.objective`` (one ``-optimize`` trial) of an sb3_kl algorithm show its samplers the
    config entry it tunes (:data:`~sb3_kl.zoo.hyperparams_opt.TUNED_HYPERPARAMS`: the zoo passes a sampler no config,
    so a study of ``kl_controller: fixed`` would search ``kl_adapt_factor``, which the fixed beta ignores), start
    each trial from its own copy of a controller object (:class:`TrialHyperparams`), and evaluate a maskable
    algorithm with its masks (:class:`MaskableTrialEvalCallback`). The zoo builds its ``TrialEvalCallback`` inside the
    method, so the name is swapped in its module for the duration of the trial.
    Idempotent.
    """
    original = ExperimentManager.objective
    if is_patched(original):
        return

    def objective(self: ExperimentManager, trial: Any) -> float:
        if self.algo not in SB3_KL_ALGOS:
            return original(self, trial)
        if not isinstance(self._hyperparams, TrialHyperparams):  # once: trials may run in threads (--n-jobs)
            self._hyperparams = TrialHyperparams(self._hyperparams)
        token = TUNED_HYPERPARAMS.set(dict(self._hyperparams))
        if self.algo in MASKABLE_ALGOS:
            exp_manager.TrialEvalCallback = MaskableTrialEvalCallback  # type: ignore[misc]
        try:
            return original(self, trial)
        finally:
            exp_manager.TrialEvalCallback = TrialEvalCallback  # type: ignore[misc]
            TUNED_HYPERPARAMS.reset(token)

    install_patch(ExperimentManager, "objective", objective)


#: Config keys that set the initial state of a KL coefficient's controller: continuing training (``-i``) keeps the
#: saved coefficient, so the zoo does not pass them to ``load`` (where they would override it)
INITIAL_STATE_KEYS = ("kl_coef", "ref_kl_coef")


def _patch_load_pretrained_agent() -> None:
    """
    Make ``ExperimentManager._load_pretrained_agent`` (``-i``/``--trained-agent``: continue training) keep the saved
    KL coefficients of an sb3_kl algorithm. The zoo passes every config key to ``load``, and ``load(path, kl_coef=x)``
    sets beta to ``x``: the config's initial beta (and ``export`` always writes one) would restart the controller in the
    middle of its run. Idempotent.
    """
    original = ExperimentManager._load_pretrained_agent
    if is_patched(original):
        return

    def _load_pretrained_agent(self: ExperimentManager, hyperparams: dict[str, Any], env: Any) -> Any:
        if self.algo in SB3_KL_ALGOS:
            dropped = [key for key in INITIAL_STATE_KEYS if hyperparams.pop(key, None) is not None]
            if dropped and self.verbose > 0:
                print(f"Continuing training: the saved {' and '.join(dropped)} kept, the config's initial value ignored")
        return original(self, hyperparams, env)

    install_patch(ExperimentManager, "_load_pretrained_agent", _load_pretrained_agent)


def register() -> None:
    """
    Register the sb3_kl algorithms, their Optuna samplers and converters in the zoo's registries (in place), and the
    masked tasks of :data:`MASKED_ENVS` in Gymnasium's.
    Called when ``sb3_kl.zoo`` is imported; calling it again is harmless.
    """
    rl_zoo3.ALGOS.update(SB3_KL_ALGOS)
    for env_id, (entry_point, kwargs) in MASKED_ENVS.items():
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=entry_point, kwargs=kwargs)
    for algo in SB3_KL_ALGOS:
        hyperparams_opt.HYPERPARAMS_SAMPLER[algo] = HYPERPARAMS_SAMPLER[algo]
        hyperparams_opt.HYPERPARAMS_CONVERTER[algo] = HYPERPARAMS_CONVERTER[algo]
    _patch_experiment_manager()
    patch_experiment_manager()  # -optimize on database storages: heartbeat, safe schema creation, exact cap
    _patch_create_callbacks()
    _patch_objective()
    _patch_load_pretrained_agent()
