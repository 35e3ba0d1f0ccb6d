"""``dsv4lab bench serve`` — measure any OpenAI-compatible endpoint with vLLM's ``bench serve`` definitions.

Requests go through the official ``openai`` client (``AsyncOpenAI``), streamed, timed on the client with
``time.perf_counter``:

* **TTFT** = arrival of the first streamed chunk that carries output (text, or token ids from a server without a
  tokenizer) − request start;
* **ITL** = the gaps between successive chunks that carry output (one per chunk, not per token);
* **E2EL** = arrival of the last chunk − request start;
* **TPOT** = (E2EL − TTFT) / (output tokens − 1), for requests with more than one output token.

Per run: request throughput, output tok/s (all output tokens / wall time of the run), total tok/s, and
mean / median / p90 / p99 (plus std) of every per-request metric in milliseconds. Output token counts come
from the server's usage chunk (``stream_options.include_usage``), or count chunks when it sends none.

A **concurrency sweep** (``--concurrency 1,2,4``) runs the same request set at each level of maximum
in-flight requests; ``--request-rate`` spaces arrivals as a Poisson process (default: all at once). Prompts
are random token ids sent as ids to ``/v1/completions`` (exact input lengths) or, for ``--endpoint chat``,
random words. The JSON result keeps every per-request array (``ttfts``, ``itls``, ``e2els``, ``tpots``,
``output_lens``) so notebooks can plot distributions.

**In-process servers.** ``--checkpoint DIR`` or ``--generate PRESET --layers N --model-seed S`` (the model
``bench e2e`` measures, generated in memory) loads the model once and serves it on loopback once per
``--speculative`` mode (``off,mtp``: plain decoding, then MTP self-speculation), each run recording its mode
(``runs[].speculative``). The client runs in a process of its own, as vLLM's does: in the server's process its
Python would hold the interpreter lock the engine thread needs to launch each step (``--client-in-server-process``
measures that setup). Each run also records the engine thread's side (``runs[].engine``: prefills, decode steps,
the wall time of each phase, the mean step and the rows it carried), the difference of the scheduler's counters
over the run. On a GPU the result goes to ``data/results/<gpu>/serve_<model>.json`` (``h200`` on an
H200; an existing file is kept unless ``--force``); elsewhere to ``runs/bench_serve/<time>.json``.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import openai
import torch

from dsv4lab.core.config import PRESETS
from dsv4lab.core.errors import UserError
from dsv4lab.core.paths import RESULTS_DIR
from dsv4lab.core.provenance import identity, result_path, write_json
from dsv4lab.tools.bench.serve_client import PERCENTILES, ClientProcess, level as client_level
from dsv4lab.tools.options import add_backend, add_device, add_dtype, float_range, int_range
from dsv4lab.tools.serve.server import BackgroundServer, ServerOptions, build_app, load_model

HELP = "HTTP benchmark of an OpenAI-compatible server (vLLM bench serve metrics: TTFT, TPOT, ITL, E2E)"


def add_arguments(p):
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--checkpoint", default=None,
                   help="instead of --url: start `dsv4lab serve` for this checkpoint in-process on loopback")
    p.add_argument("--generate", default=None, choices=sorted(PRESETS), metavar="PRESET",
                   help="instead of --url: serve a model of this preset generated in memory (as `serve --generate`)")
    p.add_argument("--layers", type=int_range(0), default=0, help="with --generate: main layers kept (0 = all)")
    p.add_argument("--model-seed", type=int_range(0), default=0, help="with --generate: seed of the weights")
    p.add_argument("--speculative", default="off",
                   help="in-process server: comma-separated decoding modes to measure, off and/or mtp (default off)")
    p.add_argument("--draft-tokens", type=int_range(1), default=1, help="with --speculative mtp: drafts per step")
    p.add_argument("--max-model-len", type=int_range(2), default=None, help="in-process server: cache length")
    add_backend(p, help="in-process server: engine backend")
    add_device(p)
    add_dtype(p)
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int_range(1), default=16, help="requests per concurrency level")
    p.add_argument("--input-len", type=int_range(1), default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int_range(1), default=16, help="max_tokens per request")
    p.add_argument("--concurrency", default="1,4", help="comma-separated maximum in-flight requests (a sweep)")
    p.add_argument("--request-rate", type=float_range(0, lo_open=True, finite=False), default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once (default)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: ignore_eos so every request yields --output-len)")
    p.add_argument("--vocab-size", type=int_range(2), default=None,
                   help="id range for random prompts (default: the server's or 4096)")
    p.add_argument("--client-in-server-process", action="store_true",
                   help="in-process server: run the client in the server's process too (default: a process of its "
                        "own, so that its Python does not take the interpreter lock from the engine thread)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float_range(0, lo_open=True), default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="JSON result path (default: data/results/<gpu>/serve_<model>.json "
                                                "for an in-process server on a GPU, else runs/bench_serve/<time>.json)")
    p.add_argument("--force", action="store_true", help="replace an existing result under data/results/")


ENGINE_COUNTERS = ("prefill_forwards", "prefill_tokens", "decode_steps", "generated_tokens", "prefill_s", "decode_s")
"""The scheduler's counters a run reports the difference of (:meth:`Scheduler.stats`)."""


def engine_section(before: dict, after: dict, duration: float, sequences: int) -> dict:
    """The engine thread's side of one run from the scheduler's counters before and after it: prefills, decode
    steps, the wall time of each phase (and its share of the run), the mean decode step and the rows it carried
    (each sequence's first token comes from its prefill, the rest from decode steps)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ENGINE_COUNTERS}
    steps = d["decode_steps"]
    out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}
    out.update(prefill_share=round(d["prefill_s"] / duration, 4) if duration else None,
               decode_share=round(d["decode_s"] / duration, 4) if duration else None,
               decode_step_ms=round(1000 * d["decode_s"] / steps, 3) if steps else None,
               rows_per_step=round((d["generated_tokens"] - sequences) / steps, 3) if steps else None)
    return out


def make_prompts(endpoint: str, num: int, input_len: int, vocab_size: int, seed: int) -> tuple[list, list[int]]:
    """Random prompts: token ids (completions; exact lengths) or random words (chat; lengths approximate)."""
    rng = random.Random(seed)
    if endpoint == "completions":
        # Ids 0..5 are control tokens (BOS, EOS, roles, think): keep them out of random prompts.
        prompts = [[rng.randrange(6, vocab_size) for _ in range(input_len)] for _ in range(num)]
        return prompts, [input_len] * num
    words = ["alpha", "beta", "gamma", "delta", "import", "return", "value", "class", "print", "data"]
    prompts = [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(num)]
    return prompts, [input_len] * num


def format_table(run: dict, model: str) -> str:
    """vLLM's result block for one run."""
    lines = [f"{' Serving Benchmark Result (concurrency ' + str(run['concurrency']) + ') ':=^60}",
             f"{'Model:':<40}{model:>20}",
             f"{'Successful requests:':<40}{run['completed']:>20}",
             f"{'Failed requests:':<40}{run['failed']:>20}",
             f"{'Benchmark duration (s):':<40}{run['duration_s']:>20.2f}",
             f"{'Total input tokens:':<40}{run['total_input_tokens']:>20}",
             f"{'Total generated tokens:':<40}{run['total_output_tokens']:>20}",
             f"{'Request throughput (req/s):':<40}{run['request_throughput']:>20.2f}",
             f"{'Output token throughput (tok/s):':<40}{run['output_throughput']:>20.2f}",
             f"{'Total token throughput (tok/s):':<40}{run['total_token_throughput']:>20.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        s = run[key]
        lines.append(f"{' ' + title + ' ':-^60}")
        lines.append(f"{'Mean ' + short + ' (ms):':<40}{s['mean']:>20.2f}")
        lines.append(f"{'Median ' + short + ' (ms):':<40}{s['median']:>20.2f}")
        for q in PERCENTILES[1:]:
            lines.append(f"{'P' + str(q) + ' ' + short + ' (ms):':<40}{s['p' + str(q)]:>20.2f}")
    e = run.get("engine")
    if e:  # an in-process server: where the engine thread's time went
        rows = [("Prefills (forwards / tokens):", f"{e['prefill_forwards']} / {e['prefill_tokens']}"),
                ("Prefill time (s, share of the run):", _share(e["prefill_s"], e["prefill_share"])),
                ("Decode time (s, share of the run):", _share(e["decode_s"], e["decode_share"])),
                ("Decode steps / mean step (ms):", f"{e['decode_steps']} / {e['decode_step_ms']}"),
                ("Rows per decode step:", str(e["rows_per_step"]))]
        lines.append(f"{' Engine thread ':-^60}")
        lines.extend(f"{title:<40}{value:>20}" for title, value in rows)
    lines.append("=" * 60)
    return "\n".join(lines)


def _share(seconds: float, share: float | None) -> str:
    return f"{seconds:.2f}" + (f" ({share:.0%})" if share is not None else "")


def _discover(url: str, api_key: str | None) -> dict:
    models = openai.OpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=30).models.list()
    if not models.data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return models.data[0].model_dump()


def _modes(text: str) -> list[str | None]:
    """``--speculative off,mtp`` → ``[None, "mtp"]``."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("off", "mtp") for m in modes):
        raise UserError(f"--speculative {text!r}: expected a comma-separated list of off and mtp")
    return [None if m == "off" else m for m in modes]


def default_out(model: str, in_process: bool, device: torch.device) -> Path:
    """Where a run is written unless ``--out`` says: ``data/results/<gpu>/serve_<model>.json`` for an in-process
    server on a GPU (``h200`` on an H200, else the GPU's name in lower case, spaces as ``_``), else ``runs/``."""
    if in_process and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = "h200" if "H200" in name else name.lower().replace("nvidia ", "").replace(" ", "_")
        return RESULTS_DIR / gpu / f"serve_{model}.json"
    return result_path(None, "bench_serve")


def _check_out(out: Path | None, name: str, in_process: bool, args) -> None:
    """An existing result under ``data/results/`` is kept unless ``--force`` (``out`` None: the default path of
    an in-process server, on the GPU it will load on)."""
    if out is None:
        asked = getattr(args, "device", None) or "auto"
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if asked == "auto" else asked)
        out = default_out(name, in_process, dev)
    if out.exists() and out.resolve().is_relative_to(RESULTS_DIR.resolve()) and not args.force:
        raise UserError(f"{out} exists (a committed result): pass --force to replace it, or --out elsewhere")


def run(args) -> int:
    in_process = args.checkpoint is not None or args.generate is not None
    if (args.url is None) == (not in_process) or (args.checkpoint is not None and args.generate is not None):
        raise UserError("give exactly one of --url (a running server), --checkpoint or --generate (start one here)")
    try:
        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--concurrency {args.concurrency!r}: expected comma-separated integers") from None
    if not levels or min(levels) < 1:
        raise UserError(f"--concurrency {args.concurrency!r}: levels must be >= 1")
    modes = _modes(args.speculative)
    if args.url is not None and modes != [None]:
        raise UserError("--speculative picks the decoding of an in-process server; a --url server decodes as it "
                        "was started")
    ignore_eos = not args.no_ignore_eos
    opts = ServerOptions(checkpoint=args.checkpoint, generate=args.generate, layers=args.layers,
                         seed=args.model_seed, max_concurrency=max(levels), api_key=args.api_key,
                         backend=args.backend, device=args.device, dtype=args.dtype,
                         max_model_len=args.max_model_len, draft_tokens=args.draft_tokens)
    if args.out or in_process:  # a committed result is refused before the run, not after it
        _check_out(Path(args.out) if args.out else None, args.model or (opts.model_name if in_process else ""),
                   in_process, args)
    model = None
    if in_process:
        print(f"loading {args.checkpoint or opts.model_name} ...", file=sys.stderr)
        try:
            model = load_model(opts)
        except ValueError as err:
            raise UserError(str(err)) from None
    runs, name, url = [], None, args.url.rstrip("/") if args.url else None
    own_process = in_process and not args.client_in_server_process
    client = ClientProcess() if own_process else None

    def level(**kwargs) -> dict:  # one run of the client, in its own process where it has one
        return client(**kwargs) if client is not None else client_level(kwargs)

    try:
        for mode in modes:
            server = None
            if model is not None:
                opts.speculative = mode
                try:
                    app, scheduler = build_app(opts, model=model)
                except ValueError as err:  # no MTP block, --draft-tokens above what the model supports
                    raise UserError(str(err).replace("draft_tokens", "--draft-tokens")) from None
                server = BackgroundServer(app, scheduler=scheduler).start()
                url = server.url
            try:
                name = _measure_mode(args, url, model, mode, levels, ignore_eos, level, runs,
                                     scheduler if server is not None else None)
            finally:
                if server is not None:
                    server.stop()
    finally:
        if client is not None:
            client.close()
    _write(args, runs, name, model, in_process, ignore_eos, own_process)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _measure_mode(args, url: str, model, mode: str | None, levels: list[int], ignore_eos: bool, level, runs: list,
                  scheduler) -> str:
    """Every concurrency level against the server at ``url`` (one decoding ``mode``), appended to ``runs``;
    returns the model's name."""
    try:
        info = _discover(url, args.api_key)
    except Exception as err:
        raise UserError(f"cannot list models at {url}/v1/models: {err}") from None
    name = args.model or info["id"]
    vocab = args.vocab_size or (model.args.vocab_size if model is not None else 4096)
    prompts, lens = make_prompts(args.endpoint, args.num_prompts, args.input_len, vocab, args.seed)
    common = dict(url=url, model=name, endpoint=args.endpoint, ignore_eos=ignore_eos, api_key=args.api_key,
                  timeout=args.timeout, seed=args.seed)
    # One request first, as vLLM does: it checks the setup and keeps start-up costs out of the numbers.
    warm = level(prompts=prompts[:1], prompt_lens=lens[:1], output_len=min(args.output_len, 4), concurrency=1,
                 request_rate=float("inf"), **common)
    if warm["failed"]:
        raise UserError(f"the warm-up request failed: {warm['errors'][0]}")
    for c in levels:
        print(f"{'speculative ' + mode if mode else 'plain'} decoding, concurrency {c}: "
              f"{args.num_prompts} requests ...", file=sys.stderr)
        before = scheduler.stats() if scheduler is not None else None
        result = level(prompts=prompts, prompt_lens=lens, output_len=args.output_len, concurrency=c,
                       request_rate=args.request_rate, **common)
        result["speculative"] = mode or "off"
        if scheduler is not None:
            after = scheduler.stats()
            result["engine"] = engine_section(before, after, result["duration_s"], result["completed"])
            if mode:  # this run's drafts (the counters run on over the mode's levels)
                result["draft_tokens"] = args.draft_tokens
                for k in ("accepted_tokens", "drafted_tokens"):
                    result[k] = after.get(k, 0) - before.get(k, 0)
        runs.append(result)
        print(format_table(result, name))
    return name


def _write(args, runs: list, name: str, model, in_process: bool, ignore_eos: bool, own_process: bool) -> None:
    device = getattr(model, "device", torch.device("cpu"))
    source = args.url or (f"in-process: {args.checkpoint}" if args.checkpoint else f"in-process: generated "
                          f"{args.generate}, {args.layers or 'all'} layers, seed {args.model_seed}")
    doc = {"benchmark": "serve", "definitions": "vLLM bench serve (TTFT, TPOT, ITL, E2EL; ms), openai client",
           "meta": {**identity(str(device)), "url": source, "model": name, "endpoint": args.endpoint,
                    "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                    "request_rate": args.request_rate, "ignore_eos": ignore_eos, "seed": args.seed,
                    "backend": args.backend if in_process else None,
                    "client": ("own process" if own_process else "the server's process") if in_process else None,
                    "decode_path": model.decode_path if model is not None else None},
           "runs": runs}
    out = Path(args.out) if args.out else default_out(name, in_process, device)
    _check_out(out, name, in_process, args)
    write_json(out, doc)
    print(f"wrote {out}")
