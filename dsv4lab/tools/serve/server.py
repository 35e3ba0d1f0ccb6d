"""Putting a server together: load the model, start the engine thread, run uvicorn.

:func:`build_app` is what ``dsv4lab serve`` runs; :class:`BackgroundServer` runs the same app in a thread on
a free loopback port, for tests, notebooks and ``bench serve --checkpoint``.
"""
from __future__ import annotations

import inspect
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dsv4lab.engine.loader import load
from dsv4lab.tools.options import resolve_device, torch_dtype
from dsv4lab.tools.serve.encoding import chat_format_for
from dsv4lab.tools.serve.limits import Limits
from dsv4lab.tools.serve.scheduler import Scheduler

log = logging.getLogger("dsv4lab.tools.serve")


@dataclass
class ServerOptions:
    """``dsv4lab serve``'s knobs (see its ``--help``)."""
    checkpoint: str
    backend: str = "reference"
    device: str = "auto"
    dtype: str = "bf16"
    max_model_len: int | None = None
    max_concurrency: int = 8
    max_queue: int = 1024
    served_model_name: str | None = None
    api_key: str | None = None
    chat_format: str = "auto"
    batch_prefill: bool = True
    speculative: str | None = None
    draft_tokens: int = 1
    max_body_bytes: int = Limits.max_body_bytes


def load_model(opts: ServerOptions):
    """``dsv4lab.load`` with the serving options it accepts (cache slots, cache length, backend)."""
    accepted = inspect.signature(load).parameters
    wanted = {"device": resolve_device(opts.device), "dtype": torch_dtype(opts.dtype), "backend": opts.backend,
              "max_batch": opts.max_concurrency}
    if opts.max_model_len is not None:
        wanted["max_seq_len"] = opts.max_model_len
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in wanted.items() if takes_any or k in accepted}
    dropped = sorted(set(wanted) - set(kwargs))
    if dropped:
        log.warning("dsv4lab.load does not take %s; using its defaults", ", ".join(dropped))
    return load(opts.checkpoint, **kwargs)


def build_app(opts: ServerOptions, model=None):
    """Load (unless ``model`` is given), start the scheduler and return ``(app, scheduler)``."""
    from dsv4lab.tools.serve.app import ServeConfig, create_app

    model = model if model is not None else load_model(opts)
    cache_len = int(model.args.max_seq_len)
    max_model_len = min(opts.max_model_len or cache_len, cache_len)
    scheduler = Scheduler(model, max_running=opts.max_concurrency, max_waiting=opts.max_queue,
                          batch_prefill=opts.batch_prefill, speculative=opts.speculative,
                          draft_tokens=opts.draft_tokens)
    tokenizer = getattr(model, "tokenizer", None)
    config = ServeConfig(served_model_name=opts.served_model_name or Path(opts.checkpoint).name,
                         max_model_len=max_model_len, api_key=opts.api_key,
                         chat_format=chat_format_for(tokenizer, opts.chat_format) if tokenizer else None,
                         root=str(opts.checkpoint), limits=Limits(max_body_bytes=opts.max_body_bytes))
    app = create_app(scheduler, tokenizer, config)
    scheduler.start()
    return app, scheduler


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread; ``with BackgroundServer(app) as s: s.url``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, scheduler=None,
                 log_level: str = "warning"):
        import uvicorn
        self.host, self.port = host, port or free_port(host)
        self.scheduler = scheduler
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level,
                                                    lifespan="off", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="dsv4lab-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.scheduler is not None:
            self.scheduler.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
