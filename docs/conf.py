"""Sphinx configuration of the sb3-kl documentation (MyST Markdown pages, reST docstrings)."""

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.abspath(".."))

with open(os.path.join(os.path.dirname(__file__), "..", "sb3_kl", "version.txt")) as file_handler:
    __version__ = file_handler.read().strip()

project = "sb3-kl"
author = "sb3-kl contributors"
copyright = "sb3-kl contributors"
version = __version__
release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "myst_parser",
]

# No intersphinx: the site builds offline (CI reaches PyPI only).
source_suffix = {".md": "markdown"}
master_doc = "index"
# _generated/ holds tables that the algorithm pages include; they are no pages of their own.
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]
# Headings get anchors, so pages can link to a section: [text](page.md#section-title)
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "substitution"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports: list[str] = []

html_theme = "sphinx_rtd_theme"
html_title = f"sb3-kl {__version__}"
html_static_path = ["_static"]
# Wider content and wrapping table cells: the theme caps the text at 800 px and keeps each cell on one line
html_css_files = ["wide_tables.css"]
# The version on the landing page: |release| in a MyST page
myst_substitutions = {"release": release}

# The benchmark pages (benchmarks/results/*.md and their figures) are the repository's; the site renders copies of
# them under results/, made at each build (not committed), so a docs page links to them as ../results/<page>.md.
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
#: The folders of ``benchmarks/results`` whose pages the site renders ("" is the folder itself)
RESULTS_FOLDERS = ("", "side_studies")
RESULTS_COPY = "results"


def results_pages() -> list[str]:
    """The results pages the site renders, as paths relative to ``benchmarks/results`` (and to ``docs/results``)."""
    return sorted(
        path.relative_to(RESULTS).as_posix() for folder in RESULTS_FOLDERS for path in (RESULTS / folder).glob("*.md")
    )


def copy_results(app, config) -> None:
    """Copy the results pages and their figures into the site's sources (only what changed: builds stay incremental)."""
    target = Path(app.srcdir) / RESULTS_COPY
    wanted = {}
    for folder in RESULTS_FOLDERS:
        for path in (RESULTS / folder).iterdir():
            if path.suffix in (".md", ".png"):
                wanted[target / folder / path.name] = path
    if target.exists():
        for path in target.rglob("*"):
            if path.is_file() and path not in wanted:
                path.unlink()
    for copy, source in wanted.items():
        copy.parent.mkdir(parents=True, exist_ok=True)
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copy2(source, copy)


def setup(app) -> None:
    app.connect("config-inited", copy_results)
