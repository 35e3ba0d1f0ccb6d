"""``bench serve`` with an in-process server of a model generated in memory (issue 32 item 4): the CPU smoke run
of what the H200 measures (``--generate flash --layers 30``), with and without speculation, through the ``openai``
client, and the fields its JSON must carry. Also ``serve --generate`` and the refusals of bad speculation
settings."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from dsv4lab.faces.cli import main  # noqa: E402

pytestmark = pytest.mark.serve


def test_bench_serve_smoke_on_a_generated_model_writes_every_field(tmp_path, capsys):
    out = tmp_path / "serve_smoke.json"
    assert main(["bench", "serve", "--generate", "tiny", "--speculative", "off,mtp", "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "3", "--concurrency", "1,2", "--device", "cpu",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s):" in printed and f"wrote {out}" in printed
    assert printed.count("Rows per decode step:") == 4  # the engine thread's lines, one block per run
    doc = json.loads(out.read_text())
    assert doc["meta"]["model"] == "tiny-seed0" and "generated tiny" in doc["meta"]["url"]
    assert [(r["speculative"], r["concurrency"]) for r in doc["runs"]] == [("off", 1), ("off", 2), ("mtp", 1),
                                                                          ("mtp", 2)]
    for run in doc["runs"]:
        assert run["completed"] == 2 and run["failed"] == 0 and run["output_lens"] == [3, 3]
        assert run["tok_s"] == run["output_throughput"] > 0
        for metric in ("ttft_ms", "itl_ms"):
            assert 0 < run[metric]["p50"] <= run[metric]["p99"]
        assert all(len(itl) == 2 for itl in run["itls"])  # a tokenizer-less server: one chunk of ids per token
    mtp = [r for r in doc["runs"] if r["speculative"] == "mtp"]
    assert all(r["draft_tokens"] == 1 and r["drafted_tokens"] > 0 for r in mtp)
    assert doc["meta"]["client"] == "own process"
    for run in doc["runs"]:  # the engine thread's side: this run's counters only (the warm-up request excluded)
        e = run["engine"]
        assert e["generated_tokens"] == 6 and e["prefill_tokens"] == 8 and 1 <= e["prefill_forwards"] <= 2
        assert e["decode_steps"] >= 2 and e["decode_s"] > 0 and e["prefill_s"] > 0
        assert 0 < e["decode_share"] + e["prefill_share"] <= 1
        assert e["decode_step_ms"] == pytest.approx(1000 * e["decode_s"] / e["decode_steps"], rel=1e-3, abs=1e-3)


def test_bench_serve_can_run_its_client_in_the_server_process(tmp_path):
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--generate", "tiny", "--num-prompts", "1", "--input-len", "4", "--output-len",
                 "2", "--concurrency", "1", "--device", "cpu", "--client-in-server-process", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["client"] == "the server's process" and doc["runs"][0]["completed"] == 1


@pytest.mark.parametrize("argv,says", [
    (["--speculative", "mtp", "--draft-tokens", "99"], "--draft-tokens must be an integer in [1, "),
    (["--draft-tokens", "2"], "--draft-tokens needs --speculative mtp"),
    (["--layers", "2", "--checkpoint", "data/tiny"], "give exactly one of --checkpoint"),
])
def test_serve_refuses_bad_speculation_settings_in_one_line(argv, says, capsys, monkeypatch):
    import uvicorn
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the server must not start"))
    assert main(["serve", "--generate", "tiny", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "Traceback" not in "\n".join(err)


def test_speculation_asked_of_a_model_without_an_mtp_block_is_refused():
    from dsv4lab.core.config import get_preset
    from dsv4lab.core.errors import UserError
    from dsv4lab.tools.serve.server import ServerOptions, build_app
    from dsv4lab.engine.loader import load
    from dsv4lab.core.random_checkpoint import RandomCheckpoint
    args = get_preset("tiny")
    ck = RandomCheckpoint(args.replace(n_mtp_layers=0, compress_ratios=args.compress_ratios[:args.n_layers]), 0, "cpu",
                          name="tiny")
    model = load(ck, max_batch=1, validate=False)
    with pytest.raises(ValueError, match="has no MTP block"):
        build_app(ServerOptions(checkpoint=None, generate="tiny", speculative="mtp"), model=model)
    with pytest.raises(UserError, match="exactly one of --checkpoint"):
        build_app(ServerOptions(checkpoint="data/tiny", generate="tiny"))


def test_an_existing_committed_result_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from dsv4lab.tools.bench import serve as bench_serve
    monkeypatch.setattr(bench_serve, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench_serve, "load_model", lambda opts: pytest.fail("the model must not load"))
    (tmp_path / "serve.json").write_text("{}")
    assert main(["bench", "serve", "--generate", "tiny", "--device", "cpu", "--out", str(tmp_path / "serve.json")]) == 2
    err = capsys.readouterr().err
    assert "exists (a committed result): pass --force" in err and "Traceback" not in err
