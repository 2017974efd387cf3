"""A wheel carries its CPU kernels: every source the kernel build reads ships in the wheel and the sdist, and the
wheel installed into a clean venv uses both kernels (`hetero run --json`).

Offline and quick: the wheel is built as `pip wheel . --no-deps` builds it, without build isolation (this venv's
setuptools); the clean venv gets the wheel alone (`--no-deps`), and sees the dependencies of this venv through a
.pth file that names its site-packages folders (as plain paths: the .pth files in them, this checkout's editable
install among them, are not run, so `import hetero` finds the wheel's copy). The kernels' cache is the shared one
(`HETERO_KERNEL_CACHE`, set by conftest.py): a library is kept there under a key of the bytes of every file SOURCES
names (`hetero.host.kernels._key`), built in a folder holding those files alone, so the wheel's key equal to this
tree's proves its files are the very ones a build succeeded from; where the cache lacks it, the venv builds it from
the wheel's files (about 30 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from hetero.host import kernels

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "hetero" / "host" / "kernels"
PACKAGE_DIR = "hetero/host/kernels"


def run(command: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """What a checkout builds from (pyproject.toml, README.md, hetero/), copied: a build writes build/ and
    *.egg-info beside it."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hetero", src / "hetero", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def wheel(source_tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", str(source_tree), "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out)])
    (built,) = out.glob("hetero-*.whl")
    return built


@pytest.fixture(scope="module")
def sdist(source_tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    name = run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
               cwd=source_tree).stdout.split()[-1]
    return out / name


def test_every_kernel_source_ships_in_the_wheel_and_the_sdist(wheel, sdist):
    """The files SOURCES names are all the build reads (the .cpp files CMakeLists compiles and the headers they
    include, and every non-Python file of the folder), and each one ships in the wheel and in the sdist."""
    names = set(kernels.SOURCES)
    assert {p.name for p in KERNELS.iterdir() if p.is_file() and p.suffix != ".py"} == names
    cmake = (KERNELS / "CMakeLists.txt").read_text()
    compiled = re.search(r"nanobind_add_module\(_kernels ([^)]*)\)", cmake).group(1).split()
    included = {m for p in KERNELS.glob("*.cpp") for m in re.findall(r'#include "([^"/]+)"', p.read_text())}  # local
    assert {f for f in compiled if "." in f} | included <= names and "kernels.h" in included
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {f"{PACKAGE_DIR}/{name}" for name in names} <= shipped, sorted(names - {Path(n).name for n in shipped})
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[-1] for m in tar.getmembers()}  # below the top folder, hetero-<version>/
    assert {f"{PACKAGE_DIR}/{name}" for name in names} <= members


def test_a_clean_venv_with_the_wheel_uses_both_kernels(wheel, tmp_path):
    """`pip wheel .`, installed alone into a new venv: `hetero run --json` there imports the wheel's hetero and
    reports both CPU kernels in use, from the same sources' key as this tree's."""
    why = kernels.unsupported()
    if why is not None:  # (macOS, aarch64, no AVX2: MLX's own ops run and no wheel carries a kernel to use)
        pytest.skip(f"the CPU kernels do not apply here: {why}")
    assert kernels.status() == {"few_row_kernel": "in use", "delta_kernel": "in use"}  # this tree's, as a reference
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HETERO_HOME=str(tmp_path / "home"), HETERO_KERNEL_CACHE=str(kernels.cache_dir()))
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
        env=env, cwd=tmp_path)
    out = run([str(venv / "bin" / "hetero"), "run", "--json", "--no-mtp", "--max-tokens", "4", "--prompt", "def f():"],
              env=env, cwd=tmp_path)
    report = json.loads(out.stdout)
    assert (report["few_row_kernel"], report["delta_kernel"]) == ("in use", "in use"), out.stderr
    assert report["generated_tokens"] == 4 and "could not be built" not in out.stderr
    where = run([str(python), "-c", "import hetero; from hetero.host.kernels import _key; print(hetero.__file__, "
                 "_key())"], env=env, cwd=tmp_path).stdout.split()  # (not this checkout's folder: `-c` imports from it)
    assert Path(where[0]).is_relative_to(site) and where[1] == kernels._key()
