"""Rebuild data/tokenizers/pystdlib-bpe-4096.json: byte-level BPE, 4,096 ids, on the corpus training split.

    python scripts/train_tokenizer.py [--out data/tokenizers/pystdlib-bpe-4096.json]

The corpus is the running interpreter's standard library (see dsv4lab/tools/train/corpus.py for exactly which files);
the committed file was built with Python 3.11.7, whose corpus manifest digest the script prints.
"""
import argparse

from dsv4lab.tools.train.corpus import corpus_manifest, read_corpus
from dsv4lab.core.tokenizer import train_bpe

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", default="data/tokenizers/pystdlib-bpe-4096.json")
p.add_argument("--vocab-size", type=int, default=4096)
a = p.parse_args()
split = read_corpus()
train_bpe([t for _, t in split["train"]], a.vocab_size, a.out)
m = corpus_manifest()
print(f"wrote {a.out}: {m['n_files']} files ({m['n_heldout']} held out), corpus digest {m['digest'][:16]}")
