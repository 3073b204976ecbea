"""
Loading models saved by the stock algorithms (SB3's PPO and A2C, sb3-contrib's TRPO, MaskablePPO and RecurrentPPO) into
the sb3-kl algorithms: weights, optimizer state and hyperparameters come along, the KL state starts fresh, the user is
told once; and a corrupt zip is one sentence naming the file.
"""

import warnings
import zipfile

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from sb3_contrib import TRPO
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import SimpleMultiObsEnv
from stable_baselines3.common.vec_env import VecNormalize

from sb3_kl import KLPPO, KLTRPO, ClipKLPPO
from sb3_kl.common.buffers import KLDictRolloutBuffer, KLRolloutBuffer
from sb3_kl.common.kl import GaussianParams

TINY = dict(n_steps=32, policy_kwargs=dict(net_arch=[16]), seed=0, device="cpu")
PPO_TINY = dict(TINY, batch_size=32, n_epochs=2)


def assert_same_policy(saved, loaded) -> None:
    for (name, a), (_, b) in zip(saved.policy.state_dict().items(), loaded.policy.state_dict().items(), strict=True):
        assert th.equal(a, b), name


def load_with_one_warning(cls, path, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = cls.load(path, **kwargs)
    fresh = [w for w in caught if "without a KL state" in str(w.message)]
    assert len(fresh) == 1, [str(w.message) for w in caught]
    return model, str(fresh[0].message)


def test_klppo_loads_stock_ppo(tmp_path):
    ppo = PPO("MlpPolicy", "CartPole-v1", **PPO_TINY).learn(64)
    ppo.save(tmp_path / "ppo_plain")
    model, message = load_with_one_warning(KLPPO, tmp_path / "ppo_plain.zip", env=make_vec_env("CartPole-v1", n_envs=1))
    assert "ppo_plain.zip" in message and "PPO" in message and "kl_coef=1" in message
    assert "clip_range=None" in message  # how to drop the saved ratio clip
    assert isinstance(model.rollout_buffer, KLRolloutBuffer)
    assert_same_policy(ppo, model)
    assert model.kl_coef == 1.0 and model.num_timesteps == ppo.num_timesteps
    assert model.n_steps == 32 and model.batch_size == 32 and model.n_epochs == 2  # PPO's hyperparameters kept
    assert model.clip_range(1.0) == pytest.approx(0.2)
    assert model.target_kl(1.0) == pytest.approx(0.02)  # PPO's target_kl=None: KLPPO's discrete default
    model.learn(64, reset_num_timesteps=False)
    assert np.isfinite(model.logger.name_to_value["train/kl"])
    # saved again, it is an sb3-kl model: no warning, the KL state comes back
    model.save(tmp_path / "klppo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = KLPPO.load(tmp_path / "klppo.zip")
    assert again.kl_coef == model.kl_coef


def test_klppo_loads_stock_ppo_with_gsde_and_vecnormalize(tmp_path):
    venv = VecNormalize(make_vec_env("Pendulum-v1", n_envs=2, seed=0))
    ppo = PPO("MlpPolicy", venv, use_sde=True, **PPO_TINY).learn(128)
    ppo.save(tmp_path / "ppo_sde")
    venv.save(tmp_path / "vecnormalize.pkl")
    # the usual SB3 recipe: the statistics beside the zip wrap the new env, the model loads onto it
    new_env = VecNormalize.load(str(tmp_path / "vecnormalize.pkl"), make_vec_env("Pendulum-v1", n_envs=2, seed=1))
    model, _ = load_with_one_warning(KLPPO, tmp_path / "ppo_sde", env=new_env, clip_range=None)
    assert model.use_sde and model.clip_range is None
    assert isinstance(model.dist_params, GaussianParams)
    assert_same_policy(ppo, model)
    np.testing.assert_array_equal(model.get_vec_normalize_env().obs_rms.mean, venv.obs_rms.mean)
    before = th.exp(model.policy.log_std).detach().clone()
    model.learn(64, reset_num_timesteps=False)
    assert not th.equal(before, th.exp(model.policy.log_std))
    assert model.logger.name_to_value["train/action_std_min"] > 0


def test_klppo_loads_stock_ppo_with_dict_observations(tmp_path):
    env = make_vec_env(SimpleMultiObsEnv, n_envs=1)
    ppo = PPO("MultiInputPolicy", env, **PPO_TINY).learn(64)
    ppo.save(tmp_path / "ppo_dict")
    model, _ = load_with_one_warning(ClipKLPPO, tmp_path / "ppo_dict", env=make_vec_env(SimpleMultiObsEnv, n_envs=1))
    assert isinstance(model.rollout_buffer, KLDictRolloutBuffer)
    assert_same_policy(ppo, model)
    model.learn(64, reset_num_timesteps=False)
    assert np.isfinite(model.logger.name_to_value["train/kl"])


def test_klppo_loads_stock_a2c(tmp_path):
    a2c = A2C("MlpPolicy", "CartPole-v1", **TINY).learn(64)
    a2c.save(tmp_path / "a2c")
    model, message = load_with_one_warning(KLPPO, tmp_path / "a2c.zip", env=make_vec_env("CartPole-v1", n_envs=1))
    assert "A2C" in message and "batch_size=64, n_epochs=10" in message  # A2C has neither: KLPPO's defaults
    assert (model.batch_size, model.n_epochs) == (64, 10)
    assert_same_policy(a2c, model)
    assert type(model.policy.optimizer) is th.optim.RMSprop  # A2C's optimizer and its state come along
    model.learn(64, reset_num_timesteps=False)
    assert np.isfinite(model.logger.name_to_value["train/kl"])


def test_kltrpo_loads_sb3_contrib_trpo(tmp_path):
    trpo = TRPO("MlpPolicy", "Pendulum-v1", batch_size=32, target_kl=0.02, **TINY).learn(64)
    trpo.save(tmp_path / "trpo")
    model, message = load_with_one_warning(KLTRPO, tmp_path / "trpo.zip", env=make_vec_env("Pendulum-v1", n_envs=1))
    assert "TRPO" in message and "target_kl=0.02" in message
    assert_same_policy(trpo, model)
    assert model.cg_max_steps == trpo.cg_max_steps
    model.learn(64, reset_num_timesteps=False)
    # KLTRPO's constraint on the loaded policy: the measured KL of the update stays within TRPO's target
    assert model.logger.name_to_value["train/kl"] <= 0.02 * (1 + 1e-4)


def test_loaded_stock_model_update_kl_matches_torch_distributions(tmp_path):
    """The first KL measured after loading a stock model is the exact KL between the policy before and after."""
    ppo = PPO("MlpPolicy", "CartPole-v1", **PPO_TINY).learn(64)
    ppo.save(tmp_path / "ppo")
    env = make_vec_env("CartPole-v1", n_envs=1)
    model, _ = load_with_one_warning(KLPPO, tmp_path / "ppo.zip", env=env)
    model.learn(32, reset_num_timesteps=False)  # one rollout of 32 steps, one update
    observations = th.as_tensor(model.rollout_buffer.observations.reshape(-1, 4))
    with th.no_grad():
        old = ppo.policy.get_distribution(observations).distribution
        new = model.policy.get_distribution(observations).distribution
    expected = th.distributions.kl_divergence(old, new).mean().item()
    assert model.logger.name_to_value["train/kl"] == pytest.approx(expected, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize(
    "damage, words",
    [
        ("json", "'data' entry is not valid JSON"),
        ("truncated", "is a truncated or corrupt zip file"),
        ("corrupt", "is a truncated or corrupt zip file"),
        ("not_a_zip", "wasn't a zip-file"),  # SB3's wording, which its own tests match
    ],
)
def test_corrupt_zip_is_one_sentence_naming_the_file(tmp_path, damage, words):
    KLPPO("MlpPolicy", "CartPole-v1", **PPO_TINY).save(tmp_path / "model")
    path = tmp_path / "model.zip"
    if damage == "json":
        with zipfile.ZipFile(path) as archive:
            entries = {name: archive.read(name) for name in archive.namelist()}
        entries["data"] = entries["data"][: len(entries["data"]) // 2]
        with zipfile.ZipFile(path, "w") as archive:
            for name, content in entries.items():
                archive.writestr(name, content)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "corrupt":  # bytes changed inside the policy's weights, the zip's directory intact
        content = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(next(name for name in archive.namelist() if name.endswith("policy.pth")))
        start = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
        content[start : start + 8] = bytes(255 - b for b in content[start : start + 8])
        path.write_bytes(bytes(content))
    else:
        path.write_text("hello")
    with pytest.raises(ValueError) as info:
        KLPPO.load(path)
    message = str(info.value)
    assert str(path) in message and words in message and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_maskable_klppo_loads_stock_maskable_ppo(tmp_path):
    """sb3-contrib's MaskablePPO saves its MaskableRolloutBuffer class: MaskableKLPPO takes its own KL buffer instead."""
    from sb3_contrib import MaskablePPO
    from sb3_contrib.common.envs import InvalidActionEnvDiscrete

    from sb3_kl import MaskableKLPPO
    from sb3_kl.common.maskable.buffers import MaskableKLRolloutBuffer

    env = InvalidActionEnvDiscrete(dim=10, n_invalid_actions=3)
    stock = MaskablePPO("MlpPolicy", env, **PPO_TINY).learn(64)
    stock.save(tmp_path / "maskable_ppo")
    model, message = load_with_one_warning(MaskableKLPPO, tmp_path / "maskable_ppo.zip", env=env)
    assert "saved by MaskablePPO" in message
    assert isinstance(model.rollout_buffer, MaskableKLRolloutBuffer)
    assert_same_policy(stock, model)
    model.learn(64, reset_num_timesteps=False)
    assert np.isfinite(model.logger.name_to_value["train/kl"])


def test_recurrent_klppo_names_stock_recurrent_ppo(tmp_path):
    from sb3_contrib import RecurrentPPO

    from sb3_kl import RecurrentKLPPO

    stock = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, seed=0, device="cpu")
    stock.learn(32)
    stock.save(tmp_path / "recurrent_ppo")
    model, message = load_with_one_warning(RecurrentKLPPO, tmp_path / "recurrent_ppo.zip", env=make_vec_env("CartPole-v1"))
    assert "saved by RecurrentPPO" in message
    assert_same_policy(stock, model)


class TwoDimensionalActions(gym.Env):
    """Reward ``-||a - x||^2`` for an observed point ``x`` in [-1, 1]^2; episodes of 16 steps (no MuJoCo or Box2D)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.x = 0, self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return self.x, {}

    def step(self, action):
        reward = -float(np.sum((np.clip(action, -1, 1) - self.x) ** 2))
        self.t, self.x = self.t + 1, self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return self.x, reward, False, self.t >= 16, {}


def test_kltrpo_loads_a_trpo_zip_in_trpos_constraint_or_says_it_changes(tmp_path):
    """
    A TRPO zip holds no KL convention: ``load()``'s KL options are built as the constructor would, so that
    ``kl_reduction="sb3_contrib"`` keeps TRPO's constraint (its very updates, without the growing line search);
    without it the warning says that the same target_kl now bounds another KL.
    """
    from stable_baselines3.common.utils import set_random_seed

    env_id = TwoDimensionalActions  # TRPO's KL averaged over the action dimensions is not the joint one
    TRPO("MlpPolicy", make_vec_env(env_id, n_envs=1, seed=0), **TINY).learn(32).save(tmp_path / "trpo")

    def continued(cls, **load_kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = cls.load(tmp_path / "trpo.zip", env=make_vec_env(env_id, n_envs=1, seed=1), **load_kwargs)
        set_random_seed(3)
        model.learn(32, reset_num_timesteps=False)
        return model, " ".join(str(w.message) for w in caught if "without a KL state" in str(w.message))

    trpo, _ = continued(TRPO)
    kept, message = continued(KLTRPO, kl_reduction="sb3_contrib", line_search_grow_iter=0)
    assert kept.kl_settings.convention == "reverse/analytic/mean" and "sb3_contrib" not in message
    for (name, a), b in zip(trpo.policy.named_parameters(), kept.policy.parameters(), strict=True):
        assert th.allclose(a, b, atol=1e-5), name
    default, message = continued(KLTRPO)
    assert default.kl_settings.convention == "forward/analytic/sum"
    assert "pass kl_reduction='sb3_contrib' to load()" in message and "kl_coef" not in message
    # a KLTRPO zip keeps its convention: another one given to load() is still refused
    default.save(tmp_path / "kltrpo")
    with pytest.raises(ValueError, match="kl_reduction"):
        KLTRPO.load(tmp_path / "kltrpo.zip", kl_reduction="sb3_contrib")


def test_kl_options_given_to_load_apply_to_a_stock_ppo_zip(tmp_path):
    PPO("MlpPolicy", "CartPole-v1", **PPO_TINY).save(tmp_path / "ppo")
    model, message = load_with_one_warning(
        KLPPO, tmp_path / "ppo.zip", kl_direction="reverse", kl_band=(0.5, 2.0), kl_coef=0.3
    )
    assert model.kl_settings.direction == "reverse" and model.kl_controller.kl_band == (0.5, 2.0)
    assert model.kl_coef == 0.3 and "reverse/analytic/sum" in message


def test_a_zip_of_another_policy_family_is_refused_at_load(tmp_path):
    from sb3_contrib import MaskablePPO, RecurrentPPO

    from sb3_kl import MaskableKLPPO, RecurrentKLPPO

    small = dict(n_steps=32, batch_size=32, n_epochs=1, seed=0, device="cpu")
    RecurrentPPO("MlpLstmPolicy", "CartPole-v1", **small).save(tmp_path / "recurrent")
    MaskablePPO("MlpPolicy", "CartPole-v1", **small).save(tmp_path / "maskable")
    PPO("MlpPolicy", "CartPole-v1", **small).save(tmp_path / "feed_forward")
    for cls, name, family, loader in (
        (KLPPO, "recurrent", "recurrent", "RecurrentKLPPO"),
        (KLTRPO, "maskable", "maskable", "MaskableKLPPO"),
        (RecurrentKLPPO, "feed_forward", "feed-forward", "KLPPO"),
        (MaskableKLPPO, "recurrent", "recurrent", "RecurrentKLPPO"),
    ):
        with pytest.raises(ValueError, match=f"holds a {family} policy.*load it with {loader}"):
            cls.load(tmp_path / f"{name}.zip", env=make_vec_env("CartPole-v1"))


def test_kltrpo_refuses_a_zip_with_a_sample_kl_estimator(tmp_path):
    KLPPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, kl_estimator="k3", device="cpu").save(tmp_path / "k3")
    with pytest.raises(ValueError, match="estimator is 'k3'"):
        KLTRPO.load(tmp_path / "k3.zip", env=make_vec_env("CartPole-v1"))
