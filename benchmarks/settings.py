"""
Base hyperparameters of the benchmarks: rl-baselines3-zoo 2.9.2's tuned settings (``hyperparams/ppo.yml`` for the
PPO family, ``hyperparams/trpo.yml`` for the TRPO family; the MuJoCo v4 entries are used for v5), written as plain
Python so the benchmarks do not need rl_zoo3. ``lin_x`` in the zoo is a linear decay from x to 0.
"""

from typing import Any

from stable_baselines3.common.utils import LinearSchedule
from torch import nn

MUJOCO_POLICY = dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU, net_arch=dict(pi=[256, 256], vf=[256, 256]))

# name -> (zoo n_timesteps, n_envs, normalize, constructor kwargs)
PPO_SETTINGS: dict[str, dict[str, Any]] = {
    "CartPole-v1": dict(
        n_timesteps=100_000,
        n_envs=8,
        normalize=False,
        kwargs=dict(
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=LinearSchedule(1e-3, 0.0, 1.0),
            clip_range=LinearSchedule(0.2, 0.0, 1.0),
        ),
    ),
    "Acrobot-v1": dict(
        n_timesteps=1_000_000,
        n_envs=16,
        normalize=True,
        kwargs=dict(n_steps=256, gae_lambda=0.94, gamma=0.99, n_epochs=4, ent_coef=0.0),
    ),
    "Pendulum-v1": dict(
        n_timesteps=100_000,
        n_envs=4,
        normalize=False,
        kwargs=dict(
            n_steps=1024,
            gae_lambda=0.95,
            gamma=0.9,
            n_epochs=10,
            ent_coef=0.0,
            learning_rate=1e-3,
            clip_range=0.2,
            use_sde=True,
            sde_sample_freq=4,
        ),
    ),
    "LunarLanderContinuous-v3": dict(
        n_timesteps=1_000_000,
        n_envs=16,
        normalize=False,
        kwargs=dict(n_steps=1024, batch_size=64, gae_lambda=0.98, gamma=0.999, n_epochs=4, ent_coef=0.01),
    ),
    "HalfCheetah-v5": dict(
        n_timesteps=1_000_000,
        n_envs=1,
        normalize=True,
        kwargs=dict(
            batch_size=64,
            n_steps=512,
            gamma=0.98,
            learning_rate=2.0633e-05,
            ent_coef=0.000401762,
            clip_range=0.1,
            n_epochs=20,
            gae_lambda=0.92,
            max_grad_norm=0.8,
            vf_coef=0.58096,
            policy_kwargs=MUJOCO_POLICY,
        ),
    ),
    "Hopper-v5": dict(
        n_timesteps=1_000_000,
        n_envs=1,
        normalize=True,
        kwargs=dict(
            batch_size=32,
            n_steps=512,
            gamma=0.999,
            learning_rate=9.80828e-05,
            ent_coef=0.00229519,
            clip_range=0.2,
            n_epochs=5,
            gae_lambda=0.99,
            max_grad_norm=0.7,
            vf_coef=0.835671,
            policy_kwargs=MUJOCO_POLICY,
        ),
    ),
}

_TRPO_MUJOCO = dict(
    n_timesteps=1_000_000,
    n_envs=2,
    normalize=True,
    kwargs=dict(
        batch_size=128,
        n_steps=1024,
        gamma=0.99,
        gae_lambda=0.95,
        sub_sampling_factor=1,
        cg_max_steps=25,
        cg_damping=0.1,
        n_critic_updates=20,
        learning_rate=1e-3,
    ),
)

TRPO_SETTINGS: dict[str, dict[str, Any]] = {
    "CartPole-v1": dict(
        n_timesteps=100_000,
        n_envs=2,
        normalize=False,
        kwargs=dict(
            n_steps=512, batch_size=512, cg_damping=1e-3, gae_lambda=0.98, gamma=0.99, learning_rate=1e-3, n_critic_updates=20
        ),
    ),
    "Acrobot-v1": dict(n_timesteps=100_000, n_envs=2, normalize=True, kwargs=dict(n_steps=1024)),
    "Pendulum-v1": dict(
        n_timesteps=100_000,
        n_envs=2,
        normalize=False,
        kwargs=dict(n_steps=1024, gamma=0.9, n_critic_updates=15, use_sde=True, sde_sample_freq=4),
    ),
    "LunarLanderContinuous-v3": dict(
        n_timesteps=100_000, n_envs=2, normalize=True, kwargs=dict(n_steps=1024, n_critic_updates=20)
    ),
    "HalfCheetah-v5": {**_TRPO_MUJOCO, "kwargs": {**_TRPO_MUJOCO["kwargs"], "target_kl": 0.04}},
    "Hopper-v5": _TRPO_MUJOCO,
}

PPO_FAMILY = ("ppo", "ppo_target_kl", "ppo_adaptive_lr", "klppo", "klppo_auto", "klppo_noclip", "clip_klppo")
TRPO_FAMILY = ("trpo", "kltrpo", "kltrpo_matched")
# ``klppo`` is the drop-in swap: PPO's zoo entry unchanged, so where the zoo sets ``clip_range`` KLPPO clips *and*
# penalizes. ``klppo_noclip`` drops these arguments, i.e. KLPPO with its own default of no ratio clipping.
KLPPO_DROPPED = ("clip_range",)
# TRPL's per-state bounds on KL(new||old) in the grid: the discrete tasks take ``mean_bound`` only (the bound of a
# categorical policy's whole KL), the continuous ones both parts. Chosen once by ``trpl_bounds.py`` on seeds outside
# the grid's (its page, ``results/trpl_bounds.md``, states the rule): discrete from CartPole-v1's runs, continuous
# from Pendulum-v1's (TRPL's defaults).
TRPL_BOUNDS = {"discrete": dict(mean_bound=0.01), "continuous": dict(mean_bound=0.03, cov_bound=0.001)}
#: The grid's tasks with discrete actions (named, so that the settings of a MuJoCo task need no MuJoCo)
DISCRETE_ENVS = ("CartPole-v1", "Acrobot-v1")


def klppo_default_target(env_id: str) -> float:
    """KLPPO's target when ``target_kl=None``: 0.02 for discrete action spaces, 0.03 for ``Box``."""
    import gymnasium as gym

    env = gym.make(env_id)
    continuous = isinstance(env.action_space, gym.spaces.Box)
    env.close()
    return 0.03 if continuous else 0.02


def clips(env_id: str) -> bool:
    """Whether PPO's zoo entry sets ``clip_range`` (elsewhere ``klppo`` already runs without clipping)."""
    return any(name in PPO_SETTINGS[env_id]["kwargs"] for name in KLPPO_DROPPED)


def settings_for(algo: str, env_id: str) -> dict[str, Any]:
    """
    :param algo: benchmark name of the algorithm (``ppo``, ``ppo_target_kl``, ``klppo``, ``klppo_noclip``,
        ``clip_klppo``, ``klppo_auto``, ``trpo``, ``kltrpo``, ``kltrpo_matched``). ``ppo_target_kl`` is stock PPO with
        SB3's KL early stop (``target_kl``, judged on its approximate KL per minibatch) at the target KLPPO controls
        toward, with PPO's zoo entry (so the same clip as ``klppo`` and ``clip_klppo``). ``kltrpo_matched`` gets TRPO's
        settings; its ``target_kl`` is set by the benchmark from TRPO's records. ``trpl`` gets PPO's zoo entry without
        ``clip_range`` and the bounds of :data:`TRPL_BOUNDS`; ``klppo_auto`` PPO's zoo entry without ``clip_range`` (its
        learning rate is made ``"auto_<rate>"`` by the benchmark)
    :param env_id: Gymnasium id
    :return: ``dict(n_timesteps, n_envs, normalize, kwargs)`` (kwargs copied, safe to modify)
    """
    table = PPO_SETTINGS if algo in (*PPO_FAMILY, "trpl") else TRPO_SETTINGS
    entry = table[env_id]
    kwargs = dict(entry["kwargs"])
    if algo == "trpl":  # PPO's zoo entry without its clip, at the grid's bounds
        kwargs.update(TRPL_BOUNDS["discrete" if env_id in DISCRETE_ENVS else "continuous"])
    if algo in ("klppo_noclip", "klppo_auto", "trpl"):
        for name in KLPPO_DROPPED:
            kwargs.pop(name, None)
    if algo == "ppo_target_kl":
        kwargs["target_kl"] = klppo_default_target(env_id)
    return {**entry, "kwargs": kwargs}


def n_epochs_for(algo: str, env_id: str) -> int:
    """The epochs per update of ``algo``'s settings on ``env_id`` (the zoo entry's, else SB3's default 10)."""
    return int(settings_for(algo, env_id)["kwargs"].get("n_epochs", 10))
