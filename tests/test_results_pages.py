"""
The results pages written from one JSON beside them: their ``--report`` rewrites each committed page, figure first, from
that JSON alone, so regenerating a page moves no number (``benchmarks/README.md``).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS / "studies"))

import distributed_throughput  # noqa: E402
import kl_term_floor  # noqa: E402
import kltrpo_budget_use  # noqa: E402
import torch_threads_small_mlp  # noqa: E402
import trpo_joint_kl  # noqa: E402


def _opens_with_its_figure(page: Path) -> None:
    lines = page.read_text().splitlines()
    assert lines[2].startswith("![") and lines[2].endswith(f"({page.stem}.png)")
    assert lines[4].startswith("| ")  # then the summary table
    assert page.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "module, name",
    [
        (kltrpo_budget_use, "kltrpo_budget_use"),
        (kl_term_floor, "kl_term_floor"),
        (torch_threads_small_mlp, "torch_threads_small_mlp"),
        (torch_threads_small_mlp, "torch_threads_small_mlp_idle"),
    ],
)
def test_report_rewrites_the_committed_page_from_its_json(tmp_path, module, name):
    shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    out = tmp_path / (f"{name}.md" if module in (kltrpo_budget_use, kl_term_floor) else name)
    module.main(["--report", "--out", str(out)])
    page = tmp_path / f"{name}.md"
    assert page.read_text() == (RESULTS / f"{name}.md").read_text()
    _opens_with_its_figure(page)


def test_distributed_report_rewrites_the_committed_page_and_keeps_its_json(tmp_path, monkeypatch):
    shutil.copy(RESULTS / "distributed_runs.json", tmp_path / "distributed_runs.json")
    monkeypatch.setattr(distributed_throughput, "RESULTS", tmp_path)
    distributed_throughput.main(["--report"])
    assert (tmp_path / "distributed.md").read_text() == (RESULTS / "distributed.md").read_text()
    assert json.loads((tmp_path / "distributed_runs.json").read_text()) == json.loads(
        (RESULTS / "distributed_runs.json").read_text()
    )
    _opens_with_its_figure(tmp_path / "distributed.md")


def test_trpo_joint_kl_page_comes_from_its_json(tmp_path):
    saved = json.loads((RESULTS / "trpo_joint_kl.json").read_text())
    text = trpo_joint_kl.write_page(saved, tmp_path / "trpo_joint_kl.md")
    assert text == (RESULTS / "trpo_joint_kl.md").read_text()
    _opens_with_its_figure(tmp_path / "trpo_joint_kl.md")
    # the summary's ratio is the detail's mean over TRPO's target
    row = saved["rows"][0]
    assert f"| {row['env']} | {row['mean'] / row['trpo_target_kl']:.2f} | {row['kltrpo_target_kl']:g} |" in text
