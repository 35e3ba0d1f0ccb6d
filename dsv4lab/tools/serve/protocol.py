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
body larger than the server's limit     413     RequestEntityTooLargeError
Content-Type not application/json       415     UnsupportedMediaTypeError
server full, queuing disabled           429     RateLimitError
internal error (no traceback)           500     InternalServerError
======================================  ======  ===========================  ==================

The ``type`` names are the exception classes the official ``openai`` client raises for each status (413 and 415
have none there: the client raises its ``APIStatusError``). Every bound a request is checked against is in
:mod:`dsv4lab.tools.serve.limits`.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 413: "RequestEntityTooLargeError", 415: "UnsupportedMediaTypeError",
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


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields completions and chat completions share (OpenAI's plus vLLM's extensions)."""
    model_config = ConfigDict(extra="allow")

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

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True  # vLLM: a text prompt starts with BOS (as ``dsv4lab generate --prompt``)


class _Open(BaseModel):
    """A part of a request that may carry fields this server does not read (kept, passed on, ignored)."""
    model_config = ConfigDict(extra="allow")


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
