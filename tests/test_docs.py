"""
The documentation runs as written: every ```python block of every page of ``docs/`` (not the generated tables) and
of ``README.md`` executes, page by page, the page's blocks in order in one fresh interpreter whose working directory
is a temporary folder; the Sphinx site builds with warnings fatal (``python -m sphinx -W -b html docs OUT``); every
repository path a page names exists; every results page a docs page cites is a link the site opens; and each algorithm
page's "Can I use?" table of spaces is true.
"""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# _generated: tables the pages include; results: the site's copies of benchmarks/results' pages, made by each build
SKIPPED_FOLDERS = {"_generated", "_build", "results"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")

# Runs in the fresh interpreter: each block compiled under a name that says where it comes from, in one namespace,
# so a page's later blocks see what its earlier ones defined (as a reader running them in order would).
RUNNER = """
import json, linecache, sys, traceback
import torch
torch.set_num_threads(1)
page, blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for number, (first_line, source) in enumerate(blocks, start=1):
    name = f"<{page} python block {number}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        exec(compile(source, name, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {page}, python block {number}, first line: {first_line}", file=sys.stderr)
        sys.exit(1)
"""


def doc_pages() -> list[Path]:
    """``README.md`` and every Markdown page of ``docs/`` outside the generated and build folders."""
    pages = [path for path in sorted(DOCS.rglob("*.md")) if not SKIPPED_FOLDERS & set(path.relative_to(DOCS).parts)]
    return [ROOT / "README.md", *pages]


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose info string is ``python``, in page order, dedented."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        index += 1
        if match is None:
            continue
        fence, body = match["fence"], []
        while index < len(lines):
            closing = FENCE.match(lines[index])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence):
                if not closing["info"].strip():
                    break
            body.append(lines[index])
            index += 1
        index += 1  # past the closing fence
        if match["info"].strip() == "python":
            blocks.append(textwrap.dedent("\n".join(body)) + "\n")
    return blocks


def first_line(block: str) -> str:
    return next((line.strip() for line in block.splitlines() if line.strip()), "")


PAGES_WITH_CODE = [page for page in doc_pages() if python_blocks(page.read_text(encoding="utf-8"))]


def test_block_extraction_finds_python_blocks_only() -> None:
    text = "\n".join(
        [
            "```bash",
            "python -c 'raise SystemExit(1)'",
            "```",
            "- a list item:",
            "",
            "  ```python",
            "  x = 1",
            "  ```",
            "````md",
            "```python",
            "not run: inside a four-backtick block",
            "```",
            "````",
            "```python",
            "y = x + 1",
            "```",
        ]
    )
    assert python_blocks(text) == ["x = 1\n", "y = x + 1\n"]
    # the pages that must show runnable code are found
    names = {page.relative_to(ROOT).as_posix() for page in PAGES_WITH_CODE}
    assert {"README.md", "docs/guide/quickstart.md"} <= names


@pytest.mark.slow  # one interpreter per page, each training a few thousand steps
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    import json

    name = page.relative_to(ROOT).as_posix()
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([name, [(first_line(block), block) for block in blocks]]))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    env = dict(os.environ, SB3_LOGDIR=str(tmp_path / "sb3_logs"), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(spec)], cwd=workdir, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{name}: a python block failed\n{result.stderr[-4000:]}"


# A path of the repository named in backticks or a link, e.g. `python benchmarks/learning.py` or (benchmarks/README.md)
REPOSITORY_PATH = re.compile(
    r"[`(](?:python )?((?:benchmarks|scripts|examples|tests|sb3_kl|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_])"
)
# The changelog names files as they were at each release
HISTORY_PAGES = {"docs/misc/changelog.md"}


@pytest.mark.parametrize(
    "page",
    [page for page in doc_pages() if page.relative_to(ROOT).as_posix() not in HISTORY_PAGES],
    ids=lambda page: page.relative_to(ROOT).as_posix(),
)
def test_named_repository_paths_exist(page: Path) -> None:
    name = page.relative_to(ROOT).as_posix()
    text = page.read_text(encoding="utf-8")
    # globs, placeholders and the site's build output are not files of the repository
    named = {path for path in REPOSITORY_PATH.findall(text) if "*" not in path and "<" not in path and "_build" not in path}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{name} names paths that do not exist: {missing}"


def site_results_pages() -> set[str]:
    """The results pages the site renders, relative to ``docs/results`` (``docs/conf.py`` copies them at each build)."""
    spec = importlib.util.spec_from_file_location("sb3_kl_docs_conf", DOCS / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return set(conf.results_pages())


# A Markdown link (its text may hold brackets, e.g. [`x[0]`](page.md)) and its target
MARKDOWN_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")
# A results page named in the text, e.g. `benchmarks/results/learning.md` or {download}`... <../../benchmarks/results/x.md>`
RESULTS_PATH = re.compile(r"benchmarks/results/[\w./-]*\.md\b")


def prose(text: str) -> str:
    """The page without its fenced blocks (code and command output cite paths that are no citations)."""
    kept, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match is not None:
            fence = match["fence"]
        elif fence is not None and match is not None and match["fence"][0] == fence[0] and len(match["fence"]) >= len(fence):
            if not match["info"].strip():
                fence = None
        elif fence is None:
            kept.append(line)
    return "\n".join(kept)


def results_citation_problems(text: str, folder: Path, rendered: set[str]) -> list[str]:
    """
    How a page in ``folder`` cites results pages wrongly: as plain text (a path or a page's file name in the prose, which
    a site reader cannot open), or by a link to a file the built site has no page for (a repository path, or a page the
    site does not render). ``rendered``: the results pages of the site, relative to ``docs/results``.
    """
    text = prose(text)
    problems = []
    for target in MARKDOWN_LINK.findall(text):
        path = target.split("#")[0]
        if not path or "://" in path or path.startswith("mailto:"):
            continue
        resolved = Path(os.path.normpath(folder / path))
        if RESULTS_PATH.search(path) or resolved.is_relative_to(ROOT / "benchmarks" / "results"):
            problems.append(f"links to the repository's {path}, which the site cannot open: link ../results/<page>.md")
        elif resolved.is_relative_to(DOCS / "results") and resolved.relative_to(DOCS / "results").as_posix() not in rendered:
            problems.append(f"links to {path}, a results page the site does not render")
    without_links = MARKDOWN_LINK.sub("", text)
    problems += [f"cites {path} as plain text: link ../results/<page>.md" for path in RESULTS_PATH.findall(without_links)]
    names = {Path(page).name for page in rendered}
    problems += [
        f"cites {name} as plain text: link ../results/<page>.md"
        for name in re.findall(r"`([\w.-]+\.md)`", without_links)
        if name in names
    ]
    return problems


def test_results_citation_check_finds_plain_text_and_links_the_site_cannot_open() -> None:
    rendered = {"learning.md", "side_studies/kl_stop.md"}
    folder = DOCS / "guide"
    good = "See the [learning grid](../results/learning.md#goals) and [a study](../results/side_studies/kl_stop.md)."
    assert results_citation_problems(good, folder, rendered) == []
    assert results_citation_problems("```text\nbenchmarks/results/learning.md\n```", folder, rendered) == []
    bad = [
        "The full report is `benchmarks/results/learning.md`.",
        "(*Goals* in `learning.md`)",
        "[the grid](../../benchmarks/results/learning.md)",
        "{download}`the measurement <../../benchmarks/results/learning.md>`",
        "[a page the site lacks](../results/overhead_recheck/overhead.md)",
    ]
    for text in bad:
        assert len(results_citation_problems(text, folder, rendered)) == 1, text


@pytest.mark.parametrize(
    "page",
    [*doc_pages()[1:], *sorted((DOCS / "_generated").glob("*.md"))],
    ids=lambda page: page.relative_to(ROOT).as_posix(),
)
def test_docs_cite_results_pages_by_links_the_site_opens(page: Path) -> None:
    # README.md is no page of the site; a generated table is included by a page one folder below docs/, as it is
    problems = results_citation_problems(page.read_text(encoding="utf-8"), page.parent, site_results_pages())
    assert not problems, f"{page.relative_to(ROOT).as_posix()}: " + "; ".join(problems)


def sphinx_missing() -> list[str]:
    return [module for module in ("sphinx", "myst_parser", "sphinx_rtd_theme") if importlib.util.find_spec(module) is None]


@pytest.mark.slow  # a full Sphinx build with autodoc
def test_sphinx_builds_without_warnings(tmp_path: Path) -> None:
    missing = sphinx_missing()
    if missing:
        message = f"the docs extra is missing ({', '.join(missing)}): pip install -e \".[docs]\""
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path / "html")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"the Sphinx build warned or failed:\n{result.stderr[-6000:]}"
    assert (tmp_path / "html" / "modules" / "klppo.html").is_file()
    # the results pages the docs link to are pages of the site, with their figures
    for page in site_results_pages():
        assert (tmp_path / "html" / "results" / page).with_suffix(".html").is_file(), page
    assert (tmp_path / "html" / "_images" / "learning_curves.png").is_file()


# The "Can I use?" table of each algorithm page, checked by training a few steps on each space it names
ALGORITHM_PAGES = {
    "klppo.md": "KLPPO",
    "clip_klppo.md": "ClipKLPPO",
    "kltrpo.md": "KLTRPO",
    "ppo_recurrent.md": "RecurrentKLPPO",
    "ppo_mask.md": "MaskableKLPPO",
    "trpl.md": "TRPL",
}
SPACE_ROW = re.compile(r"^\|\s*(Discrete|Box|MultiDiscrete|MultiBinary|Dict)\s*\|\s*(\S+)\s*\|\s*(\S+)\s*\|\s*$")


def space_table(page: Path) -> dict[tuple[str, str], bool]:
    """``{(space, "action" or "observation"): supported}`` from the page's table of spaces (✔️ or ❌)."""
    table = {}
    for line in page.read_text(encoding="utf-8").splitlines():
        match = SPACE_ROW.match(line)
        if match:
            for column, mark in (("action", match[2]), ("observation", match[3])):
                assert mark in ("✔️", "❌"), f"{page.name}: {match[1]} {column} is marked {mark!r}"
                table[(match[1], column)] = mark == "✔️"
    return table


def make_space(name: str):
    from gymnasium import spaces

    return {
        "Discrete": spaces.Discrete(3),
        "Box": spaces.Box(-1.0, 1.0, (2,)),
        "MultiDiscrete": spaces.MultiDiscrete([3, 2]),
        "MultiBinary": spaces.MultiBinary(3),
        "Dict": spaces.Dict({"position": spaces.Box(-1.0, 1.0, (2,)), "mode": spaces.Discrete(3)}),
    }[name]


def space_cases() -> list[tuple[str, str, str, str, bool]]:
    cases = []
    for page_name, algo in ALGORITHM_PAGES.items():
        page = DOCS / "modules" / page_name
        if page.is_file():
            cases += [(page_name, algo, space, column, ok) for (space, column), ok in space_table(page).items()]
    return cases


@pytest.mark.parametrize(
    ("page_name", "algo", "space", "column", "supported"), space_cases(), ids=lambda value: str(value).replace(".md", "")
)
def test_can_i_use_tables_are_true(page_name: str, algo: str, space: str, column: str, supported: bool) -> None:
    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces

    import sb3_kl

    action_space = make_space(space) if column == "action" else spaces.Discrete(2)
    observation_space = make_space(space) if column == "observation" else spaces.Box(-1.0, 1.0, (3,))

    class RandomEnv(gym.Env):
        """Random observations, no reward, 8 steps per episode; every action valid (``action_masks``)."""

        def __init__(self) -> None:
            self.observation_space, self.action_space, self.steps = observation_space, action_space, 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.steps = 0
            return self.observation_space.sample(), {}

        def step(self, action):
            self.steps += 1
            return self.observation_space.sample(), 0.0, False, self.steps >= 8, {}

        def action_masks(self) -> np.ndarray:
            sizes = {spaces.Discrete: lambda s: s.n, spaces.MultiDiscrete: lambda s: int(s.nvec.sum())}
            size = sizes.get(type(self.action_space), lambda s: 2 * int(np.prod(s.shape)))(self.action_space)
            return np.ones(size, dtype=bool)

    if not hasattr(sb3_kl, algo):
        pytest.skip(f"{algo} is not in this version of sb3_kl")
    cls = getattr(sb3_kl, algo)
    policy = ("MultiInput" if isinstance(observation_space, spaces.Dict) else "Mlp") + (
        "LstmPolicy" if algo == "RecurrentKLPPO" else "Policy"
    )
    try:
        # the keywords suit every algorithm (KLTRPO has no n_epochs): the ✔️ cells show that they are accepted
        epochs = {} if algo == "KLTRPO" else {"n_epochs": 1}
        cls(policy, RandomEnv(), n_steps=16, batch_size=16, seed=0, **epochs).learn(32)
    except Exception as error:
        assert not supported, f"{page_name} says ✔️ for {space} {column}s, but {algo} failed: {error!r}"
    else:
        assert supported, f"{page_name} says ❌ for {space} {column}s, but {algo} trained on them"
