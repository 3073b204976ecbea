"""MaskableKLPPO: KLPPO's update with sb3-contrib's invalid-action masking, the KL taken between masked distributions."""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from sb3_contrib import MaskablePPO
from sb3_contrib.common.envs import InvalidActionEnvDiscrete, InvalidActionEnvMultiBinary, InvalidActionEnvMultiDiscrete
from sb3_contrib.common.maskable.buffers import MaskableRolloutBuffer
from sb3_contrib.common.maskable.evaluation import evaluate_policy
from sb3_contrib.common.maskable.utils import get_action_masks
from sb3_contrib.common.wrappers import ActionMasker
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.envs import IdentityEnv, IdentityEnvBox
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.vec_env import DummyVecEnv

from sb3_kl import MaskableKLPPO
from sb3_kl.callbacks import KLMonitorCallback
from sb3_kl.common.buffers import KLRolloutBuffer
from sb3_kl.common.maskable.buffers import MaskableKLDictRolloutBuffer, MaskableKLRolloutBuffer

SMALL = dict(n_steps=64, batch_size=32, n_epochs=4, policy_kwargs=dict(net_arch=[32]), seed=0)

MASKED_ENVS = {
    "Discrete": lambda: InvalidActionEnvDiscrete(dim=8, n_invalid_actions=4),
    "MultiDiscrete": lambda: InvalidActionEnvMultiDiscrete(dims=[3, 4], n_invalid_actions=3),
    "MultiBinary": lambda: InvalidActionEnvMultiBinary(dims=4, n_invalid_actions=2),
}


def vec_env(name: str, n_envs: int = 2) -> DummyVecEnv:
    return DummyVecEnv([MASKED_ENVS[name]] * n_envs)


class RolloutPolicySnapshot(BaseCallback):
    """A deep copy of the policy at the end of each rollout, i.e. the rollout policy before ``train()``."""

    def __init__(self):
        super().__init__()
        self.policy = None

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self.policy = copy.deepcopy(self.model.policy)


def masked_torch_distributions(policy, obs: th.Tensor, masks: np.ndarray, nvec: list[int]) -> list:
    """
    The policy's masked action distribution, built independently of sb3-contrib's masking: the unmasked logits
    (float64), probabilities set to 0 on invalid actions and renormalized over the valid ones.
    """
    with th.no_grad():
        distribution = policy.get_distribution(obs)  # no masks: the unmasked log-probabilities
        if hasattr(distribution, "distributions"):
            raw = th.cat([d.logits for d in distribution.distributions], dim=1)
        else:
            raw = distribution.distribution.logits
    out = []
    valid = th.as_tensor(masks, dtype=th.bool)
    for raw_i, valid_i in zip(th.split(raw.double(), nvec, dim=1), th.split(valid, nvec, dim=1), strict=True):
        weights = th.exp(raw_i - raw_i.max(dim=1, keepdim=True).values) * valid_i
        probs = weights / weights.sum(dim=1, keepdim=True)
        out.append(th.distributions.Categorical(probs=probs))
    return out


def factor_sizes(model) -> list[int]:
    space = model.action_space
    if isinstance(space, gym.spaces.Discrete):
        return [int(space.n)]
    if isinstance(space, gym.spaces.MultiDiscrete):
        return [int(n) for n in space.nvec]
    return [2] * int(space.n)  # MultiBinary: two categories per binary action, as sb3-contrib masks them


@pytest.mark.parametrize("env_name", ["Discrete", "MultiDiscrete"])
@pytest.mark.parametrize("kl_direction", ["forward", "reverse"])
def test_logged_kl_is_the_kl_between_masked_distributions(env_name, kl_direction):
    """
    ``train/kl`` and its quantiles equal the KL between the rollout policy (deep copy before ``train()``) and the updated
    policy, both masked with each state's stored masks, computed with ``torch.distributions`` in float64 (invalid
    actions: probability exactly 0). Two envs, so the masks must stay aligned with their states through the buffer's
    flattening. Also: the rollout policy's stored log-probs are those of the masked distribution.
    """
    snapshot = RolloutPolicySnapshot()
    model = MaskableKLPPO("MlpPolicy", vec_env(env_name), learning_rate=3e-3, kl_direction=kl_direction, **SMALL)
    model.learn(2 * 64 * 2, callback=snapshot)
    buffer = model.rollout_buffer
    obs = th.as_tensor(buffer.observations.reshape(-1, *model.observation_space.shape))
    masks = buffer.action_masks.reshape(len(obs), -1)
    assert (masks == 0).any() and (masks == 1).any()
    nvec = factor_sizes(model)
    old = masked_torch_distributions(snapshot.policy, obs, masks, nvec)
    new = masked_torch_distributions(model.policy, obs, masks, nvec)
    pairs = zip(old, new, strict=True) if kl_direction == "forward" else zip(new, old, strict=True)
    per_state = sum(th.distributions.kl_divergence(p, q) for p, q in pairs).numpy()
    assert np.all(np.isfinite(per_state)) and per_state.mean() > 1e-4

    logged = model.logger.name_to_value
    assert logged["train/kl"] == pytest.approx(per_state.mean(), rel=1e-4)
    for q in (0.5, 0.9, 0.99):
        assert logged[f"train/kl_p{round(100 * q)}"] == pytest.approx(np.quantile(per_state, q), rel=1e-4)
    assert logged["train/kl_max"] == pytest.approx(per_state.max(), rel=1e-4)
    assert logged["train/kl_convention"] == f"{kl_direction}/analytic/sum"

    # the stored old log-probs are the masked rollout policy's: the masks were applied in the right order
    actions = th.as_tensor(buffer.actions.reshape(len(obs), -1)).long()
    old_log_prob = sum(d.log_prob(actions[:, i]) for i, d in enumerate(old)).numpy()
    np.testing.assert_allclose(buffer.log_probs.flatten(), old_log_prob, rtol=1e-4, atol=1e-5)
    # the per-state KL excludes invalid actions: their rollout parameters are the masked logits
    assert buffer.old_dist_params[masks == 0].max() < -1e7


def test_kl_monitor_agrees_with_the_logged_kl():
    """KLMonitorCallback (which masks with the buffer's masks itself) measures the same KL as MaskableKLPPO logs."""
    monitor = KLMonitorCallback()
    model = MaskableKLPPO("MlpPolicy", vec_env("MultiDiscrete"), learning_rate=3e-3, **SMALL)
    model.learn(2 * 64 * 2, callback=monitor)
    assert len(monitor.history) == 2
    assert monitor.history[-1]["mean"] == pytest.approx(model.logger.name_to_value["train/kl"], rel=1e-4)
    assert monitor.history[-1]["p99"] == pytest.approx(model.logger.name_to_value["train/kl_p99"], rel=1e-4)


@pytest.mark.parametrize("env_name", ["Discrete", "MultiDiscrete", "MultiBinary"])
def test_negligible_fixed_penalty_with_clip_is_maskable_ppo(env_name):
    """
    With PPO's clip and a fixed, negligible KL coefficient, MaskableKLPPO is sb3-contrib's MaskablePPO: on the same seed
    it collects the same masked rollouts, draws the same minibatches and reaches the same parameters after several
    updates. Adam as MaskablePPO's: single-tensor kernel, eps=1e-5.
    """
    common = dict(n_steps=64, batch_size=32, n_epochs=3, seed=3, clip_range=0.2)
    stock = MaskablePPO("MlpPolicy", MASKED_ENVS[env_name](), **common).learn(3 * 64)
    ours = MaskableKLPPO(
        "MlpPolicy",
        MASKED_ENVS[env_name](),
        kl_coef=1e-12,
        kl_controller="fixed",
        kl_coef_bounds=(1e-12, 1.0),
        policy_kwargs=dict(optimizer_kwargs=dict(foreach=False, eps=1e-5)),
        **common,
    ).learn(3 * 64)
    initial = MaskablePPO("MlpPolicy", MASKED_ENVS[env_name](), **common).policy.state_dict()
    for key, value in stock.policy.state_dict().items():
        assert th.allclose(value, ours.policy.state_dict()[key], rtol=0, atol=1e-6), key
    assert max(float((stock.policy.state_dict()[k] - initial[k]).abs().max()) for k in initial) > 1e-3
    assert ours.logger.name_to_value["train/kl"] > 0


def test_save_load_keeps_kl_state(tmp_path):
    model = MaskableKLPPO("MlpPolicy", vec_env("Discrete"), learning_rate=3e-3, kl_window=3, **SMALL)
    model.learn(3 * 64 * 2)
    assert model.kl_coef != 1.0
    controller_state = copy.deepcopy(model.kl_controller.__dict__)
    model.save(tmp_path / "model")
    loaded = MaskableKLPPO.load(tmp_path / "model", env=vec_env("Discrete"))
    assert isinstance(loaded, MaskableKLPPO)
    assert loaded.kl_coef == model.kl_coef
    assert loaded.kl_controller.__dict__.keys() == controller_state.keys()
    for key, value in controller_state.items():
        assert str(loaded.kl_controller.__dict__[key]) == str(value), key
    assert loaded.kl_settings == model.kl_settings and tuple(loaded.kl_quantiles) == model.kl_quantiles
    assert loaded.rollout_buffer_class is MaskableKLRolloutBuffer
    for key, value in model.policy.state_dict().items():
        assert th.equal(value, loaded.policy.state_dict()[key])
    loaded.learn(64 * 2, reset_num_timesteps=False)
    assert loaded.num_timesteps == 4 * 64 * 2
    assert "train/kl" in loaded.logger.name_to_value
    assert MaskableKLPPO.load(tmp_path / "model", kl_coef=0.25).kl_coef == 0.25


def test_masks_act_in_predict_learn_and_evaluation():
    """The sb3-contrib interface: masked predict, evaluation with masks, ActionMasker envs, learn(use_masking=False)."""
    env = InvalidActionEnvDiscrete(dim=8, n_invalid_actions=6)
    model = MaskableKLPPO("MlpPolicy", env, **SMALL).learn(64)
    obs, _ = env.reset(seed=0)
    for _ in range(20):
        masks = get_action_masks(env)
        action, _ = model.predict(obs, action_masks=masks)
        assert masks[int(action)]
        obs, *_ = env.step(action)
    mean_reward, _ = evaluate_policy(model, env, n_eval_episodes=2, warn=False)
    assert 0 <= mean_reward <= 100

    # ActionMasker: the masks come from a function of the env
    masked = ActionMasker(IdentityEnv(4), lambda e: np.array([True, True, False, False]))
    model = MaskableKLPPO("MlpPolicy", masked, **SMALL).learn(64)
    assert not model.rollout_buffer.action_masks[..., 2:].any()
    assert np.isfinite(model.logger.name_to_value["train/kl"])

    # use_masking=False: all actions valid, as in MaskablePPO
    model = MaskableKLPPO("MlpPolicy", IdentityEnv(4), **SMALL).learn(64, use_masking=False)
    assert model.rollout_buffer.action_masks.all()
    with pytest.raises(ValueError, match="does not support action masking"):
        MaskableKLPPO("MlpPolicy", IdentityEnv(4), **SMALL).learn(64)


def test_dict_observations_use_the_dict_buffer():
    class ToDict(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Dict({"obs": env.observation_space})

        def observation(self, observation):
            return {"obs": observation}

    model = MaskableKLPPO("MultiInputPolicy", ToDict(InvalidActionEnvDiscrete(dim=6, n_invalid_actions=3)), **SMALL)
    model.learn(64)
    assert isinstance(model.rollout_buffer, MaskableKLDictRolloutBuffer)
    assert np.isfinite(model.logger.name_to_value["train/kl"])


@pytest.mark.parametrize("source", ["model", "path"])
def test_reference_is_masked_like_the_policy(tmp_path, source):
    """
    A MaskablePPO reference (model or saved zip) is evaluated with the same masks: ``train/ref_kl`` is the mean
    KL(pi || pi_ref) between the masked updated policy and the masked reference, computed independently; the penalty
    version trains with finite losses.
    """
    # a reference that has learned something, so that its KL to the policy is well above float32 round-off
    reference = MaskablePPO("MlpPolicy", vec_env("MultiDiscrete"), learning_rate=1e-2, n_steps=64, seed=7).learn(128)
    if source == "path":
        reference.save(tmp_path / "reference")
        ref = str(tmp_path / "reference.zip")
    else:
        ref = reference
    model = MaskableKLPPO("MlpPolicy", vec_env("MultiDiscrete"), ref_policy=ref, ref_kl_coef=0.0, **SMALL).learn(64 * 2)
    buffer = model.rollout_buffer
    obs = th.as_tensor(buffer.observations.reshape(-1, *model.observation_space.shape))
    masks = buffer.action_masks.reshape(len(obs), -1)
    nvec = factor_sizes(model)
    pi = masked_torch_distributions(model.policy, obs, masks, nvec)
    pi_ref = masked_torch_distributions(reference.policy, obs, masks, nvec)
    per_state = sum(th.distributions.kl_divergence(p, q) for p, q in zip(pi, pi_ref, strict=True)).numpy()
    assert model.logger.name_to_value["train/ref_kl"] == pytest.approx(per_state.mean(), rel=1e-4)

    anchored = MaskableKLPPO("MlpPolicy", vec_env("MultiDiscrete"), ref_policy=ref, ref_kl_coef=1.0, **SMALL).learn(64 * 2)
    assert np.isfinite(anchored.logger.name_to_value["train/loss"])
    anchored.save(tmp_path / "anchored")
    assert MaskableKLPPO.load(tmp_path / "anchored").ref_policy is not None


def test_bad_inputs():
    env = InvalidActionEnvDiscrete(dim=6, n_invalid_actions=3)
    with pytest.raises(ValueError, match="MaskableActorCriticPolicy"):
        MaskableKLPPO(ActorCriticPolicy, env)
    with pytest.raises(AssertionError, match="The algorithm only supports"):
        MaskableKLPPO("MlpPolicy", IdentityEnvBox())
    with pytest.raises(ValueError, match="min_std"):
        MaskableKLPPO("MlpPolicy", env, min_std=0.1)
    with pytest.raises(TypeError, match="rollout_buffer_class"):
        MaskableKLPPO("MlpPolicy", env, rollout_buffer_class=KLRolloutBuffer)
    with pytest.raises(TypeError, match="rollout_buffer_class"):
        MaskableKLPPO("MlpPolicy", env, rollout_buffer_class=MaskableRolloutBuffer)
    with pytest.raises(ValueError, match="ref_policy"):
        MaskableKLPPO("MlpPolicy", env, ref_policy=PPO("MlpPolicy", env))
    with pytest.raises(ValueError, match="kl_direction"):
        MaskableKLPPO("MlpPolicy", env, kl_direction="sideways")
    with pytest.raises(ValueError, match="kl_coef"):
        MaskableKLPPO("MlpPolicy", env, kl_coef=-1.0)
    # batch_size=None: the whole rollout is one minibatch, as in MaskablePPO
    model = MaskableKLPPO("MlpPolicy", env, n_steps=32, batch_size=None)
    assert model.batch_size == 32


def test_zoo_train_and_enjoy_klppo_mask(tmp_path, capsys, monkeypatch):
    """``--algo klppo_mask`` trains with the shipped config on the registered masked task; ``enjoy`` acts with masks."""
    pytest.importorskip("rl_zoo3")
    import rl_zoo3
    import yaml
    from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy

    import sb3_kl.zoo
    from sb3_kl.zoo.__main__ import main

    assert rl_zoo3.ALGOS["klppo_mask"] is MaskableKLPPO
    env_id = "InvalidActionMultiDiscrete-v0"
    config = yaml.safe_load(open(sb3_kl.zoo.default_config("klppo_mask")))
    assert env_id in config and "target_kl" in config[env_id]

    fast = ["-params", "n_envs:2", "n_steps:64", "policy_kwargs:dict(net_arch=[16])"]
    main(
        ["train", "--algo", "klppo_mask", "--env", env_id, "-n", "256", "--seed", "1", "-f", str(tmp_path),
         "--eval-freq", "-1", "--verbose", "0", *fast]
    )  # fmt: skip
    run_dir = tmp_path / "klppo_mask" / f"{env_id}_1"
    model = MaskableKLPPO.load(run_dir / f"{env_id}.zip")
    assert model.num_timesteps >= 256 and model.target_kl(1.0) == pytest.approx(0.02)

    masks_given = []
    predict = MaskableActorCriticPolicy.predict

    def spy(self, observation, state=None, episode_start=None, deterministic=False, action_masks=None):
        masks_given.append(action_masks is not None)
        return predict(self, observation, state, episode_start, deterministic, action_masks=action_masks)

    monkeypatch.setattr(MaskableActorCriticPolicy, "predict", spy)
    capsys.readouterr()
    main(["enjoy", "--algo", "klppo_mask", "--env", env_id, "-f", str(tmp_path), "--no-render", "-n", "150"])
    assert "Mean reward:" in capsys.readouterr().out  # at least one 100-step episode was played
    assert len(masks_given) >= 150 and all(masks_given)
    assert MaskableKLPPO.predict is not None and "masked_predict" not in MaskableKLPPO.predict.__qualname__


class NaNAfterSteps(gym.Env):
    """Float observations, three actions of which the last is always invalid; the observation turns NaN at step 5."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert action != 2, "a masked action was taken"
        self.steps += 1
        obs = np.full(2, np.nan if self.steps == 5 else 0.5, np.float32)
        return obs, 1.0, False, False, {}

    def action_masks(self):
        return np.array([True, True, False])


def test_kl_bookkeeping_wraps_the_masked_collection():
    """MaskablePPO's collection runs inside KLPPO's: NaN observations stop it, the buffer is stamped and checked."""
    from sb3_kl.common.buffers import StalePolicyError
    from sb3_kl.common.on_policy_algorithm import NonFiniteEnvError

    with pytest.raises(NonFiniteEnvError, match="env 0 returned a NaN observation at step 4"):
        MaskableKLPPO("MlpPolicy", NaNAfterSteps(), **SMALL).learn(64)
    env = InvalidActionEnvDiscrete(dim=6, n_invalid_actions=3)
    model = MaskableKLPPO("MlpPolicy", env, **SMALL).learn(64)
    with pytest.raises(StalePolicyError):
        model.train()  # the buffer was collected by the policy before the last update


@pytest.mark.parametrize("algo_name", ["MaskableKLPPO", "RecurrentKLPPO"])
def test_drop_in_variants_keep_klppo_kl_defaults(algo_name):
    """Every KL option of KLPPO that the masked and recurrent variants take has KLPPO's default (no silent drift)."""
    import inspect

    import sb3_kl
    from sb3_kl import KLPPO

    klppo = inspect.signature(KLPPO.__init__).parameters
    variant = inspect.signature(getattr(sb3_kl, algo_name).__init__).parameters
    kl_options = [name for name in klppo if name.startswith(("kl_", "ref_", "target_kl", "min_std", "log_ratio_clip"))]
    assert len(kl_options) > 10
    for name in kl_options:
        assert name in variant, f"{algo_name} lacks KLPPO's {name}"
        assert variant[name].default == klppo[name].default, f"{algo_name}.{name} default differs from KLPPO's"


def _spy_on_masks(monkeypatch) -> list[bool]:
    """Record, for every ``predict`` of a maskable policy, whether it was given action masks."""
    from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy

    masks_given: list[bool] = []
    predict = MaskableActorCriticPolicy.predict

    def spy(self, observation, state=None, episode_start=None, deterministic=False, action_masks=None):
        masks_given.append(action_masks is not None)
        return predict(self, observation, state, episode_start, deterministic, action_masks=action_masks)

    monkeypatch.setattr(MaskableActorCriticPolicy, "predict", spy)
    return masks_given


def test_zoo_evaluations_during_training_use_masks(tmp_path, monkeypatch):
    """The zoo's periodic evaluation (``--eval-freq``), which picks ``best_model.zip``, acts with the env's masks."""
    pytest.importorskip("rl_zoo3")
    from sb3_kl.zoo.__main__ import main

    env_id = "InvalidActionMultiDiscrete-v0"
    masks_given = _spy_on_masks(monkeypatch)
    main(
        ["train", "--algo", "klppo_mask", "--env", env_id, "-n", "256", "--seed", "1", "-f", str(tmp_path),
         "--eval-freq", "128", "--eval-episodes", "1", "--n-eval-envs", "1", "--verbose", "0",
         "-params", "n_envs:2", "n_steps:64", "policy_kwargs:dict(net_arch=[16])"]
    )  # fmt: skip
    run_dir = tmp_path / "klppo_mask" / f"{env_id}_1"
    # evaluations at 128 and 256 steps, each one 100-step episode; training itself never calls predict
    assert len(masks_given) >= 200 and all(masks_given)
    assert (run_dir / "evaluations.npz").exists() and (run_dir / "best_model.zip").exists()


def test_zoo_tuning_trials_are_evaluated_with_masks(tmp_path, monkeypatch):
    """A ``-optimize`` trial of klppo_mask reports the return of masked evaluations to Optuna."""
    pytest.importorskip("rl_zoo3")
    import optuna
    from rl_zoo3 import exp_manager

    from sb3_kl.zoo.__main__ import main

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="mask", storage=storage, direction="maximize")
    study.enqueue_trial({"n_steps_pow": 6, "batch_size_pow": 6, "n_epochs": 1, "net_arch": "tiny"})
    masks_given = _spy_on_masks(monkeypatch)
    main(
        ["train", "--algo", "klppo_mask", "--env", "InvalidActionMultiDiscrete-v0", "-n", "256", "--seed", "0",
         "-f", str(tmp_path), "--verbose", "0", "-params", "n_envs:2", "-optimize", "--n-trials", "1",
         "--n-evaluations", "1", "--eval-episodes", "1", "--sampler", "random", "--pruner", "none",
         "--no-optim-plots", "--storage", storage, "--study-name", "mask"]
    )  # fmt: skip
    trials = optuna.load_study(study_name="mask", storage=storage).trials
    assert trials[0].state == optuna.trial.TrialState.COMPLETE
    assert len(masks_given) >= 100 and all(masks_given)
    assert exp_manager.TrialEvalCallback.__name__ == "TrialEvalCallback", "the zoo's own class is put back"
