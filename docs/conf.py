"""Sphinx configuration of the sb3-kl documentation (MyST Markdown pages, reST docstrings)."""

import os
import sys

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
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports: list[str] = []

html_theme = "sphinx_rtd_theme"
html_title = f"sb3-kl {__version__}"
html_static_path: list[str] = []
