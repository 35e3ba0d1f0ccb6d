"""The package as a user installs it: a wheel built from the tree holds every module and the data commands read,
and works with no source tree on the path.

The wheel is built from a copy of the tracked files, installed into a fresh virtual environment (its
dependencies — torch and the rest — are borrowed from the running interpreter through a ``.pth`` file, so nothing
is downloaded), and run from a folder outside the repository. The development environment's editable install
(a meta-path finder that maps ``dsv4lab`` to the source tree) is not visible there: the test asserts that
``dsv4lab.__file__`` lies in the fresh environment.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dsv4lab.core import paths

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
# What the wheel is built from (everything else in the repository stays out of it).
SOURCES = ("pyproject.toml", "README.md", "dsv4lab", "kernels", "data")


def package_dir(name: str) -> Path:
    """The source folder of package ``name`` under the package-dir mapping of pyproject.toml."""
    mapping = SETUPTOOLS["package-dir"]
    prefix = max((p for p in mapping if name == p or name.startswith(p + ".")), key=len)
    rest = name[len(prefix) + 1:].split(".") if name != prefix else []
    return REPO / mapping[prefix] / Path(*rest)


def shipped_data_files() -> set[str]:
    """Wheel paths of every file the package-data globs select."""
    out = set()
    for pkg, globs in SETUPTOOLS["package-data"].items():
        for g in globs:
            for f in package_dir(pkg).glob(g):
                out.add("/".join([*pkg.split("."), f.name]))
    return out


def test_the_package_list_is_complete():
    listed = set(SETUPTOOLS["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "dsv4lab").rglob("__init__.py")}
    assert found - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert [p for p in listed if not package_dir(p).is_dir()] == []
    assert "dsv4lab_kernels" in listed and (package_dir("dsv4lab_kernels") / "__init__.py").exists()
    # every file paths.py names as run-time data is selected by a package-data glob
    needed = [paths.EXPECTATIONS_FILE, paths.DEFAULT_TOKENIZER, *paths.HARDWARE_DIR.glob("*.yaml"),
              *paths.PAPER_DIR.glob("*.yaml"), *paths.GOLDEN_DIR.glob("*.json"), *paths.RESULTS_DIR.glob("*.json"),
              *paths.RESULTS_DIR.glob("*/*.json")]  # measurements; not the logs of past runs under */logs/
    shipped = shipped_data_files()
    missing = [str(p.relative_to(REPO)) for p in needed
               if "dsv4lab/_data/" + str(p.relative_to(paths.DATA_DIR)) not in shipped]
    assert missing == []
    assert "dsv4lab/faces/style/dsv4lab.mplstyle" in shipped
    tuned = sorted((package_dir("dsv4lab_kernels") / "tuned").glob("*.json"))  # the dispatch's per-GPU choices
    assert tuned and {f"dsv4lab_kernels/tuned/{p.name}" for p in tuned} <= shipped


def test_transformers_imports_from_the_repository_root():
    """Run from the root (a notebook kernel, ``python -c``, pytest), ``kernels`` must not resolve to this repository:
    transformers >= 5.25 imports Hugging Face's ``kernels`` package, and a ``kernels/__init__.py`` here shadowed it."""
    assert not (REPO / "kernels" / "__init__.py").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, pathlib, sys\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None\n"
            "assert origin is None or (pathlib.Path.cwd().resolve() / 'kernels') not in origin.parents, origin\n"
            "from transformers import DeepseekV4ForCausalLM, DeepseekV4Config\n"
            "import dsv4lab_kernels\n"
            "print('ok', DeepseekV4ForCausalLM.__name__, dsv4lab_kernels.__name__)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok DeepseekV4ForCausalLM"), res.stdout + res.stderr


def _copy_sources(dest: Path) -> None:
    """The tracked files of SOURCES (a plain copy outside a git checkout), without caches or checkpoints."""
    listed = subprocess.run(["git", "ls-files", "-z", *SOURCES], cwd=REPO, capture_output=True)
    files = [f for f in listed.stdout.decode().split("\0") if f] if listed.returncode == 0 else []
    if not files:
        files = [str(p.relative_to(REPO)) for s in SOURCES for p in ([REPO / s] if (REPO / s).is_file()
                                                                       else (REPO / s).rglob("*")) if p.is_file()]
    for f in files:
        if "__pycache__" in f or f.startswith(("data/tiny", "data/tiny-py")):
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dest / f)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, dsv4lab script, a working folder) of a fresh venv with the wheel built from this tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv, work = tmp / "src", tmp / "dist", tmp / "venv", tmp / "elsewhere"
    _copy_sources(src)
    work.mkdir()
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)]
    if importlib.util.find_spec("setuptools") is not None:  # else pip fetches setuptools from PyPI to build
        build[5:5] = ["--no-build-isolation", "--no-index"]
    res = subprocess.run(build, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    wheel = next(dist.glob("dsv4lab-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # torch & co. from this interpreter: a .pth line adds its site folder but runs none of the .pth files there
    # (the editable install's finder among them)
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_borrowed_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    return python, venv / "bin" / "dsv4lab", work, wheel


def _run(cmd, work: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHONNOUSERSITE="1")
    return subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_every_module_and_data_file(installed):
    *_, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for top, pkg in (("dsv4lab", "dsv4lab"), ("kernels/dsv4lab_kernels", "dsv4lab_kernels")):
        for f in (REPO / top).rglob("*.py"):
            if "__pycache__" not in f.parts:
                assert "/".join([pkg, *f.relative_to(REPO / top).parts]) in names, f
    assert shipped_data_files() <= names


def test_the_installed_cli_runs_without_the_source_tree(installed):
    python, script, work, _ = installed
    res = _run([script, "--help"], work)
    assert res.returncode == 0 and "roofline" in res.stdout, res.stderr
    res = _run([script, "inventory", "flash"], work)
    assert res.returncode == 0 and "69,187" in res.stdout and "159,609,485,896" in res.stdout, res.stderr
    res = _run([script, "roofline", "account"], work)  # the hardware catalogue and the paper's numbers
    assert res.returncode == 0 and "74.5" in res.stdout and "H200" in res.stdout, res.stdout + res.stderr
    res = _run([script, "generate", "--checkpoint", "data/tiny", "--prompt-ids", "5,6", "--backend", "trition"],
               work)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "reference" in res.stderr, res.stderr


def test_every_installed_module_imports_from_the_wheel(installed):
    python, _, work, _ = installed
    code = f"""
import importlib, pkgutil, sys
import dsv4lab, dsv4lab_kernels
from dsv4lab.core import paths
repo = {str(REPO)!r}
assert not dsv4lab.__file__.startswith(repo), dsv4lab.__file__
assert not paths.IN_CHECKOUT and paths.HARDWARE_DIR.is_dir() and paths.DEFAULT_TOKENIZER.is_file(), paths.DATA_DIR
names = [m.name for pkg in (dsv4lab, dsv4lab_kernels) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
         if not m.name.endswith("__main__") and not m.name.startswith("dsv4lab._data")]
for name in names:
    module = importlib.import_module(name)
    assert not module.__file__.startswith(repo), module.__file__
from dsv4lab.engine.dispatch import load_tuned, tuned_path
assert not str(tuned_path("NVIDIA H200")).startswith(repo) and len(load_tuned("NVIDIA H200")) > 0  # shipped, read
print(len(names))
"""
    res = _run([python, "-c", code], work)
    assert res.returncode == 0, res.stdout + res.stderr
    assert int(res.stdout.strip()) > 90
