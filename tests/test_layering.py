"""The floor plan of dsv4lab, enforced on the source (README, "What is here").

Every module of ``dsv4lab/``, ``kernels/dsv4lab_kernels/`` (imported as ``dsv4lab_kernels``) and the notebook sources
stands on one floor — the folder it lives in — and imports only from its own floor or below::

    faces    dsv4lab/faces/   cli, commands/, and what only the notebooks use (runs, plots, measurements);
                              the notebooks; the root package's front door (dsv4lab.load)
    tools    dsv4lab/tools/   verify/, perf/, bench/, train/, serve/, drill, options
    engine   dsv4lab/engine/  loader, runner, dispatch, decode graphs, backends, parallel, collectives
    core     dsv4lab/core/    errors, paths, provenance, config, quant, checkpoint, random_checkpoint, tokenizer,
                              model/, layouts/; and kernels/dsv4lab_kernels/

No source file is longer than :data:`MAX_LINES` lines.

The imports are read with ``ast`` (nothing is imported to check them). The test fails on

* an **upward** import (a module importing from a floor above its own), inside a function or not;
* an import **cycle** between modules;
* an import **inside a function** that is not one of the named exceptions: a heavy optional library
  (:data:`OPTIONAL_LIBRARIES`, or a package module that imports one at its top), torch and the other libraries of
  :data:`HEAVY_FOR_LIGHT` inside the :data:`LIGHT` modules only (they are imported to build the command line or
  must run without torch, which :func:`test_light_modules_import_without_torch` checks), or a probe for an optional
  feature (an import inside ``try: ... except ImportError``).

``test_the_detector_flags_planted_mistakes`` plants an upward import, a cycle and an unjustified deferred import in
a copy of the package and checks each is reported.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FLOORS = ("core", "engine", "tools", "faces")
# A module's floor is its folder: dsv4lab/<floor>/... The kernels package and the notebooks have theirs named here;
# the root package (``dsv4lab/__init__.py``, ``__main__``) is the faces' front door.
FLOOR_OF_TOP = {"dsv4lab_kernels": "core", "notebooks": "faces", "dsv4lab": "faces"}
MAX_LINES = 800
"""No source file is longer than this: past it a file has stopped being one thing."""
# Constants every floor may read from the root package (it imports nothing at its top, see below).
ROOT_CONSTANTS = {"__version__"}

# Heavy optional libraries: importing them inside the function that needs them is always allowed.
OPTIONAL_LIBRARIES = {
    "triton",                                     # the kernels; also needs TRITON_INTERPRET set first on a CPU
    "fastapi", "uvicorn", "sse_starlette", "httpx", "starlette",  # serving
    "matplotlib", "ipywidgets", "IPython",        # figures and widgets
    "papermill", "nbformat", "nbclient",          # running notebooks
    "jupytext",                                   # reading the text notebooks
    "transformers",                               # the independent oracle
    "yaml",                                       # read only with a YAML file: `roofline` and `--help` stay fast
    "tqdm",                                       # progress bars, only when asked for
}
# Libraries the light modules must not import at their top (and may import inside functions).
HEAVY_FOR_LIGHT = {"torch", "numpy", "safetensors", "tokenizers"}
# Modules imported to build the command line, or that must run without torch (`dsv4lab roofline`, `import
# dsv4lab`, the notebooks' result files): they defer torch and the package modules that import it.
LIGHT = (
    "dsv4lab", "dsv4lab.__main__", "dsv4lab.faces.cli", "dsv4lab.faces.commands", "dsv4lab.faces.commands.*", "dsv4lab.core.errors",
    "dsv4lab.core.paths", "dsv4lab.core.provenance", "dsv4lab.core.config", "dsv4lab.tools.options", "dsv4lab.engine", "dsv4lab.tools.perf",
    "dsv4lab.tools.perf.*", "dsv4lab.faces.plots", "dsv4lab.faces.plots.*", "dsv4lab.faces.runs", "dsv4lab_kernels",
)
STDLIB = set(sys.stdlib_module_names)
# Functions that import a kernel module by name (dsv4lab.engine.kernel_loader): called at a module's top, they
# import triton there, which the import statements alone do not show.
KERNEL_IMPORTERS = {"kernel_module", "_kernels"}


@dataclass
class Edge:
    source: str
    target: str            # a module of the package, or a library's top-level name
    line: int
    deferred: bool         # inside a function
    probe: bool            # inside try/except ImportError (an optional feature)
    names: tuple = ()      # the names imported from ``target`` (from-imports)


@dataclass
class Graph:
    modules: dict[str, Path]
    edges: list[Edge] = field(default_factory=list)

    def internal(self) -> list[Edge]:
        return [e for e in self.edges if e.target in self.modules]


def module_names(root: Path) -> dict[str, Path]:
    """Module name → file for the package, the kernels and the notebook sources under ``root``."""
    out: dict[str, Path] = {}
    for top, name in (("dsv4lab", "dsv4lab"), ("kernels/dsv4lab_kernels", "dsv4lab_kernels"), ("notebooks", "notebooks")):
        for path in sorted((root / top).rglob("*.py")):
            if ".ipynb_checkpoints" in path.parts:  # JupyterLab's copies of the text notebooks
                continue
            parts = [name, *path.relative_to(root / top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = {n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)} if handler.type else {"*"}
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception", "*"})


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def read_graph(root: Path) -> Graph:
    graph = Graph(module_names(root))
    for mod, path in graph.modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for call in _top_level_calls(tree):
            if isinstance(call.func, ast.Name) and call.func.id in KERNEL_IMPORTERS:
                # kernel_module("x") imports dsv4lab_kernels.x (and triton) by name, at import time
                graph.edges.append(Edge(mod, "triton", call.lineno, False, False))

        def visit(node, deferred: bool, probe: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    continue  # annotations only: never imported at run time
                if isinstance(child, ast.Try):
                    catches = any(_catches_import_error(h) for h in child.handlers)
                    for sub in child.body:
                        visit_one(sub, deferred, probe or catches)
                    for sub in [*child.handlers, *child.orelse, *child.finalbody]:
                        visit(sub, deferred, probe)
                    continue
                visit_one(child, deferred, probe)

        def visit_one(child, deferred: bool, probe: bool):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    graph.edges.append(Edge(mod, _resolve(graph, alias.name), child.lineno, deferred, probe))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    if sub in graph.modules:  # `from pkg import module`
                        graph.edges.append(Edge(mod, sub, child.lineno, deferred, probe))
                    else:
                        graph.edges.append(Edge(mod, _resolve(graph, base), child.lineno, deferred, probe,
                                                (alias.name,)))
            else:
                if isinstance(child, ast.If) and _is_type_checking(child):
                    return
                visit(child, inner, probe)

        visit(tree, False, False)
    return graph


def _top_level_calls(tree: ast.Module):
    """Calls that run when the module is imported (outside functions and classes' methods)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _resolve(graph: Graph, name: str) -> str:
    """The package module ``name`` names (``dsv4lab_kernels.x``), else the library's top-level name."""
    if name in graph.modules:
        return name
    top = name.split(".")[0]
    return name if top in ("dsv4lab", "dsv4lab_kernels") else top


def floor_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "dsv4lab" and len(parts) > 1 and parts[1] != "__main__":
        if parts[1] not in FLOORS:
            raise AssertionError(f"{module}: dsv4lab/{parts[1]} is not a floor folder (dsv4lab/{{{','.join(FLOORS)}}}/)")
        return parts[1]
    return FLOOR_OF_TOP[parts[0]]


def is_light(module: str) -> bool:
    return any(fnmatchcase(module, p) for p in LIGHT)


def top_level_libraries(graph: Graph) -> dict[str, set[str]]:
    """Module → the libraries importing it loads: its own top-level imports, those of the package modules it
    imports at top level, and those of its parent packages (Python imports them first), transitively."""
    direct: dict[str, set[str]] = {m: set() for m in graph.modules}
    deps: dict[str, set[str]] = {m: set() for m in graph.modules}
    for e in graph.edges:
        if e.deferred or e.probe:
            continue
        (deps if e.target in graph.modules else direct)[e.source].add(e.target)
    for m in graph.modules:
        parts = m.split(".")
        deps[m] |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in graph.modules}
    memo: dict[str, set[str]] = {}

    def libs(m: str, stack: frozenset = frozenset()) -> set[str]:
        if m in memo:
            return memo[m]
        out = set(direct[m])
        for d in deps[m] - stack - {m}:
            out |= libs(d, stack | {m})
        memo[m] = out
        return out
    return {m: libs(m) for m in graph.modules}


def upward_imports(graph: Graph) -> list[str]:
    bad = []
    for e in graph.internal():
        if e.target == "dsv4lab" and set(e.names) <= ROOT_CONSTANTS:
            continue
        src, dst = floor_of(e.source), floor_of(e.target)
        if FLOORS.index(dst) > FLOORS.index(src):
            bad.append(f"{e.source} ({src}) imports {e.target} ({dst}) at line {e.line}")
    return bad


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), over every internal import (reading a root
    constant imports nothing, so it closes no cycle)."""
    succ: dict[str, set[str]] = {m: set() for m in graph.modules}
    for e in graph.internal():
        if e.target != e.source and not (e.target == "dsv4lab" and set(e.names) <= ROOT_CONSTANTS):
            succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(graph.modules):
        if m not in index:
            strong(m)
    return out


def unjustified_deferred_imports(graph: Graph) -> list[str]:
    libs = top_level_libraries(graph)
    bad = []
    for e in graph.edges:
        if not e.deferred or e.probe:
            continue
        pulled = (libs[e.target] if e.target in graph.modules else {e.target}) - libs[e.source]
        if pulled & OPTIONAL_LIBRARIES or (is_light(e.source) and pulled & HEAVY_FOR_LIGHT):
            continue
        why = "a standard-library module" if e.target in STDLIB else (
            "imports nothing heavy" if e.target in graph.modules else "not a named heavy optional library")
        bad.append(f"{e.source}:{e.line} imports {e.target} inside a function ({why}): move it to the top")
    return bad


# ============================================================================================ the tests
GRAPH = read_graph(REPO)


def test_every_module_has_a_floor():
    for m in GRAPH.modules:
        floor_of(m)


def test_the_package_root_holds_only_the_floor_folders():
    """``dsv4lab/`` shows the floors and nothing else: the front door (``__init__``, ``__main__``) and one folder
    per floor."""
    root = REPO / "dsv4lab"
    entries = {p.name for p in root.iterdir() if p.name not in ("__pycache__",) and not p.name.endswith(".egg-info")}
    assert entries == {"__init__.py", "__main__.py", *FLOORS}


def test_no_source_file_is_longer_than_the_limit():
    long = {}
    for top in ("dsv4lab", "kernels/dsv4lab_kernels", "notebooks", "tests", "scripts"):
        for path in (REPO / top).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long[str(path.relative_to(REPO))] = n
    assert long == {}, f"files over {MAX_LINES} lines: split them by what they do"


def test_no_module_imports_from_a_floor_above_its_own():
    assert upward_imports(GRAPH) == []


def test_there_is_no_import_cycle():
    assert cycles(GRAPH) == []


def test_imports_sit_at_module_top_except_the_named_heavy_ones():
    assert unjustified_deferred_imports(GRAPH) == []


def test_the_root_package_imports_only_the_core_at_its_top():
    # every `import dsv4lab.x` runs dsv4lab/__init__.py first: it must not drag a higher floor in with it
    top = [e.target for e in GRAPH.internal() if e.source == "dsv4lab" and not e.deferred]
    assert top and all(floor_of(t) == "core" for t in top), top


def test_light_modules_import_nothing_heavy_at_their_top():
    libs = top_level_libraries(GRAPH)
    heavy = {m: sorted(libs[m] & (HEAVY_FOR_LIGHT | OPTIONAL_LIBRARIES)) for m in GRAPH.modules if is_light(m)}
    assert {m: v for m, v in heavy.items() if v} == {}


def test_light_modules_import_without_torch():
    """What the static check says, confirmed by importing them and building every command's parser."""
    light = sorted(m for m in GRAPH.modules if is_light(m) and not m.endswith("__main__"))
    code = (f"import importlib, sys\nfor m in {light!r}: importlib.import_module(m)\n"
            "from dsv4lab.faces.cli import build_parser\nbuild_parser()\n"
            f"print(sorted(m for m in {sorted(HEAVY_FOR_LIGHT | OPTIONAL_LIBRARIES)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_detector_flags_planted_mistakes(tmp_path):
    for top in ("dsv4lab", "kernels/dsv4lab_kernels", "notebooks"):
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    clean = read_graph(tmp_path)
    assert upward_imports(clean) == [] and cycles(clean) == [] and unjustified_deferred_imports(clean) == []
    # core importing a tool; two engine modules importing each other; a deferred import of a light library
    (tmp_path / "dsv4lab" / "core" / "model" / "planted_upward.py").write_text("from dsv4lab.tools.bench import common\n")
    (tmp_path / "dsv4lab" / "engine" / "planted_a.py").write_text("from . import planted_b\n")
    (tmp_path / "dsv4lab" / "engine" / "planted_b.py").write_text("def f():\n    from . import planted_a\n")
    (tmp_path / "dsv4lab" / "tools" / "verify" / "planted_deferred.py").write_text(
        "def f():\n    import json\n    from dsv4lab.core.config import ModelArgs\n    import triton\n    return json\n")
    graph = read_graph(tmp_path)
    assert upward_imports(graph) == ["dsv4lab.core.model.planted_upward (core) imports dsv4lab.tools.bench.common (tools) "
                                     "at line 1"]
    assert cycles(graph) == [["dsv4lab.engine.planted_a", "dsv4lab.engine.planted_b"]]
    deferred = unjustified_deferred_imports(graph)
    assert [d.split(" inside")[0] for d in deferred] == [
        "dsv4lab.engine.planted_b:2 imports dsv4lab.engine.planted_a",
        "dsv4lab.tools.verify.planted_deferred:2 imports json",
        "dsv4lab.tools.verify.planted_deferred:3 imports dsv4lab.core.config"]  # triton (line 4) is a named exception
