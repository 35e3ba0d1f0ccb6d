"""Chat prompts: DeepSeek-V4's message encoder and the small models' simple chat format.

DeepSeek-V4 ships no Jinja chat template. Its prompts are rendered by a Python encoder
(``encoding/encoding_dsv4.py`` in the model repository); :func:`encode_messages` renders the same strings
(checked against the four official input/expected-output pairs). The shape of a conversation::

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...]
    <｜User｜>{user}<｜Assistant｜>        then "</think>" (chat mode) or "<think>" (thinking mode)
    [{reasoning}</think>]{answer}[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{tool output}</tool_result><｜Assistant｜>...

Rules the encoder follows (all observable in the official pairs):

* ``tool`` messages have no turn of their own: consecutive tool results and user texts merge into one user
  turn, parts joined by a blank line, tool results reordered to the order of the preceding assistant's calls.
* Thinking mode drops the reasoning of assistant turns before the last user turn (and developer turns
  before it) unless any message carries tools, in which case every reasoning is kept.
* ``developer`` messages render as user turns; ``latest_reminder`` as ``<｜latest_reminder｜>{content}``;
  a message with ``task`` (``action``, ``query``, ...) ends with its task token instead of the usual
  assistant opener, and the assistant answer that follows carries no reasoning block.
* Tool calls are written in DSML: one ``invoke`` per call, one ``parameter`` per argument, strings as is
  (``string="true"``), everything else as JSON (``string="false"``).

Where this encoder deliberately differs from the official one (cases the official pairs do not cover):
tool-call ``arguments`` given as a JSON object (not a string) are rendered as their fields, not wrapped in a
single ``arguments`` parameter; OpenAI content-part lists are flattened to their text.

:class:`SimpleChatFormat` is the small models' format (``data/tiny``): the same special tokens, chat mode
only, text messages only — exactly the subset of the DeepSeek-V4 format above without tools or reasoning::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{assistant}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜></think>

The output side (:func:`parse_completion`, :class:`StreamingChatParser`) splits what the model generated
into reasoning, answer text and tool calls.
"""
from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
# What the model writes before a tool-call block: a blank line, then the block.
TOOL_CALLS_START = "\n\n" + TOOL_CALLS_OPEN

TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")

# Prompt text the model was trained with: it must match the official encoder character for character.
REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


class ChatEncodingError(ValueError):
    """A conversation the chat format cannot render (names the message and the field)."""


def _json(value: Any) -> str:
    """JSON the way the encoder writes schemas and non-string arguments (non-ASCII kept, default spacing)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


def _text_of(content: Any, where: str) -> str:
    """Message content as text: a string, None, or an OpenAI list of content parts (text parts only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatEncodingError(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(texts)
    raise ChatEncodingError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def render_tools_section(tools: list[dict]) -> str:
    """The ``## Tools`` section for OpenAI-style tool definitions (``{"type": "function", "function": {...}}``)."""
    functions = [t["function"] if isinstance(t, dict) and "function" in t else t for t in tools]
    return TOOLS_SECTION.replace("{schemas}", "\n".join(_json(f) for f in functions))


def _dsml_parameters(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {"arguments": arguments}
    if not isinstance(arguments, dict):
        arguments = {"arguments": arguments}
    lines = []
    for name, value in arguments.items():
        is_string = isinstance(value, str)
        rendered = value if is_string else _json(value)
        lines.append(f'<{DSML}parameter name="{name}" string="{"true" if is_string else "false"}">'
                     f'{rendered}</{DSML}parameter>')
    return "\n".join(lines)


def render_tool_calls(tool_calls: list[dict]) -> str:
    """A DSML ``tool_calls`` block (without the blank line that precedes it in an assistant turn)."""
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)
        invokes.append(f'<{DSML}invoke name="{fn.get("name")}">\n{_dsml_parameters(fn.get("arguments", "{}"))}'
                       f'\n</{DSML}invoke>')
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _merge_tool_turns(messages: list[dict]) -> list[dict]:
    """Fold ``tool`` messages (and the user texts that follow them) into user turns made of blocks."""
    merged: list[dict] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ChatEncodingError(f"messages[{i}]: expected an object with a 'role'")
        msg = copy.deepcopy(msg)
        role = msg["role"]
        previous = merged[-1] if merged else None
        joinable = previous is not None and previous["role"] == "user" and "blocks" in previous
        if role == "tool":
            block = {"type": "tool_result", "call_id": msg.get("tool_call_id", ""), "content": msg.get("content", "")}
            if joinable:
                previous["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": _text_of(msg.get("content"), f"messages[{i}]")}
            if joinable and previous.get("task") is None:
                previous["blocks"].append(block)
            else:
                turn = {"role": "user", "blocks": [block]}
                for key in ("task", "wo_eos"):
                    if key in msg:
                        turn[key] = msg[key]
                merged.append(turn)
        else:
            merged.append(msg)
    return merged


def _order_tool_results(messages: list[dict]) -> None:
    """Reorder each user turn's tool results to the order of the calls of the assistant turn before it."""
    call_order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            call_order = {}
            for k, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    call_order[call_id] = k
        elif msg["role"] == "user" and msg.get("blocks") and call_order:
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1:
                ordered = iter(sorted(results, key=lambda b: call_order.get(b.get("call_id", ""), 0)))
                msg["blocks"] = [next(ordered) if b["type"] == "tool_result" else b for b in msg["blocks"]]


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_old_reasoning(messages: list[dict]) -> list[dict]:
    """Thinking mode's history trimming: before the last user turn, assistants lose their reasoning and
    developer turns disappear."""
    last_user = _last_user_index(messages)
    kept = []
    for i, msg in enumerate(messages):
        if msg["role"] in ("user", "system", "tool", "latest_reminder") or i >= last_user:
            kept.append(msg)
        elif msg["role"] == "assistant":
            msg = dict(msg)
            msg.pop("reasoning_content", None)
            kept.append(msg)
    return kept


def _render_tool_result(content: Any) -> str:
    if isinstance(content, list):
        parts = []
        for b in content:
            if isinstance(b, dict) and b.get("type") == "text":
                parts.append(str(b.get("text", "")))
            else:
                parts.append(f"[Unsupported {b.get('type') if isinstance(b, dict) else type(b).__name__}]")
        content = "\n\n".join(parts)
    return f"<tool_result>{content}</tool_result>"


def _render_one(i: int, messages: list[dict], thinking: bool, keep_all_reasoning: bool, last_user: int) -> str:
    msg = messages[i]
    role = msg["role"]
    where = f"messages[{i}] ({role})"
    out = ""
    if role in ("system", "developer"):
        content = _text_of(msg.get("content"), where)
        if role == "developer":
            if not content:
                raise ChatEncodingError(f"{where}: a developer message needs non-empty content")
            out += USER
        out += content
        if msg.get("tools"):
            out += "\n\n" + render_tools_section(msg["tools"])
        if msg.get("response_format"):
            out += "\n\n" + RESPONSE_FORMAT_SECTION.format(schema=_json(msg["response_format"]))
    elif role == "user":
        parts = []
        for block in msg["blocks"]:
            parts.append(block["text"] if block["type"] == "text" else _render_tool_result(block["content"]))
        out += USER + "\n\n".join(parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + _text_of(msg.get("content"), where)
    elif role == "assistant":
        reasoning = ""
        follows_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not follows_task and (keep_all_reasoning or i > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_CLOSE
        calls = "\n\n" + render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        out += reasoning + _text_of(msg.get("content"), where) + calls
        if not msg.get("wo_eos", False):
            out += EOS
    else:
        raise ChatEncodingError(f"{where}: unknown role {role!r} (expected system, developer, user, assistant, "
                                f"tool or latest_reminder)")

    # What opens the next turn: only when the next message is the assistant's (or a reminder), or at the end.
    if i + 1 < len(messages) and messages[i + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ChatEncodingError(f"{where}: unknown task {task!r} (expected one of {sorted(TASK_TOKENS)})")
        if task == "action":
            out += ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE)
        out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        opens_thinking = thinking and (keep_all_reasoning or i >= last_user)
        out += ASSISTANT + (THINK_OPEN if opens_thinking else THINK_CLOSE)
    return out


def encode_messages(messages: list[dict], thinking_mode: str = "chat", *, drop_thinking: bool = True,
                    add_bos: bool = True, reasoning_effort: str | None = None) -> str:
    """Render a conversation as DeepSeek-V4's prompt text.

    Args:
        messages: OpenAI-style messages (``system``, ``developer``, ``user``, ``assistant`` with optional
            ``reasoning_content`` and ``tool_calls``, ``tool``, ``latest_reminder``); ``tools`` and
            ``response_format`` may be attached to a system or developer message; ``task`` to a user message.
        thinking_mode: ``"chat"`` (the assistant opener is followed by ``</think>``) or ``"thinking"``
            (followed by ``<think>``).
        drop_thinking: in thinking mode, drop the reasoning of turns before the last user turn (ignored when
            any message carries tools).
        add_bos: start with the BOS token.
        reasoning_effort: ``None``, ``"high"`` (same prompt as None) or ``"max"`` (thinking mode: a fixed
            instruction opens the prompt).

    Returns:
        The prompt text, special tokens written out as text (the tokenizer maps them to their ids).
    """
    if thinking_mode not in THINKING_MODES:
        raise ChatEncodingError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatEncodingError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    if not isinstance(messages, list) or not messages:
        raise ChatEncodingError("messages must be a non-empty list")
    thinking = thinking_mode == "thinking"
    turns = _merge_tool_turns(messages)
    _order_tool_results(turns)
    keep_all_reasoning = not drop_thinking or any(m.get("tools") for m in turns)
    if thinking and not keep_all_reasoning:
        turns = _drop_old_reasoning(turns)
    last_user = _last_user_index(turns)

    prompt = BOS if add_bos else ""
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX_PREFIX
    for i in range(len(turns)):
        prompt += _render_one(i, turns, thinking, keep_all_reasoning, last_user)
    return prompt


# ----------------------------------------------------------------------------------------------------------
# Output side: reasoning / answer / tool calls

@dataclass
class ParsedCompletion:
    """What the model generated, split the way an OpenAI chat response reports it."""
    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)


_INVOKE_RE = re.compile(rf'<{DSML}invoke name="(.*?)">\n?(.*?)\n?</{DSML}invoke>', re.DOTALL)
_PARAM_RE = re.compile(rf'<{DSML}parameter name="(.*?)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


def parse_tool_calls(block: str) -> list[dict]:
    """OpenAI ``tool_calls`` from a DSML block (text starting at ``<｜DSML｜tool_calls>``).

    Raises:
        ValueError: the block is not well-formed DSML.
    """
    start = block.find(TOOL_CALLS_OPEN)
    end = block.find(TOOL_CALLS_CLOSE)
    if start < 0 or end < 0:
        raise ValueError("no complete DSML tool_calls block")
    body = block[start + len(TOOL_CALLS_OPEN):end]
    calls = []
    for name, params in _INVOKE_RE.findall(body):
        arguments: dict[str, Any] = {}
        for key, is_string, value in _PARAM_RE.findall(params):
            if key in arguments:
                raise ValueError(f"tool call {name!r}: parameter {key!r} given twice")
            if is_string == "true":
                arguments[key] = value
            else:
                try:
                    arguments[key] = json.loads(value)
                except ValueError:
                    arguments[key] = value
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        raise ValueError("DSML tool_calls block without any invoke")
    return calls


def parse_completion(text: str, thinking: bool, tools: bool) -> ParsedCompletion:
    """Split generated text (without the EOS) into reasoning, answer and tool calls.

    In thinking mode the text before the first ``</think>`` is the reasoning (all of it when the generation
    stopped before ``</think>``). With ``tools``, a well-formed DSML block after the answer becomes
    ``tool_calls``; a malformed one stays in the answer text.
    """
    reasoning = None
    if thinking:
        head, sep, tail = text.partition(THINK_CLOSE)
        if not sep:
            return ParsedCompletion(content="", reasoning_content=head.replace(THINK_OPEN, ""))
        reasoning, text = head.replace(THINK_OPEN, ""), tail
    if tools:
        k = text.find(TOOL_CALLS_START)
        if k >= 0:
            try:
                return ParsedCompletion(content=text[:k], reasoning_content=reasoning,
                                        tool_calls=parse_tool_calls(text[k:]))
            except ValueError:
                pass
    return ParsedCompletion(content=text, reasoning_content=reasoning)


def held_back_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``.

    A streamer must hold those characters back: the next delta may complete the marker.
    """
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class StreamingChatParser:
    """Incremental :func:`parse_completion` for streamed chat: feed text deltas, get typed deltas back.

    ``feed`` returns ``[("reasoning" | "content", text), ...]``; text that may be the start of a marker
    (``</think>``, the tool-call block) is held back until it is decided. ``finish`` flushes what is held and
    returns the tool calls, if the generation ended in a DSML block.
    """

    def __init__(self, thinking: bool, tools: bool):
        self.tools = tools
        self.state = "reasoning" if thinking else "content"
        self.pending = ""
        self.tool_text = ""

    def _markers(self) -> list[str]:
        if self.state == "reasoning":
            return [THINK_CLOSE]
        return [TOOL_CALLS_START] if self.tools else []

    def feed(self, delta: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.pending += delta
        while self.pending:
            if self.state == "tools":
                self.tool_text += self.pending
                self.pending = ""
                break
            markers = self._markers()
            hit = min(((self.pending.find(m), m) for m in markers if m in self.pending), default=None)
            if hit is not None:
                k, marker = hit
                if k:
                    out.append((self.state, self.pending[:k]))
                if self.state == "reasoning":
                    self.state = "content"
                    self.pending = self.pending[k + len(marker):]
                else:
                    self.state = "tools"
                    self.tool_text, self.pending = self.pending[k:], ""
                continue
            keep = held_back_suffix(self.pending, markers)
            ready = self.pending[:len(self.pending) - keep]
            if ready:
                out.append((self.state, ready))
            self.pending = self.pending[len(ready):]
            break
        return [(kind, text.replace(THINK_OPEN, "") if kind == "reasoning" else text) for kind, text in out
                if text]

    def finish(self) -> tuple[list[tuple[str, str]], list[dict]]:
        out = [(self.state, self.pending)] if self.pending and self.state != "tools" else []
        self.pending = ""
        if self.state == "tools":
            try:
                return out, parse_tool_calls(self.tool_text)
            except ValueError:
                return out + [("content", self.tool_text)], []
        return out, []


# ----------------------------------------------------------------------------------------------------------
# Chat formats a server can use

@dataclass
class ChatOptions:
    """How to render one request: thinking or chat mode, tools, reasoning effort."""
    thinking: bool = False
    tools: list[dict] | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool = False


class DeepSeekV4ChatFormat:
    """The full DeepSeek-V4 format: system, developer, tools, reasoning, thinking mode."""

    name = "dsv4"
    supports_tools = True
    supports_thinking = True

    def render(self, messages: list[dict], options: ChatOptions) -> str:
        messages = [dict(m) if isinstance(m, dict) else m for m in messages]
        if options.tools:
            if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
                messages[0]["tools"] = options.tools
            else:
                messages.insert(0, {"role": "system", "content": "", "tools": options.tools})
        if options.continue_final_message:
            if not messages or messages[-1].get("role") != "assistant":
                raise ChatEncodingError("continue_final_message needs the last message to be the assistant's")
            messages[-1]["wo_eos"] = True
        return encode_messages(messages, "thinking" if options.thinking else "chat",
                               reasoning_effort=options.reasoning_effort)


class SimpleChatFormat:
    """The small models' chat format: DeepSeek-V4's chat mode restricted to text system/user/assistant turns."""

    name = "simple"
    supports_tools = False
    supports_thinking = False

    def render(self, messages: list[dict], options: ChatOptions) -> str:
        if options.tools:
            raise ChatEncodingError("this checkpoint uses the simple chat format, which has no tool calls")
        if options.thinking or options.reasoning_effort:
            raise ChatEncodingError("this checkpoint uses the simple chat format, which has no thinking mode")
        plain = []
        for i, msg in enumerate(messages):
            role = msg.get("role") if isinstance(msg, dict) else None
            if role not in ("system", "user", "assistant"):
                raise ChatEncodingError(f"messages[{i}]: role {role!r} is not supported by the simple chat format "
                                        f"(system, user, assistant)")
            if role == "system" and i != 0:
                raise ChatEncodingError(f"messages[{i}]: the system message must come first")
            if msg.get("tool_calls"):
                raise ChatEncodingError(f"messages[{i}]: tool_calls are not supported by the simple chat format")
            plain.append({"role": role, "content": _text_of(msg.get("content"), f"messages[{i}]")})
        if options.continue_final_message:
            if plain[-1]["role"] != "assistant":
                raise ChatEncodingError("continue_final_message needs the last message to be the assistant's")
            plain[-1]["wo_eos"] = True
        return encode_messages(plain, "chat")


CHAT_FORMATS = {"dsv4": DeepSeekV4ChatFormat, "simple": SimpleChatFormat}


def chat_format_for(tokenizer, name: str = "auto"):
    """The chat format to serve a checkpoint with: ``name`` or, for ``"auto"``, DeepSeek-V4's when the
    tokenizer knows its extra tokens (``<｜latest_reminder｜>``), else the simple format."""
    if name == "auto":
        knows_dsv4 = tokenizer is not None and tokenizer.token_to_id(LATEST_REMINDER) is not None
        name = "dsv4" if knows_dsv4 else "simple"
    if name not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {name!r} (expected auto, {', '.join(CHAT_FORMATS)})")
    return CHAT_FORMATS[name]()
