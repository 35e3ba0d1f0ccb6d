"""What the server tests share: one server on ``data/tiny-py`` in a background thread with its model, scheduler and
an ``openai`` client; waiting until a scheduler is idle; and a second server on the same model with a small
scheduler whose slots a test fills to see the 429.

Import it after ``pytest.importorskip("fastapi")`` / ``("openai")``: it needs both.
"""
from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import openai

from dsv4lab.tools.serve.app import ServeConfig, create_app
from dsv4lab.tools.serve.scheduler import Scheduler
from dsv4lab.tools.serve.server import BackgroundServer, ServerOptions, build_app, load_model
from conftest import ROOT

TINY_PY = ROOT / "data" / "tiny-py"
MODEL = "tiny-py"


def wait_idle(scheduler, timeout: float = 60.0) -> dict:
    """``scheduler.stats()`` once nothing runs or waits (an assertion error naming the stats after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = scheduler.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not become idle: {stats}")
        time.sleep(0.02)


@contextlib.contextmanager
def tiny_server(client_timeout: float = 120, **options):
    """A running server on ``data/tiny-py`` with ``ServerOptions(**options)``, stopped on exit. Yields ``model``,
    ``scheduler``, ``opts``, ``url``, ``tokenizer``, ``client`` (``openai``, no retries) and ``reference(prompt_ids,
    n, **kw)``: ``model.generate`` once the server is idle (it shares the model), i.e. what ``dsv4lab generate``
    runs."""
    opts = ServerOptions(checkpoint=str(TINY_PY), **options)
    model = load_model(opts)
    app, scheduler = build_app(opts, model=model)
    server = BackgroundServer(app, scheduler=scheduler).start()

    def reference(prompt_ids, n, **kw):
        wait_idle(scheduler)
        return model.generate(prompt_ids, n, **kw)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=client_timeout)
    try:
        yield SimpleNamespace(model=model, scheduler=scheduler, opts=opts, url=server.url, client=client,
                              tokenizer=model.tokenizer, reference=reference)
    finally:
        server.stop()


async def stream_token_ids(client, prompt: list[int], max_tokens: int) -> list[int]:
    """The ids of a greedy streamed completion of ``prompt`` through the async ``openai`` ``client``."""
    ids: list[int] = []
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"return_token_ids": True})
    async for chunk in stream:
        for c in chunk.choices:
            ids += getattr(c, "token_ids", None) or []
    return ids


@contextlib.contextmanager
def small_scheduler_server(served, max_running: int, max_waiting: int):
    """A second server on ``served``'s model with its own scheduler of ``max_running`` slots and a queue of
    ``max_waiting`` (safe while ``served`` is idle, which it waits for first). Yields ``(scheduler, url)``."""
    wait_idle(served.scheduler)
    small = Scheduler(served.model, max_running=max_running, max_waiting=max_waiting)
    small.start()
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=2048)
    try:
        with BackgroundServer(create_app(small, served.tokenizer, cfg), scheduler=small) as s:
            yield small, s.url
    finally:
        small.stop()


def wait_for_load(scheduler, running: int, waiting: int, timeout: float = 60.0) -> None:
    """Until ``scheduler`` has exactly ``running`` sequences decoding and ``waiting`` queued."""
    deadline = time.monotonic() + timeout
    while (scheduler.stats()["running"], scheduler.stats()["waiting"]) != (running, waiting):
        assert time.monotonic() < deadline, scheduler.stats()
        time.sleep(0.01)
