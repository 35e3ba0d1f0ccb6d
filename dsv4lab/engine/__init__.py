"""The engine: loading a checkpoint into the model, caches, generation, backends and the graph-captured decode step.

:data:`BACKENDS` names the backends :func:`dsv4lab.engine.backends.make_ops` builds, and :data:`MAX_TEMPERATURE` and
:data:`SEED_RANGE` bound a generation request (:func:`dsv4lab.engine.sampling.check_generation`); they are defined
here, with no import, so the command line can offer and check them without importing torch.
"""

BACKENDS = ("reference", "triton")
MAX_TEMPERATURE = 2.0
"""The largest sampling temperature accepted (OpenAI's range is 0 to 2; the API, the CLI and the server agree)."""
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The sampling seeds ``torch.Generator.manual_seed`` accepts."""
