"""
``python -m sb3_kl.zoo export``: write a trial of an Optuna study (the best one by default) as a zoo config entry,
so that it can be trained and evaluated on fresh seeds with ``python -m sb3_kl.zoo train -conf best.yml``.

The entry is the base config's entry for the environment (the shipped ``sb3_kl/hyperparams/{algo}.yml``, or
``-conf``) with the trial's hyperparameters on top, converted by the algorithm's converter (the one ``--trial-id``
uses), and ``policy_kwargs`` written as the string the zoo evaluates. As in the trial and in ``--trial-id``, the
trial's ``policy_kwargs`` (the sampled network) replaces the base config's whole ``policy_kwargs``: the entry trains
the network the trial trained.
"""

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import yaml
from rl_zoo3.exp_manager import ExperimentManager
from rl_zoo3.hyperparams_opt import HYPERPARAMS_CONVERTER
from torch import nn

from sb3_kl.zoo import distributed
from sb3_kl.zoo.distributed import check_params_match_algo, load_study
from sb3_kl.zoo.hyperparams_opt import CONTROLLER_KINDS, possible_parameter_names, sampled_parameter_names, trial_controller
from sb3_kl.zoo.registry import SB3_KL_ALGOS, default_config, register

__all__ = [
    "CONTROLLER_KINDS",
    "check_params_match_algo",
    "check_trial_matches_algo",
    "export",
    "load_study",
    "possible_parameter_names",
    "sampled_parameter_names",
    "trial_config",
]


def check_trial_matches_algo(trial: optuna.trial.FrozenTrial, study_name: str, algo: str) -> None:
    """
    :param trial: The trial to export
    :param study_name: Its study's name (for the message)
    :param algo: The ``--algo`` it is exported for
    :raises distributed.StorageError: the trial was not drawn by ``algo``'s sampler (see :func:`check_params_match_algo`)
    """
    check_params_match_algo(trial.params, f"trial {trial.number}", study_name, algo)


def _python_literal(value: Any) -> str:
    """Render a ``policy_kwargs`` value the way the zoo's ``eval`` reads it back (``nn.Tanh``, lists, numbers)."""
    if isinstance(value, type) and getattr(nn, value.__name__, None) is value:
        return f"nn.{value.__name__}"
    if isinstance(value, dict):
        return "dict(" + ", ".join(f"{key}={_python_literal(item)}" for key, item in value.items()) + ")"
    if isinstance(value, (list, tuple)):
        items = ", ".join(_python_literal(item) for item in value)
        return f"[{items}]" if isinstance(value, list) else f"({items}{',' if len(value) == 1 else ''})"
    return repr(value)


def trial_config(
    study: optuna.Study, algo: str, env_id: str, trial_number: int | None = None, conf_file: str | None = None
) -> dict[str, Any]:
    """
    :param study: Study of an sb3_kl zoo search
    :param algo: Zoo name of the algorithm the study tuned (a key of :data:`~sb3_kl.zoo.registry.SB3_KL_ALGOS`)
    :param env_id: Environment id (the key of the entry)
    :param trial_number: Trial to export (default: the best complete trial)
    :param conf_file: Base config (default: the shipped one for ``algo``)
    :return: The zoo config entry (hyperparameters) of that trial
    """
    register()
    if trial_number is None:
        if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
            raise distributed.StorageError(f"study {study.study_name!r} has no complete trial yet: nothing to export.")
        trial = study.best_trial
    else:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == trial_number]
        if not matches or matches[0].state != optuna.trial.TrialState.COMPLETE:
            raise distributed.StorageError(f"--trial-id {trial_number}: no complete trial with that number in the study.")
        trial = matches[0]
    check_trial_matches_algo(trial, study.study_name, algo)
    base_path = Path(conf_file or default_config(algo))
    entries = yaml.safe_load(base_path.read_text()) or {}
    key = _entry_key(entries, env_id)
    if key is None:
        raise distributed.StorageError(
            f"the base config {base_path} has no entry for --env {env_id} (its entries: {', '.join(entries) or 'none'}): "
            "pass -conf with the config the study was tuned with, so that the exported entry keeps its n_envs, "
            "n_timesteps, normalization and the other settings the trial did not sample."
        )
    entry = dict(entries[key])
    hyperparams = dict(HYPERPARAMS_CONVERTER[algo](trial.params))
    # beta's options were drawn for the tuned config's controller: the entry trains with that one
    controller, is_object = trial_controller(trial.user_attrs)
    if is_object:
        raise distributed.StorageError(
            f"trial {trial.number} of study {study.study_name!r} was tuned with a controller object as kl_controller "
            f"({trial.user_attrs['kl_controller']}), which a YAML entry cannot hold: re-train it with the zoo's "
            "--trial-id and the config it was tuned with (-conf)."
        )
    if controller is not None:
        hyperparams["kl_controller"] = controller
    # the zoo's objective and --trial-id replace the config's policy_kwargs with the trial's (dict.update)
    if "policy_kwargs" in hyperparams:
        hyperparams["policy_kwargs"] = _python_literal(hyperparams["policy_kwargs"])
    entry.update(hyperparams)
    entry.setdefault("policy", "MlpPolicy")
    return entry


def _entry_key(entries: dict[str, Any], env_id: str) -> str | None:
    """The entry the zoo trains ``env_id`` with: its own, else ``atari`` for an Atari env, else ``default``."""
    if env_id in entries:
        return env_id
    if "atari" in entries:
        try:
            if ExperimentManager.is_atari(env_id):
                return "atari"
        except Exception:  # an env id gymnasium does not know: not Atari as far as the zoo can tell either
            pass
    return "default" if "default" in entries else None


def export(argv: Sequence[str] | None = None) -> Path:
    """
    Command line: ``python -m sb3_kl.zoo export --algo A --env E --storage URL --study-name NAME [--trial-id N]
    [-conf base.yml] -o best.yml``.

    :param argv: Arguments without the program name
    :return: Path of the written config
    """
    parser = argparse.ArgumentParser(prog="python -m sb3_kl.zoo export", description=__doc__)
    parser.add_argument("--algo", required=True, choices=list(SB3_KL_ALGOS))
    parser.add_argument("--env", required=True, help="environment id (key of the written entry)")
    parser.add_argument("--storage", required=True, help="the study's storage (database URL or journal .log file)")
    parser.add_argument("--study-name", required=True)
    parser.add_argument("--trial-id", type=int, default=None, help="trial number (default: the best complete trial)")
    parser.add_argument("-conf", "--conf-file", default=None, help="base config (default: the shipped one)")
    parser.add_argument("-o", "--output", required=True, help="YAML file to write")
    args = parser.parse_args(argv)
    study = load_study(args.storage, args.study_name)
    entry = trial_config(study, args.algo, args.env, args.trial_id, args.conf_file)
    trial = study.best_trial if args.trial_id is None else study.trials[args.trial_id]
    header = (
        f"# Trial {trial.number} (value {trial.value}) of study {study.study_name!r} in {distributed.redact(args.storage)},\n"
        f"# exported by: python -m sb3_kl.zoo export --algo {args.algo} --env {args.env} ...\n"
    )
    output = Path(args.output)
    output.write_text(header + yaml.safe_dump({args.env: entry}, sort_keys=False))
    print(f"Wrote trial {trial.number} (value {trial.value}) of {study.study_name!r} to {output}")
    return output
