"""Tokenizers: the checkpoint's ``tokenizer.json`` (via the ``tokenizers`` library) and the small-model BPE.

The small models use a byte-level BPE with 4,096 ids trained on the training split of :mod:`dsv4lab.tools.train.corpus`.
Its first ids are DeepSeek-V4's special tokens, so prompts are built the same way as for the real model:

====  ============================
id    token
====  ============================
0     ``<｜begin▁of▁sentence｜>`` (BOS)
1     ``<｜end▁of▁sentence｜>`` (EOS, also padding)
2     ``<｜User｜>``
3     ``<｜Assistant｜>``
4     ``<think>``
5     ``</think>``
====  ============================
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from dsv4lab.core.errors import CheckpointError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE]


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with the ids the engine and server need."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as err:  # the library raises a bare Exception for any malformed file
            raise CheckpointError(self.path.parent, [f"{self.path.name}: not a tokenizer the tokenizers library "
                                                     f"can read ({_first_line(err)})"]) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # ids need not be dense: a tokenizer of n tokens may still hand out an id >= n
        self.max_id = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        self.bos_id = self._tok.token_to_id(BOS)
        self.eos_id = self._tok.token_to_id(EOS)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def ids_outside(self, ids: Sequence[int], vocab_size: int) -> list[tuple[int, int]]:
        """``(position, id)`` of the first few ``ids`` outside ``[0, vocab_size)`` (what an encoded text must never
        hold before it reaches the embedding)."""
        return [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size][:5]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)


    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for, when the tokenizer keeps every input character
        (a byte-level BPE without a normalizer, as DeepSeek's and the small models'): a text of ``n`` characters
        then has at least ``ceil(n / max_chars_per_token)`` tokens, known without tokenizing it. None for a
        tokenizer that may drop or merge characters before tokenizing."""
        spec = json.loads(self._tok.to_str())
        if not _keeps_every_character(spec.get("normalizer"), spec.get("pre_tokenizer")):
            return None
        # A byte-level token's string has one character per byte, and a text character is at least one byte;
        # an added (special) token stands for exactly its own characters.
        return max(1, max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1))

    def problems(self, vocab_size: int, bos_id: int, eos_id: int) -> list[str]:
        """What makes this tokenizer unusable with a model of ``vocab_size`` ids and these BOS/EOS ids."""
        out = []
        name = self.path.name
        if self.vocab_size > vocab_size or self.max_id >= vocab_size:
            out.append(f"{name}: {self.vocab_size} token ids up to {self.max_id} but the model embeds only "
                       f"{vocab_size} (config.json vocab_size); ids >= {vocab_size} would have no embedding")
        for what, token, got, want in (("BOS", BOS, self.bos_id, bos_id), ("EOS", EOS, self.eos_id, eos_id)):
            if got is not None and got != want:
                out.append(f"{name}: {what} {token} is id {got}, config.json says {want}")
        try:
            self._tok.decode(list(range(min(self.vocab_size, 256))))
        except Exception as err:  # a decoder the library cannot run on valid ids
            out.append(f"{name}: cannot decode token ids ({_first_line(err)})")
        return out


_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def _keeps_every_character(normalizer: dict | None, pre_tokenizer: dict | None) -> bool:
    """True when no normalizer changes the text and the pre-tokenizers only split it, one of them byte-level."""
    if normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return False
    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer]) if pre_tokenizer else []
    for step in steps:
        kind = step.get("type")
        if kind == "Split" and step.get("behavior") not in _KEEPING_SPLITS:
            return False
        if kind not in ("ByteLevel", "Split", "Digits"):
            return False
    return any(step.get("type") == "ByteLevel" for step in steps)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def load_tokenizer(checkpoint: str | Path) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it ships none; a file the tokenizers library cannot read
    raises :class:`~dsv4lab.core.errors.CheckpointError` naming it."""
    p = Path(checkpoint) / "tokenizer.json"
    return Tokenizer(p) if p.exists() else None


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, out: str | Path | None = None):
    """Train the small models' byte-level BPE (deterministic for a given text order)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    if out is not None:
        tok.save(str(out), pretty=False)
    return tok
