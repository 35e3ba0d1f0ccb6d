"""The OpenAI-compatible HTTP app (FastAPI): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health``.

The app owns no model code: it validates a request, renders and tokenizes the prompt, submits the sequence
to the :class:`~dsv4lab.tools.serve.scheduler.Scheduler` and turns the token events that come back into OpenAI
responses — one JSON body, or server-sent events (``data: {chunk}`` lines, a usage chunk with
``choices: []`` when ``stream_options.include_usage`` is set, ``data: [DONE]`` always). A client that goes
away (a closed stream or an abandoned request) aborts its sequence, which frees its cache slot.

Extensions understood beyond OpenAI's fields (vLLM's names): ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``return_token_ids`` (each choice gets ``token_ids`` and ``prompt_token_ids``),
``return_tokens_as_token_ids`` (logprob tokens written ``token_id:N``), ``echo`` with ``logprobs`` (the
prompt's logprobs, teacher-forced), ``chat_template_kwargs={"thinking": true}`` and ``reasoning_effort``
(DeepSeek-V4 thinking mode), ``continue_final_message``, ``top_k``, ``min_tokens``, ``logit_bias`` (OpenAI's),
``include_stop_str_in_output``. Generation settings vLLM has and this server lacks are refused
(:data:`~dsv4lab.tools.serve.protocol.UNSUPPORTED`); JSON types are strict; ``docs/serving.md`` lists every field.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4lab.core.errors import RequestError
from dsv4lab.tools.serve import limits
from dsv4lab.tools.serve.detokenizer import IncrementalDetokenizer, special_token_ids
from dsv4lab.tools.serve.encoding import (THINK_CLOSE, THINK_OPEN, ChatEncodingError, ChatOptions, StreamingChatParser,
                       held_back_suffix, parse_completion)
from dsv4lab.tools.serve.limits import Limits
from dsv4lab.tools.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_context, context_error, error_body,
                       validation_error)
from dsv4lab.tools.serve.scheduler import SamplingParams, Scheduler, SchedulerFull, TokenEvent

log = logging.getLogger("dsv4lab.tools.serve")

TEMPLATE_KWARGS = {"thinking": bool, "enable_thinking": bool, "thinking_mode": ("thinking", "chat"),
                   "reasoning_effort": (None, "low", "medium", "high", "max", "xhigh")}
"""The ``chat_template_kwargs`` the chat formats read, and their types (a tuple: the values allowed)."""


@dataclass
class ServeConfig:
    """What the app serves and how.

    Attributes:
        served_model_name: the ``model`` id clients must send (and ``/v1/models`` lists).
        max_model_len: prompt + generated tokens per sequence (at most the model's cache length).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <key>`` (the scheme in any case).
        chat_format: an object from :func:`dsv4lab.tools.serve.encoding.chat_format_for` (None: chat disabled).
        root: the checkpoint path, reported by ``/v1/models``.
        limits: the bounds on a request (:class:`dsv4lab.tools.serve.limits.Limits`; the model's vocabulary is added).
    """
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    chat_format: Any = None
    root: str | None = None
    limits: Limits = field(default_factory=Limits)


# ---- bridging the engine thread and asyncio ------------------------------------------------------------

class _Generation:
    """One submitted sequence seen from asyncio: its events arrive on a queue."""

    def __init__(self, scheduler: Scheduler, prompt_ids: list[int], params: SamplingParams):
        self.scheduler = scheduler
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.done = False
        loop = asyncio.get_running_loop()

        def deliver(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass

        try:
            self.request_id = scheduler.submit(prompt_ids, params, deliver)
        except SchedulerFull as err:
            raise APIError(429, f"The server is at its concurrency limit: {err}. Retry later.") from None
        except RequestError as err:
            raise APIError(400, f"{err}.", "prompt") from None

    async def events(self) -> AsyncIterator[TokenEvent]:
        while not self.done:
            event = await self.queue.get()
            if event.finish_reason is not None:
                self.done = True
            yield event

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.scheduler.abort(self.request_id)


class _Output:
    """One choice's output as it grows: token ids, text (stop strings applied), logprobs, finish reason."""

    def __init__(self, tokenizer, skip_ids: set[int], stop_strings: list[str], eos_id: int | None,
                 include_stop: bool = False):
        self.eos_id = eos_id
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.detok = IncrementalDetokenizer(tokenizer, skip_ids) if tokenizer is not None else None
        self.stop_strings = stop_strings
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, float, list]] = []
        self.prompt_logprobs: list | None = None
        self.raw = ""          # detokenized text
        self.sent = 0          # characters of ``raw`` released
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None

    def add(self, event: TokenEvent) -> str:
        """Take one event; return the text it releases."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.error is not None:
            self.error, self.finish_reason = event.error, "error"
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            if event.logprob is not None:
                self.logprobs.append((event.token_id, event.logprob, event.top_logprobs or []))
            # A stop token (EOS, stop_token_ids) ends the text without appearing in it, as in vLLM.
            if self.detok is not None and event.finish_reason != "stop":
                self.raw += self.detok.add(event.token_id)
        if event.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = event.finish_reason
            if event.finish_reason == "stop" and event.token_id is not None:
                self.stop_reason = None if event.token_id == self.eos_id else event.token_id
        if self.finish_reason is not None and self.detok is not None:
            self.raw += self.detok.flush()
        return self._release()

    def _release(self) -> str:
        if self.stop_strings:
            for s in self.stop_strings:
                k = self.raw.find(s, max(0, self.sent - len(s) + 1))
                if k >= 0:
                    self.raw = self.raw[:k + (len(s) if self.include_stop else 0)]
                    self.finish_reason, self.stop_reason = "stop", s
                    break
        keep = 0 if self.finish_reason else held_back_suffix(self.raw[self.sent:], self.stop_strings)
        end = len(self.raw) - keep
        out, self.sent = self.raw[self.sent:end], max(self.sent, end)
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _token_text(tokenizer, token_id: int, as_ids: bool) -> str:
    if as_ids or tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


class _APIKeyMiddleware:
    """Rejects ``/v1/*`` requests without ``Authorization: Bearer <key>`` (401), as a plain ASGI middleware
    so streaming and disconnect detection pass through untouched.

    The scheme is matched in any case (RFC 9110: ``bearer`` is ``Bearer``); the key is compared in constant time,
    as sha256 digests, so neither its bytes nor its length leak through timing."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = hashlib.sha256(api_key.encode()).digest()

    def allows(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        given = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(given, self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not self.allows(header):
                response = JSONResponse(error_body(401, "Unauthorized: send 'Authorization: Bearer <key>'."),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- the app --------------------------------------------------------------------------------------------

def create_app(scheduler: Scheduler, tokenizer, config: ServeConfig):
    """Build the FastAPI app serving ``scheduler``'s model."""
    app = FastAPI(title="dsv4lab", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    eos_id = getattr(tokenizer, "eos_id", None) if tokenizer is not None else None
    if eos_id is None:
        eos_id = getattr(scheduler.model.args, "eos_token_id", None)
    vocab_size = int(scheduler.model.args.vocab_size)
    bounds = dataclasses.replace(config.limits, vocab_size=vocab_size)
    chars_per_token = tokenizer.max_chars_per_token() if tokenizer is not None else None
    app.state.scheduler = scheduler
    app.state.config = config

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err):
        return error_response(validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err):
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, err):  # never leak a traceback to the client; the log has it
        log.exception("unhandled error serving %s", request.url.path, exc_info=err)
        return error_response(APIError(500, "Internal server error"))

    if config.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key)

    def parse_request(raw: bytes, model_cls):
        """The validated request model of a body (in a worker thread: a large body never holds the event loop)."""
        data = limits.parse(raw, bounds)
        if model_cls is CompletionRequest:
            limits.refuse_long_id_prompt(data, config.max_model_len)
        try:
            return model_cls.model_validate(data)
        except ValidationError as err:
            raise validation_error(err) from None

    async def read_body(request: Request, model_cls):
        raw = await limits.body(request, bounds)
        req = await asyncio.to_thread(parse_request, raw, model_cls)
        if req.model is not None and req.model != config.served_model_name:
            raise APIError(404, f"The model `{req.model}` does not exist.", "model")
        limits.check_fields(req, bounds)
        req.refuse_unsupported()
        return req

    def refuse_unfittable_text(text: str, bos: int = 0) -> None:
        """A text too long to fit the context whatever it tokenizes into, refused before it is tokenized."""
        fewest = limits.min_tokens(text, chars_per_token) + bos
        if fewest >= config.max_model_len:
            raise context_error(fewest, config.max_model_len, at_least=True)

    def in_vocabulary(ids: list[int], param: str) -> list[int]:
        """A tokenized prompt's ids, refused (400) when the tokenizer yields an id the model has no row for."""
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"The tokenizer turned the {param} into token id {bad}, outside this model's "
                                f"vocabulary (vocab size {vocab_size}): the tokenizer does not match the model.", param)
        return ids

    def sampling_params(req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        max_tokens = check_context(prompt_len, max_tokens, config.max_model_len)
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens must be at most max_tokens ({max_tokens}), got {req.min_tokens}.",
                           "min_tokens")
        stop_ids = set(req.stop_token_ids or [])
        if not req.ignore_eos and eos_id is not None:
            stop_ids.add(eos_id)
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                              stop_token_ids=frozenset(stop_ids), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              top_k=max(0, req.top_k or 0), min_tokens=req.min_tokens,
                              logit_bias=req.logit_bias_ids(vocab_size))

    def new_output(req, skip_ids: set[int]) -> _Output:
        if req.stop_strings() and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)", "stop")
        return _Output(tokenizer, skip_ids, req.stop_strings(), eos_id, req.include_stop_str_in_output)

    def usage(prompt_len: int, out: _Output) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": len(out.token_ids),
                "total_tokens": prompt_len + len(out.token_ids)}

    async def run_to_end(request: Request, gen: _Generation, out: _Output) -> None:
        """Collect a whole generation; abort it when the client disconnects first."""
        async def collect():
            async for event in gen.events():
                await asyncio.to_thread(out.add, event)  # detokenizes: off the event loop
                if out.finished:
                    break

        async def disconnected():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
            gen.abort()  # no-op when finished; frees the slot when the client left or a stop string hit
        if collector.cancelled() or not collector.done():
            raise APIError(499, "client disconnected")
        collector.result()
        if out.error is not None:
            raise APIError(500, out.error)

    def sse(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"

    async def guarded_events(rid: str, gen: _Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's SSE events, then ``[DONE]``. An exception mid-stream becomes a 500 error event (the status
        line is already sent); the generation is aborted however the stream ends, so a client that went away frees
        its sequence."""
        try:
            async for event in events:
                yield event
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("error while streaming %s", rid)
            yield sse(error_body(500, "Internal server error"))
        finally:
            gen.abort()
        yield sse("[DONE]")

    def stream_response(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- routes ---------------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok", **scheduler.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": created, "owned_by": "dsv4lab",
            "root": config.root, "max_model_len": config.max_model_len}]}

    # -- completions

    def completion_prompt(req: CompletionRequest) -> list[int]:
        """The prompt's token ids (called in a worker thread: it may tokenize a long text)."""
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"Batched prompts are not supported: send one prompt per request "
                                    f"(got {len(prompt)}).", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "This model has no tokenizer (no tokenizer.json, or a generated model): send the "
                                    "prompt as token ids.", "prompt")
            refuse_unfittable_text(prompt, int(req.add_special_tokens))
            ids = in_vocabulary(tokenizer.encode(prompt, add_bos=req.add_special_tokens), "prompt")
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"Token id {bad[0]} is out of vocabulary (vocab size {vocab_size}).", "prompt")
        if not ids:
            raise APIError(400, "The prompt cannot be empty.", "prompt")
        return ids

    def completion_logprobs(out: _Output, req: CompletionRequest, prompt_ids: list[int], start: int,
                            with_prompt: bool) -> dict | None:
        if req.logprobs is None:
            return None
        as_ids = req.return_tokens_as_token_ids
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        if with_prompt and out.prompt_logprobs is not None:
            for tok, entry in zip(prompt_ids, out.prompt_logprobs):
                text = _token_text(tokenizer, tok, as_ids)
                tokens.append(text)
                token_lps.append(None if entry is None else entry[0])
                tops.append(None if entry is None else {_token_text(tokenizer, t, as_ids): lp for t, lp in entry[1]})
                offsets.append(offset)
                offset += len(text)
        for tok, lp, top in out.logprobs[start:]:
            text = _token_text(tokenizer, tok, as_ids)
            tokens.append(text)
            token_lps.append(lp)
            tops.append({_token_text(tokenizer, t, as_ids): v for t, v in top} if req.logprobs else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_body(request, CompletionRequest)
        if req.suffix:
            raise APIError(400, "suffix is not supported.", "suffix")
        prompt_ids = await asyncio.to_thread(completion_prompt, req)
        params = sampling_params(req, len(prompt_ids), req.max_tokens, req.logprobs,
                                 req.logprobs if req.echo and req.logprobs is not None else None)
        skip = special_token_ids(tokenizer) if (tokenizer is not None and req.skip_special_tokens) else set()
        out = new_output(req, skip)
        echo_text = ""
        if req.echo:
            echo_text = (req.prompt if isinstance(req.prompt, str) else
                         await asyncio.to_thread(tokenizer.decode, prompt_ids, req.skip_special_tokens) if tokenizer
                         else "")
        gen = _Generation(scheduler, prompt_ids, params)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(text: str, logprobs, finish):
            c = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                 "stop_reason": out.stop_reason if finish else None}
            if req.return_token_ids:
                c["prompt_token_ids"], c["token_ids"] = prompt_ids, list(out.token_ids)
            return c

        if not req.stream:
            await run_to_end(request, gen, out)
            text = echo_text + out.raw
            logprobs = await asyncio.to_thread(completion_logprobs, out, req, prompt_ids, 0, req.echo)
            return {"id": rid, "object": "text_completion", "created": now, "model": config.served_model_name,
                    "choices": [choice(text, logprobs, out.finish_reason)], "usage": usage(len(prompt_ids), out)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        async def body():
            def chunk(c, with_usage=False):
                d = {"id": rid, "object": "text_completion", "created": now, "model": config.served_model_name,
                     "choices": [c]}
                if with_usage:
                    d["usage"] = usage(len(prompt_ids), out)
                return sse(d)
            first, sent = True, 0  # tokens (ids, logprobs) already sent in a chunk
            async for event in gen.events():
                text = await asyncio.to_thread(out.add, event)
                if out.error is not None:
                    yield sse(error_body(500, out.error))
                    break
                if first and req.echo:
                    text = echo_text + text
                if not (text or out.finished or tokenizer is None):
                    continue  # a token that completes no text yet (half a character, a skipped special)
                c = choice(text, completion_logprobs(out, req, prompt_ids, sent, req.echo and first),
                           out.finish_reason)
                if req.return_token_ids:
                    c["token_ids"] = out.token_ids[sent:]
                first, sent = False, len(out.token_ids)
                yield chunk(c, continuous)
                if out.finished:
                    break
            if include_usage and out.error is None:
                yield sse({"id": rid, "object": "text_completion", "created": now,
                           "model": config.served_model_name, "choices": [], "usage": usage(len(prompt_ids), out)})

        return stream_response(guarded_events(rid, gen, body()))

    # -- chat completions

    def template_kwargs(kwargs: dict) -> dict:
        """``chat_template_kwargs`` with JSON types checked: the booleans are ``true``/``false`` (never ``"yes"``
        or ``1``), ``thinking_mode`` is ``"thinking"`` or ``"chat"``; a key the chat formats do not read is a 400."""
        for key, value in kwargs.items():
            if key not in TEMPLATE_KWARGS:
                raise APIError(400, f"chat_template_kwargs.{key} is not understood (known: "
                                    f"{', '.join(TEMPLATE_KWARGS)}).", f"chat_template_kwargs.{key}")
            kind = TEMPLATE_KWARGS[key]
            if kind is bool and not isinstance(value, bool):
                raise APIError(400, f"chat_template_kwargs.{key} must be true or false, got {json.dumps(value)}.",
                               f"chat_template_kwargs.{key}")
            if isinstance(kind, tuple) and value not in kind:
                raise APIError(400, f"chat_template_kwargs.{key} must be one of {', '.join(map(repr, kind))}, got "
                                    f"{json.dumps(value)}.", f"chat_template_kwargs.{key}")
        return kwargs

    def chat_options(req: ChatCompletionRequest) -> ChatOptions:
        kwargs = template_kwargs(req.chat_template_kwargs or {})
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False)) or \
            kwargs.get("thinking_mode") == "thinking"
        effort = req.reasoning_effort or kwargs.get("reasoning_effort")
        if not isinstance(effort, (str, type(None))):
            raise APIError(400, f"reasoning_effort must be a string, got {type(effort).__name__}.",
                           "reasoning_effort")
        effort = {None: None, "low": "high", "medium": "high", "high": "high", "max": "max", "xhigh": "max"}.get(effort, effort)
        if effort not in (None, "high", "max"):
            raise APIError(400, f"reasoning_effort must be one of low, medium, high, max; got {effort!r}.",
                           "reasoning_effort")
        tools = req.tool_dicts() if req.tool_choice in (None, "auto") else None
        if req.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "Only tool_choice 'auto' and 'none' are supported.", "tool_choice")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise APIError(400, "response_format other than 'text' is not supported.", "response_format")
        return ChatOptions(thinking=thinking, tools=tools or None, reasoning_effort=effort if thinking else None,
                           continue_final_message=req.continue_final_message)

    def chat_logprobs(out: _Output, req: ChatCompletionRequest, start: int) -> dict | None:
        if not req.logprobs:
            return None
        as_ids = req.return_tokens_as_token_ids

        def entry(tok, lp):
            text = _token_text(tokenizer, tok, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        content = []
        for tok, lp, top in out.logprobs[start:]:
            e = entry(tok, lp)
            e["top_logprobs"] = [entry(t, v) for t, v in top]
            content.append(e)
        return {"content": content}

    def chat_prompt(req: ChatCompletionRequest, options: ChatOptions) -> list[int]:
        """The rendered conversation's token ids (called in a worker thread)."""
        try:
            prompt_text = config.chat_format.render(req.message_dicts(), options)
        except ChatEncodingError as err:
            raise APIError(400, str(err), "messages") from None
        refuse_unfittable_text(prompt_text)
        return in_vocabulary(tokenizer.encode(prompt_text), "messages")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_body(request, ChatCompletionRequest)
        if config.chat_format is None or tokenizer is None:
            raise APIError(400, "This model has no tokenizer (no tokenizer.json, or a generated model), so chat is "
                                "unavailable: send token ids to /v1/completions.", "messages")
        options = chat_options(req)
        prompt_ids = await asyncio.to_thread(chat_prompt, req, options)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, len(prompt_ids), max_tokens,
                                 (req.top_logprobs or 0) if req.logprobs else None, None)
        keep = (THINK_OPEN, THINK_CLOSE) if options.thinking else ()
        skip = special_token_ids(tokenizer, keep=keep) if req.skip_special_tokens else set()
        out = new_output(req, skip)
        has_tools = bool(options.tools)
        gen = _Generation(scheduler, prompt_ids, params)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if not req.stream:
            await run_to_end(request, gen, out)
            parsed = parse_completion(out.raw, options.thinking, has_tools)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if options.thinking:
                message["reasoning_content"] = parsed.reasoning_content
            finish = out.finish_reason
            if parsed.tool_calls:
                message["tool_calls"], finish = parsed.tool_calls, "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": await asyncio.to_thread(chat_logprobs, out, req, 0),
                      "finish_reason": finish, "stop_reason": out.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            response = {"id": rid, "object": "chat.completion", "created": now, "model": config.served_model_name,
                        "choices": [choice], "usage": usage(len(prompt_ids), out)}
            if req.return_token_ids:
                response["prompt_token_ids"] = prompt_ids
            return response

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        parser = StreamingChatParser(options.thinking, has_tools)

        async def body():
            def chunk(delta: dict, finish=None, logprobs=None, token_ids=None):
                c = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if token_ids is not None:
                    c["token_ids"] = token_ids
                d = {"id": rid, "object": "chat.completion.chunk", "created": now,
                     "model": config.served_model_name, "choices": [c]}
                if continuous:
                    d["usage"] = usage(len(prompt_ids), out)
                return sse(d)
            yield chunk({"role": "assistant", "content": ""})
            sent = 0  # tokens (ids, logprobs) already sent in a chunk
            async for event in gen.events():
                text = await asyncio.to_thread(out.add, event)
                if out.error is not None:
                    yield sse(error_body(500, out.error))
                    break
                pieces = parser.feed(text) if text else []
                tool_calls: list[dict] = []
                if out.finished:
                    rest, tool_calls = parser.finish()
                    pieces += rest
                delta: dict[str, Any] = {}
                for kind, piece in pieces:
                    key = "reasoning_content" if kind == "reasoning" else "content"
                    delta[key] = delta.get(key, "") + piece
                if delta or (out.finished and sent < len(out.token_ids)):
                    ids = out.token_ids[sent:] if req.return_token_ids else None
                    yield chunk(delta, logprobs=chat_logprobs(out, req, sent), token_ids=ids)
                    sent = len(out.token_ids)
                if out.finished:
                    if tool_calls:
                        yield chunk({"tool_calls": [dict(c, index=k) for k, c in enumerate(tool_calls)]})
                    yield chunk({}, finish="tool_calls" if tool_calls else out.finish_reason)
                    break
            if include_usage and out.error is None:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": now,
                           "model": config.served_model_name, "choices": [],
                           "usage": usage(len(prompt_ids), out)})

        return stream_response(guarded_events(rid, gen, body()))

    return app
