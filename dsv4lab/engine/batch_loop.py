"""One-token decode steps for a changing set of rows, the host reading each step's ids one step behind the device.

:meth:`ModelRunner.decode_greedy <dsv4lab.engine.runner.ModelRunner.decode_greedy>` runs a fixed batch to its end;
a server's batch changes between steps: sequences join after their prefill and leave when they finish.
:class:`BatchLoop` is that loop. Each :meth:`~BatchLoop.step`

1. feeds every stepping row its next token — on the device, the id the row's previous step chose (never read back
   first), or a token the host gave (:meth:`~BatchLoop.join`, :meth:`~BatchLoop.feed`);
2. launches one step through the runner's decoder (``runner.decoder.stepper(slots)``: the CUDA-graph tier or the
   static step; ``runner.forward`` on the eager path), chooses each row's argmax on the device and queues its copy
   to the host with one ``isfinite`` flag folded in (:func:`dsv4lab.engine.finite.greedy_ids`: −1 for a row whose
   logits are not finite);
3. returns the **previous** step's ids of the device-fed rows (read while this step runs) and, for the rows the host
   chooses for (sampling, logprobs, logit processors: ``on_host``), this step's logits, which the host reads at once.

Rows join and leave between steps; the stepper is rebuilt only when the set of stepping rows changes. A row joins
with the number of steps it may take (its token budget, its room in the cache); it stops stepping when they are
spent and stays until its last id has been read. **The overshoot rule, per row:** a row whose id read at step
``i`` is a stop token has already been fed into step ``i + 1`` (launched before the read): that step wrote the stop
token's cache rows at the slot's next position. A caller that continues the sequence overwrites them with the next
token fed there (see ``tests/test_decode_greedy.py``: bit for bit); a caller that ends it resets the slot. No row
ever steps past its budget or the cache: the count-based limits are known before launching.

The loop keeps ``runner.positions`` of its slots equal to the positions it has fed, so ``runner.forward`` (a
prefill of another slot between steps, the eager path) sees consistent bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4lab.engine.finite import greedy_ids


@dataclass
class _Row:
    slot: int
    position: int               # where the row's next token is fed
    steps_left: int             # steps it may still take
    on_host: bool               # the host chooses its tokens (from the logits this step returns)
    token: int | None = None    # a host-given next token (None: the device's choice of the row's last step)


@dataclass
class Step:
    """What one :meth:`BatchLoop.step` hands back.

    Attributes:
        ids: ``(slot, id)`` chosen by the previous step for each device-fed row still joined, in batch order
            (``id`` is :data:`~dsv4lab.engine.finite.NON_FINITE` where that row's logits were not finite).
        logits: ``(slot, logits [vocab] fp32 on the host)`` of this step for each ``on_host`` row.
    """
    ids: list[tuple[int, int]] = field(default_factory=list)
    logits: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class BatchLoop:
    """Decode steps over rows that join and leave between steps (see the module doc).

    Args:
        runner: a :class:`~dsv4lab.engine.runner.ModelRunner` (``decoder``, ``forward``, ``positions``, ``args``).
    """

    def __init__(self, runner):
        self.runner = runner
        self.rows: dict[int, _Row] = {}
        self.steps = 0
        self._slots: list[int] = []            # the stepping rows of the last launch, in batch order
        self._advance = None                   # stepper for _slots
        self._feed: torch.Tensor | None = None  # the last launch's argmax per row (device)
        self._positions: torch.Tensor | None = None
        self._pending: tuple[list[_Row], torch.Tensor, object] | None = None  # (rows, host ids, ready event)

    # ------------------------------------------------------------------ rows
    def join(self, slot: int, token: int, position: int, steps: int, on_host: bool = False) -> None:
        """Add a row: ``token`` is fed at ``position`` of ``slot`` (whose caches hold the positions before it) at
        the next step; it takes at most ``steps`` steps."""
        slot, position, steps = int(slot), int(position), int(steps)
        if slot in self.rows:
            raise ValueError(f"slot {slot} already decodes in this loop")
        if steps < 1:
            raise ValueError(f"a row joins with at least one step to take, got {steps}")
        if position + steps > self.runner.args.max_seq_len:
            raise ValueError(f"{steps} steps from position {position} would exceed "
                             f"max_seq_len={self.runner.args.max_seq_len}")
        if not 0 <= int(token) < self.runner.args.vocab_size:
            raise ValueError(f"token id {token} is outside [0, {self.runner.args.vocab_size})")
        self.rows[slot] = _Row(slot, position, steps, on_host, int(token))
        self.runner.positions[slot] = position

    def feed(self, slot: int, token: int) -> None:
        """The host's choice of ``slot``'s next token (an ``on_host`` row, after reading its logits)."""
        if not 0 <= int(token) < self.runner.args.vocab_size:
            raise ValueError(f"token id {token} is outside [0, {self.runner.args.vocab_size})")
        self.rows[int(slot)].token = int(token)

    def leave(self, slot: int) -> None:
        """Drop a row (finished, failed or aborted); a step already launched for it is not read."""
        self.rows.pop(int(slot), None)

    @property
    def busy(self) -> bool:
        """Rows to step or ids still to read."""
        return self._pending is not None or any(self._steps_now())

    def _steps_now(self) -> list[_Row]:
        return [r for r in self.rows.values() if r.steps_left > 0 and not (r.on_host and r.token is None)]

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> Step:
        """Launch one step for the rows that step now, then read the previous launch's device-fed ids."""
        out = Step()
        stepping = self._steps_now()
        pending, self._pending = self._pending, None
        if stepping:
            self._launch(stepping, out)
        if pending is not None:
            rows, host, ready = pending
            if ready is not None:
                ready.synchronize()
            for row, token in zip(rows, host.tolist()):
                if self.rows.get(row.slot) is row:  # not a row that left (its slot may hold a new one by now)
                    out.ids.append((row.slot, token))
        return out

    def _launch(self, stepping: list[_Row], out: Step) -> None:
        r, dev = self.runner, self.runner.device
        slots = [row.slot for row in stepping]
        same = slots == self._slots and all(row.token is None for row in stepping)
        if same:  # the same rows as the last launch, each fed its own choice: nothing crosses to the device
            tokens, positions = self._feed, self._positions + 1
        else:
            tokens, positions = self._inputs(stepping, dev)
            if slots != self._slots or self._advance is None:
                self._advance = self._stepper(torch.tensor(slots, dtype=torch.long, device=dev))
            self._slots = slots
        logits = self._advance(tokens, positions)
        feed, seen = greedy_ids(logits)
        self._feed, self._positions = feed, positions
        device_rows = [i for i, row in enumerate(stepping) if not row.on_host]
        if device_rows:
            host = torch.empty(len(device_rows), dtype=torch.long, pin_memory=dev.type == "cuda")
            picked = seen if len(device_rows) == len(stepping) else seen[torch.tensor(device_rows, device=dev)]
            host.copy_(picked, non_blocking=True)
            ready = None
            if dev.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            self._pending = ([stepping[i] for i in device_rows], host, ready)
        host_rows = [i for i, row in enumerate(stepping) if row.on_host]
        if host_rows:
            rows = logits[torch.tensor(host_rows, device=dev)].float().cpu()
            out.logits.extend((stepping[i].slot, rows[j]) for j, i in enumerate(host_rows))
        for row in stepping:
            row.position += 1
            row.steps_left -= 1
            row.token = None
            r.positions[row.slot] = row.position
        self.steps += 1

    def _inputs(self, stepping: list[_Row], dev) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token (the last launch's choice on the device, or the host's) and position."""
        last = {slot: i for i, slot in enumerate(self._slots)}
        n_last = len(self._slots)
        given = [row.token for row in stepping if row.token is not None]
        index = []
        for row in stepping:
            if row.token is not None:  # the host's tokens follow the last launch's choices in `source`
                index.append(n_last + sum(1 for r in stepping[:len(index)] if r.token is not None))
            elif row.slot in last and self._feed is not None:
                index.append(last[row.slot])
            else:
                raise RuntimeError(f"slot {row.slot} has no next token: feed() it, or join it with one")
        host = torch.tensor([index, [row.position for row in stepping]], dtype=torch.long).to(dev, non_blocking=True)
        source = torch.tensor(given, dtype=torch.long).to(dev, non_blocking=True)
        if n_last:
            source = torch.cat((self._feed, source))
        return source[host[0]], host[1]

    def _stepper(self, slots: torch.Tensor):
        """``advance(tokens, positions) → [b, vocab]`` logits for ``slots``: the decoder's stepper, or on the eager
        path (no decoder) ``runner.forward`` one token per row."""
        r = self.runner
        decoder = r.decoder
        if decoder is not None:
            return decoder.stepper(slots)
        slots_cpu = slots.cpu()

        def forward_step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return r.forward(tokens[:, None], positions, slots=slots_cpu)[:, -1]
        return forward_step


__all__ = ["BatchLoop", "Step"]
