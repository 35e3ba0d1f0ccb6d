"""The notebooks' two files: a percent-format source (``notebooks/source/NAME.py``) and the committed ``.ipynb``,
always output-free and in step with each other, whether edited as text or in JupyterLab.

The source is the text a person reads and diffs::

    # %% [markdown]
    # # A title
    # Some text.

    # %% tags=["parameters"]
    RUN_DIR: str = ""  # help

    # %%
    code()

IPython magics are commented out (``# %matplotlib inline``), as jupytext writes them. :func:`build` turns a source
into notebook text (cells numbered ``cell-01`` ..., no outputs, fixed metadata) and :func:`render_source` turns a
notebook back into its source; the two round-trip exactly.

**JupyterLab.** This module is also a Jupyter server extension (enabled by
``notebooks/jupyter_config/jupyter_server_config.d/dsv4lab.json``, which ``make install`` copies into the
environment and ``make lab`` puts on ``JUPYTER_CONFIG_PATH``). When JupyterLab saves one of the repository's
notebooks that has a source, :func:`pre_save_hook` writes it in the committed form — outputs, execution counts and
editor metadata dropped — so running every cell and saving leaves ``git status`` clean; :func:`post_save_hook`
writes the edited cells back to the source. A source edited outside JupyterLab since the notebook was last built
is never overwritten: the save is refused with a message saying how to rebuild. Other notebooks are left alone.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dsv4lab.core.paths import NOTEBOOKS_DIR

SOURCE_DIR_NAME = "source"
HEADER = re.compile(r"^# %%(?P<rest>.*)$")
MAGIC = re.compile(r"^# %[a-z]")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
METADATA = {"kernelspec": KERNELSPEC, "language_info": {"name": "python", "pygments_lexer": "ipython3"}}


class NotebookFormatError(ValueError):
    """A source or notebook that the other form cannot hold (the message names the file and line or cell)."""


# ============================================================================================ source -> notebook
def parse_cells(text: str, where: str) -> list[dict]:
    """Split percent-format text into ``[{kind, source, tags}]``."""
    cells: list[dict] = []
    current: dict | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        m = HEADER.match(line)
        if m:
            rest = m.group("rest").strip()
            kind = "markdown" if rest.startswith("[markdown]") else "code"
            rest = rest.removeprefix("[markdown]").strip()
            tags: list[str] = []
            if rest:
                tm = re.fullmatch(r"tags=(\[.*\])", rest)
                if not tm:
                    raise NotebookFormatError(f"{where}:{lineno}: cannot read cell header options {rest!r} "
                                              "(expected tags=[\"...\"])")
                tags = json.loads(tm.group(1))
            current = dict(kind=kind, lines=[], tags=tags)
            cells.append(current)
            continue
        if current is None:
            if line.strip():
                raise NotebookFormatError(f"{where}:{lineno}: text before the first '# %%' cell header")
            continue
        if current["kind"] == "markdown":
            if line.strip() and not line.startswith("#"):
                raise NotebookFormatError(f"{where}:{lineno}: markdown lines must start with '#'")
            line = line[2:] if line.startswith("# ") else line[1:]
        elif MAGIC.match(line):  # jupytext's convention: IPython magics are commented out in the source
            line = line[2:]
        current["lines"].append(line)
    out = []
    for c in cells:
        lines = c["lines"]
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        out.append(dict(kind=c["kind"], source="\n".join(lines), tags=c["tags"]))
    return out


def build_from_text(text: str, where: str = "<source>") -> str:
    """The committed ``.ipynb`` text for percent-format ``text``."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    cells = []
    for i, c in enumerate(parse_cells(text, where), 1):
        meta = {"tags": c["tags"]} if c["tags"] else {}
        make = new_markdown_cell if c["kind"] == "markdown" else new_code_cell
        cell = make(c["source"], metadata=meta)
        cell["id"] = f"cell-{i:02d}"
        cells.append(cell)
    nb = new_notebook(cells=cells, metadata=json.loads(json.dumps(METADATA)))
    nb["nbformat"], nb["nbformat_minor"] = 4, 5
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def build(source: Path) -> str:
    """The committed ``.ipynb`` text for one source file."""
    return build_from_text(Path(source).read_text(), str(source))


# ============================================================================================ notebook -> source
def _source_text(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def render_source(nb: dict, where: str = "<notebook>") -> str:
    """The percent-format source of a notebook (a dict as nbformat reads it): the inverse of :func:`build`."""
    blocks = []
    for i, cell in enumerate(nb.get("cells", []), 1):
        kind = cell.get("cell_type")
        text = _source_text(cell).strip("\n")
        tags = list((cell.get("metadata") or {}).get("tags") or [])
        if kind == "markdown":
            lines = ["# %% [markdown]"] + [("# " + ln) if ln.strip() else "#" for ln in text.splitlines()]
        elif kind == "code":
            header = "# %%" + (f" tags={json.dumps(tags)}" if tags else "")
            lines = [header] + [("# " + ln) if ln.startswith("%") else ln for ln in text.splitlines()]
        else:
            raise NotebookFormatError(f"{where}: cell {i} is a {kind} cell; the source format holds only code and "
                                      "markdown cells")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def canonical(nb: dict, where: str = "<notebook>") -> dict:
    """``nb`` in the committed form, in place: exactly what :func:`build` makes of its :func:`render_source` — no
    outputs or execution counts, cell metadata reduced to tags, cells numbered ``cell-01`` ..., the fixed
    notebook metadata."""
    committed = json.loads(build_from_text(render_source(nb, where), where))
    nb.clear()
    nb.update(committed)
    return nb


# ============================================================================================ JupyterLab saves
def source_for(notebook: Path, notebooks_dir: Path = NOTEBOOKS_DIR) -> Path | None:
    """The source of a repository notebook (``notebooks/NAME.ipynb`` → ``notebooks/source/NAME.py``) when it has
    one; None for any other file."""
    notebook = Path(notebook).resolve()
    if notebook.suffix != ".ipynb" or notebook.parent != Path(notebooks_dir).resolve():
        return None
    source = notebook.parent / SOURCE_DIR_NAME / f"{notebook.stem}.py"
    return source if source.exists() else None


def in_step(notebook: Path, source: Path) -> bool:
    """Whether the notebook on disk and its source say the same (the source was not edited on its own)."""
    if not notebook.exists():
        return True
    try:
        return render_source(json.loads(notebook.read_text()), str(notebook)) == source.read_text()
    except (ValueError, NotebookFormatError):
        return False


def prepare_save(content: dict, os_path: Path, notebooks_dir: Path = NOTEBOOKS_DIR) -> Path | None:
    """Make ``content`` (a notebook about to be saved at ``os_path``) the committed form when it is a repository
    notebook with a source, and return that source; None (content untouched) otherwise. A source edited on its
    own since the notebook was built raises :class:`NotebookFormatError`."""
    source = source_for(os_path, notebooks_dir)
    if source is None:
        return None
    if not in_step(Path(os_path), source):
        raise NotebookFormatError(
            f"{source} was edited since {Path(os_path).name} was built: run `python scripts/build_notebooks.py`, "
            "then reload the notebook in JupyterLab (this save would overwrite those edits)")
    canonical(content, str(os_path))
    return source


def pre_save_hook(model: dict, path: str, contents_manager: Any, **kwargs: Any) -> None:
    """Jupyter's pre-save hook: repository notebooks are saved output-free (see :func:`prepare_save`)."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    try:
        prepare_save(model["content"], Path(contents_manager._get_os_path(path)))
    except NotebookFormatError as err:
        from tornado.web import HTTPError
        raise HTTPError(409, str(err)) from None


def post_save_hook(model: dict, os_path: str, contents_manager: Any, **kwargs: Any) -> None:
    """Jupyter's post-save hook: the saved repository notebook's cells go back to its source."""
    if model.get("type") != "notebook":
        return
    source = source_for(Path(os_path))
    if source is None:
        return
    text = render_source(json.loads(Path(os_path).read_text()), os_path)
    if source.read_text() != text:
        source.write_text(text)


# The Jupyter server extension (enabled by notebooks/jupyter_config/jupyter_server_config.d/dsv4lab.json).
def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "dsv4lab.faces.notebook_format"}]


def _load_jupyter_server_extension(serverapp) -> None:
    contents = serverapp.contents_manager
    contents.register_pre_save_hook(pre_save_hook)
    contents.register_post_save_hook(post_save_hook)
    serverapp.log.info("dsv4lab: notebooks under %s are saved output-free and in step with their sources",
                       NOTEBOOKS_DIR)


__all__ = ["NotebookFormatError", "KERNELSPEC", "METADATA", "parse_cells", "build", "build_from_text",
           "render_source", "canonical", "source_for", "in_step", "prepare_save", "pre_save_hook",
           "post_save_hook"]
