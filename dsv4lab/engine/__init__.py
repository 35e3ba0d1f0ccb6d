"""The engine: loading a checkpoint into the model, caches, generation, backends and the graph-captured decode step.

:data:`BACKENDS` names the backends :func:`dsv4lab.engine.backends.make_ops` builds; it is defined here, with no
import, so the command line can offer them as choices without importing torch.
"""

BACKENDS = ("reference", "triton")
