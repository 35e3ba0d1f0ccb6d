"""The OpenAI wire format: request models, validation and error bodies.

Errors use OpenAI's nested shape ``{"error": {"message", "type", "param", "code"}}`` with vLLM's status codes
and wording, so clients that parse vLLM's errors (context overflow, unknown model) keep working:

======================================  ======  ==================  ==================
case                                    status  type                param
======================================  ======  ==================  ==================
invalid JSON, failed validation         400     BadRequestError     the field
``max_tokens`` < 1                      400     BadRequestError     ``max_tokens``
prompt >= max model length              400     BadRequestError     ``input_tokens``
prompt + max_tokens > max model length  400     BadRequestError     ``max_tokens``
missing or wrong API key                401     AuthenticationError
unknown model                           404     NotFoundError       ``model``
server full, queuing disabled           429     RateLimitError
internal error (no traceback)           500     InternalServerError
======================================  ======  ==================  ==================

The ``type`` names are the exception classes the official ``openai`` client raises for each status.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}

MAX_LOGPROBS = 20


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
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def validation_error(err) -> APIError:
    """A 400 from a pydantic ``ValidationError``: every problem with its field, the first field as ``param``."""
    problems, first = [], None
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        first = first or loc or None
        problems.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return APIError(400, "; ".join(problems) or "invalid request", param=first)


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


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict]] = None
    response_format: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True


def check_sampling(req: _Common) -> None:
    """The checks vLLM's ``SamplingParams`` makes, with its messages."""
    if req.n != 1:
        raise APIError(400, f"n must be 1 (this server returns one choice per request), got {req.n}.", "n")
    if getattr(req, "best_of", None) not in (None, 1):
        raise APIError(400, f"best_of must be 1 or unset, got {req.best_of}.", "best_of")
    if req.temperature is not None and req.temperature < 0:
        raise APIError(400, f"temperature must be non-negative, got {req.temperature}.", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}.", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported by this server (got {getattr(req, name)}); "
                                f"leave it at 0.", name)


def check_max_tokens(max_tokens: int | None) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """vLLM's context-length checks; returns the effective ``max_tokens`` (the room left when unset)."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"request has {prompt_len} input tokens. Please reduce the length of the input "
                            f"messages.", "input_tokens")
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                            f"maximum context length is {max_model_len} tokens and your request has "
                            f"{prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len}).",
                       "max_tokens")
    return max_tokens


def check_logprobs(value: int | None, name: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}.", name)
