"""Fault isolation and numerics through the real server (issue 35 items 1 and 2): a request's failure is that
request's alone, and non-finite logits are an error naming the position and the first non-finite stage, never a
token.

Each case sends one failing request while greedy streams decode beside it (submitted together, so the scheduler
batches them) and checks the failing request's status and one-line message, and that every other stream's ids
equal its sequential greedy run (``m.generate`` on the same model while the server is idle). One server on
``data/tiny-py`` serves the module; cases that poison the model restore it.
"""
from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

from dsv4lab.tools.serve.app import ServeConfig, create_app  # noqa: E402
from dsv4lab.tools.serve.encoding import chat_format_for  # noqa: E402
from dsv4lab.tools.serve.scheduler import Scheduler  # noqa: E402
from dsv4lab.tools.serve.server import BackgroundServer  # noqa: E402
from serve_helpers import MODEL, stream_token_ids, tiny_server  # noqa: E402

pytestmark = pytest.mark.serve

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def served():
    with tiny_server(max_concurrency=6) as s:
        memo: dict = {}
        sequential = s.reference

        def reference(prompt_ids, n=MAX_TOKENS):
            """Sequential greedy ids (remembered: the cases restore every poisoned weight before they return)."""
            key = (tuple(prompt_ids), n)
            if key not in memo:
                memo[key] = sequential(prompt_ids, n)
            return memo[key]

        s.reference = reference
        yield s


def _prompts(n: int, avoid: set[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice([t for t in range(6, 4096) if t not in avoid]) for _ in range(rng.randint(3, 9))]
            for _ in range(n)]


def _alongside(url: str, prompts: list[list[int]], bad) -> tuple[list[list[int]], object]:
    """Stream ``prompts`` greedily and run ``bad(httpx_client, openai_client)`` at the same time; returns the streams'
    ids and what ``bad`` returned."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as raw:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            *ids, outcome = await asyncio.gather(*(stream_token_ids(client, p, MAX_TOKENS) for p in prompts),
                                                 bad(raw, client))
            await client.close()
            return ids, outcome
    return asyncio.run(run())


def _one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


class _Poisoned:
    """The embedding row of ``token`` set to NaN while inside (a request that feeds the token gets NaN logits;
    rows are independent, so no other request does)."""

    def __init__(self, model, token: int):
        self.weight, self.token = model.model.embed.weight, token

    def __enter__(self):
        self.saved = self.weight[self.token].clone()
        with torch.no_grad():
            self.weight[self.token] = float("nan")

    def __exit__(self, *exc):
        with torch.no_grad():
            self.weight[self.token] = self.saved


def test_nan_logits_in_one_decode_step_fail_only_that_request_naming_the_position(served):
    bad_prompt = [17, 230, 1999, 45, 8]
    first = served.reference(bad_prompt, 1)[0]  # the token the bad request chooses first, then feeds
    prompts = _prompts(4, {first}, seed=1)
    refs = [served.reference(p) for p in prompts]
    assert all(first not in r for r in refs)  # no other stream ever feeds the poisoned token

    async def bad(raw, client):
        return await raw.post("/v1/completions", json={"prompt": bad_prompt, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0})
    with _Poisoned(served.model, first):
        ids, r = _alongside(served.url, prompts, bad)
    assert ids == refs
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    message = _one_line(r.json()["error"]["message"])
    # the first token is chosen from finite prefill logits and fed at position len(prompt): NaN from its embedding
    assert f"logits at position {len(bad_prompt)} are not finite" in message
    assert "the first non-finite output is embed" in message


def test_nan_logits_at_the_prefill_name_the_first_layer_and_the_stream_ends_with_an_error_event(served):
    poison = 3001
    bad_prompt = [12, poison, 77, 412, 9, 600]  # NaN enters at position 1; the last position's first NaN: layer 0
    prompts = _prompts(3, {poison}, seed=2)
    refs = [served.reference(p) for p in prompts]

    async def bad(raw, client):
        stream = await client.completions.create(model=MODEL, prompt=bad_prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        try:
            async for _ in stream:
                pass
        except openai.APIError as err:
            return err
        return None
    with _Poisoned(served.model, poison):
        ids, err = _alongside(served.url, prompts, bad)
    assert ids == refs
    assert err is not None, "the stream ended without an error event"
    message = _one_line(str(err.message))
    assert f"logits at position {len(bad_prompt) - 1} are not finite" in message
    assert "the first non-finite output is layer 0's (layers.0." in message


def test_an_engine_error_choosing_one_token_fails_that_request_alone(served, monkeypatch):
    real_choose = Scheduler._choose

    def choose(self, seq, logits):
        if seq.params.seed == 666:
            raise RuntimeError("secret detail of a broken sampler")
        return real_choose(self, seq, logits)

    prompts = _prompts(4, set(), seed=3)
    refs = [served.reference(p) for p in prompts]
    monkeypatch.setattr(Scheduler, "_choose", choose)

    async def bad(raw, client):
        try:
            await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=MAX_TOKENS, temperature=0.7,
                                            seed=666)
        except openai.InternalServerError as err:
            return err
    ids, err = _alongside(served.url, prompts, bad)
    assert ids == refs
    assert err is not None and err.status_code == 500
    assert _one_line(err.body["message"]) == "internal error in the engine (RuntimeError)"


EXTREME = [{"temperature": 1e-30}, {"temperature": 1e-6, "top_p": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
           {"temperature": 2.0, "top_k": 1}]


def test_extreme_sampling_settings_decode_the_best_token(served):
    """Values inside the documented ranges that used to make NaN (and fail every stream beside them): greedy below
    the threshold, the best token always kept."""
    prompt = [40, 41, 42, 43]
    ref = served.reference(prompt)
    prompts = _prompts(2, set(), seed=4)
    refs = [served.reference(p) for p in prompts]

    async def bad(raw, client):
        return await asyncio.gather(*(raw.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "seed": 1, "return_token_ids": True, **settings})
            for settings in EXTREME))
    ids, answers = _alongside(served.url, prompts, bad)
    assert ids == refs
    for settings, r in zip(EXTREME, answers):
        assert r.status_code == 200, (settings, r.text)
        assert r.json()["choices"][0]["token_ids"] == ref, settings


class _OutOfVocabulary:
    """The module's tokenizer, but a text holding ``MARK`` tokenizes to an id past the vocabulary (a tokenizer
    that does not match its model)."""
    MARK = "zqx-out-of-vocab"

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab = tokenizer, vocab_size

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text, *args, **kwargs):
        ids = self._tokenizer.encode(text, *args, **kwargs)
        return ids + [self._vocab + 7] if self.MARK in text else ids


def test_a_tokenizer_id_past_the_vocabulary_is_a_400_naming_it(served):
    prompts = _prompts(3, set(), seed=5)
    refs = [served.reference(p) for p in prompts]
    vocab = served.model.args.vocab_size
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=256,
                      chat_format=chat_format_for(served.tokenizer, "simple"))
    app = create_app(served.scheduler, _OutOfVocabulary(served.tokenizer, vocab), cfg)
    with BackgroundServer(app) as other:
        async def bad(raw, client):
            text = await raw.post(other.url + "/v1/completions",
                                  json={"prompt": f"def f(): {_OutOfVocabulary.MARK}", "max_tokens": 2})
            chat = await raw.post(other.url + "/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": _OutOfVocabulary.MARK}],
                                        "max_tokens": 2})
            return text, chat
        ids, (text, chat) = _alongside(served.url, prompts, bad)
    assert ids == refs
    for r, param in ((text, "prompt"), (chat, "messages")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        message = _one_line(r.json()["error"]["message"])
        assert f"token id {vocab + 7}, outside this model's vocabulary (vocab size {vocab})" in message
    assert served.scheduler.stats()["running"] == 0
