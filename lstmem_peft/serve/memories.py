"""Session memories on the worker thread: a fresh one, batched memory writes through the served
model's engine (:meth:`~.engine.Engine.write`), and the state and gate statistics the record and
the page show.

Memory writes run on the scheduler's single worker thread (an engine is never entered by two threads
at once).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lstmem_peft.memory.cache import MemoryCache, MemoryLayout

from .engine import Engine, MemoryRow


def fresh_memory(layout: MemoryLayout, device: torch.device) -> MemoryCache:
    """A one-row memory with zero states (a session that has written nothing yet)."""
    cache = MemoryCache(layout)
    cache.ensure(1, device)
    return cache


def state_norms(cache: MemoryCache) -> dict[str, list[float]]:
    """Frobenius norms of ``C`` and ``D`` of every memory layer (row 0), for the record and page."""
    if not cache.is_initialized:
        return {"cell": [], "hidden": []}
    return {
        "cell": [float(layer.cell[0].double().norm()) for layer in cache.layers],
        "hidden": [float(layer.hidden[0].double().norm()) for layer in cache.layers],
    }


def write_rows(
    engine: Engine, rows: list[MemoryRow], tokens: list[list[int]], device: torch.device
) -> tuple[list[MemoryRow], list[dict | None]]:
    """Write ``tokens[i]`` into ``rows[i]`` as history (blocks + feedback) in one batched call of the
    engine's :meth:`~.engine.Engine.write`.

    Args:
        engine: what writes (the served model's :class:`~.engine.Engine`).
        rows: the memories (not modified).
        tokens: token ids per row; rows with none are returned as they are.
        device: where session memories live (the served model's ``LoadedModel.device``).

    Returns:
        the new memories (same order; a row's new memory on ``device``) and the gate
        statistics of each row's write (or ``None``: a row that wrote nothing, or an engine that
        reports no gates, as vLLM).
    """
    out = list(rows)
    gates: list[dict | None] = [None] * len(rows)
    active = [i for i, t in enumerate(tokens) if t]
    if not active:
        return out, gates
    written, stats = engine.write([rows[i] for i in active], [tokens[i] for i in active])
    for i, row, gate in zip(active, written, stats, strict=True):
        out[i], gates[i] = replace(row, memory=row.memory.to(device)), gate
    return out, gates


def merge_gates(a: dict | None, b: dict | None, na: int, nb: int) -> dict | None:
    """Token-weighted mean of two writes' gate statistics (either may be missing): a turn's writes
    before and after answering (``na`` and ``nb`` tokens), as one record."""
    if a is None or b is None:
        return a if b is None else b
    total = na + nb
    return {k: [(x * na + y * nb) / total for x, y in zip(a[k], b[k], strict=True)] for k in a}
