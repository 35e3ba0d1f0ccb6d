"""Putting a server together: load (or generate) the model, start the engine thread, run uvicorn.

:func:`build_app` is what ``dsv4lab serve`` runs; :class:`BackgroundServer` runs the same app in a thread on
a free loopback port, for tests, notebooks and ``bench serve --checkpoint``. Both serve HTTP through
:class:`TimedH11Protocol`, uvicorn's h11 protocol with a deadline for a request's line and headers (a client that
sends them byte by byte cannot hold a connection open; the body has its own deadline in
:func:`dsv4lab.tools.serve.limits.body`).

``ServerOptions(generate="flash", layers=30, seed=0)`` serves a model generated in memory
(:class:`~dsv4lab.core.random_checkpoint.RandomCheckpoint`, cut as ``bench e2e --layers`` cuts it: no checkpoint on
disk). It has no tokenizer: prompts are token ids (``/v1/completions`` with ``"prompt": [ids]``), and each
streamed chunk carries an empty text and, with ``return_token_ids``, the ids it delivers.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsv4lab.core.config import get_preset
from dsv4lab.core.errors import UserError
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.loader import load
from dsv4lab.tools.bench.e2e import cut_layers
from dsv4lab.tools.options import resolve_device, torch_dtype
from dsv4lab.tools.serve.encoding import chat_format_for
from dsv4lab.tools.serve.limits import Limits
from dsv4lab.tools.serve.scheduler import Scheduler

log = logging.getLogger("dsv4lab.tools.serve")


@dataclass
class ServerOptions:
    """``dsv4lab serve``'s knobs (see its ``--help``). ``checkpoint`` is a folder, or None with ``generate`` (a
    preset name: the model is generated in memory from ``seed``, cut to its first ``layers`` main layers; 0 = all)."""
    checkpoint: str | None
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
    header_timeout_s: float = Limits.header_timeout_s
    body_timeout_s: float = Limits.body_timeout_s
    generate: str | None = None
    layers: int = 0
    seed: int = 0
    warmup: bool | None = None  # compile every prefill bucket and decode tier before serving (None: on a GPU)

    @property
    def model_name(self) -> str:
        """The default ``model`` id: the checkpoint folder's name, or ``<preset>-<layers>L-seed<seed>``."""
        if self.generate:
            return f"{self.generate}-{self.layers}L-seed{self.seed}" if self.layers else \
                f"{self.generate}-seed{self.seed}"
        return Path(self.checkpoint).name


def load_model(opts: ServerOptions):
    """``dsv4lab.load`` with the serving options it accepts (cache slots, cache length, backend), of the checkpoint
    folder or of the generated model (``opts.generate``)."""
    if (opts.checkpoint is None) == (opts.generate is None):
        raise UserError("serve needs exactly one of --checkpoint (a folder) or --generate (a preset)")
    accepted = inspect.signature(load).parameters
    device = resolve_device(opts.device)
    wanted = {"device": device, "dtype": torch_dtype(opts.dtype), "backend": opts.backend,
              "max_batch": opts.max_concurrency}
    if opts.max_model_len is not None:
        wanted["max_seq_len"] = opts.max_model_len
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in wanted.items() if takes_any or k in accepted}
    dropped = sorted(set(wanted) - set(kwargs))
    if dropped:
        log.warning("dsv4lab.load does not take %s; using its defaults", ", ".join(dropped))
    if opts.generate is None:
        return load(opts.checkpoint, **kwargs)
    if opts.layers < 0:
        raise UserError(f"--layers {opts.layers}: expected 0 (all layers) or a positive count")
    # the same model `bench e2e --preset P --layers N --seed S` measures (generated on the device, never validated
    # value by value: its values come from a seeded generator)
    ck = RandomCheckpoint(cut_layers(get_preset(opts.generate), opts.layers), opts.seed, device, name=opts.generate)
    try:
        return load(ck, validate=False, **kwargs)
    finally:
        ck.close()


def build_app(opts: ServerOptions, model=None):
    """Load (unless ``model`` is given), start the scheduler and return ``(app, scheduler)``."""
    from dsv4lab.tools.serve.app import ServeConfig, create_app

    model = model if model is not None else load_model(opts)
    on_gpu = getattr(getattr(model, "device", None), "type", None) == "cuda"
    if hasattr(model, "warmup") and (opts.warmup or (opts.warmup is None and on_gpu)):
        # the first request then compiles nothing (with --speculative mtp: its prefill and cycles neither)
        drafts = opts.draft_tokens if opts.speculative is not None else 0
        log.info("%s", model.warmup(progress=None, draft_tokens=drafts).describe())
    cache_len = int(model.args.max_seq_len)
    max_model_len = min(opts.max_model_len or cache_len, cache_len)
    scheduler = Scheduler(model, max_running=opts.max_concurrency, max_waiting=opts.max_queue,
                          batch_prefill=opts.batch_prefill, speculative=opts.speculative,
                          draft_tokens=opts.draft_tokens)
    tokenizer = getattr(model, "tokenizer", None)
    config = ServeConfig(served_model_name=opts.served_model_name or opts.model_name,
                         max_model_len=max_model_len, api_key=opts.api_key,
                         chat_format=chat_format_for(tokenizer, opts.chat_format) if tokenizer else None,
                         root=str(opts.checkpoint or getattr(model, "checkpoint", None)),
                         limits=Limits(max_body_bytes=opts.max_body_bytes, header_timeout_s=opts.header_timeout_s,
                                       body_timeout_s=opts.body_timeout_s))
    app = create_app(scheduler, tokenizer, config)
    scheduler.start()
    return app, scheduler


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers: ``header_timeout_s`` after a
    connection opens (or its previous response ends), a request whose headers are not complete is answered 408 and
    the connection closed. uvicorn itself only times out an idle keep-alive connection, and any byte resets that
    timer. Use :func:`timed_protocol` to set the deadline."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_deadline(self) -> None:
        handle = getattr(self, "_header_deadline", None)
        if handle is not None:
            handle.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request arrived: say why it is dropped
            body = (b'{"error": {"message": "The request line and headers did not arrive within '
                    + f"{self.header_timeout_s:g}".encode() + b' s (dsv4lab serve --header-timeout).", '
                    b'"type": "RequestTimeoutError", "param": null, "code": 408}}')
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                                 + body)
        self.transport.close()


def timed_protocol(header_timeout_s: float) -> type[TimedH11Protocol]:
    """:class:`TimedH11Protocol` with its header deadline set (uvicorn takes a protocol class, not an instance)."""
    if not header_timeout_s > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {header_timeout_s}")
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})


def uvicorn_config(app, host: str, port: int, log_level: str, timeout_graceful_shutdown: float):
    """uvicorn's configuration for ``app``: the h11 protocol with the app's header deadline, no lifespan."""
    header_timeout = app.state.config.limits.header_timeout_s if hasattr(app.state, "config") else \
        TimedH11Protocol.header_timeout_s
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                          timeout_graceful_shutdown=timeout_graceful_shutdown, http=timed_protocol(header_timeout))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread; ``with BackgroundServer(app) as s: s.url``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, scheduler=None,
                 log_level: str = "warning"):
        self.host, self.port = host, port or free_port(host)
        self.scheduler = scheduler
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level, 2))
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
