"""
The import graph of ``sb3_kl`` (and of ``benchmarks``) has no cycle, counting imports inside functions as well, and
every module of ``sb3_kl`` imports alone in a fresh interpreter.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_names(folder: Path) -> dict[str, Path]:
    """
    The modules under ``folder`` by dotted name: ``sb3_kl.zoo.registry`` for a package (a folder with an
    ``__init__.py``), ``learning`` for a folder of scripts that import each other by their file names.
    """
    base = folder.parent if (folder / "__init__.py").exists() else folder
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every dotted name the module imports, at module level or inside a function or class, relative ones resolved."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - node.level + 1]
                source = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                source = node.module or ""
            # ``from a import b`` imports the module ``a.b`` when there is one, else the name ``b`` of ``a``
            names.extend(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(folder: Path) -> dict[str, set[str]]:
    """For each module under ``folder``, the modules of that folder it imports (the longest known prefix of each name)."""
    modules = module_names(folder)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for name in _imported_names(tree, module, path.name == "__init__.py"):
            parts = name.split(".")
            for end in range(len(parts), 0, -1):
                target = ".".join(parts[:end])
                if target in modules:
                    if target != module:
                        edges.add(target)
                    break
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def test_find_cycle_sees_a_loop_through_a_function_level_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("from . import c\n")
    (package / "c.py").write_text("def f():\n    from pkg.a import g\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(package)) is None


@pytest.mark.parametrize(
    "folder",
    ["sb3_kl", "benchmarks"],
)
def test_no_import_cycle(folder):
    graph = import_graph(ROOT / folder)
    assert len(graph) > 5
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: Third-party packages the child processes share (imported once, before any sb3_kl module): each child then imports
#: one sb3_kl module into an interpreter holding no sb3_kl module, as a fresh ``python -c "import ..."`` would
_PRELOAD = [
    "numpy",
    "torch",
    "gymnasium",
    "stable_baselines3",
    "sb3_contrib",
    "matplotlib",
    "yaml",
    "optuna",
    "rl_zoo3",
    "rl_zoo3.exp_manager",
    "rl_zoo3.hyperparams_opt",
]

_IMPORT_EACH = """
import importlib, json, os, sys, traceback

for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
assert not any(name.split(".")[0] == "sb3_kl" for name in sys.modules)
failures = {}
for name in json.loads(sys.argv[2]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = b""
        except BaseException:
            message = traceback.format_exc().encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    if message:
        failures[name] = message
print(json.dumps(failures))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the child processes are forked")
def test_every_module_imports_alone():
    # the modules that run as commands (``__main__``, ``train``, ...) guard their command, so importing runs none
    names = sorted(module_names(ROOT / "sb3_kl"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _IMPORT_EACH, json.dumps(_PRELOAD), json.dumps(names)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{name}:\n{error}" for name, error in failures.items())
