"""The OpenAI surface (issue 35 item 6): ``top_k``, ``min_tokens`` and ``logit_bias`` do what vLLM does, other
generation settings this server lacks are refused rather than ignored, ``stop`` has vLLM's semantics, JSON types
are strict, slow clients meet deadlines, and the 429 says what it counts.

One server on ``data/tiny-py`` serves the module; the refusals are sent while greedy streams decode, which must
still equal their sequential runs.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dsv4lab.tools.serve.app import ServeConfig, create_app  # noqa: E402
from dsv4lab.tools.serve.encoding import chat_format_for  # noqa: E402
from dsv4lab.tools.serve.limits import Limits  # noqa: E402
from dsv4lab.tools.serve.scheduler import SamplingParams  # noqa: E402
from dsv4lab.tools.serve.server import BackgroundServer  # noqa: E402
from serve_helpers import MODEL, small_scheduler_server, tiny_server, wait_for_load, wait_idle  # noqa: E402

pytestmark = pytest.mark.serve

PROMPT = [40, 41, 42, 43]
USER = [{"role": "user", "content": "x = 1"}]


@pytest.fixture(scope="module")
def served():
    with tiny_server(max_concurrency=4) as s:
        yield s


def _ids(served, **kw) -> tuple[list[int], str]:
    r = served.client.completions.create(model=MODEL, prompt=kw.pop("prompt", PROMPT), temperature=kw.pop("t", 0),
                                         max_tokens=kw.pop("max_tokens", 4),
                                         extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)
    return r.choices[0].token_ids, r.choices[0].finish_reason


# ------------------------------------------------------------------------------------------ implemented
def test_logit_bias_top_k_and_min_tokens_do_what_vllm_does(served):
    greedy = served.reference(PROMPT, 4, stop_at_eos=False)
    # logit_bias: +100 on one token makes it every greedy choice; -100 on the greedy first token moves the choice
    ids, _ = _ids(served, logit_bias={"777": 100}, extra={"ignore_eos": True})
    assert ids == [777] * 4
    ids, _ = _ids(served, logit_bias={str(greedy[0]): -100}, extra={"ignore_eos": True})
    assert ids[0] != greedy[0]
    # top_k=1: sampling at any temperature draws the most likely token (the greedy run)
    ids, _ = _ids(served, t=1.7, seed=5, extra={"top_k": 1, "ignore_eos": True})
    assert ids == greedy
    # top_k=-1 / 0: off (the same draw as without it)
    assert _ids(served, t=0.9, seed=9, extra={"top_k": -1})[0] == _ids(served, t=0.9, seed=9)[0] \
        == served.reference(PROMPT, 4, temperature=0.9, seed=9)
    # min_tokens: the greedy first token as a stop token ends the request at once; with min_tokens=3 it is
    # banned for the first 3 tokens, so at least 3 come out and none of them is it
    ids, finish = _ids(served, extra={"stop_token_ids": [greedy[0]], "ignore_eos": True})
    assert (ids, finish) == ([greedy[0]], "stop")
    ids, _ = _ids(served, extra={"stop_token_ids": [greedy[0]], "min_tokens": 3, "ignore_eos": True})
    assert len(ids) >= 3 and greedy[0] not in ids[:3]


def test_stop_strings_follow_vllm(served):
    full = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0]
    for stop in ("", [""], ["", ""]):  # empty strings are ignored (an empty match would stop at once)
        r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=stop)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (full.text, full.finish_reason)
    cut = full.text[2:4]
    kept = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=["", cut],
                                            extra_body={"include_stop_str_in_output": True}).choices[0]
    at = full.text.find(cut)
    assert (kept.text, kept.finish_reason, kept.stop_reason) == (full.text[:at + len(cut)], "stop", cut)


# ------------------------------------------------------------------------------------------ refused
def _completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **fields}


def _chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **fields}


REFUSED = {  # name: (path, body, param, a phrase of the message)
    "max_tokens true": (*_completion(max_tokens=True), "max_tokens", "valid integer"),
    "max_tokens 2.0": (*_completion(max_tokens=2.0), "max_tokens", "valid integer"),
    "max_tokens '2'": (*_completion(max_tokens="2"), "max_tokens", "valid integer"),
    "temperature '0.5'": (*_completion(temperature="0.5"), "temperature", "valid number"),
    "temperature true": (*_completion(temperature=True), "temperature", "valid number"),
    "seed 1.5": (*_completion(seed=1.5), "seed", "valid integer"),
    "stream 'yes'": (*_completion(stream="yes"), "stream", "valid boolean"),
    "stream 1": (*_completion(stream=1), "stream", "valid boolean"),
    "ignore_eos 'true'": (*_completion(ignore_eos="true"), "ignore_eos", "valid boolean"),
    "echo 1": (*_completion(echo=1), "echo", "valid boolean"),
    "stop_token_ids [true]": (*_completion(stop_token_ids=[True]), "stop_token_ids.0", "valid integer"),
    "include_usage 'yes'": (*_completion(stream=True, stream_options={"include_usage": "yes"}),
                            "stream_options.include_usage", "valid boolean"),
    "chat logprobs 1": (*_chat(logprobs=1), "logprobs", "valid boolean"),
    "thinking 'yes'": (*_chat(chat_template_kwargs={"thinking": "yes"}), "chat_template_kwargs.thinking",
                       'must be true or false, got "yes"'),
    "thinking 1": (*_chat(chat_template_kwargs={"thinking": 1}), "chat_template_kwargs.thinking",
                   "must be true or false, got 1"),
    "enable_thinking 'false'": (*_chat(chat_template_kwargs={"enable_thinking": "false"}),
                                "chat_template_kwargs.enable_thinking", "must be true or false"),
    "thinking_mode 'fast'": (*_chat(chat_template_kwargs={"thinking_mode": "fast"}),
                             "chat_template_kwargs.thinking_mode", "must be one of 'thinking', 'chat'"),
    "template key unknown": (*_chat(chat_template_kwargs={"add_vision_id": True}),
                             "chat_template_kwargs.add_vision_id", "is not understood"),
    "top_k -2": (*_completion(top_k=-2), "top_k", "top_k must be at least -1"),
    "top_k '1'": (*_completion(top_k="1"), "top_k", "valid integer"),
    "min_tokens -1": (*_completion(min_tokens=-1), "min_tokens", "min_tokens must be at least 0"),
    "min_tokens > max_tokens": (*_completion(min_tokens=3), "min_tokens", "min_tokens must be at most max_tokens"),
    "logit_bias key": (*_completion(logit_bias={"abc": 1}), "logit_bias", "key 'abc' is not a token id"),
    "logit_bias id": (*_completion(logit_bias={"4096": 1}), "logit_bias", "key '4096' is not a token id"),
    "logit_bias 101": (*_completion(logit_bias={"5": 101}), "logit_bias", "must be in [-100, 100]"),
    "logit_bias '1'": (*_completion(logit_bias={"5": "1"}), "logit_bias.5", "valid number"),
    "repetition_penalty": (*_completion(repetition_penalty=1.2), "repetition_penalty", "not supported"),
    "min_p": (*_chat(min_p=0.1), "min_p", "not supported"),
    "use_beam_search": (*_completion(use_beam_search=True), "use_beam_search", "not supported"),
}


def test_refusals_are_400s_naming_the_field_while_other_streams_decode_exactly(served):
    prompts = [[9, 10, 11], [300, 301, 302, 303, 304], [2000, 7]]
    refs = [served.reference(p, 4) for p in prompts]

    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as raw:
            async def stream(prompt):
                ids = []
                async with raw.stream("POST", "/v1/completions", json={
                        "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
                        "return_token_ids": True}) as s:
                    async for line in s.aiter_lines():
                        if line.startswith("data: {"):
                            ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                return ids
            streams = [asyncio.ensure_future(stream(p)) for p in prompts]
            answers = await asyncio.gather(*(raw.post(path, json=body) for path, body, _, _ in REFUSED.values()))
            return await asyncio.gather(*streams), answers
    ids, answers = asyncio.run(run())
    assert ids == refs
    wrong = {}
    for (name, (_, _, param, phrase)), r in zip(REFUSED.items(), answers):
        err = r.json().get("error", {})
        message = err.get("message", "")
        if (r.status_code, err.get("param")) != (400, param) or phrase not in message or "\n" in message:
            wrong[name] = (r.status_code, err.get("param"), message)
    assert wrong == {}
    # an "off" value of a setting this server lacks is accepted
    ok = httpx.post(served.url + "/v1/completions", timeout=120,
                    json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "repetition_penalty": 1.0, "top_k": 0,
                          "min_tokens": 0, "chat_template_kwargs_unused": True})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------ slow clients
@pytest.fixture(scope="module")
def impatient(served):
    """The module's scheduler behind a second app whose header and body deadlines are 0.5 s."""
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=256, chat_format=chat_format_for(served.tokenizer),
                      limits=Limits(header_timeout_s=0.5, body_timeout_s=0.5))
    with BackgroundServer(create_app(served.scheduler, served.tokenizer, cfg)) as s:
        yield s


def _raw(server, data: bytes, wait: float) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes; returns what it sent and when it closed."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(data)
        start, got = time.monotonic(), b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got, time.monotonic() - start
            got += chunk
            assert time.monotonic() - start < wait, got


def test_slow_headers_and_bodies_meet_their_deadlines(impatient):
    got, closed = _raw(impatient, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty", wait=5)
    assert got.startswith(b"HTTP/1.1 408 ") and closed < 4
    assert b"did not arrive within 0.5 s (dsv4lab serve --header-timeout)" in got
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    got, closed = _raw(impatient, head + body[:10], wait=5)
    assert got.startswith(b"HTTP/1.1 408 ") and closed < 4
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["message"] == ("The request body did not arrive within 0.5 s (10 bytes received; dsv4lab serve "
                                "--body-timeout).") and error["type"] == "RequestTimeoutError"
    # a prompt client on the same server is served (the deadlines bound waiting, not work)
    got, _ = _raw(impatient, head + body, wait=120)
    assert got.startswith(b"HTTP/1.1 200 ")


# ------------------------------------------------------------------------------------------ 429
def test_the_429_counts_running_and_waiting_requests(served):
    with small_scheduler_server(served, max_running=1, max_waiting=1) as (small, url):
        held = [small.submit([5, 6], SamplingParams(max_tokens=1000, stop_token_ids=frozenset()), lambda e: None)
                for _ in range(2)]
        wait_for_load(small, running=1, waiting=1)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
        assert r.json()["error"]["message"] == (
            "The server is at its concurrency limit: 1 of 1 sequence slots are decoding and 1 requests wait for "
            "one (a queue of at most 1). Retry later.")
        for h in held:
            small.abort(h)
        wait_idle(small)
