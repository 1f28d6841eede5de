"""History blocks written over several forwards (lstmem_peft/memory/chunks.py): the feedback samples a
pass over slot tables keeps across a block's chunks, and the terminals it hands to block-end feedback,
equal those of the library's pass that writes each block in one forward; without a transformer or vLLM."""

from types import SimpleNamespace

import pytest
import torch
from tiny_models import memory_stack

from lstmem_peft import LSTMemLayer, MemoryCache, MemoryLayout, MemoryPass
from lstmem_peft.memory.chunks import BlockSamples, plan_chunk
from lstmem_peft.memory.feedback import BlockEnds
from lstmem_peft.memory.storage import SlotTables

L, H, R, D, SLOTS = 3, 2, 4, 16, 6
LAYOUT = MemoryLayout(tuple(range(L)), H, R)
PROMPT, BLOCK, POSITIONS = 20, 11, 4  # blocks [0, 11) and [11, 20), 4 samples each
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _stack(seed=0) -> list[LSTMemLayer]:
    return memory_stack(D, L, seed, num_heads=H, head_dim=R)


def _tables(seed=1) -> SlotTables:
    g = torch.Generator().manual_seed(seed)
    shape = (SLOTS, H, R, R)
    return SlotTables(
        [
            SimpleNamespace(
                kv_cache=(0.5 * torch.randn(shape, generator=g), 0.5 * torch.randn(shape, generator=g))
            )
            for _ in range(L)
        ]
    )


def _copy_terminals(group) -> list:
    return [SimpleNamespace(**{k: v.clone() for k, v in vars(t).items()}) for t in group[2]]


def _whole_blocks(layers, tables, slot, xs):
    """The library's way: each block one forward over a one-row cache holding ``slot``'s states,
    feedback in its :meth:`MemoryPass.finish`. Returns per block the terminals and the states after."""
    cache = MemoryCache(LAYOUT)
    cache.ensure(1, torch.device("cpu"))
    for d, state in enumerate(cache.layers):
        cell, hidden = tables.read(d, torch.tensor([slot]))
        state.cell, state.hidden = cell.clone(), hidden.clone()
    blocks = []
    for start in range(0, PROMPT, BLOCK):
        stop = min(start + BLOCK, PROMPT)
        memory_pass = MemoryPass(cache, feedback=True, feedback_positions=POSITIONS)
        for d, layer in enumerate(layers):
            memory_pass.run(d, layer, xs[d][None, start:stop])
        terminals = _copy_terminals(memory_pass.block_ends.groups[0])
        assert memory_pass.finish() is not None
        states = [(s.cell.clone(), s.hidden.clone()) for s in cache.layers]
        blocks.append((terminals, states))
    return blocks


def test_samples_kept_over_chunks_equal_one_whole_block_pass():
    """Two history requests in slots 4 and 1, chunked differently (a one-token chunk among them) and
    run side by side, padded, in passes over the slot tables that keep their samples: at each block
    end every layer's terminal (states, gates, keys and values at the samples) equals the whole-block
    pass's, and so do the states after the feedback that follows, batched over both requests."""
    layers, tables = _stack(), _tables()
    requests = {4: [3, 1, 5, 2, 4, 5], 1: [11, 6, 3]}  # slot -> its chunk lengths, in order
    xs = {slot: [torch.randn(PROMPT, D) for _ in range(L)] for slot in requests}
    expected = {slot: _whole_blocks(layers, tables, slot, xs[slot]) for slot in requests}

    store = BlockSamples(BlockEnds(L))
    position = dict.fromkeys(requests, 0)
    seen = {slot: [] for slot in requests}
    for step in range(max(len(c) for c in requests.values())):
        running = [(slot, lengths[step]) for slot, lengths in requests.items() if step < len(lengths)]
        T = max(n for _, n in running)
        chunks, x, valid = [], [torch.zeros(len(running), T, D) for _ in range(L)], []
        for row, (slot, n) in enumerate(running):
            start = position[slot]
            chunks.append((row, slot, plan_chunk(start, n, PROMPT, BLOCK, POSITIONS)))
            for d in range(L):
                x[d][row, :n] = xs[slot][d][start : start + n]
            valid.append(torch.arange(T) < n)
            position[slot] += n
        slots = torch.tensor([slot for slot, _ in running])
        memory_pass = MemoryPass(tables, torch.stack(valid), slots=slots, samples=store, chunks=chunks)
        for d, layer in enumerate(layers):
            memory_pass.run(d, layer, x[d])
        assert memory_pass.finish() is None
        ended = [slot for _, slot, plan in chunks if plan.ends_block]
        assert sorted(store.ends.groups) == sorted(ended)
        terminals = {slot: _copy_terminals(store.ends.groups[slot]) for slot in ended}
        store.ends.apply(tables)
        for slot in ended:
            states = [tuple(t.clone() for t in tables.read(d, torch.tensor([slot]))) for d in range(L)]
            seen[slot].append((terminals[slot], states))

    for slot in requests:
        assert len(seen[slot]) == len(expected[slot]) == 2
        for (got, got_states), (want, want_states) in zip(seen[slot], expected[slot], strict=True):
            for g, w in zip(got, want, strict=True):
                assert g.key.shape == w.key.shape == (1, POSITIONS, H, R)
                for name in ("cell", "hidden", "out_gate", "depth_gate", "key", "value"):
                    torch.testing.assert_close(getattr(g, name), getattr(w, name), **TOLERANCE)
            for (gc, gh), (wc, wh) in zip(got_states, want_states, strict=True):
                torch.testing.assert_close(gc, wc, **TOLERANCE)
                torch.testing.assert_close(gh, wh, **TOLERANCE)


def test_a_new_block_and_a_restart_begin_with_no_samples():
    """A block's first chunk starts from empty buffers; ``discard`` forgets a slot's samples and its
    pending terminals; a store is for passes over slot tables, and chunks need one."""
    layers, tables = _stack(), _tables()
    store = BlockSamples(BlockEnds(L))

    def run(start, n):
        plan = plan_chunk(start, n, PROMPT, BLOCK, POSITIONS)
        memory_pass = MemoryPass(tables, slots=torch.tensor([2]), samples=store, chunks=[(0, 2, plan)])
        for d, layer in enumerate(layers):
            memory_pass.run(d, layer, torch.randn(1, n, D))
        memory_pass.finish()
        return plan

    plan = run(0, 3)  # samples 0 and 1 of the first block (offsets 0, 3, 7, 10)
    assert plan.slots == (0,) and not plan.ends_block
    assert all(k[0].any() and not k[1:].any() for k in store.keys[2])
    run(3, 8)  # ends the block: terminals wait for feedback
    assert 2 in store.ends.groups and all(k.all() for k in store.keys[2])
    store.discard(2)
    assert 2 not in store.keys and not store.ends
    run(11, 2)  # the second block starts empty (only its sample 0 seen)
    assert all(k[0].any() and not k[1:].any() for k in store.keys[2])

    with pytest.raises(ValueError, match="slot tables"):
        cache = MemoryCache(LAYOUT)
        cache.ensure(1, torch.device("cpu"))
        MemoryPass(cache, samples=store)
    with pytest.raises(ValueError, match="samples="):
        MemoryPass(tables, slots=torch.tensor([2]), chunks=[(0, 2, plan)])
