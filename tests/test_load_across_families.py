"""
A zip saved by an sb3-kl algorithm whose ``target_kl`` means something else (KLPPO's penalty target, KLTRPO's bound on
the mean KL, TRPL's bound on every state's KL) loads with a warning naming the class that saved it and what is kept;
the KL convention and controller start fresh. Loading within a family stays silent.
"""

import json
import warnings
import zipfile

import pytest
import torch as th

from sb3_kl import KLPPO, KLTRPO, TRPL, ClipKLPPO
from sb3_kl.common.save_util import SAVED_BY_KEY

TINY = dict(n_steps=64, batch_size=64, policy_kwargs=dict(net_arch=[8]), seed=0, device="cpu")


class AnchoredKLPPO(KLPPO):
    """A user's subclass: the KLPPO family."""


def saved(tmp_path, model_class, **kwargs) -> str:
    path = str(tmp_path / f"{model_class.__name__}.zip")
    model_class("MlpPolicy", "Pendulum-v1", **TINY, **kwargs).save(path)
    return path


def load_warnings(model_class, path, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = model_class.load(path, **kwargs)
    return model, [w for w in caught if "whose KL target means something else" in str(w.message)]


@pytest.mark.parametrize(
    "saver, loader", [(TRPL, KLPPO), (KLPPO, TRPL), (KLPPO, KLTRPO), (KLTRPO, KLPPO), (TRPL, KLTRPO), (KLTRPO, TRPL)]
)
def test_a_zip_of_another_family_warns_naming_the_class_that_saved_it(tmp_path, saver, loader):
    _, caught = load_warnings(loader, saved(tmp_path, saver))
    (warning,) = caught
    assert f"was saved by {saver.__name__}," in str(warning.message)
    assert warning.filename == __file__


def test_klppo_reads_trpls_bound_as_its_target_with_a_fresh_kl_state(tmp_path):
    trpl = TRPL("MlpPolicy", "Pendulum-v1", **TINY).learn(64)
    trpl.save(tmp_path / "trpl")
    model, (warning,) = load_warnings(KLPPO, tmp_path / "trpl.zip")
    message = str(warning.message)
    bound = trpl.joint_bound
    assert f"TRPL's target_kl {bound:g} was its bound on every state's KL(new||old)" in message
    assert "target of the update's mean KL(old||new)" in message and "pass target_kl=" in message
    assert model.kl_settings.direction == "forward"  # KLPPO's default, not TRPL's fixed KL(new||old)
    assert model.target_kl(1.0) == pytest.approx(bound) and model.kl_coef == 1.0
    for name, value in trpl.policy.state_dict().items():
        assert th.equal(value, model.policy.state_dict()[name]), name
    model.set_env(trpl.get_env())
    model.learn(64, reset_num_timesteps=False)


def test_trpl_keeps_its_own_bound_and_kl_when_loading_a_klppo_zip(tmp_path):
    path = saved(tmp_path, KLPPO, target_kl=0.05, kl_direction="forward")
    model, (warning,) = load_warnings(TRPL, path)
    message = str(warning.message)
    assert "KLPPO's target_kl 0.05 was the target of the update's mean KL(old||new)" in message
    assert "pass mean_bound= and cov_bound=" in message
    assert model.kl_settings.direction == "reverse"  # the KL TRPL's projection bounds
    assert model._current_target_kl() == pytest.approx(model.joint_bound)


def test_kl_options_given_to_load_apply_across_families(tmp_path):
    model, (warning,) = load_warnings(KLPPO, saved(tmp_path, TRPL), kl_direction="reverse", kl_coef=0.5, target_kl=0.02)
    assert model.kl_settings.direction == "reverse" and model.kl_coef == 0.5 and model.target_kl(1.0) == 0.02
    assert "takes the target_kl given to load(), 0.02" in str(warning.message)


def test_a_zip_saved_before_the_class_was_recorded_is_recognised(tmp_path):
    path = saved(tmp_path, TRPL)
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    data = json.loads(entries["data"])
    del data[SAVED_BY_KEY]
    entries["data"] = json.dumps(data).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    _, (warning,) = load_warnings(KLPPO, path)
    assert "was saved by TRPL," in str(warning.message)


@pytest.mark.parametrize(
    "saver, loader",
    [(KLPPO, KLPPO), (ClipKLPPO, KLPPO), (KLPPO, ClipKLPPO), (AnchoredKLPPO, KLPPO), (KLPPO, AnchoredKLPPO), (TRPL, TRPL)],
)
def test_a_zip_of_the_same_family_loads_silently(tmp_path, saver, loader):
    path = saved(tmp_path, saver)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = loader.load(path)
    assert not hasattr(model, SAVED_BY_KEY)  # the record lives in the zip only
