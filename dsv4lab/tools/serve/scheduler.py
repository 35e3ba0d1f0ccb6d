"""The serving loop: a request queue and one engine thread that batches sequences over cache slots.

Each admitted sequence owns one of the model's cache slots (``m.forward(..., slots=...)``) from its prefill
to its last token; its slot is reset when it is admitted and again when it leaves, so states never mix.
One iteration of the engine thread:

1. drop aborted sequences (a client went away) and free their slots;
2. admit waiting sequences into free slots and prefill them together (right-padded, ``lengths`` per row),
   as many as fit in ``prefill_token_budget`` padded tokens; choose each one's first token on the host and let it
   join the decode loop;
3. one step of the engine's decode loop (:class:`~dsv4lab.engine.batch_loop.BatchLoop`) for every running
   sequence: greedy sequences are fed their previous choice on the device and their ids read **one step late**
   (the host delivers step ``i − 1``'s tokens while step ``i`` runs; a sequence whose token read is a stop has
   already run one step past it, and its slot is reset when it leaves); sequences whose tokens the host must
   choose (sampling, logprobs, ``logit_bias``, ``min_tokens``) have their logits read at once and their token fed
   back before the next step.

With ``speculative="mtp"`` step 3 is one speculative cycle (:class:`~dsv4lab.engine.speculative.
SpeculativeDecoder`, synchronous: its acceptance is read on the host): each greedy sequence gets its MTP block's
drafts verified in the same forward and may emit several tokens per step — the same tokens, one event each;
sampled sequences take one token per step.

**Fault isolation.** A request's failure is that request's alone: choosing a token (sampling, logit processors,
the check that the logits are finite) is done per sequence and a failure ends that sequence only, with its
reason; a prefill that fails for a group is retried one sequence at a time so that only the sequence that fails
alone is ended. Non-finite logits end their sequence with an error naming the position and the first non-finite
layer (:mod:`dsv4lab.engine.finite`), never a token. Only a failure of the decode step itself (a bug, not a
request) ends every sequence in that step.

The engine thread's wall time is counted per phase (``stats()``: ``prefill_s``, the admissions' prefills and first
tokens; ``decode_s``, the steps with their token deliveries), so a benchmark can say where a run's time went.

Tokens go back to the asyncio side through each request's ``asyncio.Queue`` (``call_soon_threadsafe``),
so the HTTP layer never touches the model. Greedy decoding is ``argmax`` of the same logits ``m.generate``
uses, and sampled decoding calls :func:`dsv4lab.engine.sampling.sample` with a per-request generator.
"""
from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4lab.core.errors import NonFiniteError, RequestError
from dsv4lab.engine.batch_loop import BatchLoop
from dsv4lab.engine.finite import NON_FINITE, check_rows, located, non_finite
from dsv4lab.engine.sampling import MIN_TEMPERATURE, bias_logits, sample
from dsv4lab.engine.speculative import SpeculativeDecoder, check_speculative

log = logging.getLogger("dsv4lab.tools.serve")


class SchedulerFull(RuntimeError):
    """No slot is free and the queue is full (or queuing is disabled)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (already validated by the HTTP layer)."""
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None          # None: no logprobs; k >= 0: the chosen token's plus the top k
    prompt_logprobs: int | None = None   # the same for every prompt token after the first (``echo``)
    top_k: int = 0                       # 0 (or -1): every token; k: sample among the k most likely
    min_tokens: int = 0                  # the stop tokens are banned until this many tokens are generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before choosing

    @property
    def greedy(self) -> bool:
        """Greedy (temperature below :data:`~dsv4lab.engine.sampling.MIN_TEMPERATURE`)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def on_host(self) -> bool:
        """The host must see this request's logits at every step (sampling, logprobs, logit processors)."""
        return not self.greedy or self.logprobs is not None or bool(self.logit_bias) or self.min_tokens > 0


@dataclass
class TokenEvent:
    """One step of one sequence, as delivered to its request.

    ``token_id`` is None on a final event that carries no token (abort, error). ``prompt_logprobs`` comes
    with the first event when it was asked for: ``[None, (logprob, top), ...]`` per prompt token.
    """
    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None     # "stop", "length", "abort", "error"
    error: str | None = None
    prompt_logprobs: list | None = None
    time: float = field(default_factory=time.perf_counter)


class Sequence:
    """A request inside the engine: its prompt, settings, slot and progress."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, deliver):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.deliver = deliver                  # callable(TokenEvent), thread-safe
        self.output_ids: list[int] = []
        self.slot: int | None = None
        self.finished = False
        self.generator = None                   # torch.Generator for sampled decoding, made on admission

    @property
    def length(self) -> int:
        """Tokens in the cache after the next forward of this sequence's newest token."""
        return len(self.prompt_ids) + len(self.output_ids)


class Scheduler:
    """Serves one loaded model to many concurrent requests.

    Args:
        model: the object :func:`dsv4lab.load` returns (``forward``, ``reset``, ``max_batch``, ``args``,
            ``decoder``, ``positions``).
        max_running: sequences decoded together (cache slots used); at most ``model.max_batch``.
        max_waiting: requests that may queue for a slot; 0 disables queuing (a full server answers 429).
        prefill_token_budget: padded prompt tokens prefilled in one forward (prompts beyond it wait for the
            next iteration; a single longer prompt is prefilled alone).
        batch_prefill: prefill several admitted prompts in one forward (False: one forward per prompt).
        speculative: ``"mtp"``: self-speculative decoding of greedy sequences (lossless); None: plain decoding.
        draft_tokens: tokens the MTP block drafts per step.
    """

    def __init__(self, model, max_running: int | None = None, max_waiting: int = 1024,
                 prefill_token_budget: int = 8192, batch_prefill: bool = True, speculative: str | None = None,
                 draft_tokens: int = 1):
        self.model = model
        slots = int(getattr(model, "max_batch", 1))
        self.max_running = min(max_running or slots, slots)
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_waiting = max_waiting
        self.prefill_token_budget = prefill_token_budget
        self.batch_prefill = batch_prefill
        self.max_seq_len = int(model.args.max_seq_len)
        self.vocab_size = int(model.args.vocab_size)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._by_slot: dict[int, Sequence] = {}
        self._aborted: set[str] = set()
        self._free_slots = list(range(self.max_running - 1, -1, -1))
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counters = collections.Counter()
        self.speculative = None
        if speculative is not None:
            check_speculative(speculative)
            self.speculative = SpeculativeDecoder(model, draft_tokens)
        self.batch = BatchLoop(model)

    # ---- asyncio side ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsv4lab-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, prompt_ids: list[int], params: SamplingParams, deliver, request_id: str | None = None) -> str:
        """Queue a sequence; ``deliver(TokenEvent)`` is called from the engine thread. Returns its id.

        Raises:
            RequestError: a prompt id outside the vocabulary, an empty prompt or one that fills the cache.
            SchedulerFull: every slot is busy and the queue is full (or disabled).
        """
        bad = next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if not 1 <= len(prompt_ids) < self.max_seq_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the cache holds {self.max_seq_len} "
                               "positions (at least 1 prompt token, and room for one more)")
        request_id = request_id or f"seq-{next(self._ids)}"
        with self._cond:
            if self._stop:
                raise SchedulerFull("the server is shutting down")
            running, waiting = len(self._running), len(self._waiting)
            if running + waiting >= self.max_running + self.max_waiting:
                raise SchedulerFull(f"{running} of {self.max_running} sequence slots are decoding and {waiting} "
                                    f"requests wait for one (a queue of at most {self.max_waiting})")
            self._waiting.append(Sequence(request_id, prompt_ids, params, deliver))
            self.counters["submitted"] += 1
            self._cond.notify_all()
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a sequence (its client went away); its slot is freed at the next engine iteration."""
        with self._cond:
            self._aborted.add(request_id)
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "max_running": self.max_running, "max_waiting": self.max_waiting,
                    "free_slots": len(self._free_slots), **{k: v for k, v in self.counters.items()}}

    # ---- engine thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not (self._stop or self._waiting or self._running or self._aborted or self.batch.busy):
                    self._cond.wait()
                if self._stop:
                    stopping = list(self._running) + list(self._waiting)
                    self._waiting.clear()
                    break
                aborted, self._aborted = self._aborted, set()
                admitted = []
                if aborted:  # requests that left while still queued never get a slot
                    kept = collections.deque(s for s in self._waiting if s.request_id not in aborted)
                    self.counters["aborted"] += len(self._waiting) - len(kept)
                    self._waiting = kept
                while self._waiting and self._free_slots:
                    seq = self._waiting.popleft()
                    seq.slot = self._free_slots.pop()
                    admitted.append(seq)
            for seq in list(self._running):
                if seq.request_id in aborted:
                    self._retire(seq, None)
                    self.counters["aborted"] += 1
            if admitted:
                t0 = time.perf_counter()
                self._prefill(admitted)
                self.counters["prefill_s"] += time.perf_counter() - t0
            if self._running or self.batch.busy:
                t0 = time.perf_counter()
                try:
                    self._decode()
                except Exception as err:  # the step itself broke (not one request): fail the sequences in it
                    log.exception("decode step failed")
                    for seq in list(self._running):
                        self._fail(seq, err)
                    self.batch = BatchLoop(self.model)
                self.counters["decode_s"] += time.perf_counter() - t0
        for seq in stopping:
            self._fail(seq, RuntimeError("the server is shutting down"))

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot is None:
            return
        self.batch.leave(seq.slot)
        self.model.reset(slots=torch.tensor([seq.slot], dtype=torch.long))
        with self._cond:
            self._free_slots.append(seq.slot)
            self._by_slot.pop(seq.slot, None)
            if seq in self._running:
                self._running.remove(seq)
        seq.slot = None

    def _retire(self, seq: Sequence, event: TokenEvent | None) -> None:
        seq.finished = True
        self._release_slot(seq)
        if event is not None:
            seq.deliver(event)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        """End ``seq`` with an error event. A :class:`NonFiniteError` is located first (its slot re-run with a
        trace) and its message sent; any other error is logged and the client sees only its kind."""
        if seq.finished:
            return
        self.counters["failed"] += 1
        if isinstance(err, NonFiniteError) and seq.slot is not None:
            self.batch.leave(seq.slot)
            err = located(self.model, seq.slot, seq.prompt_ids + seq.output_ids, err)
            message = str(err)
        elif isinstance(err, RequestError):
            message = str(err)
        else:
            message = f"internal error in the engine ({type(err).__name__})"
        log.error("request %s failed: %s", seq.request_id, err)
        self._retire(seq, TokenEvent(None, finish_reason="error", error=message))

    @staticmethod
    def _new_generator(seq: Sequence) -> None:
        """Sampled sequences get their own CPU generator (``sample`` draws on the CPU), seeded like
        ``m.generate(seed=...)`` so a seeded request reproduces it."""
        if not seq.params.greedy:
            seed = seq.params.seed if seq.params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator().manual_seed(seed)

    def _prefill_groups(self, admitted: list[Sequence]) -> list[list[Sequence]]:
        if not self.batch_prefill:
            return [[s] for s in admitted]
        groups, current, longest = [], [], 0
        for seq in admitted:
            n = len(seq.prompt_ids)
            if current and max(longest, n) * (len(current) + 1) > self.prefill_token_budget:
                groups.append(current)
                current, longest = [], 0
            current.append(seq)
            longest = max(longest, n)
        if current:
            groups.append(current)
        return groups

    def _prefill(self, admitted: list[Sequence]) -> None:
        self.model.reset(slots=torch.tensor([s.slot for s in admitted], dtype=torch.long))
        for group in self._prefill_groups(admitted):
            try:
                self._prefill_group(group)
            except Exception as err:
                if len(group) == 1:
                    log.exception("prefill failed")
                    self._fail(group[0], err)
                    continue
                # a group's failure may be one sequence's: retry each alone, so only that one fails
                log.warning("a batched prefill failed (%s: %s); prefilling its %d sequences one by one",
                            type(err).__name__, err, len(group))
                for seq in group:
                    if seq.finished or seq in self._running:
                        continue
                    self.model.reset(slots=torch.tensor([seq.slot], dtype=torch.long))
                    try:
                        self._prefill_group([seq])
                    except Exception as one:
                        log.exception("prefill of %s failed", seq.request_id)
                        self._fail(seq, one)

    def _prefill_group(self, group: list[Sequence]) -> None:
        device = _model_device(self.model)
        lengths = [len(s.prompt_ids) for s in group]
        width = max(lengths)
        pad = getattr(self.model.args, "eos_token_id", 0) or 0
        tokens = torch.full((len(group), width), pad, dtype=torch.long)
        for row, seq in enumerate(group):
            tokens[row, :lengths[row]] = torch.tensor(seq.prompt_ids, dtype=torch.long)
        ragged = len(set(lengths)) > 1
        slots = torch.tensor([s.slot for s in group], dtype=torch.long, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device) if ragged else None
        # the head on each row's last token only, unless a request wants its prompt's log-probabilities
        last_only = all(seq.params.prompt_logprobs is None for seq in group)
        if self.speculative is not None:  # last_only: the captured prefill step, as a plain prefill (issue 32)
            logits, _ = self.speculative.prefill(tokens.to(device), slots.tolist(), lengths=lengths_t,
                                                 logits="last" if last_only else "all")
        else:
            logits = self.model.prefill(tokens, slots=slots, lengths=lengths_t,
                                        logits="last" if last_only else "all")
        self.counters["prefill_forwards"] += 1
        self.counters["prefill_tokens"] += sum(lengths)
        last = (logits if last_only else
                torch.stack([logits[row, lengths[row] - 1] for row in range(len(group))])).float().cpu()
        for row, seq in enumerate(group):
            self._new_generator(seq)
            with self._cond:
                self._running.append(seq)
                self._by_slot[seq.slot] = seq
            try:
                prompt_logprobs = (self._prompt_logprobs(seq, logits[row, :lengths[row]])
                                   if seq.params.prompt_logprobs is not None else None)
                token = self._choose(seq, last[row])
            except Exception as err:
                self._fail(seq, err)
                continue
            if not self._emit_token(seq, token, last[row], prompt_logprobs) and self.speculative is None:
                self.batch.join(seq.slot, token, seq.length - 1, self._steps_left(seq), seq.params.on_host)

    def _steps_left(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still generate: its budget and its room in the cache."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.max_seq_len - seq.length)

    # ---- decoding -------------------------------------------------------------------------------------
    def _decode(self) -> None:
        if self.speculative is not None:
            batch = [s for s in self._running if not s.finished]
            if batch:
                self._decode_speculative(batch)
            return
        step = self.batch.step()
        self.counters["decode_steps"] += 1
        for slot, token in step.ids:  # device-fed sequences, one step late
            seq = self._by_slot[slot]
            if token == NON_FINITE:
                self._fail(seq, non_finite(0, seq.length - 1))
            else:
                self._emit_token(seq, token, None, None)
        for slot, logits in step.logits:  # the host chooses, now
            seq = self._by_slot[slot]
            try:
                token = self._choose(seq, logits)
            except Exception as err:
                self._fail(seq, err)
                continue
            if not self._emit_token(seq, token, logits, None):
                self.batch.feed(slot, token)

    def _decode_speculative(self, batch: list[Sequence]) -> None:
        """One speculative cycle: greedy sequences verify up to ``draft_tokens`` drafts (never more than their
        budget needs), the others run a plain step and choose from its logits on the host."""
        greedy = [s.params.greedy and not s.params.logit_bias and s.params.min_tokens == 0 for s in batch]
        counts = [min(self.speculative.draft_tokens, self._steps_left(s) - 1) if g else 0
                  for s, g in zip(batch, greedy)]
        results = self.speculative.step([s.slot for s in batch], tokens=[s.output_ids[-1] for s in batch],
                                        draft_counts=counts)
        self.counters["decode_steps"] += 1
        self.counters["drafted_tokens"] += sum(r.drafted for r in results)
        self.counters["accepted_tokens"] += sum(r.accepted for r in results)
        for seq, g, res in zip(batch, greedy, results):
            try:
                logits = res.logits.float()
                check_rows(logits)
                tokens = res.tokens if g else [self._choose(seq, logits[0].cpu())]
            except Exception as err:
                self._fail(seq, err)
                continue
            for j, token in enumerate(tokens):
                if self._emit_token(seq, int(token), logits[j], None):
                    break

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> int:
        """``seq``'s next token from its logits row ``[vocab]``: its logit processors, then greedy or a draw
        (raises :class:`NonFiniteError` for non-finite logits)."""
        p = seq.params
        check_rows(logits[None])  # the model's logits: before the processors, whose −inf bans are intended
        banned = sorted(p.stop_token_ids) if len(seq.output_ids) < p.min_tokens else ()
        row = bias_logits(logits[None], p.logit_bias, banned)
        if p.greedy:
            return int(row[0].argmax())
        return int(sample(row, p.temperature, p.top_p, seq.generator, top_k=p.top_k, check=False)[0])

    def _emit_token(self, seq: Sequence, token: int, logits_row, prompt_logprobs) -> bool:
        """Deliver one chosen token of ``seq``; retire it when it is finished (returns True then)."""
        seq.output_ids.append(token)
        self.counters["generated_tokens"] += 1
        logprob = top = None
        if seq.params.logprobs is not None and logits_row is not None:
            logprob, top = _logprobs_of(logits_row, token, seq.params.logprobs)
        finish = None
        if token in seq.params.stop_token_ids:  # (banned by _choose while fewer than min_tokens are out)
            finish = "stop"
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.length >= self.max_seq_len:
            finish = "length"
        event = TokenEvent(token, logprob, top, finish_reason=finish, prompt_logprobs=prompt_logprobs)
        if finish:
            self.counters["finished"] += 1
            self._retire(seq, event)
        else:
            seq.deliver(event)
        return finish is not None

    @staticmethod
    def _prompt_logprobs(seq: Sequence, logits) -> list:
        """Logprob (and top-k) of every prompt token after the first under the prefill logits."""
        out: list = [None]
        for j in range(1, len(seq.prompt_ids)):
            out.append(_logprobs_of(logits[j - 1], seq.prompt_ids[j], seq.params.prompt_logprobs))
        return out


def _logprobs_of(logits_row, token: int, top_k: int) -> tuple[float, list[tuple[int, float]]]:
    lp = torch.log_softmax(logits_row.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_k > 0:
        values, ids = lp.topk(min(top_k, lp.numel()))
        top = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), top


def _model_device(model):
    dev = getattr(model, "device", None)
    if dev is not None:
        return dev
    try:
        params = getattr(model, "parameters", None)
        if callable(params):
            return next(iter(params())).device
        return torch.device("cpu")
    except StopIteration:
        return "cpu"
