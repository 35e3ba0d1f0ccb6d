"""Every bad request gets a clear refusal, and a large one does not stall the server (issue 21).

One server on ``data/tiny-py`` (body limit 2 MiB) answers a scripted corpus of malformed and out-of-range requests
sent with ``httpx``: each must get its 4xx — never a 500 — in OpenAI's error shape with vLLM's type names and the
field as ``param``; afterwards the server still serves a request exactly. A few go through the official ``openai``
client to show what a client sees. ``/health`` is timed while 10 MB requests are processed, and while a tokenizer
that takes a second per prompt works (it must run off the event loop). The API key comes from the environment,
its scheme in any case.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dsv4lab.tools.serve.app import ServeConfig, create_app  # noqa: E402
from dsv4lab.tools.serve.protocol import ERROR_TYPES  # noqa: E402
from dsv4lab.tools.serve.server import BackgroundServer  # noqa: E402
from serve_helpers import MODEL, TINY_PY, tiny_server  # noqa: E402

pytestmark = pytest.mark.serve

BODY_LIMIT = 2 << 20
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def server():
    with tiny_server(client_timeout=60, max_concurrency=2, max_body_bytes=BODY_LIMIT) as s:
        yield s


# ------------------------------------------------------------------------------------------ the corpus
@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: object            # a dict (sent as JSON) or raw bytes
    status: int
    param: str | None = None
    content_type: str | None = "application/json"
    method: str = "POST"


def _nested(depth: int) -> dict:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return {"prompt": "x", "user_data": value}


def _chunks(total: int):
    for _ in range(total // 65536):
        yield b" " * 65536


CORPUS = [
    # the body: content type and size
    Bad("text/plain body (a cross-site form can send it)", COMPLETIONS, b'{"prompt": "x"}', 415,
        content_type="text/plain"),
    Bad("form body", COMPLETIONS, b"prompt=x", 415, content_type="application/x-www-form-urlencoded"),
    Bad("no content type", COMPLETIONS, b'{"prompt": "x"}', 415, content_type=None),
    Bad("body over the limit (Content-Length)", COMPLETIONS, b" " * (BODY_LIMIT + 1), 413),
    Bad("chunked body over the limit", COMPLETIONS, "chunked", 413),
    # the JSON document
    Bad("invalid JSON", CHAT, b'{"model": "tiny-py", "messages": [', 400),
    Bad("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400),
    Bad("body not an object", COMPLETIONS, b"[1, 2]", 400),
    Bad("JSON nested 100,000 deep", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400),
    Bad("JSON nested 65 deep", COMPLETIONS, _nested(65), 400, "user_data" + ".0" * 63),
    Bad("lone surrogate in a message", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
        "messages.0.content"),
    Bad("lone surrogate in a prompt", COMPLETIONS, b'{"prompt": "ab\\udfff"}', 400, "prompt"),
    Bad("lone surrogate in a key", COMPLETIONS, b'{"prompt": "x", "\\ud83d": 1}', 400, "\\ud83d"),
    Bad("lone surrogate as the model", COMPLETIONS, b'{"prompt": "x", "model": "\\udc00"}', 400, "model"),
    Bad("temperature NaN", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    Bad("top_p Infinity", COMPLETIONS, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    Bad("temperature -Infinity", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": -Infinity}',
        400, "temperature"),
    Bad("temperature 1e400", COMPLETIONS, b'{"prompt": "x", "temperature": 1e400}', 400, "temperature"),
    Bad("a 5000-digit integer", COMPLETIONS, b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", 400),
    # the fields and their ranges
    Bad("temperature 3", COMPLETIONS, {"prompt": "x", "temperature": 3}, 400, "temperature"),
    Bad("negative temperature", COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    Bad("top_p 0", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    Bad("top_p 1.5", CHAT, {"messages": USER, "top_p": 1.5}, 400, "top_p"),
    Bad("seed 2**70", COMPLETIONS, {"prompt": "x", "seed": 1180591620717411303424}, 400, "seed"),
    Bad("seed a string", COMPLETIONS, {"prompt": "x", "seed": "abc"}, 400, "seed"),
    Bad("max_tokens zero", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    Bad("max_tokens negative", CHAT, {"messages": USER, "max_tokens": -3}, 400, "max_tokens"),
    Bad("max_completion_tokens zero", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
        "max_completion_tokens"),
    Bad("max_tokens 10**30", COMPLETIONS, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    Bad("max_tokens a word", COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    Bad("n 2", COMPLETIONS, {"prompt": "x", "n": 2}, 400, "n"),
    Bad("best_of 3", COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    Bad("logprobs 21", COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    Bad("top_logprobs 50", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    Bad("presence_penalty", COMPLETIONS, {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    Bad("stop_token_ids negative", COMPLETIONS, {"prompt": "x", "stop_token_ids": [1, -1]}, 400, "stop_token_ids"),
    Bad("stop_token_ids beyond the vocabulary", COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**9]}, 400,
        "stop_token_ids"),
    Bad("17 stop strings", COMPLETIONS, {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    Bad("stream a list", COMPLETIONS, {"prompt": "x", "stream": [1]}, 400, "stream"),
    Bad("stream_options a string", COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": "x"}, 400,
        "stream_options"),
    Bad("model a number", COMPLETIONS, {"prompt": "x", "model": 5}, 400, "model"),
    Bad("unknown model", COMPLETIONS, {"model": "nope", "prompt": "x"}, 404, "model"),
    Bad("suffix", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    # the prompt
    Bad("prompt missing", COMPLETIONS, {"max_tokens": 1}, 400, "prompt"),
    Bad("prompt empty", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    Bad("prompt an object", COMPLETIONS, {"prompt": {"text": "x"}}, 400, "prompt"),
    Bad("token id out of vocabulary", COMPLETIONS, {"prompt": [5, 99999], "max_tokens": 1}, 400, "prompt"),
    Bad("negative token id", COMPLETIONS, {"prompt": [5, -2], "max_tokens": 1}, 400, "prompt"),
    Bad("batched prompts", COMPLETIONS, {"prompt": [[5, 6], [7]]}, 400, "prompt"),
    Bad("prompt ids fill the context", COMPLETIONS, {"prompt": [7] * 4096, "max_tokens": 1}, 400, "input_tokens"),
    Bad("half a million prompt ids", COMPLETIONS, {"prompt": [7] * 500_000}, 400, "input_tokens"),
    Bad("prompt text cannot fit", COMPLETIONS, {"prompt": "a" * 500_000}, 400, "input_tokens"),
    Bad("prompt + max_tokens overflow", COMPLETIONS, {"prompt": [7] * 4000, "max_tokens": 97}, 400, "max_tokens"),
    # chat messages
    Bad("messages missing", CHAT, {"model": MODEL}, 400, "messages"),
    Bad("messages empty", CHAT, {"messages": []}, 400, "messages"),
    Bad("messages a string", CHAT, {"messages": "hello"}, 400, "messages"),
    Bad("role unknown", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    Bad("role missing", CHAT, {"messages": [{"content": "x"}]}, 400, "messages.0.role"),
    Bad("content an object", CHAT, {"messages": [{"role": "user", "content": {"a": 1}}]}, 400, "messages.0.content"),
    Bad("content part an image", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    Bad("tool_calls a string", CHAT, {"messages": [{"role": "assistant", "content": "x", "tool_calls": "call"}]},
        400, "messages.0.tool_calls"),
    Bad("tool call without a function", CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
        400, "messages.0.tool_calls.0.function"),
    Bad("tool role on the simple format", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    Bad("tools without a function", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400,
        "tools.0.function"),
    Bad("tool_choice required", CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    Bad("response_format json", CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, 400,
        "response_format"),
    Bad("reasoning_effort unknown", CHAT, {"messages": USER, "reasoning_effort": "ultra"}, 400, "reasoning_effort"),
    Bad("reasoning_effort a list", CHAT, {"messages": USER, "chat_template_kwargs": {"reasoning_effort": [1]}}, 400,
        "chat_template_kwargs.reasoning_effort"),
    Bad("thinking on the simple format", CHAT, {"messages": USER, "chat_template_kwargs": {"thinking": True}}, 400,
        "messages"),
    Bad("continue_final_message after a user turn", CHAT, {"messages": USER, "continue_final_message": True}, 400,
        "messages"),
    # routes
    Bad("unknown route", "/v1/embeddings", {"input": "x"}, 404),
    Bad("GET on a POST route", COMPLETIONS, None, 405, method="GET"),
]


def send(url: str, case: Bad) -> httpx.Response:
    if case.method == "GET":
        return httpx.get(url + case.path, timeout=60)
    headers = {"content-type": case.content_type} if case.content_type else {}
    if case.body == "chunked":
        content = _chunks(BODY_LIMIT + (1 << 20))
    elif isinstance(case.body, bytes):
        content = case.body
    else:
        content = json.dumps(case.body).encode()
    return httpx.post(url + case.path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_a_bad_request_gets_its_4xx_in_vllms_shape(server, case):
    r = send(server.url, case)
    assert r.status_code == case.status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"]) == (case.status, case.param), err
    assert err["type"] == ERROR_TYPES.get(case.status, "BadRequestError") and err["message"]
    assert "Traceback" not in r.text and "File \"" not in r.text


def test_the_corpus_is_large_and_leaves_the_server_serving(server):
    assert len(CORPUS) >= 40 and len({c.name for c in CORPUS}) == len(CORPUS)
    assert {c.status for c in CORPUS} >= {400, 404, 413, 415}
    for case in CORPUS[:6]:  # a second round of the transport cases: nothing was left half-read
        assert send(server.url, case).status_code == case.status
    deadline = time.monotonic() + 30
    while server.scheduler.stats()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stats = server.scheduler.stats()
    assert stats.get("failed", 0) == 0 and stats["free_slots"] == stats["max_running"]
    expected = server.model.generate([5, 6, 7], 3, stop_at_eos=False)
    r = server.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == expected


def test_the_openai_client_sees_the_refusals(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="x", temperature=3)
    assert e.value.body["param"] == "temperature" and "got 3" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL, messages=USER, seed=2**70)
    assert e.value.body["param"] == "seed"
    with pytest.raises(openai.APIStatusError) as e:
        server.client.completions.create(model=MODEL, prompt="y" * (BODY_LIMIT + 10))
    assert e.value.status_code == 413 and e.value.body["type"] == "RequestEntityTooLargeError"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="x" * 400_000)
    assert e.value.body["param"] == "input_tokens" and "at least" in e.value.body["message"]


# ------------------------------------------------------------------------------------------ nothing stalls
def _health_during(url: str, work, min_samples: int, max_rounds: int,
                   answers: list | None = None) -> tuple[list[float], list]:
    """``/health`` latencies measured while ``work()`` (one request) runs in another thread, repeated until
    ``min_samples`` latencies fell inside a request (or ``max_rounds`` requests were made); and the results.
    ``answers`` (a list) also gets each ``/health``'s (sent, answered) ``perf_counter`` times."""
    during, results = [], []
    with httpx.Client(timeout=30) as client:
        for _ in range(max_rounds):
            box: dict = {}
            worker = threading.Thread(target=lambda: box.update(result=work()))
            worker.start()
            while worker.is_alive():
                t0 = time.perf_counter()
                assert client.get(url + "/health").json()["status"] == "ok"
                if answers is not None:
                    answers.append((t0, time.perf_counter()))
                if worker.is_alive():  # the request was still in flight when /health answered
                    during.append(time.perf_counter() - t0)
                time.sleep(0.005)
            worker.join()
            results.append(box.get("result"))
            if len(during) >= min_samples:
                break
    return during, results


def test_health_answers_in_under_100ms_during_a_10mb_request(server):
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=4096)  # the default limits: 16 MiB bodies
    body = json.dumps({"model": MODEL, "prompt": "def f(x):\n    return x\n" * 440_000, "max_tokens": 4}).encode()
    assert len(body) >= 10_000_000
    with BackgroundServer(create_app(server.scheduler, server.tokenizer, cfg)) as s:
        def big():
            r = httpx.post(s.url + COMPLETIONS, content=body, headers={"content-type": "application/json"},
                           timeout=120)
            return r.status_code, r.json()["error"]["param"]
        during, results = _health_during(s.url, big, min_samples=12, max_rounds=8)
    assert all(res == (400, "input_tokens") for res in results), results
    assert len(during) >= 12, f"only {len(during)} /health answers fell inside {len(results)} 10 MB requests"
    ms = sorted(round(t * 1e3, 1) for t in during)
    print(f"/health during 10 MB requests: n={len(ms)}, median {statistics.median(ms)} ms, max {ms[-1]} ms")
    # Typically a few ms. The median is the target; the maximum only has to show no stall (on a loaded 2-core
    # machine one answer may wait for json.loads of the body, which holds the interpreter for tens of ms).
    assert statistics.median(during) < 0.100, ms
    assert max(during) < 1.0, ms


class SlowTokenizer:
    """The server's tokenizer, taking ``seconds`` per encode (as a long prompt would, without holding the GIL);
    ``windows`` records when each encode ran."""

    def __init__(self, tokenizer, seconds: float):
        self.tokenizer, self.seconds = tokenizer, seconds
        self.windows: list[tuple[float, float]] = []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, *args, **kwargs):
        t0 = time.perf_counter()
        time.sleep(self.seconds)
        self.windows.append((t0, time.perf_counter()))
        return self.tokenizer.encode(*args, **kwargs)


def test_tokenization_runs_off_the_event_loop(server):
    """While a prompt's encode runs (1 s), ``/health`` keeps answering: answers sent and received inside the encode
    are counted. Encoding on the event loop would let none complete inside it, however loaded the machine; off it,
    one answers every few milliseconds (a latency threshold instead flaked on a loaded 2-core machine)."""
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=4096)
    slow = SlowTokenizer(server.tokenizer, 1.0)
    answers: list = []  # (sent, answered) of each /health
    with BackgroundServer(create_app(server.scheduler, slow, cfg)) as s:
        def one():
            return httpx.post(s.url + COMPLETIONS, json={"prompt": "def f(", "max_tokens": 1}, timeout=60).status_code
        _, results = _health_during(s.url, one, min_samples=5, max_rounds=1, answers=answers)
    assert results == [200] and slow.windows, (results, slow.windows)
    inside = [a for a in answers if any(w0 <= a[0] and a[1] <= w1 for w0, w1 in slow.windows)]
    assert len(inside) >= 5, f"{len(inside)} of {len(answers)} /health answers completed inside the encode"


# ------------------------------------------------------------------------------------------ the API key
def test_the_api_key_comes_from_the_environment_and_its_scheme_in_any_case(monkeypatch, capsys):
    import uvicorn

    from dsv4lab.faces.cli import main
    from dsv4lab.tools.serve import API_KEY_ENV
    seen = {}

    def serve_briefly(app, **kwargs):  # instead of serving forever: check the app dsv4lab serve built
        with BackgroundServer(app) as s:
            def status(header):
                headers = {"Authorization": header} if header is not None else {}
                return httpx.get(s.url + "/v1/models", headers=headers, timeout=30).status_code
            seen.update({h: status(h) for h in ("Bearer env-s3cret", "bearer env-s3cret", "BEARER  env-s3cret",
                                                "Bearer wrong", "Bearer env-s3cret2", "Basic env-s3cret",
                                                "env-s3cret", "", None)})
            unauthorized = httpx.get(s.url + "/v1/models", timeout=30)
            seen["www-authenticate"] = unauthorized.headers.get("www-authenticate")
            seen["health"] = httpx.get(s.url + "/health", timeout=30).status_code

    monkeypatch.setattr(uvicorn, "run", serve_briefly)
    monkeypatch.setenv(API_KEY_ENV, "env-s3cret")
    assert main(["serve", "--checkpoint", str(TINY_PY), "--device", "cpu", "--max-concurrency", "1"]) == 0
    assert "API key required" in capsys.readouterr().err
    assert seen.pop("health") == 200 and seen.pop("www-authenticate") == "Bearer"
    assert seen == {"Bearer env-s3cret": 200, "bearer env-s3cret": 200, "BEARER  env-s3cret": 200,
                    "Bearer wrong": 401, "Bearer env-s3cret2": 401, "Basic env-s3cret": 401, "env-s3cret": 401,
                    "": 401, None: 401}
    assert os.environ[API_KEY_ENV] == "env-s3cret"
