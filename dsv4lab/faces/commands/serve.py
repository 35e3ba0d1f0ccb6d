"""``dsv4lab serve`` — an OpenAI-compatible HTTP server for a checkpoint, or for a model generated in memory
(``--generate flash --layers 30 --seed 0``: the model ``bench e2e`` measures, no file on disk, prompts as token ids)
(FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (prompt as text or token ids),
``POST /v1/chat/completions`` (DeepSeek-V4 chat encoding, or the simple chat format of the small models),
both streamed (SSE) or not, and ``GET /health`` (with the number of running and waiting sequences).
Binds to loopback unless ``--host`` says otherwise; the API key is read from ``DSV4LAB_API_KEY`` (or ``--api-key``,
which other users of the machine can see in ``ps``). Every bound on a request is in :mod:`dsv4lab.tools.serve.limits`.
See ``docs/serving.md``.
"""
from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

from dsv4lab.core.config import PRESETS
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import (add_backend, add_device, add_dtype, add_threads, float_range, int_range,
                                   resolve_device, set_cpu_threads)
from dsv4lab.tools.serve import API_KEY_ENV

NAME = "serve"
HELP = "OpenAI-compatible server (/v1/models, /v1/completions, /v1/chat/completions, /health)"


def add_arguments(p):
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (e.g. data/tiny)")
    p.add_argument("--generate", default=None, choices=sorted(PRESETS), metavar="PRESET",
                   help="instead of --checkpoint: serve a model of this preset generated in memory from --seed (the "
                        "model `bench e2e` measures; no tokenizer: send prompts as token ids)")
    p.add_argument("--layers", type=int_range(0), default=0,
                   help="with --generate: keep the first N main layers (real layer-kind pattern, MTP kept); 0 = all")
    p.add_argument("--seed", type=int_range(0), default=0, help="with --generate: seed of the generated weights")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int_range(0, 65535), default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, which, unlike this "
                        "flag, other users cannot read in ps)")
    add_backend(p)
    add_device(p)
    add_dtype(p)
    add_threads(p)
    p.add_argument("--max-model-len", type=int_range(2), default=None,
                   help="prompt + generated tokens per sequence (default and maximum: the model's cache length)")
    p.add_argument("--max-concurrency", type=int_range(1), default=8,
                   help="sequences decoded together (cache slots, default 8)")
    p.add_argument("--max-queue", type=int_range(0), default=1024,
                   help="requests that may wait for a slot; 0 answers 429 when all slots are busy")
    p.add_argument("--max-body-mb", type=int_range(1, 1024), default=16,
                   help="largest request body accepted, in MiB (default 16; larger ones are answered 413)")
    p.add_argument("--header-timeout", type=float_range(0, lo_open=True), default=10.0,
                   help="seconds a client may take to send a request's line and headers (default 10; then 408 and "
                        "the connection is closed)")
    p.add_argument("--body-timeout", type=float_range(0, lo_open=True), default=60.0,
                   help="seconds a client may take to send a request's body after its headers (default 60; then 408)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the folder name, or PRESET-NL-seedS with --generate)")
    p.add_argument("--chat-format", default="auto", choices=["auto", "dsv4", "simple"],
                   help="chat prompt format (auto: dsv4 when the tokenizer has DeepSeek-V4's extra tokens)")
    p.add_argument("--no-batch-prefill", action="store_true",
                   help="prefill prompts that arrive together one at a time")
    p.add_argument("--speculative", default=None, choices=("mtp",),
                   help="greedy requests decode self-speculatively: the MTP block drafts, the model verifies "
                        "(lossless; sampled requests decode one token per step)")
    p.add_argument("--draft-tokens", type=int, default=1,
                   help="tokens the MTP block drafts per step (default 1; at most what the model's smallest ring "
                        "cache allows, which the error names)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"))


def run(args) -> int:
    if (args.checkpoint is None) == (args.generate is None):
        raise UserError("give exactly one of --checkpoint (a folder) or --generate (a preset)")
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        raise UserError(f"--checkpoint {args.checkpoint}: no such folder")
    if args.draft_tokens != 1 and args.speculative is None:
        raise UserError("--draft-tokens needs --speculative mtp")
    if args.max_concurrency < 1:
        raise UserError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.draft_tokens < 1:
        raise UserError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.api_key:
        print(f"warning: --api-key is visible to every user of this machine (ps); set {API_KEY_ENV} instead",
              file=sys.stderr)
    if api_key is None and not _is_loopback(args.host):
        print(f"warning: serving on {args.host} without an API key: anyone who can reach this address can use "
              f"the model (set {API_KEY_ENV})", file=sys.stderr)
    try:
        import uvicorn
        from dsv4lab.tools.serve.server import ServerOptions, build_app, timed_protocol
    except ImportError as err:
        raise UserError(f"serving needs the 'serve' extra (pip install 'dsv4lab[serve]'): {err}") from None

    opts = ServerOptions(checkpoint=args.checkpoint, backend=args.backend, device=args.device, dtype=args.dtype,
                         max_model_len=args.max_model_len, max_concurrency=args.max_concurrency,
                         max_queue=args.max_queue, served_model_name=args.served_model_name,
                         api_key=api_key, chat_format=args.chat_format,
                         batch_prefill=not args.no_batch_prefill, max_body_bytes=args.max_body_mb << 20,
                         speculative=args.speculative, draft_tokens=args.draft_tokens,
                         header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                         generate=args.generate, layers=args.layers, seed=args.seed)
    set_cpu_threads(args.threads, resolve_device(args.device))
    what = args.checkpoint or f"a generated {args.generate} model (seed {args.seed}, layers {args.layers or 'all'})"
    print(f"loading {what} (backend {args.backend}, {args.device}, {args.dtype})", file=sys.stderr)
    try:
        app, scheduler = build_app(opts)
    except ValueError as err:  # e.g. --speculative on a checkpoint without an MTP block, --draft-tokens too many
        raise UserError(str(err).replace("draft_tokens", "--draft-tokens")) from None
    cfg = app.state.config
    print(f"serving model '{cfg.served_model_name}' on http://{args.host}:{args.port}/v1 "
          f"(max_model_len {cfg.max_model_len}, {scheduler.max_running} slots, chat format "
          f"{cfg.chat_format.name if cfg.chat_format else 'none'}, API key "
          f"{'required' if api_key else 'not required'})", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                    http=timed_protocol(args.header_timeout))
    finally:
        scheduler.stop()
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
