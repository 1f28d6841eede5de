"""Running the server: load the model, build the app and serve it with uvicorn until interrupted
(what ``lstmem serve`` does)."""

from __future__ import annotations

from .app import create_app
from .loading import load_model


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

    ``engine``/``vllm_options``: see :func:`~lstmem_peft.serve.loading.load_model`. ``options`` go to
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
