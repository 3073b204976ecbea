"""The docs' results tables are what benchmarks/docs_tables.py makes from the committed records (none stale or hand-edited)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import docs_tables  # noqa: E402


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "docs" / "_generated").glob("results_*.md")))
def test_generated_results_table_matches_the_records(name):
    committed = (ROOT / "docs" / "_generated" / name).read_text()
    regenerated = docs_tables.pages()[name]
    assert regenerated == committed, f"docs/_generated/{name} is stale: run `python benchmarks/docs_tables.py`"


def test_pages_name_commits_with_a_fixed_length_whatever_gits_abbreviation(monkeypatch):
    # git's --short grows with a clone's object count (a CI clone gave 8 characters where this one gave 7)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.abbrev")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "12")
    commit = docs_tables.records_commit(ROOT / "benchmarks" / "results")
    if commit == "unknown":
        pytest.skip("no git history")
    assert len(commit) == docs_tables.run_records.SHORT_HASH == 7
