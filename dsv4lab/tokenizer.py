"""Tokenizers: the checkpoint's ``tokenizer.json`` (via the ``tokenizers`` library) and the small-model BPE.

The small models use a byte-level BPE with 4,096 ids trained on the training split of :mod:`dsv4lab.train.corpus`.
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

from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

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
        self._tok = HFTokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._tok.token_to_id(BOS)
        self.eos_id = self._tok.token_to_id(EOS)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)


def load_tokenizer(checkpoint: str | Path) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it ships none."""
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
