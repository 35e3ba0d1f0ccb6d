"""Incremental detokenization for streaming: token ids in, text deltas out.

Byte-level BPE tokens may split a UTF-8 character across tokens, and some decoders change earlier text
when a token is appended. The detokenizer therefore decodes a short window of recent tokens and emits only
the text that is past the previously emitted part and does not end in an incomplete character (U+FFFD),
the same scheme vLLM and text-generation-inference use.
"""
from __future__ import annotations

from typing import Iterable

from dsv4lab.core.tokenizer import SPECIAL_TOKENS

REPLACEMENT_CHAR = "\ufffd"

# Control tokens beyond the tiny tokenizer's six that the DeepSeek-V4 tokenizer defines.
DSV4_EXTRA_SPECIAL = ["<｜latest_reminder｜>", "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>",
                      "<｜title｜>", "<｜read_url｜>"]


def special_token_ids(tokenizer, keep: Iterable[str] = ()) -> set[int]:
    """Ids of the control tokens the tokenizer knows, except those named in ``keep``."""
    keep = set(keep)
    ids = set()
    for tok in SPECIAL_TOKENS + DSV4_EXTRA_SPECIAL:
        if tok in keep:
            continue
        i = tokenizer.token_to_id(tok)
        if i is not None:
            ids.add(i)
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Args:
        tokenizer: a :class:`dsv4lab.core.tokenizer.Tokenizer`.
        skip_ids: token ids that produce no text (the control tokens, as ``skip_special_tokens`` does).
    """

    def __init__(self, tokenizer, skip_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.skip_ids = set(skip_ids)
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are settled
        self.read_offset = 0    # tokens before it have been emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ('' while a character is incomplete)."""
        if token_id in self.skip_ids:
            return ""
        self.ids.append(int(token_id))
        settled = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(settled) and not window.endswith(REPLACEMENT_CHAR):
            delta = window[len(settled):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: the text still held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        settled = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        delta = window[len(settled):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
