"""Generation requests (issue 21): out-of-range arguments are refused by the API, ``generate`` streams its text
as it goes and says why it stopped — EOS, max new tokens, or a full cache."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

import dsv4lab
from dsv4lab.faces.cli import main
from dsv4lab.engine import loader
from dsv4lab.engine.sampling import FINISH_REASONS, finish_reason
from dsv4lab.core.errors import DSV4LabError, RequestError

TINY_PY = Path(__file__).resolve().parents[1] / "data" / "tiny-py"


@pytest.fixture(scope="module")
def small_cache():
    """data/tiny-py with caches of 12 positions: a full cache is a few tokens away."""
    return dsv4lab.load(TINY_PY, device="cpu", max_batch=1, max_seq_len=12)


@pytest.mark.parametrize("kwargs,says", [
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1, got -1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-1), "temperature must be a number in [0, 2]"),
    (dict(temperature=math.nan), "temperature must be a number in [0, 2]"),
    (dict(temperature=3), "temperature must be a number in [0, 2]"),
    (dict(top_p=0), "top_p must be a number in (0, 1]"),
    (dict(top_p=2), "top_p must be a number in (0, 1]"),
    (dict(seed=2**70), "seed must be an integer in"),
    (dict(prompt_ids=[5] * 12), "the prompt has 12 tokens but the cache holds max_seq_len=12 positions"),
    (dict(prompt_ids=[]), "prompt_ids is empty"),
])
def test_an_out_of_range_generation_request_is_refused(small_cache, kwargs, says):
    request = dict(prompt_ids=[5, 6, 7], max_new_tokens=2) | kwargs
    with pytest.raises(RequestError) as e:
        small_cache.generate(request.pop("prompt_ids"), request.pop("max_new_tokens"), **request)
    assert says in str(e.value)
    assert isinstance(e.value, DSV4LabError) and isinstance(e.value, ValueError)


def test_tokens_are_heard_as_chosen_and_the_stop_reason_is_the_loops(small_cache):
    heard = []
    out = small_cache.generate([5, 6, 7, 8], 3, stop_at_eos=False, on_token=heard.append)
    assert heard == out and len(out) == 3
    assert finish_reason(out, 4, 3, 12, small_cache.args.eos_token_id, stop_at_eos=False) == "length"
    out = small_cache.generate([5, 6, 7, 8], 50, stop_at_eos=False)
    assert len(out) == 12 - 4  # the cache holds 12 positions; the last token is never fed back
    assert finish_reason(out, 4, 50, 12, small_cache.args.eos_token_id, stop_at_eos=False) == "context"
    eos = small_cache.args.eos_token_id
    assert finish_reason([9, eos], 4, 50, 12, eos) == "eos"
    for unfinished in ([9], [9, eos]):  # (an EOS is no reason when generation does not stop at it)
        with pytest.raises(ValueError):
            finish_reason(unfinished, 4, 50, 12, eos, stop_at_eos=False)


def test_generate_streams_its_text_and_says_why_it_stopped(capsys):
    assert main(["generate", "--checkpoint", str(TINY_PY), "--prompt", "def f(", "--max-new-tokens", "4",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"stopped: {FINISH_REASONS['length']}" and out[-2].startswith("decode path: eager")
    first = next(i for i, line in enumerate(out) if line.startswith("output_ids "))  # after the streamed text
    assert out[first + 1].startswith("hash ") and first + 3 == len(out) - 1
    ids = json.loads(out[first][len("output_ids "):])
    tok = dsv4lab.load(TINY_PY, device="cpu", max_batch=1).tokenizer
    assert "\n".join(out[:first]) == tok.decode(tok.encode("def f(", add_bos=True)) + tok.decode(ids)

    from dsv4lab.faces.commands.generate import TextStream
    sink = io.StringIO()
    sink.isatty = lambda: False
    stream = TextStream(tok, sink)
    stream.start("P:")
    sizes = []
    for i in ids:
        stream(i)
        sizes.append(len(sink.getvalue()))
    stream.end()
    assert sink.getvalue() == "P:" + tok.decode(ids) + "\n"
    assert sizes[-1] > sizes[0] >= len("P:")  # written token by token, not at the end


def test_generate_says_when_the_cache_ends_the_generation(monkeypatch, capsys):
    real_load = loader.load
    monkeypatch.setattr(loader, "load", lambda *a, **k: real_load(*a, **(k | {"max_seq_len": 12})))
    assert main(["generate", "--checkpoint", str(TINY_PY), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "50",
                 "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr()
    assert "at most 8 of the 50 new tokens fit after the 4-token prompt" in out.err
    res = json.loads(out.out)
    assert res["finish_reason"] == "context" and len(res["output_ids"]) == 8


@pytest.mark.gpu
def test_on_a_gpu_machine_a_missing_gpu_index_is_refused_and_generate_streams_on_cuda(capsys):
    import torch

    from dsv4lab.engine.device import check_device
    count = torch.cuda.device_count()
    assert check_device("cuda").type == "cuda" and check_device(f"cuda:{count - 1}").index == count - 1
    with pytest.raises(RequestError, match=f"this machine has {count} GPU"):
        check_device(f"cuda:{count}")
    assert main(["generate", "--checkpoint", str(TINY_PY), "--prompt", "def f(", "--max-new-tokens", "4",
                 "--device", "cuda"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"stopped: {FINISH_REASONS['length']}"
