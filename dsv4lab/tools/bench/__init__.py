"""Every benchmark of dsv4lab: each measures, checks against the reference where it computes, and writes JSON.

* :mod:`~dsv4lab.tools.bench.kernels` — ``dsv4lab bench kernels --suite decode|prefill``, which dispatches to
  :mod:`~dsv4lab.tools.bench.decode` and :mod:`~dsv4lab.tools.bench.prefill`; both share the harness of
  :mod:`~dsv4lab.tools.bench.common` (timers, ceilings measured in the same run, random inputs), iterate the kernel
  families' variants (:mod:`dsv4lab.engine.kernel_families`) and, from a GPU, write what they measured fastest as a
  tuned file the dispatch reads (:mod:`~dsv4lab.tools.bench.tuned`).
* :mod:`~dsv4lab.tools.bench.engine` — engine-side prefill/decode throughput (``dsv4lab bench engine``).
* :mod:`~dsv4lab.tools.bench.serve` — the OpenAI endpoint under load: TTFT, TPOT, ITL (``dsv4lab bench serve``).
* :mod:`~dsv4lab.tools.bench.e2e` — a generated full-width model, end to end, one or several ranks (``dsv4lab bench e2e``).
* :mod:`~dsv4lab.tools.bench.collectives` — library vs peer-read all-reduce (``dsv4lab bench collectives``).

The cost model and roofline these numbers are compared with live in :mod:`dsv4lab.tools.perf`.
"""
