"""The learning grid's definition: its environments, algorithms, learning-rate multiples, budgets and scoring band."""

from typing import Any

MAIN_ENVS = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v5", "Hopper-v5"]
# ppo_target_kl: stock PPO with SB3's KL early stop at KLPPO's target (see settings.settings_for);
# klppo_noclip runs only where PPO's zoo entry clips (elsewhere klppo is already KLPPO without clipping)
# trpl: TRPL with PPO's zoo entry without the clip, at the bounds of ``settings.TRPL_BOUNDS``
MAIN_ALGOS = ["ppo", "ppo_target_kl", "trpo", "klppo", "klppo_noclip", "clip_klppo", "kltrpo", "trpl"]
# not in the default grid (kltrpo_matched needs TRPO's records first: ``--algos kltrpo_matched``; klppo_auto is KLPPO
# with learning_rate="auto_<the zoo rate>" and no clip range, see SWEEP_ALGOS); reported when records exist
EXTRA_ALGOS = ["kltrpo_matched", "klppo_auto"]
# TRPO's seeds whose records set kltrpo_matched's target: fixed, so that adding TRPO seeds does not move the target of
# later kltrpo_matched runs away from that of the earlier ones
MATCHED_SEEDS = (0, 1, 2)
ALL_ALGOS = MAIN_ALGOS + EXTRA_ALGOS
# the algorithms of sb3-kl (the others run no sb3-kl code: only the KL monitor watches them)
SB3_KL_ALGOS = ("klppo", "klppo_noclip", "clip_klppo", "kltrpo", "kltrpo_matched", "trpl", "klppo_auto")
#: the sb3-kl algorithms whose loss carries the adaptive KL penalty (beta)
KL_PENALIZED_ALGOS = ("klppo", "klppo_noclip", "clip_klppo", "klppo_auto")
STRESS_ENVS = ["Pendulum-v1", "HalfCheetah-v5"]
STRESS_ALGOS = ["ppo", "ppo_target_kl", "klppo", "klppo_noclip", "clip_klppo", "trpl"]
# the goals judge the controller at 10x the zoo learning rate
STRESS_LR_MULTS = [10.0]
# The learning-rate sweep (``lr_sweep.py``): multiples of the zoo rate, on three tasks. ``ppo_adaptive_lr`` is stock PPO
# (its clip kept) with ``KLAdaptiveLRCallback`` at the family's target, the field's practice; ``klppo_auto`` is KLPPO
# with ``learning_rate="auto_<the multiplied zoo rate>"`` and KLPPO's own default of no clip range (as in sb3-kl's zoo
# configs): a clip range tighter than the target holds the update and the adapted rate climbs
# (``results/auto_learning_rate_halfcheetah.md``)
SWEEP_ENVS = ["Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v5"]
SWEEP_ALGOS = ["ppo", "ppo_adaptive_lr", "klppo", "klppo_auto"]
SWEEP_LR_MULTS = [0.1, 0.3, 1.0, 3.0, 10.0]
#: the target of ``ppo_adaptive_lr``'s callback (KLPPO's default for ``Box`` actions)
ADAPTIVE_LR_TARGET = 0.03
#: The commit from which ``learning_rate="auto"`` gives the first epoch ``1 / n_epochs`` of the target
#: (``docs/guide/learning_rate.md``)
AUTO_RULE_SINCE = "35755f6"
#: From this commit to :data:`AUTO_RULE_SINCE` the first epoch was given a quarter of the target: the same rule, to the
#: bit, where ``n_epochs`` is 4 (``1 / 4 == 0.25``). Older ``klppo_auto`` records ran the earlier rule (each update's
#: step scaled onto the target)
QUARTER_SHARE_SINCE = "2780723"

# Budget (environment steps) per tier: "full" is what the results report; MuJoCo runs below rl-zoo's 1M steps to fit
# 2 CPU cores; "quick" runs the whole grid in minutes; "tiny" is for the test suite.
BUDGETS = {
    "full": {
        "CartPole-v1": 100_000,
        "Acrobot-v1": 100_000,
        "Pendulum-v1": 100_000,
        "LunarLanderContinuous-v3": 200_000,
        "HalfCheetah-v5": 150_000,
        "Hopper-v5": 150_000,
    },
    "quick": {env: 4096 for env in MAIN_ENVS},
    "tiny": {env: 1024 for env in MAIN_ENVS},
}
N_EVAL_EPISODES = {"full": 10, "quick": 3, "tiny": 1}
# The KL band of the goals: [0.5, 2] x target
BAND = (0.5, 2.0)


def cell_order(cell: tuple[str, str, float]) -> tuple[float, int, str]:
    """
    The report's order of the cells ``(env, algo, lr_mult)``: by learning-rate multiplier, then environment in the
    grid's order, then algorithm name.
    """
    env, algo, lr_mult = cell
    return lr_mult, MAIN_ENVS.index(env), algo


# Stock algorithms: their records do not depend on the sb3-kl version
STOCK = ("ppo", "ppo_target_kl", "trpo")


def made_by_todays_auto_rule(record: dict[str, Any]) -> bool:
    """Whether a ``klppo_auto`` record's run followed today's rule of ``learning_rate="auto"``."""
    import run_records
    from settings import n_epochs_for

    if run_records.made_since(record, AUTO_RULE_SINCE):
        return True
    return n_epochs_for("klppo_auto", record["env"]) == 4 and run_records.made_since(record, QUARTER_SHARE_SINCE)
