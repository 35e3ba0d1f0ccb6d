"""OpenAI-compatible serving of any checkpoint dsv4lab can load, and the benchmarks of the engine and endpoint.

Modules (importing this package imports none of them, and nothing imports FastAPI until a server is built):

- :mod:`~dsv4lab.tools.serve.encoding` — DeepSeek-V4's chat encoder, the small models' simple chat format, and the
  parsing of generated text into reasoning / answer / tool calls.
- :mod:`~dsv4lab.tools.serve.detokenizer` — incremental detokenization for streaming.
- :mod:`~dsv4lab.tools.serve.protocol` — request models, validation, OpenAI error shapes with vLLM's wording.
- :mod:`~dsv4lab.tools.serve.limits` — every bound on a request (body size, content type, JSON, field ranges, prompt
  length) and the checks that apply them.
- :mod:`~dsv4lab.tools.serve.scheduler` — the request queue and the batched engine loop over cache slots.
- :mod:`~dsv4lab.tools.serve.app` — the FastAPI app; :mod:`~dsv4lab.tools.serve.server` — loading, uvicorn, a
  background server for tests and notebooks.
- :mod:`~dsv4lab.tools.serve.verify_endpoint` (``dsv4lab verify endpoint``). The engine and endpoint benchmarks are
  :mod:`dsv4lab.tools.bench.engine` and :mod:`dsv4lab.tools.bench.serve`.
"""

API_KEY_ENV = "DSV4LAB_API_KEY"
"""The environment variable ``dsv4lab serve`` reads its API key from (a key on the command line shows in ``ps``)."""
