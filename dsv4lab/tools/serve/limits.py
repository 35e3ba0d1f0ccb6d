"""Every bound the server puts on a request, in one place, and the checks that apply them.

A request passes four gates; each refuses in OpenAI's error shape with vLLM's wording and names the field
(``param``) when there is one:

=====================  ======  ==============================================================================
gate                   status  what is refused
=====================  ======  ==============================================================================
body (:func:`body`)    415     a ``Content-Type`` other than ``application/json`` (a cross-site page can send
                               ``text/plain`` without a CORS preflight; it cannot send JSON)
body (:func:`body`)    413     more than :attr:`Limits.max_body_bytes` bytes
body (:func:`body`)    408     a body that has not arrived :attr:`Limits.body_timeout_s` seconds after the headers
                               (the headers themselves: :class:`dsv4lab.tools.serve.server.TimedH11Protocol`)
JSON (:func:`parse`)   400     not UTF-8 JSON; a string with a lone surrogate (not Unicode); NaN, Infinity or a
                               number too large for a float; nesting deeper than :attr:`Limits.max_json_depth`
fields (:data:`RULES`) 400     a number outside its range (:func:`check_fields`), too many stop strings or
                               ``logit_bias`` entries, a bias outside [-100, 100]
prompt                 400     a prompt that cannot fit ``max_model_len``: token ids counted before they are
                               validated, text bounded by :func:`min_tokens` before it is tokenized
=====================  ======  ==============================================================================

The last gate is what keeps a 10 MB prompt from costing a minute of tokenizer time: a byte-level BPE token stands
for at most as many characters as its longest vocabulary entry, so a text that long cannot be tokenized into few
enough tokens and is refused at once.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect

from dsv4lab.engine import MAX_TEMPERATURE, SEED_RANGE
from dsv4lab.tools.serve.protocol import APIError, context_error

JSON_TYPES = ("application/json",)


@dataclass(frozen=True)
class Limits:
    """The server's bounds on one request. ``max_body_bytes`` is ``dsv4lab serve --max-body-mb``,
    ``header_timeout_s`` and ``body_timeout_s`` are ``--header-timeout`` and ``--body-timeout`` (seconds a client
    may take to send its request line and headers, and then its body); ``vocab_size`` is the model's (token ids
    must be below it)."""
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_logit_bias: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    vocab_size: int | None = None


@dataclass(frozen=True)
class Rule:
    """One numeric field's range. A bound is a number or the name of a :class:`Limits` attribute; ``each``
    applies the range to every element of a list; ``why`` is said when the value is refused."""
    field: str
    lo: float | str | None
    hi: float | str | None
    lo_open: bool = False
    hi_open: bool = False
    each: bool = False
    why: str = ""


RULES = (
    Rule("max_tokens", 1, None),
    Rule("max_completion_tokens", 1, None),
    Rule("temperature", 0, MAX_TEMPERATURE, why="OpenAI's range; 0 is greedy"),
    Rule("top_p", 0, 1, lo_open=True),
    Rule("seed", *SEED_RANGE, why="the seeds torch.Generator takes"),
    Rule("n", 1, 1, why="this server returns one choice per request"),
    Rule("best_of", 1, 1, why="this server returns one choice per request"),
    Rule("logprobs", 0, "max_logprobs"),
    Rule("top_logprobs", 0, "max_logprobs"),
    Rule("presence_penalty", 0, 0, why="penalties are not supported by this server: leave it at 0"),
    Rule("frequency_penalty", 0, 0, why="penalties are not supported by this server: leave it at 0"),
    Rule("stop_token_ids", 0, "vocab_size", hi_open=True, each=True, why="a token id of this model"),
    Rule("top_k", -1, None, why="-1 or 0: every token"),
    Rule("min_tokens", 0, None),
)
"""The numeric fields of completions and chat completions and their ranges (a field a request lacks is skipped)."""


# ---------------------------------------------------------------------------------------------- body
async def body(request, limits: Limits) -> bytes:
    """The raw body of a JSON request, refused with 415 when it is not JSON and 413 when it is too large (by its
    ``Content-Length`` before reading, or while reading a chunked body)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() not in JSON_TYPES:
        raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _too_large(f"{int(declared):,}", limits)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _too_large(f"more than {limits.max_body_bytes:,}", limits)
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "The client disconnected while sending the request.") from None
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {limits.body_timeout_s:g} s ({size:,} bytes "
                            "received; dsv4lab serve --body-timeout).") from None
    return b"".join(chunks)


def _too_large(size: str, limits: Limits) -> APIError:
    return APIError(413, f"The request body has {size} bytes; this server accepts at most "
                         f"{limits.max_body_bytes:,} (dsv4lab serve --max-body-mb).")


# ---------------------------------------------------------------------------------------------- JSON
def parse(raw: bytes, limits: Limits) -> dict:
    """The JSON object of a request body; refuses what is not JSON, not Unicode or not finite (400, ``param`` the
    field where it is found)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"The request body nests deeper than {limits.max_json_depth} levels.") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise APIError(400, f"Invalid JSON in the request body: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    check_tree(data, limits.max_json_depth)
    return data


def check_tree(data: Any, max_depth: int) -> None:
    """Walk a parsed JSON document without recursion; refuse a lone surrogate, a non-finite number, or nesting
    deeper than ``max_depth``. The path of a value is only built when it is refused."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                _check_text(value, where)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise APIError(400, f"{_field(where)}: {value} is not a JSON number (NaN, Infinity and numbers "
                                    f"beyond a float's range are not accepted).", _param(where))
        elif isinstance(value, (dict, list)):
            if depth >= max_depth:
                raise APIError(400, f"{_field(where)}: nested deeper than {max_depth} levels.", _param(where))
            if isinstance(value, list):
                if all(type(v) is int for v in value):  # token ids: nothing to check inside
                    continue
                stack.extend((v, where + (k,), depth + 1) for k, v in enumerate(value))
            else:
                for k, v in value.items():
                    if not k.isascii():
                        _check_text(k, where + (k,))
                    stack.append((v, where + (k,), depth + 1))


def _check_text(text: str, where: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{_field(where)}: contains a lone surrogate ({text[err.start]!a}) at character "
                            f"{err.start}: text must be valid Unicode.", _param(where)) from None


def _param(where: tuple) -> str | None:
    """The field path as pydantic writes it (``messages.0.content``), escaped where a key is not Unicode."""
    return ".".join(str(k).encode("utf-8", "backslashreplace").decode() for k in where) or None


def _field(where: tuple) -> str:
    return _param(where) or "the request body"


# ---------------------------------------------------------------------------------------------- fields
def check_fields(req, limits: Limits, rules=RULES) -> None:
    """Refuse the first field of a validated request outside its range (400, vLLM's "X must be ..., got Y.")."""
    for rule in rules:
        value = getattr(req, rule.field, None)
        if value is None or isinstance(value, bool):  # absent, or chat's logprobs flag
            continue
        for v in (value if rule.each else [value]):
            lo, hi = _bound(rule.lo, limits), _bound(rule.hi, limits)
            below = lo is not None and (v <= lo if rule.lo_open else v < lo)
            above = hi is not None and (v >= hi if rule.hi_open else v > hi)
            if below or above or (isinstance(v, float) and not math.isfinite(v)):
                why = f" ({rule.why})" if rule.why else ""
                raise APIError(400, f"{rule.field} must be {_range(lo, hi, rule)}{why}, got {v}.", rule.field)
    stops = getattr(req, "stop", None)
    if isinstance(stops, list) and len(stops) > limits.max_stop_strings:
        raise APIError(400, f"stop may hold at most {limits.max_stop_strings} strings, got {len(stops)}.", "stop")
    bias = getattr(req, "logit_bias", None) or {}
    if len(bias) > limits.max_logit_bias:
        raise APIError(400, f"logit_bias may hold at most {limits.max_logit_bias} entries, got {len(bias)}.",
                       "logit_bias")
    for key, value in bias.items():
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias[{key!r}] must be in [-100, 100] (OpenAI's range), got {value}.",
                           "logit_bias")


def _bound(bound, limits: Limits):
    return getattr(limits, bound) if isinstance(bound, str) else bound


def _range(lo, hi, rule: Rule) -> str:
    def num(v) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)
    if lo is not None and lo == hi:
        return num(lo)
    if hi is None:
        return f"{'greater than' if rule.lo_open else 'at least'} {num(lo)}"
    return f"in {'(' if rule.lo_open else '['}{num(lo)}, {num(hi)}{')' if rule.hi_open else ']'}"


# ---------------------------------------------------------------------------------------------- prompt
def refuse_long_id_prompt(data: dict, max_model_len: int) -> None:
    """A token-id prompt (``[ids]`` or ``[[ids]]``) of ``max_model_len`` ids or more, refused before its ids are
    validated one by one."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) >= max_model_len and not isinstance(prompt[0], str):
        raise context_error(len(prompt), max_model_len)


def min_tokens(text: str, chars_per_token: int | None) -> int:
    """The fewest tokens ``text`` can become when no token stands for more than ``chars_per_token`` characters
    (:meth:`dsv4lab.core.tokenizer.Tokenizer.max_chars_per_token`; 0 when unknown)."""
    return math.ceil(len(text) / chars_per_token) if chars_per_token else 0


__all__ = ["Limits", "Rule", "RULES", "body", "parse", "check_tree", "check_fields", "refuse_long_id_prompt",
           "min_tokens"]
