"""A real browser on a real JupyterLab: the notebooks as a person uses them, in headless Chromium.

* ``01_layout_repair`` and ``05_roofline`` with ``INTERACTIVE=True`` (a copy with papermill's parameters injected,
  nothing executed): Chromium runs all cells from the Run menu; the saved figures and the explorers' widgets must
  render, and moving a widget (01's expert slider, 05's hardware menu) must redraw the explorer's figure.
* The repository's own text notebook ``notebooks/05_roofline.py``, served from ``notebooks/`` with the
  repository's Jupyter settings (``notebooks/jupyter_config``: ``.py`` files open as notebooks through jupytext):
  run all, save, and the committed file must be unchanged (a text notebook holds no outputs) and ``git status`` the
  same as before; the run's files go to the git-ignored ``scratch/``.

JupyterLab runs on 127.0.0.1 with a token (Debian's ``chromium``, driven by playwright: ``make browser-deps``).
Screenshots are kept as test artifacts (``$DSV4LAB_TEST_ARTIFACTS`` or ``<pytest tmp>/artifacts``). Each server is
stopped by its PID. About 2 minutes on a 2-core machine.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")

pytestmark = pytest.mark.browser


def _chromium() -> str | None:
    for c in CHROMIUM_CANDIDATES:
        if Path(c).exists():
            return c
    return shutil.which("chromium")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, token: str, method: str = "GET"):
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


@contextlib.contextmanager
def _jupyterlab(root: Path, tmp_path: Path, config_path: Path | None = None):
    """JupyterLab serving ``root``; yields (base url, token, log path); stopped by its PID. The user's own Jupyter
    configuration is kept out (``JUPYTER_CONFIG_DIR`` in ``tmp_path``); ``config_path`` adds a settings folder."""
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    if config_path is not None:
        env["JUPYTER_CONFIG_PATH"] = str(config_path)
    log_path = tmp_path / f"jupyterlab-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
                             "--ServerApp.port_retries=0", "--allow-root", "--LabApp.news_url=",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                _api(f"{base}/api/status", token)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("JupyterLab did not answer /api/status within 90 s")
                time.sleep(0.5)
        yield base, token, log_path
    finally:
        try:  # shut the kernels down through the API, then the server by its PID
            for k in _api(f"{base}/api/kernels", token) or []:
                _api(f"{base}/api/kernels/{k['id']}", token, method="DELETE")
        except OSError:
            pass
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def _require_browser() -> None:
    if _chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium, or `make browser-deps`)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")


@pytest.fixture(scope="module")
def interactive_lab(tmp_path_factory):
    """JupyterLab serving parameterised copies of 01 and 05 with ``INTERACTIVE=True``; yields (base url, token).
    One server for the tests of this module (starting one took 8 s in a two-worker run on the 2-core host); they
    take it through :func:`lab`, which cleans up after each."""
    _require_browser()
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from dsv4lab.faces.commands.reproduce import read_notebook

    tmp_path = tmp_path_factory.mktemp("interactive_lab")
    served = tmp_path / "lab"
    served.mkdir()
    for name in ("01_layout_repair", "05_roofline"):
        target = served / f"{name}.ipynb"  # built as dsv4lab reproduce builds it, then parameterised
        nbformat.write(read_notebook(ROOT / "notebooks" / f"{name}.py"), str(target))
        nb = parameterize_notebook(load_notebook_node(str(target)),
                                   dict(INTERACTIVE=True, SMOKE=True, RUN_DIR=str(tmp_path / "run" / name)))
        nbformat.write(nb, str(target))
    with _jupyterlab(served, tmp_path) as (base, token, _):
        yield base, token


@pytest.fixture
def lab(interactive_lab):
    """The shared :func:`interactive_lab`; after each test its sessions (and their kernels) are shut down and the
    workspaces JupyterLab saved are deleted, so the next test finds the server as the first did: no kernel, and no
    notebook reopened from the last test's layout beside its own."""
    base, token = interactive_lab
    yield base, token
    try:
        for s in _api(f"{base}/api/sessions", token) or []:
            _api(f"{base}/api/sessions/{s['id']}", token, method="DELETE")
        for ws in ((_api(f"{base}/lab/api/workspaces", token) or {}).get("workspaces") or {}).get("ids", []):
            _api(f"{base}/lab/api/workspaces/{ws}", token, method="DELETE")
    except OSError:  # the server is gone: interactive_lab's own teardown has nothing more to stop
        pass


def _artifacts(tmp_path_factory) -> Path:
    path = Path(os.environ.get("DSV4LAB_TEST_ARTIFACTS") or tmp_path_factory.getbasetemp() / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _in_browser(tmp_path_factory, shot_name: str, drive) -> None:
    """Run ``drive(page, shot)`` in headless Chromium; keep a screenshot (and one of the failure, if any)."""
    from playwright.sync_api import sync_playwright

    shot = _artifacts(tmp_path_factory) / shot_name
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                drive(page, shot)
            except Exception:  # keep what the browser showed when it went wrong
                page.screenshot(path=str(shot.with_name(shot.stem + "_failure.png")), full_page=True)
                raise
        finally:
            browser.close()
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_layout_repair_notebook_runs_in_jupyterlab_and_its_explorer_responds(lab, tmp_path_factory):
    base, token = lab
    _in_browser(tmp_path_factory, "01_layout_repair_jupyterlab.png", lambda page, shot: _drive(page, base, token, shot))


def test_roofline_explorer_responds_to_the_hardware_menu(lab, tmp_path_factory):
    base, token = lab
    _in_browser(tmp_path_factory, "05_roofline_jupyterlab.png",
                lambda page, shot: _drive_roofline(page, base, token, shot))


def test_run_all_and_save_in_jupyterlab_leaves_the_repository_clean(tmp_path, tmp_path_factory):
    """The committed text notebook, opened where it lives with the repository's Jupyter settings (a ``.py`` opens as
    a notebook): run all, save."""
    _require_browser()
    if shutil.which("git") is None or _git("rev-parse", "--show-toplevel") is None:
        pytest.skip("not a git checkout")
    notebook = ROOT / "notebooks" / "05_roofline.py"
    committed = notebook.read_bytes()
    status_before = _git("status", "--porcelain", "--untracked-files=all")
    mtime_before = notebook.stat().st_mtime_ns
    with _jupyterlab(ROOT / "notebooks", tmp_path, ROOT / "notebooks" / "jupyter_config") as (base, token, log):
        def drive(page, shot):
            _open_and_run_all(page, base, token, "05_roofline.py")
            page.locator(".jp-Cell", has_text="plot_roofline").first.locator(".jp-RenderedImage img").first.wait_for(
                timeout=120_000)
            # the kernel reports idle between two cells of a run-all too: wait for the figures themselves
            try:
                page.wait_for_function("document.querySelectorAll('.jp-RenderedImage img').length >= 4",
                                       timeout=120_000)
            except Exception:  # noqa: BLE001 — report what was drawn, not the wait's own error
                raise AssertionError(f"the run-all drew {page.locator('.jp-RenderedImage img').count()} figures "
                                     "of at least 4 in 120 s") from None
            _wait_until_idle(base, token, "05_roofline.py")
            page.locator(".jp-NotebookPanel").first.click()
            page.keyboard.press("Control+s")
            deadline = time.time() + 30
            while notebook.stat().st_mtime_ns == mtime_before and time.time() < deadline:
                time.sleep(0.5)
            page.screenshot(path=str(shot), full_page=False)
        try:
            _in_browser(tmp_path_factory, "05_roofline_saved.png", drive)
            assert "jupyterlab_jupytext" in log.read_text(), "jupytext's server extension was not loaded"
            assert notebook.stat().st_mtime_ns != mtime_before, "JupyterLab did not save the notebook"
            assert notebook.read_bytes() == committed, "the saved text notebook differs from the committed one"
            assert _git("status", "--porcelain", "--untracked-files=all") == status_before
        finally:
            if notebook.read_bytes() != committed:  # never leave the checkout changed
                notebook.write_bytes(committed)


def _git(*args: str) -> str | None:
    res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def _open_and_run_all(page, base: str, token: str, name: str) -> None:
    page.goto(f"{base}/lab/tree/{name}?token={token}", timeout=90_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    _wait_for_kernel(page, base, token, name)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def _wait_until_idle(base: str, token: str, name: str, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    time.sleep(1.0)
    while time.time() < deadline:
        sessions = _api(f"{base}/api/sessions", token) or []
        if any(s.get("path", "").endswith(name) and (s.get("kernel") or {}).get("execution_state") == "idle"
               for s in sessions):
            return
        time.sleep(0.5)
    raise AssertionError(f"{name}: the kernel was still busy after {timeout_s:.0f} s")


def _wait_for_kernel(page, base: str, token: str, name: str = "01_layout_repair.ipynb", timeout_s: float = 90) -> None:
    """Until the notebook's kernel is started and idle (asked from the server, not guessed from the page).
    JupyterLab sometimes asks which kernel to start when it opened the notebook before it knew the kernel
    specs; the dialog is answered with its default (the notebook's own kernel)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        dialog = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        if dialog.count() and dialog.first.is_visible():
            dialog.first.click()
        sessions = _api(f"{base}/api/sessions", token) or []
        if any(s.get("path", "").endswith(name) and (s.get("kernel") or {}).get(
                "execution_state") == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise AssertionError(f"the notebook's kernel was not idle within {timeout_s:.0f} s")


def _drive(page, base: str, token: str, shot: Path) -> None:
    """Open the notebook, run all cells, check the outputs and the explorer, take the screenshot."""
    _open_and_run_all(page, base, token, "01_layout_repair.ipynb")
    # the explorer is the last output: its sliders appear when every cell before it has run
    sliders = page.locator(".jp-OutputArea .widget-slider")
    sliders.first.wait_for(timeout=120_000)
    assert sliders.count() == 3, "layer, expert and tile sliders"
    tracebacks = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
    assert tracebacks.count() == 0, f"a cell raised: {tracebacks.first.inner_text()[:500]}"
    # the saved heatmap rendered as an image in the headless path's cell
    heatmap_cell = page.locator(".jp-Cell", has_text="plot_channel_similarity").first
    assert heatmap_cell.locator(".jp-RenderedImage img").count() >= 1
    # the explorer's own figures (heatmap + per-stage errors) inside the widget output
    widget_images = page.locator(".widget-output img")
    widget_images.first.wait_for(timeout=60_000)
    before = widget_images.first.get_attribute("src")
    assert before and before.startswith("data:image/png")
    # move the expert slider one step with the keyboard; the heatmap must be redrawn
    handle = page.locator(".widget-slider", has_text="expert").locator(".noUi-handle").first
    handle.focus()
    handle.press("ArrowRight")
    page.wait_for_function(
        "(before) => { const img = document.querySelector('.widget-output img'); "
        "return img !== null && img.getAttribute('src') !== before; }", arg=before, timeout=60_000)
    readout = page.locator(".widget-slider", has_text="expert").locator(".widget-readout").first
    assert readout.inner_text().strip() == "1"
    after = page.locator(".widget-output img").first.get_attribute("src")
    assert after != before
    page.locator(".widget-output").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=False)


def _drive_roofline(page, base: str, token: str, shot: Path) -> None:
    """05: run all; the roofline explorer's menus, account table and figures render; choosing another hardware
    entry redraws its roofline and changes its account."""
    _open_and_run_all(page, base, token, "05_roofline.ipynb")
    menus = page.locator(".jp-OutputArea .widget-dropdown select")
    menus.first.wait_for(timeout=120_000)
    assert menus.count() == 3, "hardware, TP and EP menus"
    assert page.locator(".jp-OutputArea .widget-slider").count() == 2, "batch and context sliders"
    tracebacks = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
    assert tracebacks.count() == 0, f"a cell raised: {tracebacks.first.inner_text()[:500]}"
    assert page.locator(".jp-Cell", has_text="plot_roofline(panels").first.locator(".jp-RenderedImage img").count() >= 1
    images = page.locator(".widget-output img")
    images.first.wait_for(timeout=60_000)
    before = images.first.get_attribute("src")
    summary = page.locator(".widget-output", has_text="predicted").first
    text_before = summary.inner_text()
    assert "h200-sxm" in text_before and "tok/s" in text_before
    assert page.locator(".widget-output table.dsv4lab-table").count() >= 1, "the account table"
    menus.first.select_option("mi250-gcd")
    page.wait_for_function(
        "(before) => { const img = document.querySelector('.widget-output img'); "
        "return img !== null && img.getAttribute('src') !== before; }", arg=before, timeout=60_000)
    page.wait_for_function("() => document.querySelector('.widget-output').innerText.includes('mi250-gcd')",
                           timeout=30_000)
    assert page.locator(".widget-output").first.inner_text() != text_before
    page.locator(".widget-output").first.scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=False)
