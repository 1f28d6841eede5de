"""``lstmem serve``: an OpenAI-compatible HTTP server whose sessions keep a persistent LSTMem memory.

Needs the ``serve`` extra (``pip install "lstmem-peft[serve]"``); ``import lstmem_peft`` never imports
this package. Shaped as vLLM's OpenAI server is, from the HTTP side down:

* :mod:`.app`: the FastAPI app: middlewares, exception handlers, lifespan, route wiring;
* :mod:`.protocol`: every request and response body (pydantic models) and the error shape;
* :mod:`.serving_chat`, :mod:`.serving_completions`, :mod:`.serving_models`, :mod:`.serving_memory`:
  one serving class per endpoint family, over :mod:`.serving_base` (shared checks, streaming);
* :mod:`.scheduler`: the worker thread that batches jobs; :mod:`.runner` runs them (:mod:`.planning`:
  what a turn writes and prompts with);
* :mod:`.engine`: the one seam to what runs the model (:mod:`.engine_library`: the PeftModel in this
  process; :mod:`.engine_vllm`: a vLLM engine, ``--engine vllm``), speaking :mod:`.decoding`'s types;
* :mod:`.loading` (the served model's facts and loading), :mod:`.conversation` (message identity in
  a session's record), :mod:`.memories` (fresh memories, batched memory writes, state statistics),
  :mod:`.generation` (answers and log-probabilities as a client sees them), :mod:`.jobs` (what the
  serving classes queue) and :mod:`.events` (what comes back), :mod:`.store` (sessions on disk),
  :mod:`.metrics` (Prometheus), :mod:`.page` (the page at ``/``);
* :mod:`.server`: :func:`serve`, what ``lstmem serve`` runs.
"""

from __future__ import annotations

from lstmem_peft.utils.extras import missing_extra

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as err:  # depends on the environment
    raise missing_extra(err, "serve", "lstmem serve (lstmem_peft.serve)") from err

from .app import create_app
from .loading import LoadedModel, load_model
from .server import serve

__all__ = ["LoadedModel", "create_app", "load_model", "serve"]
