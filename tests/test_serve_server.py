"""The OpenAI-compatible server on loopback, driven by the official ``openai`` client and raw HTTP.

One server on ``data/tiny-py`` (the trained default) serves the whole module, in the reference's default bf16
numerics. The reference is batch-invariant (reductions are correctly rounded, see ``dsv4lab/core/model/numerics.py``),
so concurrent batched streams must equal sequential greedy runs bit for bit. References come from ``m.generate``
on the same model object while the server is idle, so the comparison is with exactly what ``dsv4lab generate``
runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
from argparse import Namespace
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dsv4lab.tools.serve.server import BackgroundServer, ServerOptions, build_app  # noqa: E402
from serve_helpers import (MODEL, TINY_PY, small_scheduler_server, stream_token_ids, tiny_server,  # noqa: E402
                           wait_for_load, wait_idle)

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served():
    with tiny_server(max_concurrency=8) as s:
        yield s


def test_models_and_greedy_completion_equal_the_generate_cli(served, capsys):
    from dsv4lab.faces.cli import main
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    prompt = "def add(a, b):"
    assert main(["generate", "--checkpoint", str(TINY_PY), "--prompt", prompt, "--max-new-tokens", "4", "--json",
                 "--dtype", "bf16", "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.prompt_token_ids == cli["prompt_ids"]          # text prompts start with BOS, as the CLI's
    assert choice.token_ids == cli["output_ids"]
    n_eos = int(cli["output_ids"][-1] == served.tokenizer.eos_id)
    assert choice.finish_reason == ("stop" if n_eos else "length")
    assert choice.text == served.tokenizer.decode(cli["output_ids"], skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(cli["prompt_ids"]), len(cli["output_ids"]))


def test_chat_non_streaming_and_streaming_with_usage(served):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    r = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                              extra_body={"return_token_ids": True})
    prompt_ids = served.tokenizer.encode("<｜begin▁of▁sentence｜>You write Python.<｜User｜>import os<｜Assistant｜></think>")
    assert r.prompt_token_ids == prompt_ids
    ref = served.reference(prompt_ids, 3)
    assert r.choices[0].token_ids == ref
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == served.tokenizer.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ref)

    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == len(ref)
    assert final.usage.total_tokens == len(prompt_ids) + len(ref)
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == r.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_sixteen_concurrent_streams_equal_sequential_greedy_runs(served):
    rng = random.Random(7)
    vocab = served.model.args.vocab_size
    prompts = [[rng.randrange(6, vocab) for _ in range(rng.randint(3, 17))] for _ in range(16)]
    max_tokens = 3
    refs = [served.reference(p, max_tokens) for p in prompts]

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(stream_token_ids(client, p, max_tokens) for p in prompts))
        finally:
            await client.close()

    before = served.scheduler.stats()
    outputs = asyncio.run(all_at_once())
    assert outputs == refs
    # Served sequentially, 16 requests would need 16 prefills and 32 decode steps: fewer means they shared batches.
    after = served.scheduler.stats()
    assert after["decode_steps"] - before.get("decode_steps", 0) < 32
    stats = wait_idle(served.scheduler)
    assert stats["free_slots"] == stats["max_running"]


ERROR_CASES = [
    # (name, path, body (dict or raw bytes), status, param)
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("invalid json", "/v1/chat/completions", b'{"model": "tiny-py", "messages": [', 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing field", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
    ("prompt fills the context", "/v1/completions", {"prompt": [7] * 4096, "max_tokens": 1}, 400, "input_tokens"),
    ("prompt + max_tokens overflow", "/v1/completions", {"prompt": [7] * 4000, "max_tokens": 97}, 400, "max_tokens"),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [5, 99999], "max_tokens": 1}, 400, "prompt"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("thinking on the simple format", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": True}}, 400, "messages"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_have_status_and_openai_shape(served, name, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(served.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param and err["message"]
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


def test_context_errors_reach_the_openai_client_with_vllm_wording(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model=MODEL, prompt=[7] * 4000, max_tokens=200)
    assert "'max_tokens' or 'max_completion_tokens' is too large: 200" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_api_key_is_required_when_set(served):
    from dsv4lab.tools.serve.app import ServeConfig, create_app
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=64, api_key="s3cret")
    with BackgroundServer(create_app(served.scheduler, served.tokenizer, cfg)) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        bad = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_internal_errors_are_500_without_traceback_and_midstream_errors_end_with_done(served, monkeypatch):
    real_forward = served.model.forward
    calls = {"n": 0}

    def broken_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 2:  # the prefill works, the first decode step fails
            raise RuntimeError("secret internal detail")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(served.model, "forward", broken_forward)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0},
                   timeout=60)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    assert "secret" not in r.text and "Traceback" not in r.text

    calls["n"] = 0
    events = []
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["code"] == 500 and "secret" not in events[-2]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"

    monkeypatch.setattr(served.model, "forward", real_forward)
    wait_idle(served.scheduler)
    ok = served.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert ok.choices[0].token_ids == served.reference([5, 6, 7], 2)


def test_client_disconnect_frees_its_sequence(served):
    before = served.scheduler.stats().get("aborted", 0)
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                      json={"prompt": [9, 10, 11], "max_tokens": 2000, "stream": True, "ignore_eos": True}) as s:
        seen = 0
        for line in s.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break
        assert served.scheduler.stats()["running"] == 1
    stats = wait_idle(served.scheduler)
    assert stats["aborted"] == before + 1 and stats["free_slots"] == stats["max_running"]
    health = httpx.get(served.url + "/health").json()
    assert health["running"] == 0 and health["status"] == "ok"
    again = served.client.completions.create(model=MODEL, prompt=[9, 10, 11], max_tokens=2, temperature=0,
                                             extra_body={"return_token_ids": True})
    assert again.choices[0].token_ids == served.reference([9, 10, 11], 2)


def test_a_full_server_without_queue_answers_429(served):
    from dsv4lab.tools.serve.scheduler import SamplingParams
    # A second one-slot scheduler on the same model. Its slot is held by a long greedy sequence submitted to the
    # engine directly (no client timing involved), then released by abort.
    with small_scheduler_server(served, max_running=1, max_waiting=0) as (single, url):
        held = single.submit([5, 6], SamplingParams(max_tokens=2000), deliver=lambda event: None)
        wait_for_load(single, running=1, waiting=0)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError", \
            (r.status_code, r.text, single.stats())
        single.abort(held)
        assert wait_idle(single)["free_slots"] == 1


def _golden(served, tmp_path: Path) -> Path:
    from dsv4lab.engine.sampling import trajectory_hash
    oracles = []
    for k, prompt in enumerate([[5, 6, 7, 8, 9], [100, 200, 300]]):
        wait_idle(served.scheduler)
        expected = served.model.generate(prompt, 4, stop_at_eos=False)
        oracles.append({"name": f"t{k}", "prompt_ids": prompt, "expected_ids": expected,
                        "hash": trajectory_hash(expected)})
    path = tmp_path / "golden.json"
    path.write_text(json.dumps({"checkpoint": "tiny-py", "oracles": oracles}))
    return path


def _fault_head(src: Path, dst: Path) -> None:
    """A copy of ``src`` whose LM head rows are permuted (a layout fault every token feels)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(src, dst)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]["head.weight"]
    with safe_open(dst / shard, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    perm = torch.randperm(tensors["head.weight"].shape[0], generator=torch.Generator().manual_seed(0))
    tensors["head.weight"] = tensors["head.weight"][perm].contiguous()
    save_file(tensors, str(dst / shard), metadata=meta)


def test_verify_endpoint_passes_a_healthy_server_and_catches_a_faulted_checkpoint(served, tmp_path, capsys):
    from dsv4lab.tools.serve import verify_endpoint
    golden = _golden(served, tmp_path)
    args = Namespace(url=served.url, golden=str(golden), model=None, api_key=None, no_teacher_forced=False,
                     timeout=120.0, out=str(tmp_path / "healthy"))
    assert verify_endpoint.run(args) == 0
    report = json.loads((tmp_path / "healthy.json").read_text())
    assert report["passed"] and all(o["golden_hash_consistent"] for o in report["oracles"])
    for o in report["oracles"]:
        assert o["first_divergence"] is None
        assert o["teacher_forced"]["max_gap"] == 0.0 and o["teacher_forced"]["first_argmax_divergence"] is None
    assert "2/2 oracles pass" in (tmp_path / "healthy.md").read_text()

    faulted = tmp_path / "tiny-faulted"
    _fault_head(TINY_PY, faulted)
    opts = ServerOptions(checkpoint=str(faulted), dtype="float32", max_concurrency=1, served_model_name="faulted")
    app, scheduler = build_app(opts)
    with BackgroundServer(app, scheduler=scheduler) as s:
        args = Namespace(url=s.url, golden=str(golden), model=None, api_key=None, no_teacher_forced=False,
                         timeout=120.0, out=str(tmp_path / "faulted"))
        assert verify_endpoint.run(args) == 1
    report = json.loads((tmp_path / "faulted.json").read_text())
    assert not report["passed"]
    first = report["oracles"][0]
    k = first["first_divergence"]
    assert k is not None and first["got_ids"][:k] == json.loads(golden.read_text())["oracles"][0]["expected_ids"][:k]
    assert first["expected_token"] != first["got_token"]
    assert first["teacher_forced"]["max_gap"] > 0
    assert "FAIL" in capsys.readouterr().out


def test_bench_serve_prints_the_metric_table_and_writes_json(served, tmp_path, capsys):
    from dsv4lab.tools.bench import serve as bench_serve
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--url", served.url, "--num-prompts", "3", "--input-len", "6", "--output-len", "3",
                              "--concurrency", "1,3", "--timeout", "120", "--out", str(out)])
    assert bench_serve.run(args) == 0
    printed = capsys.readouterr().out
    for needle in ("Serving Benchmark Result", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):",
                   "Output token throughput (tok/s):", "P90 E2EL (ms):"):
        assert needle in printed
    doc = json.loads(out.read_text())
    assert [r["concurrency"] for r in doc["runs"]] == [1, 3] and doc["meta"]["model"] == MODEL
    for run in doc["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0
        assert run["output_lens"] == [3, 3, 3] and len(run["ttfts"]) == len(run["e2els"]) == 3
        assert all(0 < t <= e for t, e in zip(run["ttfts"], run["e2els"]))
        assert all(len(itl) == 2 for itl in run["itls"])   # 3 tokens, one per chunk: 2 gaps
        assert run["output_throughput"] == pytest.approx(9 / run["duration_s"])
        assert run["tpot_ms"]["mean"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"]


def test_bench_engine_case_reports_sglang_metrics(served):
    from dsv4lab.tools.bench.engine import bench_case, decode_weight_bytes, format_table
    wait_idle(served.scheduler)
    r = bench_case(served.model, 2, 5, 3, seed=0, device="cpu")
    assert len(r["decode_step_latencies_s"]) == 2
    assert r["prefill_throughput_tok_s"] == pytest.approx(2 * 5 / r["prefill_latency_s"])
    assert r["decode_throughput_tok_s"] == pytest.approx(2 / r["decode_median_latency_s"])
    args = served.model.args
    assert decode_weight_bytes(args, 1) < decode_weight_bytes(args, 2) < decode_weight_bytes(args, 64)
    assert "decode tok/s" in format_table([r])


def test_serve_command_rejects_a_missing_checkpoint(tmp_path):
    from dsv4lab.faces.cli import main
    assert main(["serve", "--checkpoint", str(tmp_path / "nothing")]) == 2


def test_sampling_options_stop_strings_logprobs_and_thinking_format(served):
    from dsv4lab.tools.serve.app import ServeConfig, create_app
    from dsv4lab.tools.serve.encoding import chat_format_for
    prompt = [5, 6, 7, 8]
    # a seeded sampled request reproduces m.generate with the same seed
    sampled = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.8, seed=123,
                                               extra_body={"return_token_ids": True})
    wait_idle(served.scheduler)
    assert sampled.choices[0].token_ids == served.model.generate(prompt, 3, temperature=0.8, seed=123)

    # logprobs: one entry per generated token, the chosen token's logprob, the top 2
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                         extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    ids = r.choices[0].token_ids
    assert lp.tokens == [f"token_id:{i}" for i in ids]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen) and top[token] == pytest.approx(chosen)
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = 1"}],
                                                 max_tokens=2, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in chat.choices[0].logprobs.content)

    # a stop string cuts the text before it and ends the sequence
    full = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    cut = max(1, len(full) // 2)
    stop = full[cut:cut + 2]
    first = full.find(stop)
    stopped = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (full[:first], "stop")
    streamed = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stop=stop,
                                                stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:first]
    wait_idle(served.scheduler)

    # DeepSeek-V4's format in thinking mode: the text until </think> is reasoning
    cfg = ServeConfig(served_model_name=MODEL, max_model_len=256, chat_format=chat_format_for(None, "dsv4"))
    with BackgroundServer(create_app(served.scheduler, served.tokenizer, cfg)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "why?"}], max_tokens=3,
                                           temperature=0, extra_body={"chat_template_kwargs": {"thinking": True},
                                                                      "return_token_ids": True})
        assert r.prompt_token_ids[-2:] == [served.tokenizer.token_to_id("<｜Assistant｜>"),
                                           served.tokenizer.token_to_id("<think>")]
        shown = [i for i in r.choices[0].token_ids if i > 3]  # BOS, EOS and the role tokens print nothing
        text = served.tokenizer.decode(shown, skip_special_tokens=False)
        reasoning, sep, answer = text.partition("</think>")
        assert r.choices[0].message.reasoning_content == reasoning.replace("<think>", "")
        assert r.choices[0].message.content == (answer if sep else "")
