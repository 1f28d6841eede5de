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
* :mod:`.runtime` (the served model's facts and loading, message identity, batched memory writes),
  :mod:`.generation` (answers and log-probabilities as a client sees them), :mod:`.jobs` (what the
  serving classes queue), :mod:`.store` (sessions on disk), :mod:`.metrics` (Prometheus),
  :mod:`.page` (the page at ``/``).
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
from .runtime import LoadedModel, load_model


def serve(
    model: str | None = None,
    adapter: str | None = None,
    store: str = "lstmem-sessions",
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    api_keys: list[str] | None = None,
    threads: int | None = None,
    log_level: str = "info",
    engine: str = "hf",
    vllm_options: dict | None = None,
    **options,
) -> None:
    """Load the model and run the server until interrupted (what ``lstmem serve`` does).

    ``engine``/``vllm_options``: see :func:`~lstmem_peft.serve.runtime.load_model`. ``options`` go to
    :func:`~lstmem_peft.serve.app.create_app` (``context_window``, ``max_batch``, ``batch_wait_ms``,
    ``batching``, ``max_body_bytes``, ``default_max_tokens``, ``session_versions``,
    ``session_version_bytes``).
    """
    import torch
    import uvicorn

    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(
        model,
        adapter,
        name=name,
        device=device,
        dtype=dtype,
        engine=engine,
        vllm_options=vllm_options,
        store=store,
    )
    try:
        app = create_app(loaded, store, api_keys=api_keys, **options)
        window = app.state.scheduler.window
        print(
            f"lstmem serve: model {loaded.name!r}, context window {window} tokens, sessions in {store}, "
            f"http://{host}:{port}",
            flush=True,
        )
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        loaded.engine.close()  # a vLLM engine's processes end with the server


__all__ = ["LoadedModel", "create_app", "load_model", "serve"]
