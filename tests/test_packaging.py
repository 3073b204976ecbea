"""
The package builds as an sdist and a wheel (``python -m build``, as docs/release.md says), and the wheel, installed on
its own into a target directory, imports with its data files: the zoo configs, version.txt, py.typed and the console
scripts' entry points.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("sb3_kl", "pyproject.toml", "README.md", "LICENSE")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs `build` (the test extra)")
def test_sdist_and_wheel_build_install_and_import_with_data_files(tmp_path):
    # build from a copy of the sources: the checkout stays clean (no build/ or egg-info)
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    # --no-isolation: setuptools from this environment, nothing downloaded; the wheel is built from the sdist
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    version = (ROOT / "sb3_kl" / "version.txt").read_text().strip()
    wheel, sdist = dist / f"sb3_kl-{version}-py3-none-any.whl", dist / f"sb3_kl-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file()
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
    for data in ("sb3_kl/version.txt", "sb3_kl/py.typed", "sb3_kl/hyperparams/klppo.yml"):
        assert f"sb3_kl-{version}/{data}" in names

    target = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check = textwrap.dedent("""
        import importlib.metadata, importlib.resources, sys
        import sb3_kl
        assert sb3_kl.__file__.startswith(sys.argv[1]), sb3_kl.__file__
        files = importlib.resources.files("sb3_kl")
        data = ("version.txt", "py.typed", "hyperparams/klppo.yml", "hyperparams/clip_klppo.yml", "hyperparams/kltrpo.yml")
        for name in data:
            assert files.joinpath(name).is_file(), name
        distribution = importlib.metadata.distribution("sb3-kl")
        scripts = {entry.name for entry in distribution.entry_points if entry.group == "console_scripts"}
        assert scripts == {"sb3-kl", "sb3-kl-zoo"}, scripts
        print(sb3_kl.__version__, distribution.version)
        """)
    # run outside the checkout, with the target directory first on the path
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", check, str(target)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [version, version]
