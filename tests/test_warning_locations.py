"""
Every sb3-kl warning names the user's line (the call of the constructor, ``learn()`` or ``load()``), not a line inside
sb3-kl, SB3 or sb3-contrib, however deep inside them it is raised.
"""

import os
import warnings

import pytest
from stable_baselines3 import PPO

import sb3_kl
from sb3_kl import KLPPO, KLTRPO, TRPL, ClipKLPPO, KLAlarmCallback
from sb3_kl.common.on_policy_algorithm import STALLED_AT_FLOOR_UPDATES
from sb3_kl.common.user_warnings import warn_at_user_frame

TINY = dict(policy_kwargs=dict(net_arch=[8]), seed=0, device="cpu")


def caught_warning(record: list[warnings.WarningMessage], text: str) -> warnings.WarningMessage:
    (warning,) = [w for w in record if text in str(w.message)]
    return warning


def test_the_helper_skips_any_number_of_library_frames():
    # functions compiled as if they were a module of sb3_kl: call chains of different depths end at the same line here
    namespace = {"warn_at_user_frame": warn_at_user_frame}
    source = (
        "def inner():\n    warn_at_user_frame('deep')\n\n"
        "def outer(depth):\n    return outer(depth - 1) if depth else inner()\n"
    )
    exec(compile(source, os.path.join(os.path.dirname(sb3_kl.__file__), "_frames.py"), "exec"), namespace)
    for depth in (0, 7):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            namespace["outer"](depth)
        assert caught_warning(record, "deep").filename == __file__


@pytest.mark.parametrize("model_class", [KLPPO, ClipKLPPO, KLTRPO, TRPL])
def test_constructor_warning_names_the_users_line(model_class):
    with pytest.warns(UserWarning) as record:
        model_class("MlpPolicy", "CartPole-v1", n_steps=30, batch_size=16, **TINY)
    assert caught_warning(record, "truncated mini-batch").filename == __file__


def test_controller_option_warning_names_the_users_line():
    with pytest.warns(UserWarning) as record:
        KLPPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, kl_controller="fixed", kl_adapt_factor=2.0, **TINY)
    assert caught_warning(record, "has no effect").filename == __file__


def test_beta_at_floor_warning_names_the_learn_call():
    # the floor warning is raised from train() inside SB3's learn(): learn -> train -> _record_update_kl -> ...
    stalled = dict(learning_rate=1e-7, target_kl=0.5, kl_coef=1e-4, n_steps=32, batch_size=32, n_epochs=1)
    model = KLPPO("MlpPolicy", "CartPole-v1", **stalled, **TINY)
    with pytest.warns(UserWarning) as record:
        model.learn(STALLED_AT_FLOOR_UPDATES * 32)
    assert caught_warning(record, "lower bound").filename == __file__


def test_load_warning_names_the_load_call(tmp_path):
    PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, **TINY).save(tmp_path / "ppo")
    with pytest.warns(UserWarning) as record:
        KLPPO.load(tmp_path / "ppo.zip", device="cpu")
    assert caught_warning(record, "without a KL state").filename == __file__


def test_callback_warning_names_the_learn_call():
    # a stock PPO without target_kl: the alarm announces the default target it uses, from inside the rollout loop
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, **TINY)
    with pytest.warns(UserWarning) as record:
        model.learn(64, callback=KLAlarmCallback())
    assert caught_warning(record, "has no KL target").filename == __file__
