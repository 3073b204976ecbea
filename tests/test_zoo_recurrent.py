"""rl-zoo integration of RecurrentKLPPO: ``--algo klppo_lstm`` (the zoo's own name is ``ppo_lstm``)."""

from pathlib import Path

import pytest

# Small and fast: tiny LSTM, short rollouts (overrides the shipped config through the zoo's -params)
FAST_PARAMS = [
    "-params", "n_envs:2", "n_steps:32", "batch_size:64", "n_epochs:2",
    "policy_kwargs:dict(net_arch=[16], lstm_hidden_size=16)",
]  # fmt: skip


@pytest.fixture(scope="module")
def zoo():
    pytest.importorskip("rl_zoo3")
    pytest.importorskip("optuna")
    import sb3_kl.zoo

    return sb3_kl.zoo


def test_registration_and_shipped_config(zoo):
    import rl_zoo3
    import yaml

    from sb3_kl import RecurrentKLPPO

    assert rl_zoo3.ALGOS["klppo_lstm"] is RecurrentKLPPO
    assert rl_zoo3.ALGOS["ppo_lstm"].__name__ == "RecurrentPPO"  # the zoo's own entry is untouched
    configs = yaml.safe_load(Path(zoo.default_config("klppo_lstm")).read_text())
    assert set(configs) == {"CartPoleNoVel-v1", "PendulumNoVel-v1"}
    # the zoo's ppo_lstm settings; the clip range kept on CartPoleNoVel only, and PendulumNoVel's KL target raised to
    # 0.1 (both measured: recurrent_learning.md)
    stock = yaml.safe_load((Path(rl_zoo3.__file__).parent / "hyperparams" / "ppo_lstm.yml").read_text())
    for env_id, config in configs.items():
        keep_clip = env_id.startswith("CartPole")
        expected = {key: value for key, value in stock[env_id].items() if keep_clip or key != "clip_range"}
        assert {key: value for key, value in config.items() if key != "target_kl"} == expected
        assert config["target_kl"] == (0.02 if env_id.startswith("CartPole") else 0.1)


def test_sampler_gives_valid_arguments(zoo):
    import optuna

    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_CONVERTER, HYPERPARAMS_SAMPLER

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    hyperparams = HYPERPARAMS_SAMPLER["klppo_lstm"](trial, 1, 2, {})
    assert HYPERPARAMS_CONVERTER["klppo_lstm"](trial.params) == hyperparams
    model = zoo.SB3_KL_ALGOS["klppo_lstm"]("MlpLstmPolicy", "CartPole-v1", **hyperparams)
    assert model.target_kl(1.0) == pytest.approx(hyperparams["target_kl"])


def test_train_and_enjoy_klppo_lstm(zoo, tmp_path, capsys):
    from sb3_kl.zoo.__main__ import main

    env_id = "CartPoleNoVel-v1"
    main(
        ["train", "--algo", "klppo_lstm", "--env", env_id, "-n", "256", "--seed", "3", "-f", str(tmp_path),
         "--eval-freq", "-1", "--verbose", "0", *FAST_PARAMS]
    )  # fmt: skip
    run_dir = tmp_path / "klppo_lstm" / f"{env_id}_1"
    assert (run_dir / f"{env_id}.zip").is_file()
    assert (run_dir / env_id / "vecnormalize.pkl").is_file()  # the shipped config normalises observations
    model = zoo.SB3_KL_ALGOS["klppo_lstm"].load(run_dir / f"{env_id}.zip")
    assert model.num_timesteps >= 256 and model.policy.lstm_actor.hidden_size == 16
    assert model.clip_range(1.0) == pytest.approx(0.2) and model.clip_range(0.5) == pytest.approx(0.1)  # lin_0.2
    assert model.target_kl(1.0) == pytest.approx(0.02)

    capsys.readouterr()
    main(["enjoy", "--algo", "klppo_lstm", "--env", env_id, "-f", str(tmp_path), "--no-render", "-n", "300"])
    out = capsys.readouterr().out
    assert "Mean reward:" in out  # at least one full episode was played, the LSTM state carried by enjoy
