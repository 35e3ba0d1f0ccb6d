"""Chat encoding, output parsing, incremental detokenization and the wire-format checks — no model needed."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dsv4lab.tools.serve.encoding import (ASSISTANT, BOS, EOS, REASONING_EFFORT_MAX_PREFIX, THINK_CLOSE, THINK_OPEN,
                                    TOOL_CALLS_START, USER, ChatEncodingError, ChatOptions, DeepSeekV4ChatFormat,
                                    SimpleChatFormat, StreamingChatParser, chat_format_for, encode_messages,
                                    held_back_suffix, parse_completion, parse_tool_calls, render_tool_calls)

ROOT = Path(__file__).resolve().parents[1]
# The model repository's own input/expected-output pairs, committed verbatim (tests/data/dsv4_flash/README.md), and
# the mode each was produced in (the model repository's own test runs them so).
OFFICIAL = ROOT / "tests" / "data" / "dsv4_flash" / "encoding_tests"
OFFICIAL_CASES = [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")]


@pytest.mark.parametrize("case,mode", OFFICIAL_CASES)
def test_encoder_reproduces_the_official_expected_outputs(case, mode):
    src, gold = OFFICIAL / f"test_input_{case}.json", OFFICIAL / f"test_output_{case}.txt"
    data = json.loads(src.read_text(encoding="utf-8"))
    if isinstance(data, dict):  # pair 1 keeps its tools beside the messages: they belong to the system turn
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    assert encode_messages(messages, mode) == gold.read_text(encoding="utf-8")


def test_chat_and_thinking_mode_openers():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert encode_messages(msgs, "chat") == f"{BOS}S{USER}Q{ASSISTANT}{THINK_CLOSE}"
    assert encode_messages(msgs, "thinking") == f"{BOS}S{USER}Q{ASSISTANT}{THINK_OPEN}"
    assert encode_messages(msgs, "thinking", reasoning_effort="max") == \
        f"{BOS}{REASONING_EFFORT_MAX_PREFIX}S{USER}Q{ASSISTANT}{THINK_OPEN}"
    # "high" renders as no effort at all; chat mode ignores the effort
    assert encode_messages(msgs, "thinking", reasoning_effort="high") == encode_messages(msgs, "thinking")
    assert encode_messages(msgs, "chat", reasoning_effort="max") == encode_messages(msgs, "chat")
    assert encode_messages(msgs, "chat", add_bos=False) == f"S{USER}Q{ASSISTANT}{THINK_CLOSE}"


def test_thinking_mode_drops_old_reasoning_but_keeps_it_with_tools():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "reasoning_content": "r1", "content": "A1"},
            {"role": "user", "content": "b"}]
    dropped = encode_messages(msgs, "thinking")
    assert "r1" not in dropped
    assert dropped == f"{BOS}{USER}a{ASSISTANT}{THINK_CLOSE}A1{EOS}{USER}b{ASSISTANT}{THINK_OPEN}"
    kept = encode_messages(msgs, "thinking", drop_thinking=False)
    assert kept == f"{BOS}{USER}a{ASSISTANT}{THINK_OPEN}r1{THINK_CLOSE}A1{EOS}{USER}b{ASSISTANT}{THINK_OPEN}"
    with_tools = [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]}] + msgs
    assert "r1" in encode_messages(with_tools, "thinking")


def test_tool_results_merge_into_one_user_turn_in_call_order():
    calls = [{"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{\"x\": 1}"}},
             {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "{\"y\": \"s\"}"}}]
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "B"},
            {"role": "tool", "tool_call_id": "c1", "content": "A"},
            {"role": "user", "content": "and?"}]
    text = encode_messages(msgs, "chat")
    assert text.endswith(f"{EOS}{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand?"
                         f"{ASSISTANT}{THINK_CLOSE}")
    assert ('<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>' in text and
            '<｜DSML｜parameter name="y" string="true">s</｜DSML｜parameter>' in text)


def test_tool_calls_round_trip_through_the_parser():
    calls = [{"type": "function", "function": {"name": "get_weather",
                                               "arguments": json.dumps({"city": "Paris", "days": 3, "tags": ["a"]})}},
             {"type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    generated = "Let me check." + "\n\n" + render_tool_calls(calls)
    parsed = parse_completion(generated, thinking=False, tools=True)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "noop"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3, "tags": ["a"]}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.tool_calls)
    # malformed blocks stay text; without tools the block is text too
    assert parse_completion("x" + TOOL_CALLS_START + "junk", False, True).content == "x" + TOOL_CALLS_START + "junk"
    assert parse_completion(generated, thinking=False, tools=False).tool_calls == []
    with pytest.raises(ValueError):
        parse_tool_calls("<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>")


def test_parse_completion_splits_reasoning():
    p = parse_completion("thought</think>answer", thinking=True, tools=False)
    assert (p.reasoning_content, p.content) == ("thought", "answer")
    cut = parse_completion("still thinking", thinking=True, tools=False)  # stopped before </think>
    assert (cut.reasoning_content, cut.content) == ("still thinking", "")
    assert parse_completion("a</think>b", thinking=False, tools=False).content == "a</think>b"


@pytest.mark.parametrize("seed", range(5))
def test_streaming_parser_equals_whole_text_parse_for_any_chunking(seed):
    rng = random.Random(seed)
    calls = [{"type": "function", "function": {"name": "f", "arguments": json.dumps({"q": "é ü", "n": rng.randrange(9)})}}]
    text = "I think <so>" + THINK_CLOSE + "Answer \n\n with </think lookalikes" + "\n\n" + render_tool_calls(calls)
    whole = parse_completion(text, thinking=True, tools=True)
    parser = StreamingChatParser(thinking=True, tools=True)
    pieces, k = [], 0
    while k < len(text):
        n = rng.randint(1, 7)
        pieces += parser.feed(text[k:k + n])
        k += n
    rest, tool_calls = parser.finish()
    pieces += rest
    assert "".join(t for kind, t in pieces if kind == "reasoning") == whole.reasoning_content
    assert "".join(t for kind, t in pieces if kind == "content") == whole.content
    assert [c["function"] for c in tool_calls] == [c["function"] for c in whole.tool_calls]


def test_held_back_suffix():
    assert held_back_suffix("abc</th", ["</think>"]) == 4
    assert held_back_suffix("abc", ["</think>"]) == 0
    assert held_back_suffix("x\n\n<", [TOOL_CALLS_START]) == 3
    assert held_back_suffix("</think>", ["</think>"]) == 0  # a whole marker is not held, it is matched


def test_simple_format_is_the_text_subset_and_rejects_the_rest():
    fmt = SimpleChatFormat()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]
    assert fmt.render(msgs, ChatOptions()) == f"{BOS}S{USER}Q{ASSISTANT}{THINK_CLOSE}A{EOS}{USER}Q2{ASSISTANT}{THINK_CLOSE}"
    assert fmt.render(msgs, ChatOptions()) == DeepSeekV4ChatFormat().render(msgs, ChatOptions())
    cont = fmt.render(msgs[:3], ChatOptions(continue_final_message=True))
    assert cont.endswith(f"{THINK_CLOSE}A")
    for bad, opts in [([{"role": "tool", "content": "x"}], ChatOptions()),
                      ([{"role": "user", "content": "x"}], ChatOptions(thinking=True)),
                      ([{"role": "user", "content": "x"}], ChatOptions(tools=[{"type": "function"}])),
                      ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}], ChatOptions()),
                      ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ChatOptions())]:
        with pytest.raises(ChatEncodingError):
            fmt.render(bad, opts)


def test_dsv4_format_attaches_request_tools_to_the_system_turn():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fmt = DeepSeekV4ChatFormat()
    with_system = fmt.render([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
                             ChatOptions(tools=tools))
    assert with_system.startswith(f"{BOS}S\n\n## Tools\n") and '{"name": "f", "parameters"' in with_system
    without = fmt.render([{"role": "user", "content": "q"}], ChatOptions(tools=tools, thinking=True))
    assert without.startswith(f"{BOS}\n\n## Tools\n") and without.endswith(f"{USER}q{ASSISTANT}{THINK_OPEN}")


def test_encoder_errors_name_the_message():
    with pytest.raises(ChatEncodingError, match=r"messages\[1\].*unknown role 'robot'"):
        encode_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ChatEncodingError, match="task"):
        encode_messages([{"role": "user", "content": "a", "task": "dance"}])
    with pytest.raises(ChatEncodingError, match="thinking_mode"):
        encode_messages([{"role": "user", "content": "a"}], "deep")


def test_chat_format_choice_follows_the_tokenizer(tiny_path):
    from dsv4lab.core.tokenizer import load_tokenizer
    assert chat_format_for(load_tokenizer(tiny_path)).name == "simple"
    assert chat_format_for(load_tokenizer(tiny_path), "dsv4").name == "dsv4"
    with pytest.raises(ValueError):
        chat_format_for(None, "jinja")


def test_incremental_detokenizer_matches_full_decode(tiny_path):
    from dsv4lab.tools.serve.detokenizer import IncrementalDetokenizer, special_token_ids
    from dsv4lab.core.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_path)
    text = "naïve café — 東京 🙂 def f(x):\n    return x ** 2  # ok"
    ids = tok.encode(text)
    rng = random.Random(0)
    ids = ids[:9] + [3, 5] + ids[9:] + [rng.randrange(6, tok.vocab_size) for _ in range(40)]
    skip = special_token_ids(tok)
    assert skip == {0, 1, 2, 3, 4, 5}
    detok = IncrementalDetokenizer(tok, skip)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode([i for i in ids if i not in skip])
    assert all("\ufffd" not in d for d in deltas[:len(tok.encode(text))])  # no half characters mid-stream
    keep = special_token_ids(tok, keep=(THINK_OPEN, THINK_CLOSE))
    assert keep == {0, 1, 2, 3}


def test_protocol_errors_have_vllm_wording_and_params():
    from types import SimpleNamespace

    from dsv4lab.tools.serve.limits import Limits, check_fields
    from dsv4lab.tools.serve.protocol import APIError, check_context
    with pytest.raises(APIError) as e:
        check_context(10, 1, 10)
    assert (e.value.status, e.value.param) == (400, "input_tokens")
    assert "maximum context length is 10 tokens. However, your request has 10 input tokens" in e.value.message
    with pytest.raises(APIError) as e:
        check_context(6, 5, 10)
    assert e.value.param == "max_tokens" and "(5 > 10 - 6)" in e.value.message
    assert check_context(6, 4, 10) == 4 and check_context(6, None, 10) == 4
    with pytest.raises(APIError) as e:
        check_fields(SimpleNamespace(max_tokens=0), Limits())
    assert e.value.body() == {"error": {"message": "max_tokens must be at least 1, got 0.", "type": "BadRequestError",
                                        "param": "max_tokens", "code": 400}}
