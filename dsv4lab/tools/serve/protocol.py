"""The OpenAI wire format: request models, validation and error bodies.

Errors use OpenAI's nested shape ``{"error": {"message", "type", "param", "code"}}`` with vLLM's status codes
and wording, so clients that parse vLLM's errors (context overflow, unknown model) keep working:

======================================  ======  ===========================  ==================
case                                    status  type                         param
======================================  ======  ===========================  ==================
invalid JSON, failed validation         400     BadRequestError              the field
a number out of range (limits.RULES)    400     BadRequestError              the field
prompt >= max model length              400     BadRequestError              ``input_tokens``
prompt + max_tokens > max model length  400     BadRequestError              ``max_tokens``
missing or wrong API key                401     AuthenticationError
unknown model                           404     NotFoundError                ``model``
body not sent within --body-timeout     408     RequestTimeoutError
body larger than the server's limit     413     RequestEntityTooLargeError
Content-Type not application/json       415     UnsupportedMediaTypeError
server full, queuing disabled           429     RateLimitError
internal error (no traceback)           500     InternalServerError
======================================  ======  ===========================  ==================

The ``type`` names are the exception classes the official ``openai`` client raises for each status (408, 413 and
415 have none there: the client raises its ``APIStatusError``). Every bound a request is checked against is in
:mod:`dsv4lab.tools.serve.limits`.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 408: "RequestTimeoutError", 413: "RequestEntityTooLargeError",
               415: "UnsupportedMediaTypeError",
               429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "BadRequestError")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.type)


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": _unicode(message), "type": type or ERROR_TYPES.get(status, "BadRequestError"),
                      "param": _unicode(param), "code": status}}


def _unicode(text: str | None) -> str | None:
    """``text`` with anything that is not Unicode (a lone surrogate quoted from a request) escaped, so the error
    itself can always be sent."""
    return text if text is None or text.isascii() else text.encode("utf-8", "backslashreplace").decode()


# pydantic names the member of a Union it tried (``str``, ``list[int]``, ``function-after[...]``) in an error's
# location; the client's field path leaves them out.
_UNION_MEMBER_MARKS = ("[", "str", "int", "float", "bool", "dict", "list", "none")


def validation_error(err) -> APIError:
    """A 400 from a pydantic ``ValidationError``: every problem with its field, the first field as ``param``."""
    problems, first = [], None
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body" and not (
            isinstance(x, str) and (x in _UNION_MEMBER_MARKS or "[" in x)))
        first = first or loc or None
        problems.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return APIError(400, "; ".join(dict.fromkeys(problems)) or "invalid request", param=first)


class _Strict(BaseModel):
    """Strict JSON types everywhere (pydantic's strict mode): no ``true`` for an integer, no ``"yes"`` or ``1`` for a
    boolean, no ``"5"`` for a number, no ``1.0`` for an integer; an integer is a valid float. Fields this server
    does not know are kept and ignored, as vLLM does — except the sampling settings of :data:`UNSUPPORTED`."""
    model_config = ConfigDict(extra="allow", strict=True)


UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": 0.0, "use_beam_search": False, "length_penalty": 1.0,
               "bad_words": [], "allowed_token_ids": None, "truncate_prompt_tokens": None, "guided_json": None,
               "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
               "prompt_logprobs": None, "spaces_between_special_tokens": True}
"""vLLM's request fields that change what is generated but that this server does not implement, with the value
that means "off": a request that sets one to anything else is refused (400) rather than silently served without
it."""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Strict):
    """Fields completions and chat completions share (OpenAI's plus vLLM's extensions)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    user: Optional[str] = None
    # vLLM extensions
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    top_k: Optional[int] = None
    min_tokens: int = 0
    logit_bias: Optional[dict[str, float]] = None
    include_stop_str_in_output: bool = False

    def stop_strings(self) -> list[str]:
        """The stop strings, empty ones left out (vLLM ignores them: an empty string would stop at once)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return list(dict.fromkeys(s for s in stops if s))

    def refuse_unsupported(self) -> None:
        """A 400 for a field of :data:`UNSUPPORTED` set to anything but its "off" value."""
        extra = self.model_extra or {}
        for name, off in UNSUPPORTED.items():
            if name in extra and extra[name] != off:
                raise APIError(400, f"{name} is not supported by this server (leave it out, or send {off!r}).", name)

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """``logit_bias`` with its keys as token ids (OpenAI's: decimal strings), checked against the vocabulary
        (400 naming the key otherwise); values were bounded by :mod:`~dsv4lab.tools.serve.limits`."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            token = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias: key {key!r} is not a token id of this model (a decimal string in "
                                    f"[0, {vocab_size})).", "logit_bias")
            out[token] = bias
        return out


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True  # vLLM: a text prompt starts with BOS (as ``dsv4lab generate --prompt``)


class _Open(_Strict):
    """A part of a request that may carry fields this server does not read (kept, passed on, ignored)."""


class ContentPart(_Open):
    type: str
    text: Optional[str] = None


class FunctionCall(_Open):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(_Open):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    """One chat message: OpenAI's roles and DeepSeek-V4's (``developer``, ``latest_reminder``, ``task``)."""
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    task: Optional[str] = None


class FunctionDefinition(_Open):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict]] = None
    response_format: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    def message_dicts(self) -> list[dict]:
        """The messages as the chat formats read them: the fields the client sent, nested parts as dicts."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None


def context_error(prompt_len: int, max_model_len: int, at_least: bool = False) -> APIError:
    """vLLM's error for a prompt that fills the context (``at_least``: a lower bound, counted without tokenizing)."""
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                         f"{'at least ' if at_least else ''}{prompt_len} input tokens. Please reduce the length of "
                         f"the input messages.", "input_tokens")


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """vLLM's context-length checks; returns the effective ``max_tokens`` (the room left when unset)."""
    if prompt_len >= max_model_len:
        raise context_error(prompt_len, max_model_len)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                            f"maximum context length is {max_model_len} tokens and your request has "
                            f"{prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len}).",
                       "max_tokens")
    return max_tokens
