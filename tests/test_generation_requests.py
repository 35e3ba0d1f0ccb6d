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


# ------------------------------------------------------------------------------------------ numerics (issue 35)
@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e-6, 1e-5, 0.3, 1.0, 2.0])
@pytest.mark.parametrize("top_p", [1e-300, 1e-30, 1e-7, 0.5, 1.0])
def test_sampling_is_stable_for_every_accepted_setting(temperature, top_p):
    import torch

    from dsv4lab.engine.sampling import MIN_TEMPERATURE, sample
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 301, generator=g) * 30  # wide logits: a naive softmax at a small temperature overflows
    logits[2, 17] = logits[2].max() + 1e-3            # a near tie with a gap of 1e-3
    for top_k in (0, 1, 7):
        ids = sample(logits, temperature, top_p, g, top_k=top_k)
        assert ids.shape == (5,) and bool(((ids >= 0) & (ids < 301)).all())
        if temperature < MIN_TEMPERATURE or top_p < 1e-6 or top_k == 1:  # only the best token can be drawn
            assert torch.equal(ids, logits.argmax(-1))


def test_top_p_and_top_k_keep_the_right_tokens_with_the_right_weights():
    import math

    import torch

    from dsv4lab.engine.sampling import sample
    g = torch.Generator().manual_seed(1)
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # probabilities 0.1 0.2 0.3 0.4
    draws = torch.stack([sample(logits, 1.0, 0.5, g) for _ in range(4000)]).flatten()
    counts = torch.bincount(draws, minlength=4) / 4000.0  # top_p 0.5 keeps {0.4, 0.3}: 4/7 and 3/7
    assert counts[:2].sum() == 0 and abs(float(counts[3]) - 4 / 7) < 0.03
    draws = torch.stack([sample(logits, 1.0, 1.0, g, top_k=2) for _ in range(4000)]).flatten()
    assert set(draws.tolist()) == {2, 3}
    assert math.isclose(float((draws == 3).float().mean()), 4 / 7, abs_tol=0.03)


def _poisoned_load(real_load, poison):
    def load(*args, **kwargs):
        m = real_load(*args, **kwargs)
        poison(m)
        return m
    return load


def test_non_finite_logits_at_the_prefill_are_one_line_naming_the_position_and_layer(monkeypatch, capsys):
    import torch

    def poison(m):  # a NaN in layer 2's MoE norm: everything from layer 2's FFN on is NaN
        with torch.no_grad():
            m.model.layers[2].ffn_norm.weight[3] = float("nan")
    monkeypatch.setattr(loader, "load", _poisoned_load(loader.load, poison))
    assert main(["generate", "--checkpoint", str(TINY_PY), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "the model's logits at position 3 are not finite (NaN or Inf): the first non-finite output is layer 2's " \
           "(layers.2." in err[0]


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_in_a_decode_step_are_an_error_not_a_token(path, temperature):
    import torch

    from dsv4lab.core.errors import NonFiniteError
    m = dsv4lab.load(TINY_PY, device="cpu", max_batch=1, max_seq_len=32, decode_path=path)
    prompt = [5, 6, 7, 8]
    first = m.generate(prompt, 1, temperature=temperature, seed=3)[0]
    if first in prompt:  # its NaN embedding would poison the prefill too
        prompt = [t + 100 for t in prompt]
        first = m.generate(prompt, 1, temperature=temperature, seed=3)[0]
    assert first not in prompt
    with torch.no_grad():
        m.model.embed.weight[first] = float("nan")  # prefill finite; the step that feeds `first` is not
    heard = []
    with pytest.raises(NonFiniteError) as e:
        m.generate(prompt, 4, temperature=temperature, seed=3, on_token=heard.append)
    assert heard == [first] and e.value.position == len(prompt)
    assert str(e.value) == (f"the model's logits at position {len(prompt)} are not finite (NaN or Inf): the first "
                            "non-finite output is embed")
