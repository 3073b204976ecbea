"""The docs' results tables are what benchmarks/docs_tables.py makes from the committed records (none stale or hand-edited)."""

import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import docs_tables  # noqa: E402


@functools.cache
def regenerated_pages() -> dict[str, str]:
    """The tables as the records make them now (computed once: the bootstrap intervals take a while)."""
    return docs_tables.pages()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "docs" / "_generated").glob("results_*.md")))
def test_generated_results_table_matches_the_records(name):
    committed = (ROOT / "docs" / "_generated" / name).read_text()
    regenerated = regenerated_pages()[name]
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


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "docs" / "_generated").glob("results_*.md")))
def test_tables_fit_the_page_with_the_verdict_first_and_one_records_line(name):
    lines = regenerated_pages()[name].splitlines()
    rows = [line for line in lines if line.startswith("|")]
    header, cells = rows[0], [row.strip("|").split(" | ") for row in rows[2:]]
    # a few columns, so the verdicts are on screen: the algorithm's return, then one verdict cell per other algorithm
    assert header.count(" | ") + 1 <= 6, header
    verdicts = [cell.strip() for row in cells for cell in row if ": " in cell and "(p" in cell]
    assert all(cell.split(":")[0] in ("tie", "**better**", "**worse**") for cell in verdicts), verdicts
    if name != "results_trpl.md":
        assert verdicts
    # under the table, one line names the records and links the page that reports them in full
    records = [line for line in lines if line.startswith("Records: ")]
    assert len(records) == 1 and "](../results/" in records[0] and len(records[0]) < 300, records
