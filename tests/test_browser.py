"""A real browser on a real JupyterLab: ``01_layout_repair`` with ``INTERACTIVE=True`` in headless Chromium.

JupyterLab is started on 127.0.0.1 with a token, serving a copy of the notebook with its parameters injected
(papermill's parameterisation, nothing executed); Chromium (Debian's ``chromium``, driven by playwright) opens it,
runs all cells from the Run menu, and the test checks that the saved heatmap and the explorer's widgets render,
and that moving the explorer's expert slider redraws its heatmap. A screenshot is kept as a test artifact
(``$DSV4LAB_TEST_ARTIFACTS`` or ``<pytest tmp>/artifacts``). The server is stopped by its PID.
"""
from __future__ import annotations

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


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a parameterised copy of 01_layout_repair; yields (base url, token); stopped by PID."""
    if _chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium, or `make browser-deps`)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    served = tmp_path / "lab"
    served.mkdir()
    nb = load_notebook_node(str(ROOT / "notebooks" / "01_layout_repair.ipynb"))
    nb = parameterize_notebook(nb, dict(INTERACTIVE=True, SMOKE=True, RUN_DIR=str(tmp_path / "run")))
    nbformat.write(nb, str(served / "01_layout_repair.ipynb"))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}",
                             "--ServerApp.port_retries=0", "--allow-root", "--LabApp.news_url=",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=served)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                tail = (tmp_path / "jupyterlab.log").read_text()[-2000:]
                pytest.fail(f"JupyterLab exited with {proc.returncode}: {tail}")
            try:
                _api(f"{base}/api/status", token)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("JupyterLab did not answer /api/status within 90 s")
                time.sleep(0.5)
        yield base, token
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


def _artifacts(tmp_path_factory) -> Path:
    path = Path(os.environ.get("DSV4LAB_TEST_ARTIFACTS") or tmp_path_factory.getbasetemp() / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_layout_repair_notebook_runs_in_jupyterlab_and_its_explorer_responds(lab, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    base, token = lab
    shot = _artifacts(tmp_path_factory) / "01_layout_repair_jupyterlab.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                _drive(page, base, token, shot)
            except Exception:  # keep what the browser showed when it went wrong
                page.screenshot(path=str(shot.with_name(shot.stem + "_failure.png")), full_page=True)
                raise
        finally:
            browser.close()
    assert shot.exists() and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def _wait_for_kernel(page, base: str, token: str, timeout_s: float = 90) -> None:
    """Until the notebook's kernel is started and idle (asked from the server, not guessed from the page).
    JupyterLab sometimes asks which kernel to start when it opened the notebook before it knew the kernel
    specs; the dialog is answered with its default (the notebook's own kernel)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        dialog = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        if dialog.count() and dialog.first.is_visible():
            dialog.first.click()
        sessions = _api(f"{base}/api/sessions", token) or []
        if any(s.get("path", "").endswith("01_layout_repair.ipynb") and (s.get("kernel") or {}).get(
                "execution_state") == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise AssertionError(f"the notebook's kernel was not idle within {timeout_s:.0f} s")


def _drive(page, base: str, token: str, shot: Path) -> None:
    """Open the notebook, run all cells, check the outputs and the explorer, take the screenshot."""
    page.goto(f"{base}/lab/tree/01_layout_repair.ipynb?token={token}", timeout=90_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    _wait_for_kernel(page, base, token)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
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
