import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
ALGOS = ("klppo", "clip_klppo", "kltrpo")
# Small and fast: tiny network, short rollouts (overrides the shipped configs through the zoo's -params)
FAST_PARAMS = ["-params", "n_envs:2", "n_steps:256", "batch_size:128", "policy_kwargs:dict(net_arch=[16])"]
# Optuna parameters fixed in the tuning tests so that trials stay cheap (64 steps x 2 envs, 1 epoch, [64] network)
CHEAP_TRIAL = {"n_steps_pow": 6, "batch_size_pow": 6, "n_epochs": 1, "net_arch": "tiny"}


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def zoo():
    pytest.importorskip("rl_zoo3")
    pytest.importorskip("optuna")
    import sb3_kl.zoo

    return sb3_kl.zoo


def zoo_main(*args: str) -> None:
    from sb3_kl.zoo.__main__ import main

    main(list(args))


def test_import_error_without_rl_zoo3():
    result = run_python("""
        import sys
        sys.modules["rl_zoo3"] = None  # simulate a missing rl_zoo3
        try:
            import sb3_kl.zoo
        except ImportError as e:
            print("MESSAGE:", e)
        """)
    assert result.returncode == 0, result.stderr
    assert 'pip install -e ".[zoo]"' in result.stdout


def test_enjoy_import_error_without_requests(zoo):
    result = run_python("""
        import sys
        import sb3_kl.zoo
        sys.modules["requests"] = None  # rl_zoo3 does not declare it, but rl_zoo3.enjoy imports it
        sys.modules.pop("rl_zoo3.enjoy", None)
        sys.modules.pop("rl_zoo3.load_from_hub", None)
        from sb3_kl.zoo.enjoy import enjoy
        try:
            enjoy(["--algo", "klppo"])
        except ImportError as e:
            print("MESSAGE:", e)
        """)
    assert result.returncode == 0, result.stderr
    assert 'pip install -e ".[zoo]"' in result.stdout


def test_registration(zoo):
    import rl_zoo3
    import rl_zoo3.exp_manager
    import rl_zoo3.hyperparams_opt
    import rl_zoo3.train

    from sb3_kl import KLPPO, KLTRPO, ClipKLPPO

    expected = {"klppo": KLPPO, "clip_klppo": ClipKLPPO, "kltrpo": KLTRPO}
    for name, cls in expected.items():
        assert rl_zoo3.ALGOS[name] is cls
        # the zoo's scripts read these (same dict object)
        assert rl_zoo3.train.ALGOS[name] is cls
        assert rl_zoo3.exp_manager.ALGOS[name] is cls
        assert rl_zoo3.hyperparams_opt.HYPERPARAMS_SAMPLER[name] is zoo.hyperparams_opt.HYPERPARAMS_SAMPLER[name]
        assert rl_zoo3.hyperparams_opt.HYPERPARAMS_CONVERTER[name] is zoo.hyperparams_opt.HYPERPARAMS_CONVERTER[name]
        assert Path(zoo.default_config(name)).is_file()
    # the zoo's own algorithms are untouched, and registering twice changes nothing
    assert rl_zoo3.ALGOS["ppo"].__name__ == "PPO"
    preprocess = rl_zoo3.exp_manager.ExperimentManager._preprocess_hyperparams
    zoo.register()
    assert rl_zoo3.exp_manager.ExperimentManager._preprocess_hyperparams is preprocess
    with pytest.raises(ValueError, match="not an sb3_kl algorithm"):
        zoo.default_config("ppo")


def test_default_config_inserted_only_when_missing(zoo):
    from sb3_kl.zoo.train import with_default_config

    argv = ["--algo", "kltrpo", "--env", "Pendulum-v1", "-n", "100"]
    assert with_default_config(argv) == [*argv, "-conf", zoo.default_config("kltrpo")]
    for given in (["-conf", "my.yml"], ["--conf-file", "my.yml"], ["--conf", "my.yml"], ["--conf-file=my.yml"]):
        assert with_default_config(["--algo", "klppo", *given]) == ["--algo", "klppo", *given]
    # zoo algorithms keep the zoo's own configs
    assert with_default_config(["--algo", "ppo"]) == ["--algo", "ppo"]
    assert with_default_config([]) == []


def test_shipped_configs_parse(zoo):
    yaml = pytest.importorskip("yaml")
    for algo in ALGOS:
        with open(zoo.default_config(algo)) as file:
            configs = yaml.safe_load(file)
        assert {"CartPole-v1", "Acrobot-v1", "Pendulum-v1"} <= set(configs)
        for env_id, config in configs.items():
            assert isinstance(config["n_timesteps"], float), (algo, env_id)
            processed = zoo.preprocess_schedules(config)
            for key in zoo.SCHEDULE_KEYS:
                assert not isinstance(processed.get(key), str), (algo, env_id, key)


def test_linear_schedule_syntax(zoo):
    from stable_baselines3.common.utils import LinearSchedule

    schedule = zoo.registry.parse_linear_schedule("learning_rate", "lin_3e-4")
    assert isinstance(schedule, LinearSchedule)
    assert schedule(1.0) == pytest.approx(3e-4) and schedule(0.5) == pytest.approx(1.5e-4) and schedule(0.0) == 0.0
    schedule = zoo.registry.parse_linear_schedule("target_kl", "lin_0.02_0.005")
    assert schedule(1.0) == pytest.approx(0.02) and schedule(0.0) == pytest.approx(0.005)
    # the zoo's meaning: decay to 0 by the end of training (the algorithm floors the very last target)
    schedule = zoo.registry.parse_linear_schedule("target_kl", "lin_0.02")
    assert schedule(1.0) == pytest.approx(0.02) and schedule(0.0) == 0.0
    for bad in ("exp_0.1", "lin_", "lin_abc", "lin_1_2_3"):
        with pytest.raises(ValueError, match="lin_<start>"):
            zoo.registry.parse_linear_schedule("clip_range", bad)
    processed = zoo.preprocess_schedules({"target_kl": "lin_0.03_0.01", "clip_range": 0.2, "n_steps": 64})
    assert isinstance(processed["target_kl"], LinearSchedule)
    assert processed["clip_range"] == 0.2 and processed["n_steps"] == 64


@pytest.mark.filterwarnings("ignore:You have specified a mini-batch size")
@pytest.mark.parametrize("algo", ALGOS)
def test_samplers_and_converters(zoo, algo):
    import optuna

    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_CONVERTER, HYPERPARAMS_SAMPLER

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for _ in range(3):
        trial = study.ask()
        hyperparams = HYPERPARAMS_SAMPLER[algo](trial, 1, 2, {})
        # --trial-id reloads go through the converter: it must give back exactly what was trained
        assert HYPERPARAMS_CONVERTER[algo](trial.params) == hyperparams
        assert "target_kl" in hyperparams and "policy_kwargs" in hyperparams
        if algo == "kltrpo":
            assert {"cg_max_steps", "cg_damping", "n_critic_updates"} <= set(hyperparams)
        else:
            assert {"kl_coef", "kl_adapt_factor", "kl_estimator"} <= set(hyperparams)
        assert ("clip_range" in hyperparams) == (algo == "clip_klppo")
        model = zoo.SB3_KL_ALGOS[algo]("MlpPolicy", "CartPole-v1", **hyperparams)  # every key is a valid argument
        assert model.target_kl(1.0) == pytest.approx(hyperparams["target_kl"])
        study.tell(trial, 0.0)


@pytest.mark.parametrize(
    "kl_controller, drawn",
    [
        (None, {"kl_coef", "kl_adapt_factor"}),
        ("adaptive", {"kl_coef", "kl_adapt_factor"}),
        ("fixed", {"kl_coef"}),
        ("proportional", {"kl_coef"}),
        ("object", set()),
    ],
)
def test_the_kl_samplers_draw_only_the_controller_options_the_config_uses(zoo, kl_controller, drawn):
    import optuna

    from sb3_kl.common.controllers import FixedKLController
    from sb3_kl.zoo.export import check_params_match_algo
    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_CONVERTER, HYPERPARAMS_SAMPLER, TUNED_HYPERPARAMS

    config = {} if kl_controller is None else {"kl_controller": kl_controller}
    if kl_controller == "object":
        config["kl_controller"] = FixedKLController(kl_coef=0.3)
    for algo in ("klppo", "clip_klppo", "klppo_mask", "klppo_lstm"):
        # given directly, and as the zoo's objective shows it (the entry it tunes, for the duration of the trial)
        for additional_args, tuned in (({"hyperparams": config}, None), ({}, config)):
            trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)).ask()
            token = TUNED_HYPERPARAMS.set(tuned)
            try:
                hyperparams = HYPERPARAMS_SAMPLER[algo](trial, 1, 2, additional_args)
            finally:
                TUNED_HYPERPARAMS.reset(token)
            assert {"kl_coef", "kl_adapt_factor"} & set(trial.params) == drawn
            assert HYPERPARAMS_CONVERTER[algo](trial.params) == hyperparams
            check_params_match_algo(trial.params, "trial 0", "study", algo)  # export and --trial-id take it
            if algo in ("klppo", "clip_klppo"):
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)  # no "does not use" / "is ignored" warning
                    warnings.filterwarnings("ignore", message="You have specified a mini-batch size")
                    zoo.SB3_KL_ALGOS[algo]("MlpPolicy", "CartPole-v1", **{**config, **hyperparams})


def test_a_study_of_a_fixed_beta_config_does_not_search_the_adaptation_factor(zoo, tmp_path):
    import optuna

    from sb3_kl.zoo.export import trial_config

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="fixed", storage=storage, direction="maximize")
    study.enqueue_trial(CHEAP_TRIAL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zoo_main(
            "train", "--algo", "klppo", "--env", "CartPole-v1", "-f", str(tmp_path), "--verbose", "0", "--seed", "0",
            *FAST_PARAMS, "kl_controller:'fixed'", "-n", "256", "-optimize", "--n-trials", "1",
            "--n-evaluations", "1", "--eval-episodes", "1", "--sampler", "random", "--pruner", "none",
            "--no-optim-plots", "--storage", storage, "--study-name", "fixed",
        )  # fmt: skip
    assert not [w for w in caught if "kl_adapt_factor" in str(w.message)]
    (trial,) = optuna.load_study(study_name="fixed", storage=storage).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert "kl_coef" in trial.params and "kl_adapt_factor" not in trial.params
    assert trial.user_attrs["kl_controller"] == "fixed"
    # the exported entry, and a --trial-id re-run without the study's -params, train the fixed beta it was tuned with
    entry = trial_config(optuna.load_study(study_name="fixed", storage=storage), "klppo", "CartPole-v1")
    assert "kl_adapt_factor" not in entry and entry["kl_coef"] == trial.params["kl_coef"]
    assert entry["kl_controller"] == "fixed"
    zoo_main(
        "train", "--algo", "klppo", "--env", "CartPole-v1", "-f", str(tmp_path / "rerun"), "--verbose", "0",
        "--seed", "0", "-n", "256", "--eval-freq", "-1", "--storage", storage, "--study-name", "fixed", "--trial-id", "0",
    )  # fmt: skip
    (saved,) = (tmp_path / "rerun" / "klppo").glob("CartPole-v1_*/CartPole-v1.zip")
    model = zoo.SB3_KL_ALGOS["klppo"].load(saved)
    assert type(model.kl_controller).__name__ == "FixedKLController"
    assert model.kl_coef == pytest.approx(trial.params["kl_coef"])


def test_each_trial_starts_from_its_own_copy_of_a_controller_object(zoo):
    import optuna

    from sb3_kl.common.controllers import AdaptiveKLController
    from sb3_kl.zoo.distributed import StorageError
    from sb3_kl.zoo.export import trial_config
    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_SAMPLER
    from sb3_kl.zoo.registry import TrialHyperparams

    controller = AdaptiveKLController(kl_coef=1.0)
    config = TrialHyperparams({"kl_controller": controller, "n_steps": 64})
    first, second = config.copy(), config.copy()  # what the zoo's objective hands two trials
    assert type(first) is dict and first["n_steps"] == 64
    assert first["kl_controller"] is not controller and second["kl_controller"] is not first["kl_controller"]
    first["kl_controller"].update(1.0, 0.01)  # one trial's updates leave the next trial's beta alone
    assert first["kl_controller"].kl_coef != 1.0 and second["kl_controller"].kl_coef == controller.kl_coef == 1.0
    # a trial tuned with an object cannot be written to YAML: export says how to re-train it instead
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    HYPERPARAMS_SAMPLER["klppo"](trial, 1, 2, {"hyperparams": {"kl_controller": controller}})
    study.tell(trial, 1.0)
    assert trial.user_attrs["kl_controller"] == "object: AdaptiveKLController"
    with pytest.raises(StorageError, match=r"controller object .*AdaptiveKLController.*--trial-id"):
        trial_config(study, "klppo", "CartPole-v1")


@pytest.mark.parametrize("algo, env_id", [("klppo", "Pendulum-v1"), ("clip_klppo", "Acrobot-v1"), ("kltrpo", "Pendulum-v1")])
def test_train_and_enjoy_through_module(zoo, algo, env_id, tmp_path, capsys):
    import yaml

    zoo_main(
        "train", "--algo", algo, "--env", env_id, "-n", "1024", "--seed", "3", "-f", str(tmp_path),
        "--eval-freq", "-1", "--verbose", "0", *FAST_PARAMS,
    )  # fmt: skip
    run_dir = tmp_path / algo / f"{env_id}_1"
    assert (run_dir / f"{env_id}.zip").is_file()
    config = yaml.load((run_dir / env_id / "config.yml").read_text(), Loader=yaml.UnsafeLoader)
    args = yaml.load((run_dir / env_id / "args.yml").read_text(), Loader=yaml.UnsafeLoader)
    # the shipped config was used, with the command-line overrides on top
    assert args["algo"] == algo and args["conf_file"] == zoo.default_config(algo)
    assert config["n_steps"] == 256 and config["policy"] == "MlpPolicy"
    if env_id == "Pendulum-v1":
        assert config["use_sde"] is True
    else:  # the Acrobot config normalises observations: the zoo saves the statistics, enjoy loads them
        assert config["normalize"] is True and (run_dir / env_id / "vecnormalize.pkl").is_file()
    model = zoo.SB3_KL_ALGOS[algo].load(run_dir / f"{env_id}.zip")
    assert model.num_timesteps >= 1024
    assert model.policy_kwargs["net_arch"] == [16]

    capsys.readouterr()
    zoo_main("enjoy", "--algo", algo, "--env", env_id, "-f", str(tmp_path), "--no-render", "-n", "501")
    out = capsys.readouterr().out
    assert f"Loading {run_dir / env_id}.zip" in out.replace("//", "/")
    assert "Mean reward:" in out  # at least one full episode was played


def test_target_kl_schedule_loads_without_rl_zoo3(zoo, tmp_path):
    zoo_main(
        "train", "--algo", "klppo", "--env", "CartPole-v1", "-n", "512", "--seed", "0", "-f", str(tmp_path),
        "--eval-freq", "-1", "--verbose", "0", *FAST_PARAMS, "target_kl:'lin_0.02_0.005'", "learning_rate:'lin_1e-3'",
    )  # fmt: skip
    model_path = tmp_path / "klppo" / "CartPole-v1_1" / "CartPole-v1.zip"
    result = run_python(f"""
        import sys
        sys.modules["rl_zoo3"] = None  # loading must not need the zoo
        from sb3_kl import KLPPO
        model = KLPPO.load({str(model_path)!r})
        print(model.target_kl(1.0), model.target_kl(0.0), model.lr_schedule(0.5))
        """)
    assert result.returncode == 0, result.stderr
    target_start, target_end, learning_rate = map(float, result.stdout.split())
    assert target_start == pytest.approx(0.02) and target_end == pytest.approx(0.005)
    assert learning_rate == pytest.approx(5e-4)


def test_bad_schedule_string_fails_before_training(zoo, tmp_path):
    with pytest.raises(ValueError, match="target_kl"):
        zoo_main(
            "train", "--algo", "klppo", "--env", "CartPole-v1", "-n", "256", "-f", str(tmp_path), "--verbose", "0",
            *FAST_PARAMS, "target_kl:'exp_0.02'",
        )  # fmt: skip
    assert not list(tmp_path.rglob("*.zip"))


def test_optimize_two_trials_and_reload_trial(zoo, tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    # Fix the expensive dimensions of the 2 trials (Optuna's enqueue), the rest is sampled by our sampler
    study = optuna.create_study(study_name="klppo-test", storage=storage, direction="maximize")
    for _ in range(2):
        study.enqueue_trial(CHEAP_TRIAL)
    common = ["--env", "CartPole-v1", "-f", str(tmp_path), "--verbose", "0", "--seed", "0", *FAST_PARAMS]
    zoo_main(
        "train", "--algo", "klppo", *common, "-n", "512", "-optimize", "--n-trials", "2", "--n-evaluations", "1",
        "--eval-episodes", "2", "--sampler", "random", "--pruner", "none", "--no-optim-plots",
        "--storage", storage, "--study-name", "klppo-test",
    )  # fmt: skip
    study = optuna.load_study(study_name="klppo-test", storage=storage)
    complete = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2
    assert {"target_kl", "kl_coef", "kl_adapt_factor", "kl_estimator"} <= set(complete[0].params)
    assert list((tmp_path / "klppo").glob("report_CartPole-v1_2-trials-512-random-none_*.csv"))

    def train_trial(trial_id: int):
        """Train with a trial's hyperparameters (the zoo converts them back with our converter); :return: the model"""
        zoo_main(
            "train", "--algo", "klppo", *common[:-len(FAST_PARAMS)], "-n", "256", "--eval-freq", "-1",
            "--storage", storage, "--study-name", "klppo-test", "--trial-id", str(trial_id),
        )  # fmt: skip
        run_dir = max((tmp_path / "klppo").glob("CartPole-v1_*"), key=lambda path: path.stat().st_mtime)
        return zoo.SB3_KL_ALGOS["klppo"].load(run_dir / "CartPole-v1.zip")

    model = train_trial(1)
    params = study.trials[1].params
    assert model.target_kl(1.0) == pytest.approx(params["target_kl"])
    assert model.n_steps == 2 ** params["n_steps_pow"] and model.kl_settings.estimator == params["kl_estimator"]

    # trial 0 too (the zoo tests --trial-id for truth and took 0 for no trial), and a clear error for no such trial
    model = train_trial(0)
    assert model.target_kl(1.0) == pytest.approx(study.trials[0].params["target_kl"])
    with pytest.raises(SystemExit, match="--trial-id 99"):
        zoo_main(
            "train", "--algo", "klppo", *common[:-len(FAST_PARAMS)], "-n", "256",
            "--storage", storage, "--study-name", "klppo-test", "--trial-id", "99",
        )  # fmt: skip
    # a trial tuned for klppo reloaded for another algorithm: refused, as export refuses it, before any run folder
    for algo in ("kltrpo", "clip_klppo"):
        with pytest.raises(SystemExit, match=rf"not tuned for --algo {algo}: its trial 0 has .*Pass the --algo it was"):
            zoo_main(
                "train", "--algo", algo, *common[:-len(FAST_PARAMS)], "-n", "256",
                "--storage", storage, "--study-name", "klppo-test", "--trial-id", "0",
            )  # fmt: skip
        assert not (tmp_path / algo).exists()


@pytest.mark.slow
def test_distributed_optimization_two_workers_share_sqlite_storage(zoo, tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(study_name="shared", storage=storage, direction="maximize")
    for _ in range(4):
        study.enqueue_trial(CHEAP_TRIAL)
    command = [
        sys.executable, "-m", "sb3_kl.zoo", "train", "--algo", "clip_klppo", "--env", "CartPole-v1", "-n", "512",
        "-optimize", "--n-trials", "2", "--n-evaluations", "1", "--eval-episodes", "2", "--pruner", "none",
        "--no-optim-plots", "--storage", storage, "--study-name", "shared", "--verbose", "0", "--num-threads", "1",
        *FAST_PARAMS,
    ]  # fmt: skip
    workers = [
        subprocess.Popen([*command, "--seed", str(seed), "-f", str(tmp_path / f"worker{seed}")], env=SUBPROCESS_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for seed in (1, 2)
    ]  # fmt: skip
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), outputs
    study = optuna.load_study(study_name="shared", storage=storage)
    complete = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 4  # 2 trials per worker, in one study
    assert all("clip_range" in trial.params for trial in complete)
    # each worker wrote its own report of the shared study
    assert all(list((tmp_path / f"worker{seed}" / "clip_klppo").glob("report_CartPole-v1_*.csv")) for seed in (1, 2))


def test_every_shipped_config_entry_was_run():
    yaml = pytest.importorskip("yaml")
    # An entry is shipped only with a recorded run of exactly that config (benchmarks/zoo_configs.py)
    runs_dir = ROOT / "benchmarks" / "results" / "zoo_runs"
    for algo in (*ALGOS, "klppo_mask", "klppo_lstm"):
        configs = yaml.safe_load((ROOT / "sb3_kl" / "hyperparams" / f"{algo}.yml").read_text())
        for env_id, config in configs.items():
            runs = [json.loads(path.read_text()) for path in runs_dir.glob(f"{algo}_{env_id}_seed*.json")]
            assert any(run["returncode"] == 0 and run["config"] == config for run in runs), f"{algo} {env_id}: no run"


@pytest.mark.parametrize("algo", ["klppo_lstm", "klppo_mask"])
def test_export_writes_the_network_the_trial_trained(zoo, algo, tmp_path):
    """
    The zoo's objective and ``--trial-id`` replace the config's ``policy_kwargs`` with the trial's sampled network, so
    the exported entry carries the trial's ``policy_kwargs`` alone, not merged into the config's (whose other keys, e.g.
    the LSTM's size, the trial did not train with). Every tunable algorithm can be exported.
    """
    import optuna
    import yaml

    from sb3_kl.zoo.export import trial_config
    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_SAMPLER

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    trial = study.ask()
    sampled = HYPERPARAMS_SAMPLER[algo](trial, 1, 2, {})
    study.tell(trial, 1.0)
    base = tmp_path / "base.yml"
    env_id = "CartPole-v1"
    base.write_text(yaml.safe_dump({env_id: {"n_envs": 4, "policy_kwargs": "dict(lstm_hidden_size=8, ortho_init=False)"}}))
    entry = trial_config(study, algo, env_id, conf_file=str(base))
    assert entry["n_envs"] == 4  # not sampled: from the config
    from torch import nn

    assert eval(entry["policy_kwargs"], {"nn": nn, "dict": dict}) == sampled["policy_kwargs"]

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.copy_study(from_study_name=study.study_name, from_storage=study._storage, to_storage=storage, to_study_name="s")
    output = tmp_path / "best.yml"
    zoo_main("export", "--algo", algo, "--env", env_id, "--storage", storage, "--study-name", "s", "-conf", str(base),
             "-o", str(output))  # fmt: skip
    assert yaml.safe_load(output.read_text())[env_id]["policy_kwargs"] == entry["policy_kwargs"]


def test_continue_training_keeps_the_saved_kl_coef(zoo, tmp_path):
    """``-i`` with a config that sets ``kl_coef``: the run goes on from the saved beta, not the config's initial one."""
    common = ["--env", "CartPole-v1", "--seed", "0", "--eval-freq", "-1", "--verbose", "0", "-f", str(tmp_path)]
    fixed = [*FAST_PARAMS, "kl_controller:'fixed'"]
    zoo_main("train", "--algo", "klppo", *common, "-n", "512", *fixed, "kl_coef:0.5")
    first = tmp_path / "klppo" / "CartPole-v1_1" / "CartPole-v1.zip"
    assert zoo.SB3_KL_ALGOS["klppo"].load(first).kl_coef == pytest.approx(0.5)
    # a fixed beta shows what load() was given: 0.9 if the config's value reached it
    zoo_main("train", "--algo", "klppo", *common, "-n", "512", *fixed, "kl_coef:0.9", "-i", str(first))
    resumed = zoo.SB3_KL_ALGOS["klppo"].load(tmp_path / "klppo" / "CartPole-v1_2" / "CartPole-v1.zip")
    assert resumed.kl_coef == pytest.approx(0.5)


def test_record_video_through_module(zoo, tmp_path):
    pytest.importorskip("moviepy")
    zoo_main(
        "train", "--algo", "klppo", "--env", "CartPole-v1", "-n", "256", "--seed", "0", "-f", str(tmp_path),
        "--eval-freq", "-1", "--verbose", "0", *FAST_PARAMS,
    )  # fmt: skip
    videos = tmp_path / "videos"
    zoo_main("record_video", "--algo", "klppo", "--env", "CartPole-v1", "-f", str(tmp_path), "-n", "30", "-o", str(videos))
    assert list(videos.rglob("*.mp4"))


def test_export_of_a_study_without_a_complete_trial_says_so(zoo):
    import optuna

    from sb3_kl.zoo.distributed import StorageError
    from sb3_kl.zoo.export import trial_config

    study = optuna.create_study(direction="maximize")
    study.ask()  # a running trial only
    with pytest.raises(StorageError, match="no complete trial"):
        trial_config(study, "klppo", "CartPole-v1")


def test_a_malformed_sqlite_url_is_one_clear_error(zoo):
    from sb3_kl.zoo.distributed import StorageError, open_storage

    with pytest.raises(StorageError, match=r"sqlite:////absolute"):
        open_storage("sqlite://study.db")  # a host where the path should be


def test_none_and_numbers_yaml_reads_as_strings_reach_the_model(zoo, tmp_path):
    # clip_range: None is KLPPO's own default (no ratio clip); the zoo's schedule parsing refuses None
    zoo_main(
        "train", "--algo", "klppo", "--env", "CartPole-v1", "-n", "256", "--seed", "0", "-f", str(tmp_path),
        "--eval-freq", "-1", "--verbose", "0", *FAST_PARAMS, "clip_range:None", "clip_range_vf:None",
        "target_kl:'2e-2'",  # what YAML 1.1 gives for a bare 2e-2
    )  # fmt: skip
    model = zoo.SB3_KL_ALGOS["klppo"].load(tmp_path / "klppo" / "CartPole-v1_1" / "CartPole-v1.zip")
    assert model.clip_range is None and model.clip_range_vf is None
    assert model.target_kl(1.0) == pytest.approx(0.02)


def test_clip_range_none_written_in_a_yaml_config_reaches_the_model(zoo, tmp_path):
    # docs/zoo.md tells a user to write `clip_range: None`, which YAML reads as the string "None" (its null is `null`)
    conf = tmp_path / "klppo.yml"
    conf.write_text(
        "CartPole-v1:\n  n_timesteps: 256\n  policy: MlpPolicy\n  n_envs: 2\n  n_steps: 256\n  batch_size: 128\n"
        "  policy_kwargs: dict(net_arch=[16])\n  clip_range: None\n  clip_range_vf: null\n"
    )
    zoo_main(
        "train", "--algo", "klppo", "--env", "CartPole-v1", "--seed", "0", "-f", str(tmp_path), "--eval-freq", "-1",
        "--verbose", "0", "-conf", str(conf),
    )  # fmt: skip
    model = zoo.SB3_KL_ALGOS["klppo"].load(tmp_path / "klppo" / "CartPole-v1_1" / "CartPole-v1.zip")
    assert model.clip_range is None and model.clip_range_vf is None
    assert zoo.preprocess_schedules({"clip_range": "None"})["clip_range"] is None


@pytest.mark.parametrize("learning_rate, start", [("auto", 3e-4), ("auto_1e-3", 1e-3)])
def test_auto_learning_rate_in_a_yaml_config_reaches_the_model(zoo, tmp_path, learning_rate, start):
    conf = tmp_path / "klppo.yml"
    conf.write_text(
        "CartPole-v1:\n  n_timesteps: 256\n  policy: MlpPolicy\n  n_envs: 2\n  n_steps: 64\n  batch_size: 64\n"
        f"  policy_kwargs: dict(net_arch=[16])\n  learning_rate: {learning_rate}\n"
    )
    zoo_main(
        "train", "--algo", "klppo", "--env", "CartPole-v1", "--seed", "0", "-f", str(tmp_path), "--eval-freq", "-1",
        "--verbose", "0", "-conf", str(conf),
    )  # fmt: skip
    model = zoo.SB3_KL_ALGOS["klppo"].load(tmp_path / "klppo" / "CartPole-v1_1" / "CartPole-v1.zip")
    assert model.learning_rate == learning_rate and model.adapts_learning_rate
    assert model.adapted_learning_rate != pytest.approx(start)  # adapted over the two updates, and saved


def test_an_env_without_a_shipped_config_is_one_line_naming_conf(zoo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        zoo_main("train", "--algo", "klppo", "--env", "MountainCar-v0", "-n", "256")
    message = str(stopped.value.code)
    assert message.startswith("sb3_kl.zoo train: error: --algo klppo ships no config for --env MountainCar-v0")
    assert "-conf my.yml" in message and "CartPole-v1" in message and "\n" not in message
    assert not list(tmp_path.iterdir())  # nothing written


def test_enjoy_reads_the_folder_train_writes_by_default(zoo):
    from sb3_kl.zoo.enjoy import with_default_folder

    assert with_default_folder(["--algo", "klppo", "--env", "CartPole-v1"]) == [
        "--algo", "klppo", "--env", "CartPole-v1", "-f", "logs",
    ]  # fmt: skip
    for given in (["-f", "mine"], ["--folder", "mine"], ["--folder=mine"]):
        assert with_default_folder(["--algo", "klppo", *given]) == ["--algo", "klppo", *given]
    assert with_default_folder(["--algo", "ppo"]) == ["--algo", "ppo"]  # the zoo's own agents: its default folder


def test_export_refuses_a_study_of_another_algorithm_or_a_base_config_without_the_env(zoo, tmp_path):
    import optuna
    import yaml

    from sb3_kl.zoo.distributed import StorageError
    from sb3_kl.zoo.export import trial_config
    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_SAMPLER

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    trial = study.ask()
    HYPERPARAMS_SAMPLER["klppo"](trial, 1, 2, {})
    study.tell(trial, 1.0)
    with pytest.raises(StorageError, match=r"not tuned for --algo kltrpo: .*n_epochs.*Pass the --algo it was tuned with"):
        trial_config(study, "kltrpo", "CartPole-v1")
    with pytest.raises(StorageError, match=r"no entry for --env MountainCar-v0 .*pass -conf"):
        trial_config(study, "klppo", "MountainCar-v0")
    base = tmp_path / "base.yml"
    base.write_text(yaml.safe_dump({"MountainCar-v0": {"n_envs": 4, "n_timesteps": 1000, "normalize": True}}))
    entry = trial_config(study, "klppo", "MountainCar-v0", conf_file=str(base))
    assert entry["n_envs"] == 4 and entry["normalize"] is True


def test_export_takes_the_zoos_default_entry_and_leaves_optunas_logging_alone(zoo, tmp_path):
    import optuna
    import yaml

    from sb3_kl.zoo.export import trial_config
    from sb3_kl.zoo.hyperparams_opt import HYPERPARAMS_SAMPLER
    from sb3_kl.zoo.train import with_default_config

    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    HYPERPARAMS_SAMPLER["kltrpo"](trial, 1, 2, {})
    study.tell(trial, 1.0)
    base = tmp_path / "base.yml"
    base.write_text(yaml.safe_dump({"default": {"n_envs": 3, "n_timesteps": 1000}}))
    verbosity = optuna.logging.get_verbosity()
    # as the zoo trains an env without an entry of its own: with the config's "default" entry
    assert trial_config(study, "kltrpo", "MountainCar-v0", conf_file=str(base))["n_envs"] == 3
    assert optuna.logging.get_verbosity() == verbosity
    # an id gymnasium does not know (a typo) is left to the zoo, which suggests the registered names
    assert with_default_config(["--algo", "klppo", "--env", "CartPol-v1"])[-2:] == ["-conf", zoo.default_config("klppo")]
