"""
The drift-anchor experiment (``benchmarks/studies/drift_anchor.py``): the reference it penalizes the policy toward is the
policy ``lag`` updates before the update's result, and its records land beside the grid's cells.
"""

import copy
import sys
from pathlib import Path

import torch as th
from stable_baselines3.common.callbacks import BaseCallback

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "studies")]

import drift_anchor  # noqa: E402


class ReferenceWatcher(BaseCallback):
    """After the anchor's hook of each rollout start: the reference's weights and the policy's at every start so far."""

    def __init__(self):
        super().__init__()
        self.starts, self.references = [], []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        self.starts.append(copy.deepcopy(self.model.policy.state_dict()))
        self.references.append(copy.deepcopy(self.model.ref_policy.state_dict()))


def test_the_reference_is_the_policy_lag_updates_before_and_its_kl_is_penalized():
    model = drift_anchor.anchored_class("klppo")(
        "MlpPolicy", "Pendulum-v1", n_steps=128, batch_size=64, seed=0, ref_kl_coef=0.1, ref_target_kl=0.3
    )
    assert model.ref_policy is not model.policy
    watcher = ReferenceWatcher()
    model.learn(6 * 128, callback=[drift_anchor.make_anchor(3), watcher])
    for n, reference in enumerate(watcher.references):
        # at the start of rollout n the reference is the policy of rollout n - 2 (the first one until then): the
        # update that follows is 3 updates after it
        expected = watcher.starts[max(0, n - 2)]
        assert all(th.equal(reference[key], expected[key]) for key in expected)
    assert not all(th.equal(watcher.starts[0][k], watcher.starts[-1][k]) for k in watcher.starts[0])
    values = model.logger.name_to_value
    assert values["train/ref_kl"] > 0 and values["train/ref_target_kl"] == 0.3
    assert values["train/ref_kl_coef"] < 0.1  # far under its target: beta_ref decreased


def test_records_land_beside_the_grid_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(drift_anchor, "FOLDER", tmp_path / "drift_anchor")
    monkeypatch.setattr(drift_anchor.run_records, "RESULTS", tmp_path)
    drift_anchor.main(["--tier", "tiny", "--algos", "klppo", "--envs", "Pendulum-v1", "--seeds", "0", "--lag", "2"])
    folder = drift_anchor.records_folder(2, 10.0, "tiny")
    (record,) = drift_anchor.run_records.read_folder(folder)
    assert folder == tmp_path / "drift_anchor" / "lag2_x10" / "runs" / "tiny"
    assert record["anchor"] == dict(lag=2, multiple=10.0)
    assert record["overrides"] == dict(ref_kl_coef=drift_anchor.INITIAL_REF_KL_COEF, ref_target_kl=0.3)
    assert record["drift_lag"] == 10 and record["kl_updates"]
    # a second call finds the record and trains nothing
    drift_anchor.main(["--tier", "tiny", "--algos", "klppo", "--envs", "Pendulum-v1", "--seeds", "0", "--lag", "2"])
    assert drift_anchor.run_records.read_folder(folder) == [record]
    assert (tmp_path / "drift_anchor_tiny.md").exists()
