"""``dsv4lab bench serve`` — measure any OpenAI-compatible endpoint with vLLM's ``bench serve`` definitions.

Per request (streamed, timed on the client with ``time.perf_counter``):

* **TTFT** = arrival of the first streamed chunk that carries generated text − request start;
* **ITL** = the gaps between successive chunks that carry text (one per chunk, not per token);
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
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_backend, add_dtype, float_range, int_range
from dsv4lab.core.provenance import identity, result_path, write_json
from dsv4lab.tools.serve.server import BackgroundServer, ServerOptions, build_app

HELP = "HTTP benchmark of an OpenAI-compatible server (vLLM bench serve metrics: TTFT, TPOT, ITL, E2E)"
PERCENTILES = (50, 90, 99)


def add_arguments(p):
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--checkpoint", default=None,
                   help="instead of --url: start `dsv4lab serve` for this checkpoint in-process on loopback")
    add_backend(p, help="with --checkpoint: engine backend")
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
    p.add_argument("--out", default=None, help="JSON result path (default runs/bench_serve/<time>.json)")


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


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _one_request(client, url: str, model: str, endpoint: str, prompt, prompt_len: int, output_len: int,
                       ignore_eos: bool, api_key: str | None) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url + path, json=body, headers=_headers(api_key)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                if chunk.get("usage") and not chunk.get("choices"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    continue
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if endpoint == "completions" else \
                        (choice.get("delta", {}).get("content") or choice.get("delta", {}).get("reasoning_content"))
                    if text:
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
            result.error = "no generated text in the stream"
    except Exception as err:  # a failed request is a data point, not a crash
        result.error = f"{type(err).__name__}: {err}"
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
    import httpx
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1))
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def limited(prompt, n):
            async with gate:
                return await _one_request(client, url, model, endpoint, prompt, n, output_len, ignore_eos, api_key)

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
    import httpx
    r = httpx.get(url + "/v1/models", headers=_headers(api_key), timeout=30)
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return models[0]


def run(args) -> int:
    if (args.url is None) == (args.checkpoint is None):
        raise UserError("give exactly one of --url (a running server) or --checkpoint (start one here)")
    try:
        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--concurrency {args.concurrency!r}: expected comma-separated integers") from None
    if not levels or min(levels) < 1:
        raise UserError(f"--concurrency {args.concurrency!r}: levels must be >= 1")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")

    server = None
    url = args.url.rstrip("/") if args.url else None
    if args.checkpoint:
        app, scheduler = build_app(ServerOptions(checkpoint=args.checkpoint, max_concurrency=max(levels),
                                                 api_key=args.api_key, backend=args.backend, dtype=args.dtype))
        server = BackgroundServer(app, scheduler=scheduler).start()
        url = server.url
    try:
        try:
            info = _discover(url, args.api_key)
        except Exception as err:
            raise UserError(f"cannot list models at {url}/v1/models: {err}") from None
        model = args.model or info["id"]
        vocab = args.vocab_size or 4096
        prompts, lens = make_prompts(args.endpoint, args.num_prompts, args.input_len, vocab, args.seed)
        ignore_eos = not args.no_ignore_eos
        # One request first, as vLLM does: it checks the setup and keeps start-up costs out of the numbers.
        warm = asyncio.run(run_level(url, model, args.endpoint, prompts[:1], lens[:1], min(args.output_len, 4), 1,
                                     float("inf"), ignore_eos, args.api_key, args.timeout, args.seed))
        if warm["failed"]:
            raise UserError(f"the warm-up request failed: {warm['errors'][0]}")
        runs = []
        for level in levels:
            print(f"concurrency {level}: {args.num_prompts} requests ...", file=sys.stderr)
            result = asyncio.run(run_level(url, model, args.endpoint, prompts, lens, args.output_len, level,
                                           args.request_rate, ignore_eos, args.api_key, args.timeout, args.seed))
            runs.append(result)
            print(format_table(result, model))
    finally:
        if server is not None:
            server.stop()

    doc = {"benchmark": "serve", "definitions": "vLLM bench serve (TTFT, TPOT, ITL, E2EL; ms)",
           "meta": {**identity(), "url": url if args.url else f"in-process: {args.checkpoint}", "model": model,
                    "endpoint": args.endpoint, "num_prompts": args.num_prompts, "input_len": args.input_len,
                    "output_len": args.output_len, "request_rate": args.request_rate, "ignore_eos": ignore_eos,
                    "seed": args.seed},
           "runs": runs}
    out = write_json(result_path(args.out, "bench_serve"), doc)
    print(f"wrote {out}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1

