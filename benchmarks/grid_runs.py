"""Running one cell of the learning grid: the algorithm, its settings and learning rate, training and evaluation."""

import time
from typing import Any

import numpy as np

from grid import ADAPTIVE_LR_TARGET, BUDGETS, MATCHED_SEEDS, N_EVAL_EPISODES
from run_records import code_version, load_records, run_environment, save_record


def algorithm_class(algo: str) -> type:
    """:return: the class behind a benchmark name"""
    if algo in ("ppo", "ppo_target_kl", "ppo_adaptive_lr"):
        from stable_baselines3 import PPO

        return PPO
    if algo == "trpo":
        from sb3_contrib import TRPO

        return TRPO
    import sb3_kl

    names = {
        "klppo": "KLPPO",
        "klppo_auto": "KLPPO",
        "klppo_noclip": "KLPPO",
        "clip_klppo": "ClipKLPPO",
        "kltrpo": "KLTRPO",
        "kltrpo_matched": "KLTRPO",
        "trpl": "TRPL",
    }
    return getattr(sb3_kl, names[algo])


def scale_learning_rate(kwargs: dict[str, Any], lr_mult: float) -> None:
    """Multiply the learning rate (a number or an SB3 ``LinearSchedule``) in place."""
    from stable_baselines3.common.utils import LinearSchedule

    default = 3e-4 if "learning_rate" not in kwargs else kwargs["learning_rate"]
    if isinstance(default, LinearSchedule):
        kwargs["learning_rate"] = LinearSchedule(default.start * lr_mult, default.end * lr_mult, default.end_fraction)
    else:
        kwargs["learning_rate"] = float(default) * lr_mult


def auto_learning_rate(kwargs: dict[str, Any]) -> None:
    """
    Replace the learning rate in place by ``"auto_<its starting value>"`` (``klppo_auto``): a schedule's start, since
    the adapted rate follows the KL, not the schedule.
    """
    rate = kwargs.get("learning_rate", 3e-4)
    kwargs["learning_rate"] = f"auto_{rate.start if hasattr(rate, 'start') else float(rate):.6g}"


def describe(value: Any) -> Any:
    """JSON-friendly description of a hyperparameter value."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if hasattr(value, "start") and hasattr(value, "end"):
        return f"LinearSchedule({value.start}, {value.end}, {value.end_fraction})"
    return getattr(value, "__name__", repr(value))


def default_target_kl(algo: str, env_id: str, kwargs: dict[str, Any]) -> float:
    """The target the KL band is measured against (for stock algorithms: the family's default)."""
    import gymnasium as gym

    if "target_kl" in kwargs and kwargs["target_kl"] is not None:
        return float(kwargs["target_kl"])
    if algo == "trpl":  # its per-state bound on KL(new||old): mean part plus covariance part (categorical: mean part)
        return float(kwargs["mean_bound"]) + float(kwargs.get("cov_bound", 0.0))
    if algo in ("trpo", "kltrpo", "kltrpo_matched"):
        return 0.01
    continuous = isinstance(gym.make(env_id).action_space, gym.spaces.Box)
    return 0.03 if continuous else 0.02


def matched_target_kl(tier: str, env_id: str, lr_mult: float = 1.0) -> float:
    """
    The KL sb3-contrib's TRPO actually took per update on ``env_id`` (mean over the recorded updates of its seeds
    ``MATCHED_SEEDS`` of the monitor's exact joint KL(old||new), summed over action dimensions): ``kltrpo_matched``'s
    ``target_kl``, so that KLTRPO takes steps of the same size and only the constraint differs. Once the cell has
    ``kltrpo_matched`` records, their target: re-made TRPO records (another machine) do not move it.
    """
    records = load_records(tier)
    made = {r["target_kl"] for r in records if (r["algo"], r["env"], r["lr_mult"]) == ("kltrpo_matched", env_id, lr_mult)}
    if len(made) > 1:
        raise SystemExit(f"kltrpo_matched's records on {env_id} have different targets {sorted(made)}: re-make them.")
    if made:
        return made.pop()
    kls = matched_seed_kls([r for r in records if (r["algo"], r["env"], r["lr_mult"]) == ("trpo", env_id, lr_mult)])
    if not kls:
        raise SystemExit(f"kltrpo_matched on {env_id} needs TRPO's records of the {tier} tier first (--algos trpo).")
    return float(np.mean(kls))


def matched_seed_kls(trpo_records: list[dict[str, Any]]) -> list[float]:
    """The per-update joint KLs of the seeds ``MATCHED_SEEDS`` among TRPO's records of one cell."""
    return [u["mean"] for r in trpo_records if r["seed"] in MATCHED_SEEDS for u in r["kl_updates"]]


def rerun_spec(record: dict[str, Any]) -> dict[str, Any]:
    """:return: the spec of a record's run (cell, seed, tier and overrides), for :func:`train_and_evaluate` to repeat it"""
    spec = {key: record[key] for key in ("algo", "env", "seed", "lr_mult", "tier")}
    spec["overrides"] = record.get("overrides") or {}
    if record["budget"] != BUDGETS[record["tier"]][record["env"]]:  # a run made with --budget
        spec["budget"] = record["budget"]
    return spec


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train, evaluate and write the record of one run (executed in a worker process)."""
    record = train_and_evaluate(spec)
    save_record(record)
    return record


def logged_updates_probe(keys: tuple[str, ...], updates: list[dict[str, float]]) -> Any:
    """
    A probe for :func:`train_and_evaluate`: after each update, appends to ``updates`` the values the algorithm logged
    under ``train/<key>`` for each of ``keys`` (those it logged), read before SB3 dumps the logger.
    """
    from stable_baselines3.common.callbacks import BaseCallback

    class LoggedUpdates(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            values = self.model.logger.name_to_value
            if "train/kl" in values:
                updates.append({key: float(values[f"train/{key}"]) for key in keys if f"train/{key}" in values})

    return LoggedUpdates()


def evaluation_env(env_id: str, seed: int, training_env: Any) -> Any:
    """
    :return: a one-environment VecEnv for evaluating a policy, seeded ``seed``, normalized with a snapshot of
        ``training_env``'s observation statistics where that is a ``VecNormalize`` (rewards left raw)
    """
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = make_vec_env(env_id, n_envs=1, seed=seed)
    if isinstance(training_env, VecNormalize):
        env = VecNormalize(env, training=False, norm_reward=False)
        env.obs_rms = training_env.obs_rms.copy()
    return env


def train_and_evaluate(spec: dict[str, Any], probes: list[Any] | None = None, algorithm: type | None = None) -> dict[str, Any]:
    """
    Train and evaluate one run.

    :param spec: the run: ``algo``, ``env``, ``seed``, ``lr_mult``, ``tier``, optional ``overrides``, ``code_version``
        and ``budget`` (environment steps, instead of the tier's for the environment)
    :param probes: more callbacks to train with (they must not change the training: no random draws, no writes to
        the model or the environment)
    :param algorithm: the class to train instead of the grid's for ``spec["algo"]`` (a study's variant of it)
    :return: its record (not written: :func:`run_one` or the distributed grid does). ``learn(budget)`` ends with the
        rollout in which the budget is reached, so a run trains up to one rollout (``n_steps`` x ``n_envs``) more than
        ``budget``: ``trained_steps`` holds the steps it trained (the model's ``num_timesteps``), and
        ``env_steps_per_second`` is ``trained_steps / train_seconds``. Records made before ``trained_steps`` was stored
        hold ``budget / train_seconds`` there, which undercounts by the last rollout's overshoot (they were not re-made;
        :func:`trained_steps` reads their step count from the learning curve).
    """
    import torch as th

    th.set_num_threads(1)
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize

    from settings import settings_for

    algo, env_id, seed, lr_mult, tier = spec["algo"], spec["env"], spec["seed"], spec["lr_mult"], spec["tier"]
    setting = settings_for(algo, env_id)
    kwargs = dict(setting["kwargs"])
    if lr_mult != 1.0:
        scale_learning_rate(kwargs, lr_mult)
    if algo == "klppo_auto":
        auto_learning_rate(kwargs)
    if algo == "kltrpo_matched":
        kwargs["target_kl"] = matched_target_kl(tier, env_id, lr_mult)
    overrides = spec.get("overrides") or {}
    kwargs.update(resolve_activation(overrides))
    budget = spec.get("budget") or BUDGETS[tier][env_id]
    env = make_vec_env(env_id, n_envs=setting["n_envs"], seed=seed)
    if setting["normalize"]:
        env = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))

    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            if len(self.model.ep_info_buffer) > 0:
                curve.append((self.num_timesteps, float(np.mean([info["r"] for info in self.model.ep_info_buffer]))))

    callbacks: list[BaseCallback] = [Curve(), *(probes or [])]
    monitor = reverse = None
    try:
        from sb3_kl.callbacks import KLMonitorCallback

        monitor = KLMonitorCallback()
        # TRPL's direction, KL(new||old) summed over action dimensions, for every algorithm alike (the drift and the
        # normalization shift are the first monitor's)
        reverse = KLMonitorCallback(direction="reverse", quantiles=(0.99,), normalization_shift=False, drift_lag=None)
        callbacks += [monitor, reverse]
        if algo == "ppo_adaptive_lr":
            from sb3_kl.callbacks import KLAdaptiveLRCallback

            callbacks.append(KLAdaptiveLRCallback(target_kl=ADAPTIVE_LR_TARGET, monitor=monitor))
    except ImportError:
        pass

    model = (algorithm or algorithm_class(algo))("MlpPolicy", env, seed=seed, device="cpu", **kwargs)
    start = time.perf_counter()
    model.learn(budget, callback=CallbackList(callbacks))
    train_seconds = time.perf_counter() - start
    steps = int(model.num_timesteps)  # past the budget: learn() ends with the rollout in which it is reached

    returns, _ = evaluate_policy(
        model,
        evaluation_env(env_id, 10_000 + seed, env),
        n_eval_episodes=N_EVAL_EPISODES[tier],
        deterministic=True,
        return_episode_rewards=True,
    )

    kl_updates = []
    if monitor is not None:
        for entry in monitor.history:
            stats = entry.get("stats", entry)
            update = dict(timesteps=int(entry.get("num_timesteps", 0)), mean=float(stats["mean"]), p99=float(stats["p99"]))
            if "normalization_shift" in entry:  # the KL that VecNormalize's statistics alone made in the rollout
                update["normalization_shift"] = float(entry["normalization_shift"])
            if "drift" in entry:  # the KL between the policy drift_lag updates before and the updated one
                update["drift"] = float(entry["drift"])
            kl_updates.append(update)
    kl_reverse_updates = [
        dict(timesteps=int(e["num_timesteps"]), mean=float(e["mean"]), p99=float(e["p99"]), max=float(e["max"]))
        for e in (reverse.history if reverse is not None else [])
    ]
    record = dict(
        algo=algo,
        env=env_id,
        seed=seed,
        lr_mult=lr_mult,
        tier=tier,
        budget=budget,
        trained_steps=steps,
        n_envs=setting["n_envs"],
        normalize=setting["normalize"],
        hyperparameters=describe(kwargs),
        target_kl=default_target_kl(algo, env_id, kwargs),
        eval_returns=[float(r) for r in returns],
        eval_mean=float(np.mean(returns)),
        curve=curve,
        kl_updates=kl_updates,
        # per update, the per-state KL(updated||rollout policy) summed over action dimensions, over the update's rollout
        kl_reverse_updates=kl_reverse_updates,
        overrides=overrides,
        kl_source="sb3_kl.callbacks.KLMonitorCallback (exact, forward, summed)" if monitor is not None else None,
        # the lag, in updates, of the kl_updates' drift (the policy drift_lag updates before the updated one)
        drift_lag=monitor.drift_lag if monitor is not None else None,
        train_seconds=train_seconds,
        env_steps_per_second=steps / train_seconds,
        torch_threads=1,
        # the commit checked out when the batch started (the workers import the code then)
        code_version=spec.get("code_version") or code_version(),
        run_environment=run_environment(),
    )
    return record


def resolve_activation(overrides: dict[str, Any]) -> dict[str, Any]:
    """
    ``overrides`` with a ``policy_kwargs`` ``activation_fn`` given by name (JSON has no classes: ``"ReLU"`` or
    ``"nn.ReLU"``, as rl-zoo's configs write it) replaced by that ``torch.nn`` module class.

    :raise ValueError: for a name that is not a ``torch.nn`` module
    """
    import torch.nn as nn

    name = (overrides.get("policy_kwargs") or {}).get("activation_fn")
    if not isinstance(name, str):
        return overrides
    module = getattr(nn, name.removeprefix("nn."), None)
    if not (isinstance(module, type) and issubclass(module, nn.Module)):
        raise ValueError(f"policy_kwargs activation_fn={name!r} is not a torch.nn module: give one such as 'ReLU' or 'Tanh'")
    return {**overrides, "policy_kwargs": {**overrides["policy_kwargs"], "activation_fn": module}}
