"""
A misspelled keyword argument raises Python's ``TypeError`` naming the closest parameter, for every algorithm and
callback constructor and for ``load()``; a name far from all of them keeps Python's plain message.
"""

import inspect
import re

import pytest

from sb3_kl import (
    KLPPO,
    KLTRPO,
    TRPL,
    ClipKLPPO,
    KLAdaptiveLRCallback,
    KLAlarmCallback,
    KLMonitorCallback,
    MaskableKLPPO,
    RecurrentKLPPO,
    VarianceFloorCallback,
)


def hint(owner: str, name: str, meant: str) -> str:
    return re.escape(f"{owner} got an unexpected keyword argument '{name}'. Did you mean '{meant}'?")


@pytest.mark.parametrize(
    "model_class, policy",
    [(KLPPO, "MlpPolicy"), (ClipKLPPO, "MlpPolicy"), (MaskableKLPPO, "MlpPolicy"), (RecurrentKLPPO, "MlpLstmPolicy")],
)
def test_a_misspelled_kl_coef_names_kl_coef(model_class, policy):
    with pytest.raises(TypeError, match=hint(f"{model_class.__name__}()", "kl_coeff", "kl_coef")):
        model_class(policy, "CartPole-v1", kl_coeff=0.1)


@pytest.mark.parametrize("model_class", [KLPPO, ClipKLPPO, KLTRPO, TRPL])
def test_every_algorithm_names_the_closest_parameter(model_class):
    with pytest.raises(TypeError, match=hint(f"{model_class.__name__}()", "n_step", "n_steps")):
        model_class("MlpPolicy", "CartPole-v1", n_step=32)


@pytest.mark.parametrize(
    "make, owner, name, meant",
    [
        (lambda: KLAlarmCallback(targt_kl=0.02), "KLAlarmCallback()", "targt_kl", "target_kl"),
        (lambda: KLAdaptiveLRCallback(0.02, fctor=2.0), "KLAdaptiveLRCallback()", "fctor", "factor"),
        (lambda: KLMonitorCallback(topk=4), "KLMonitorCallback()", "topk", "top_k"),
        (lambda: VarianceFloorCallback(minstd=0.05), "VarianceFloorCallback()", "minstd", "min_std"),
    ],
)
def test_every_callback_names_the_closest_parameter(make, owner, name, meant):
    with pytest.raises(TypeError, match=hint(owner, name, meant)):
        make()


def test_a_name_close_to_no_parameter_keeps_pythons_message_and_subclasses_are_named():
    class MyKLPPO(KLPPO):
        pass

    with pytest.raises(TypeError, match=r"^MyKLPPO\(\) got an unexpected keyword argument 'zzz'\.$"):
        MyKLPPO("MlpPolicy", "CartPole-v1", zzz=1)
    # the signature the docs, load() and the zoo read is the constructor's own
    assert "kl_coef" in inspect.signature(KLPPO).parameters and "kl_coef" in inspect.signature(MyKLPPO.__init__).parameters


def test_load_names_the_closest_parameter_and_keeps_sb3s_new_attributes(tmp_path):
    KLPPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, device="cpu").save(tmp_path / "model")
    with pytest.raises(TypeError, match=hint("KLPPO.load()", "kl_coeff", "kl_coef")):
        KLPPO.load(tmp_path / "model.zip", kl_coeff=0.1)
    with pytest.raises(TypeError, match=hint("KLPPO.load()", "n_step", "n_steps")):
        KLPPO.load(tmp_path / "model.zip", n_step=64)
    # SB3's load sets any other keyword as an attribute: a name close to nothing may be meant
    assert KLPPO.load(tmp_path / "model.zip", run_label="baseline").run_label == "baseline"
