"""
Optuna samplers for the sb3_kl algorithms, in the zoo's format: ``sample_<algo>_params(trial, n_actions, n_envs,
additional_args) -> hyperparameters``, plus converters from a trial's raw ``params`` back to hyperparameters
(the zoo calls them for ``--trial-id`` and ``--storage`` reloads).

Every sampler names its Optuna parameters after the converter's input, and returns ``converter(trial params)``,
so that a trial reloaded from a storage gives exactly the hyperparameters that were trained.

The KL penalty's samplers draw only the controller options that the tuned config's ``kl_controller`` uses: a study
of a config with ``kl_controller: fixed`` does not search ``kl_adapt_factor``, which a fixed beta ignores. The config
is the entry the zoo's objective is tuning (set by ``sb3_kl.zoo.registry`` for the duration of each trial), or
``additional_args["hyperparams"]`` when a sampler is called directly.
"""

from contextvars import ContextVar
from typing import Any

import optuna
from rl_zoo3.hyperparams_opt import convert_onpolicy_params

from sb3_kl.common.controllers import CONTROLLER_ARGUMENTS, KL_CONTROLLERS

#: The hyperparameters of the config entry the zoo's objective is tuning (``ExperimentManager._hyperparams``), while a
#: trial of an sb3_kl algorithm is sampled and trained; None outside a trial
TUNED_HYPERPARAMS: ContextVar[dict[str, Any] | None] = ContextVar("tuned_hyperparams", default=None)


def tuned_hyperparams(additional_args: dict[str, Any] | None) -> dict[str, Any]:
    """
    :param additional_args: The zoo's extras passed to a sampler
    :return: The tuned config's hyperparameters: ``additional_args["hyperparams"]`` when given, else the entry the
        zoo's objective is tuning, else none (a sampler called outside the zoo: the algorithms' defaults)
    """
    if additional_args and additional_args.get("hyperparams") is not None:
        return dict(additional_args["hyperparams"])
    return dict(TUNED_HYPERPARAMS.get() or {})


#: The user attribute in which a KL penalty trial names the ``kl_controller`` its beta options were drawn for (a
#: controller's name, or ``"object: <class>"``), so that ``export`` and ``--trial-id`` re-train it with that controller
CONTROLLER_ATTR = "kl_controller"
#: How :data:`CONTROLLER_ATTR` starts for a controller object
_OBJECT_LABEL = "object: "


def controller_label(kl_controller: Any) -> str:
    """:return: The :data:`CONTROLLER_ATTR` value for a config's ``kl_controller`` (a name, or an object's class)"""
    return kl_controller if isinstance(kl_controller, str) else f"{_OBJECT_LABEL}{type(kl_controller).__name__}"


def trial_controller(user_attrs: dict[str, Any]) -> tuple[str | None, bool]:
    """
    :param user_attrs: A trial's ``user_attrs``
    :return: ``(name, is_object)``: the named controller the trial was tuned with (None when it recorded none, as
        trials of studies from before the attribute, or a controller object) and whether it was an object
    """
    label = user_attrs.get(CONTROLLER_ATTR)
    if not isinstance(label, str):
        return None, False
    if label.startswith(_OBJECT_LABEL):
        return None, True
    return label, False


def sampled_controller_options(kl_controller: Any = "adaptive") -> tuple[str, ...]:
    """
    The options of beta's controller that a trial draws, for the config's ``kl_controller``.

    :param kl_controller: The config's ``kl_controller`` (``"adaptive"`` when it sets none, the algorithms' default)
    :return: ``kl_coef`` and ``kl_adapt_factor`` for ``"adaptive"``; ``kl_coef`` alone for the other named
        controllers (the fixed beta, or the proportional rule's start: neither uses the band rule's factor); nothing
        for a controller object, which is used as given and ignores both
    """
    if not isinstance(kl_controller, str):
        return ()
    # of the controller arguments, the samplers search only the band rule's factor: drawn where the controller uses it
    uses_factor = "kl_adapt_factor" in CONTROLLER_ARGUMENTS.get(kl_controller, ())
    return ("kl_coef", "kl_adapt_factor") if uses_factor else ("kl_coef",)


def _sample_onpolicy_common(trial: optuna.Trial, net_archs: tuple[str, ...] = ("tiny", "small", "medium")) -> dict[str, Any]:
    """Rollout size, discounting, learning rate and network: the part every on-policy sampler shares."""
    params = {
        # 2**5 = 32 to 2**9 = 512 samples per minibatch
        "batch_size_pow": trial.suggest_int("batch_size_pow", 5, 9),
        # 2**6 = 64 to 2**11 = 2048 steps per environment and rollout
        "n_steps_pow": trial.suggest_int("n_steps_pow", 6, 11),
        "one_minus_gamma": trial.suggest_float("one_minus_gamma", 0.0001, 0.03, log=True),
        "one_minus_gae_lambda": trial.suggest_float("one_minus_gae_lambda", 0.001, 0.1, log=True),
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 3e-3, log=True),
        "net_arch": trial.suggest_categorical("net_arch", list(net_archs)),
        "activation_fn": trial.suggest_categorical("activation_fn", ["tanh", "relu"]),
    }
    # Display true values in the study
    trial.set_user_attr("gamma", 1 - params["one_minus_gamma"])
    trial.set_user_attr("n_steps", 2 ** params["n_steps_pow"])
    trial.set_user_attr("batch_size", 2 ** params["batch_size_pow"])
    return params


def _sample_kl_penalty(trial: optuna.Trial, additional_args: dict[str, Any] | None) -> dict[str, Any]:
    """
    The KL options that matter for the penalty methods (KLPPO, ClipKLPPO): the target, the estimator, and the options
    of beta's controller that the tuned config's ``kl_controller`` uses (:func:`sampled_controller_options`); the
    trial records that controller (:data:`CONTROLLER_ATTR`).
    """
    kl_controller = tuned_hyperparams(additional_args).get("kl_controller", "adaptive")
    controller_options = sampled_controller_options(kl_controller)
    trial.set_user_attr(CONTROLLER_ATTR, controller_label(kl_controller))
    params = {"target_kl": trial.suggest_float("target_kl", 0.002, 0.1, log=True)}
    if "kl_coef" in controller_options:
        params["kl_coef"] = trial.suggest_float("kl_coef", 0.01, 5.0, log=True)
    if "kl_adapt_factor" in controller_options:
        params["kl_adapt_factor"] = trial.suggest_float("kl_adapt_factor", 1.1, 3.0)
    params["kl_estimator"] = trial.suggest_categorical("kl_estimator", ["analytic", "k3"])
    return params


def convert_klppo_params(sampled_params: dict[str, Any]) -> dict[str, Any]:
    """
    Convert the raw parameters of a KLPPO or ClipKLPPO trial into hyperparameters
    (``*_pow`` -> powers of two, ``one_minus_*`` -> ``gamma``/``gae_lambda``, ``net_arch``/``activation_fn``
    -> ``policy_kwargs``; the KL options pass through unchanged).

    :param sampled_params: ``trial.params``
    :return: Hyperparameters for the algorithm's constructor
    """
    return convert_onpolicy_params(sampled_params)


def convert_kltrpo_params(sampled_params: dict[str, Any]) -> dict[str, Any]:
    """
    Convert the raw parameters of a KLTRPO trial into hyperparameters (same conversions as for KLPPO).

    :param sampled_params: ``trial.params``
    :return: Hyperparameters for the algorithm's constructor
    """
    return convert_onpolicy_params(sampled_params)


def sample_klppo_params(trial: optuna.Trial, n_actions: int, n_envs: int, additional_args: dict) -> dict[str, Any]:
    """
    Sampler for KLPPO: PPO's usual options (without clipping) and the KL penalty's target, initial coefficient,
    adaptation factor and estimator (the coefficient's options as the tuned config's ``kl_controller`` uses them,
    :func:`sampled_controller_options`).

    :param trial: Optuna trial
    :param n_actions: Number of action dimensions (unused, part of the zoo's signature)
    :param n_envs: Number of environments (unused, part of the zoo's signature)
    :param additional_args: Zoo extras; ``hyperparams``, when given, stands for the tuned config entry
    :return: Hyperparameters for ``KLPPO``
    """
    params = _sample_onpolicy_common(trial)
    params.update(
        {
            "ent_coef": trial.suggest_float("ent_coef", 1e-8, 0.1, log=True),
            "n_epochs": trial.suggest_categorical("n_epochs", [1, 5, 10, 20]),
            "max_grad_norm": trial.suggest_float("max_grad_norm", 0.3, 2.0),
        }
    )
    params.update(_sample_kl_penalty(trial, additional_args))
    return convert_klppo_params(params)


def sample_clip_klppo_params(trial: optuna.Trial, n_actions: int, n_envs: int, additional_args: dict) -> dict[str, Any]:
    """
    Sampler for ClipKLPPO: KLPPO's space plus PPO's ratio clip range.

    :param trial: Optuna trial
    :param n_actions: Number of action dimensions (unused, part of the zoo's signature)
    :param n_envs: Number of environments (unused, part of the zoo's signature)
    :param additional_args: Zoo extras; ``hyperparams``, when given, stands for the tuned config entry
    :return: Hyperparameters for ``ClipKLPPO``
    """
    params = _sample_onpolicy_common(trial)
    params.update(
        {
            "ent_coef": trial.suggest_float("ent_coef", 1e-8, 0.1, log=True),
            "n_epochs": trial.suggest_categorical("n_epochs", [1, 5, 10, 20]),
            "max_grad_norm": trial.suggest_float("max_grad_norm", 0.3, 2.0),
            "clip_range": trial.suggest_categorical("clip_range", [0.1, 0.2, 0.3, 0.4]),
        }
    )
    params.update(_sample_kl_penalty(trial, additional_args))
    return convert_klppo_params(params)


def sample_kltrpo_params(trial: optuna.Trial, n_actions: int, n_envs: int, additional_args: dict) -> dict[str, Any]:
    """
    Sampler for KLTRPO: TRPO's options (critic updates, conjugate-gradient steps and damping, line search)
    and the trust region's ``target_kl``.

    :param trial: Optuna trial
    :param n_actions: Number of action dimensions (unused, part of the zoo's signature)
    :param n_envs: Number of environments (unused, part of the zoo's signature)
    :param additional_args: Zoo extras (unused)
    :return: Hyperparameters for ``KLTRPO``
    """
    params = _sample_onpolicy_common(trial, net_archs=("small", "medium"))
    params.update(
        {
            "n_critic_updates": trial.suggest_int("n_critic_updates", 5, 30),
            "cg_max_steps": trial.suggest_int("cg_max_steps", 5, 30),
            "cg_damping": trial.suggest_categorical("cg_damping", [0.5, 0.2, 0.1, 0.05, 0.01]),
            "line_search_shrinking_factor": trial.suggest_categorical("line_search_shrinking_factor", [0.6, 0.7, 0.8, 0.9]),
            "target_kl": trial.suggest_float("target_kl", 0.001, 0.1, log=True),
        }
    )
    return convert_kltrpo_params(params)


def convert_trpl_params(sampled_params: dict[str, Any]) -> dict[str, Any]:
    """
    Convert the raw parameters of a TRPL trial into hyperparameters (same conversions as for KLPPO; the bounds and
    the trust-region coefficient pass through unchanged).

    :param sampled_params: ``trial.params``
    :return: Hyperparameters for the algorithm's constructor
    """
    return convert_onpolicy_params(sampled_params)


def sample_trpl_params(trial: optuna.Trial, n_actions: int, n_envs: int, additional_args: dict) -> dict[str, Any]:
    """
    Sampler for TRPL: PPO's usual options (without clipping) and the projection's bounds and trust-region coefficient
    (the projection itself stays the config's: ``"w2"`` and ``"frobenius"`` exist for ``Box`` actions only).

    :param trial: Optuna trial
    :param n_actions: Number of action dimensions (unused, part of the zoo's signature)
    :param n_envs: Number of environments (unused, part of the zoo's signature)
    :param additional_args: Zoo extras (unused)
    :return: Hyperparameters for ``TRPL``
    """
    params = _sample_onpolicy_common(trial)
    params.update(
        {
            "ent_coef": trial.suggest_float("ent_coef", 1e-8, 0.1, log=True),
            "n_epochs": trial.suggest_categorical("n_epochs", [1, 5, 10, 20]),
            "max_grad_norm": trial.suggest_float("max_grad_norm", 0.3, 2.0),
            "mean_bound": trial.suggest_float("mean_bound", 0.003, 0.1, log=True),
            "cov_bound": trial.suggest_float("cov_bound", 1e-4, 0.01, log=True),
            "trust_region_coef": trial.suggest_float("trust_region_coef", 1.0, 30.0, log=True),
        }
    )
    return convert_trpl_params(params)


#: Zoo name -> sampler
HYPERPARAMS_SAMPLER = {
    "klppo": sample_klppo_params,
    "clip_klppo": sample_clip_klppo_params,
    "kltrpo": sample_kltrpo_params,
    "klppo_mask": sample_klppo_params,  # MaskableKLPPO takes KLPPO's options
    # as the zoo's ppo_lstm, which samples PPO's space: KLPPO's (the LSTM's size is not sampled; the trial's
    # policy_kwargs replace the config's, as in the zoo)
    "klppo_lstm": sample_klppo_params,
    "trpl": sample_trpl_params,
}

#: Zoo name -> converter of ``trial.params``
HYPERPARAMS_CONVERTER = {
    "klppo": convert_klppo_params,
    "clip_klppo": convert_klppo_params,
    "kltrpo": convert_kltrpo_params,
    "klppo_mask": convert_klppo_params,
    "klppo_lstm": convert_klppo_params,
    "trpl": convert_trpl_params,
}


#: ``kl_controller`` values whose samplers may draw different parameters
#: (:func:`sampled_controller_options`): every named controller, and a controller object
#: (any non-string)
CONTROLLER_KINDS: tuple[Any, ...] = (*KL_CONTROLLERS, object())


def sampled_parameter_names(algo: str, hyperparams: dict[str, Any] | None = None) -> set[str]:
    """
    :param algo: Zoo name of an sb3_kl algorithm
    :param hyperparams: The tuned config's hyperparameters (default: none, the algorithm's defaults)
    :return: The Optuna parameters its sampler draws for that config (its trials' ``params`` keys)
    """
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created" line for this scratch study
    try:
        trial = optuna.create_study().ask()
    finally:
        optuna.logging.set_verbosity(verbosity)
    HYPERPARAMS_SAMPLER[algo](trial, 1, 1, {"hyperparams": dict(hyperparams or {})})
    return set(trial.params)


def possible_parameter_names(algo: str) -> list[set[str]]:
    """
    :param algo: Zoo name of an sb3_kl algorithm
    :return: Every set of Optuna parameters its sampler can draw, one per kind of ``kl_controller`` in the tuned config
        (:data:`CONTROLLER_KINDS`), without repeats
    """
    variants: list[set[str]] = []
    for kind in CONTROLLER_KINDS:
        names = sampled_parameter_names(algo, {"kl_controller": kind})
        if names not in variants:
            variants.append(names)
    return variants
