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
(``runs[].speculative``). On a GPU the result goes to ``data/results/<gpu>/serve_<model>.json`` (``h200`` on an
H200; an existing file is kept unless ``--force``); elsewhere to ``runs/bench_serve/<time>.json``.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import torch

from dsv4lab.core.config import PRESETS
from dsv4lab.core.errors import UserError
from dsv4lab.core.paths import RESULTS_DIR
from dsv4lab.core.provenance import identity, result_path, write_json
from dsv4lab.tools.options import add_backend, add_device, add_dtype, float_range, int_range
from dsv4lab.tools.serve.server import BackgroundServer, ServerOptions, build_app, load_model

HELP = "HTTP benchmark of an OpenAI-compatible server (vLLM bench serve metrics: TTFT, TPOT, ITL, E2E)"
PERCENTILES = (50, 90, 99)


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float_range(0, lo_open=True), default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="JSON result path (default: data/results/<gpu>/serve_<model>.json "
                                                "for an in-process server on a GPU, else runs/bench_serve/<time>.json)")
    p.add_argument("--force", action="store_true", help="replace an existing result under data/results/")


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds)."""
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


async def _one_request(client, model: str, endpoint: str, prompt, prompt_len: int, output_len: int,
                       ignore_eos: bool) -> RequestResult:
    """One streamed request through the ``openai`` client; a chunk counts as output when it carries text or, from
    a server without a tokenizer, token ids (``return_token_ids``)."""
    result = RequestResult(prompt_len=prompt_len)
    extra = {"ignore_eos": ignore_eos, "return_token_ids": True}
    common = dict(model=model, max_tokens=output_len, temperature=0.0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        if endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            if chunk.usage is not None and not chunk.choices:
                usage_tokens = chunk.usage.completion_tokens
                continue
            for choice in chunk.choices:
                if endpoint == "chat":
                    delta = choice.delta
                    carries = bool(delta.content or getattr(delta, "reasoning_content", None))
                else:
                    carries = bool(choice.text)
                if carries or getattr(choice, "token_ids", None):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.latency = last - start
        result.output_len = usage_tokens if usage_tokens is not None else chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "no generated output in the stream"
    except Exception as err:  # a failed request is a data point, not a crash
        result.error = f"{type(err).__name__}: {str(err)[:300]}"
    return result


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    """mean / median / std / p90 / p99 in milliseconds (0 for an empty list, as vLLM reports)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    xs = sorted(v * scale for v in values)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
            "std": statistics.pstdev(xs), **{f"p{q}": _percentile(xs, q) for q in PERCENTILES}}



def _percentile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so results match vLLM's."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float, concurrency: int) -> dict:
    """vLLM's aggregate metrics for one run, with the per-request arrays."""
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [x for r in ok for x in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    return {
        "concurrency": concurrency, "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "tok_s": total_out / duration if duration else 0.0,  # output tokens per second, the name e2e rows use
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots), "itl_ms": _stats(itls),
        "e2el_ms": _stats([r.latency for r in ok]),
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results], "tpots": [(r.latency - r.ttft) / (r.output_len - 1)
                                                       if r.success and r.output_len > 1 else None for r in results],
        "itls": [r.itl for r in results], "e2els": [r.latency for r in results],
        "errors": [r.error for r in results],
    }


async def run_level(url: str, model: str, endpoint: str, prompts: list, prompt_lens: list[int], output_len: int,
                    concurrency: int, request_rate: float, ignore_eos: bool, api_key: str | None, timeout: float,
                    seed: int) -> dict:
    """One benchmark run: every prompt once, at most ``concurrency`` in flight."""
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1))
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=timeout,
                                  http_client=httpx.AsyncClient(timeout=timeout, limits=limits)) as client:
        async def limited(prompt, n):
            async with gate:
                return await _one_request(client, model, endpoint, prompt, n, output_len, ignore_eos)

        start = time.perf_counter()
        tasks = []
        for prompt, n in zip(prompts, prompt_lens):
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(list(results), duration, concurrency)


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
    lines.append("=" * 60)
    return "\n".join(lines)


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
    model = None
    if in_process:
        print(f"loading {args.checkpoint or opts.model_name} ...", file=sys.stderr)
        try:
            model = load_model(opts)
        except ValueError as err:
            raise UserError(str(err)) from None
    runs, name, url = [], None, args.url.rstrip("/") if args.url else None
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
            try:
                info = _discover(url, args.api_key)
            except Exception as err:
                raise UserError(f"cannot list models at {url}/v1/models: {err}") from None
            name = args.model or info["id"]
            vocab = args.vocab_size or (model.args.vocab_size if model is not None else 4096)
            prompts, lens = make_prompts(args.endpoint, args.num_prompts, args.input_len, vocab, args.seed)
            # One request first, as vLLM does: it checks the setup and keeps start-up costs out of the numbers.
            warm = asyncio.run(run_level(url, name, args.endpoint, prompts[:1], lens[:1], min(args.output_len, 4), 1,
                                         float("inf"), ignore_eos, args.api_key, args.timeout, args.seed))
            if warm["failed"]:
                raise UserError(f"the warm-up request failed: {warm['errors'][0]}")
            for level in levels:
                print(f"{'speculative ' + mode if mode else 'plain'} decoding, concurrency {level}: "
                      f"{args.num_prompts} requests ...", file=sys.stderr)
                result = asyncio.run(run_level(url, name, args.endpoint, prompts, lens, args.output_len, level,
                                               args.request_rate, ignore_eos, args.api_key, args.timeout, args.seed))
                result["speculative"] = mode or "off"
                if mode:
                    result["draft_tokens"] = args.draft_tokens
                    counters = scheduler.stats()
                    result["accepted_tokens"], result["drafted_tokens"] = (counters.get("accepted_tokens", 0),
                                                                           counters.get("drafted_tokens", 0))
                runs.append(result)
                print(format_table(result, name))
        finally:
            if server is not None:
                server.stop()

    device = getattr(model, "device", torch.device("cpu"))
    source = args.url or (f"in-process: {args.checkpoint}" if args.checkpoint else f"in-process: generated "
                          f"{args.generate}, {args.layers or 'all'} layers, seed {args.model_seed}")
    doc = {"benchmark": "serve", "definitions": "vLLM bench serve (TTFT, TPOT, ITL, E2EL; ms), openai client",
           "meta": {**identity(str(device)), "url": source, "model": name, "endpoint": args.endpoint,
                    "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                    "request_rate": args.request_rate, "ignore_eos": ignore_eos, "seed": args.seed,
                    "backend": args.backend if in_process else None,
                    "decode_path": model.decode_path if model is not None else None},
           "runs": runs}
    out = Path(args.out) if args.out else default_out(name, in_process, device)
    if out.exists() and out.resolve().is_relative_to(RESULTS_DIR.resolve()) and not args.force:
        raise UserError(f"{out} exists (a committed result): pass --force to replace it, or --out elsewhere")
    write_json(out, doc)
    print(f"wrote {out}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1
