"""Training the small DeepSeek-V4 models and what is measured on them.

* :mod:`~dsv4lab.tools.train.corpus` — the offline corpus (Python's standard-library sources) and its held-out split.
* :mod:`~dsv4lab.tools.train.trainer` — the reference modules trained in float32, quantized into the native format,
  exported and evaluated (``dsv4lab train-small``; ``docs/training.md``).
* :mod:`~dsv4lab.tools.train.quant_ablation` — the weight-format ablation of the trained model.
"""
