"""The client side of ``dsv4lab bench serve``: streamed requests through the official ``openai`` client
(``AsyncOpenAI``), timed on the client, summarized with vLLM's ``bench serve`` definitions
(:mod:`dsv4lab.tools.bench.serve` has the definitions and the command).

It imports neither torch nor the engine, so that it can run in a process of its own beside an in-process server
(:class:`ClientProcess`, ``python -m dsv4lab.tools.bench.serve_client``): a client in the server's process would
take the interpreter lock the engine thread needs to launch each step.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import openai

PERCENTILES = (50, 90, 99)


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


def level(kwargs: dict) -> dict:
    """:func:`run_level` with keyword arguments, to its end."""
    return asyncio.run(run_level(**kwargs))


class ClientProcess:
    """:func:`run_level` in a Python process of its own: one JSON line of its arguments in, one JSON line of the
    run's summary out (``{"error": ...}`` when the run itself could not start)."""

    def __init__(self):
        # the parent's import path, so that the child finds this package wherever the parent found it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4lab.tools.bench.serve_client"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def __call__(self, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps(kwargs) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark client's process ended (exit status {self.proc.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"the benchmark client failed: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _serve_requests() -> None:
    """The child's loop: a run per line of stdin; results on the real stdout (anything a library prints goes to
    stderr, so that stdout carries only the answers)."""
    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        try:
            out = level(json.loads(line))
        except Exception as err:  # reported to the parent, which raises it there
            out = {"error": f"{type(err).__name__}: {err}"}
        answers.write(json.dumps(out) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve_requests()
