"""The two storage kinds a memory pass drives (dense rows, slot tables), block-end feedback written
into either, and one layer's run over writing and read-only rows (lstmem_peft/memory/storage.py,
feedback.BlockEnds, engine.run_layer), without a transformer or vLLM."""

from types import SimpleNamespace

import pytest
import torch
from tiny_models import memory_stack

from lstmem_peft import LSTMemLayer, MemoryCache, MemoryLayout
from lstmem_peft.memory.engine import run_layer
from lstmem_peft.memory.feedback import BlockEnds, LayerTerminal, block_feedback
from lstmem_peft.memory.storage import DenseRows, SlotTables

L, H, R, SLOTS = 3, 2, 4, 6
LAYOUT = MemoryLayout(tuple(range(L)), H, R)


def slot_tables(seed=0, dtype=torch.float32) -> SlotTables:
    """Slot tables of ``L`` layers as a serving engine holds them (``kv_cache`` bound to each layer)."""
    g = torch.Generator().manual_seed(seed)
    shape = (SLOTS, H, R, R)
    return SlotTables(
        [
            SimpleNamespace(
                kv_cache=(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g))
            )
            for _ in range(L)
        ]
    )


def dense_rows(batch, seed=1) -> MemoryCache:
    g = torch.Generator().manual_seed(seed)
    cache = MemoryCache(LAYOUT)
    cache.ensure(batch, torch.device("cpu"))
    for layer in cache.layers:
        layer.cell, layer.hidden = (
            torch.randn(batch, H, R, R, generator=g),
            torch.randn(batch, H, R, R, generator=g),
        )
    cache.tokens_written = torch.arange(batch) + 3
    return cache


def test_states_move_between_dense_rows_and_slots_unchanged():
    tables, cache = slot_tables(), dense_rows(2)
    addresses = [tables.tables(d)[0].data_ptr() for d in range(L)]
    tables.load(4, cache, row=1)
    back = tables.rows(4, LAYOUT, tokens_written=9)
    for d in range(L):
        assert torch.equal(back.layers[d].cell[0], cache.layers[d].cell[1])
        assert torch.equal(back.layers[d].hidden[0], cache.layers[d].hidden[1])
        assert tables.tables(d)[0].data_ptr() == addresses[d]  # written in place
    assert back.tokens_written.tolist() == [9] and back.layout == LAYOUT
    back.layers[0].cell += 1  # a copy: the slot keeps its states
    assert torch.equal(tables.tables(0)[0][4], cache.layers[0].cell[1])
    tables.load(4, None)
    assert all(not tables.read(d, torch.tensor([4]))[1].any() for d in range(L))


def test_slot_writes_touch_only_their_slots_in_the_tables_dtype():
    tables = slot_tables(dtype=torch.bfloat16)
    before = [t.clone() for t in tables.tables(1)]
    index = torch.tensor([5, 0])
    cell, hidden = torch.randn(2, H, R, R), torch.randn(2, H, R, R)
    tables.write(1, cell, hidden, index)
    cells, hiddens = tables.tables(1)
    assert torch.equal(cells[index], cell.to(torch.bfloat16)) and torch.equal(hiddens[index], hidden)
    others = torch.tensor([1, 2, 3, 4])
    assert torch.equal(cells[others], before[0][others]) and torch.equal(hiddens[others], before[1][others])


def test_dense_rows_commit_all_layers_at_once_or_nothing():
    cache = dense_rows(2)
    kept = cache.clone()
    rows = DenseRows(cache)
    for d in range(L):
        cell, hidden = rows.read(d)
        rows.write(d, cell + 1, hidden.clone())
        assert torch.equal(cache.layers[d].cell, kept.layers[d].cell)  # staged only
    rows.write(2, torch.full((1, H, R, R), float("nan")), torch.zeros(1, H, R, R), torch.tensor([1]))
    with pytest.raises(FloatingPointError, match=r"row\(s\) \[1\]"):
        rows.commit(cache.tokens_written + 1)
    for d in range(L):
        assert torch.equal(cache.layers[d].cell, kept.layers[d].cell)
    rows.write(2, kept.layers[2].cell[1:] + 1, kept.layers[2].hidden[1:], torch.tensor([1]))
    rows.commit(cache.tokens_written + 1)
    for d in range(L):
        torch.testing.assert_close(cache.layers[d].cell, kept.layers[d].cell + 1, rtol=0, atol=0)
    assert cache.tokens_written.tolist() == [4, 5]


def _terminals(seed, samples) -> list[LayerTerminal]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        C = torch.randn(1, H, R, R, generator=g)
        o, gd = torch.rand(1, H, R, generator=g), torch.rand(1, H, R, generator=g)
        k = torch.nn.functional.normalize(torch.randn(1, samples, H, R, generator=g), dim=-1)
        out.append(
            LayerTerminal(
                C, o[..., None] * torch.tanh(C), o, gd, k, torch.randn(1, samples, H, R, generator=g)
            )
        )
    return out


def test_block_ends_of_several_slots_equal_each_alone():
    """Blocks of different sample counts in one batch (padded, masked) give what each gives alone,
    written into their slots; a group some layer did not add to is dropped."""
    tables = slot_tables()
    ends = BlockEnds(L)
    groups = {3: _terminals(0, 5), 1: _terminals(1, 2)}
    for d in range(L):
        for slot, terminals in groups.items():
            ends.add(
                slot, terminals[d], torch.ones(1, terminals[d].key.shape[1], dtype=torch.bool), index=slot
            )
    ends.add(5, _terminals(2, 3)[0], torch.ones(1, 3, dtype=torch.bool), index=5)  # one layer only
    untouched = [t[5].clone() for t in tables.tables(0)]
    result = ends.apply(tables)
    assert not ends and result.cells[0].shape[0] == 2
    for slot, terminals in groups.items():
        alone = block_feedback(terminals, torch.ones(1, terminals[0].key.shape[1], dtype=torch.bool))
        for d in range(L):
            got = tables.read(d, torch.tensor([slot]))
            torch.testing.assert_close(got[0], alone.cells[d], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[1], alone.hiddens[d], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b[5]) for a, b in zip(untouched, tables.tables(0), strict=True))


def test_one_layer_run_mixes_writing_and_read_only_rows():
    """Rows that only read get the read-only pass's reads and hand their fixed D up; writing rows get
    the writing pass's; the read-only rows' tokens, masked out of ``valid``, leave their states."""
    torch.manual_seed(0)
    layer = LSTMemLayer(16, 16, num_heads=H, head_dim=R, layer_idx=1)
    with torch.no_grad():
        layer.init_corrections(torch.randn(16, 16), torch.randn(16, 16))
    x, cell, hidden = torch.randn(2, 5, 16), torch.randn(2, H, R, R), torch.randn(2, H, R, R)
    depth = torch.randn(2, 5, H, R, R)
    depth[1] = hidden[1]  # a read-only row's depth input is the fixed D below
    read_only = torch.tensor([False, True])
    valid = ~read_only[:, None].expand(2, 5)
    out, handoff = run_layer(layer, x, cell, hidden, depth=depth, valid=valid, read_only=read_only)
    written, _ = run_layer(layer, x[:1], cell[:1], hidden[:1], depth=depth[:1], valid=None, read_only=False)
    fixed, fixed_handoff = run_layer(
        layer, x[1:], cell[1:], hidden[1:], depth=hidden[1:], valid=None, read_only=True
    )
    torch.testing.assert_close(out.read[0], written.read[0])
    torch.testing.assert_close(out.read[1], fixed.read[0])
    torch.testing.assert_close(handoff[0], written.hidden_seq[0])
    assert torch.equal(handoff[1], fixed_handoff[0].expand(5, H, R, R)) and fixed_handoff.shape == (
        1,
        H,
        R,
        R,
    )
    torch.testing.assert_close(out.cell[1], cell[1])


def _stack(d=16, seed=0) -> list[LSTMemLayer]:
    return memory_stack(d, L, seed, num_heads=H, head_dim=R)


def test_one_pass_over_slots_equals_each_row_over_dense_rows_alone():
    """A batch of chunks of several lengths (right-padded, masked) in slots, one of them read-only,
    through one MemoryPass over the slot tables: each row reads and writes what a pass over a cache
    holding that slot's states alone gives, and the read-only row's slot keeps its states."""
    from lstmem_peft import MemoryPass

    layers, tables = _stack(), slot_tables(seed=3)
    slots, lengths, T = torch.tensor([4, 1, 2]), [6, 3, 6], 6
    read_only = torch.tensor([False, False, True])
    valid = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]) & ~read_only[:, None]
    before = [tables.read(d, slots) for d in range(L)]
    xs = [torch.randn(3, T, 16) for _ in range(L)]
    memory_pass = MemoryPass(tables, valid, slots=slots, read_only=read_only)
    outs = [memory_pass.run(d, layer, x) for d, (layer, x) in enumerate(zip(layers, xs, strict=True))]
    assert memory_pass.finish() is None
    for b, n in enumerate(lengths):
        cache = MemoryCache(LAYOUT)
        cache.ensure(1, torch.device("cpu"))
        for d, state in enumerate(cache.layers):
            state.cell, state.hidden = before[d][0][b : b + 1], before[d][1][b : b + 1]
        alone = MemoryPass(cache, write=not bool(read_only[b]))
        for d, (layer, x) in enumerate(zip(layers, xs, strict=True)):
            out = alone.run(d, layer, x[b : b + 1, :n])
            torch.testing.assert_close(outs[d].read[b, :n], out.read[0], rtol=1e-5, atol=1e-6)
        alone.finish()
        for d in range(L):
            cell, hidden = tables.read(d, slots[b : b + 1])
            torch.testing.assert_close(cell, cache.layers[d].cell, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(hidden, cache.layers[d].hidden, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(tables.read(d, slots[2:])[0], before[d][0][2:]) for d in range(L))


def test_a_pass_over_slots_is_told_its_slots_and_leaves_feedback_to_the_engine():
    from lstmem_peft import MemoryPass

    with pytest.raises(ValueError, match="slots="):
        MemoryPass(slot_tables())
    with pytest.raises(ValueError, match="slots="):
        MemoryPass(dense_rows(1), slots=torch.tensor([0]))
    with pytest.raises(ValueError, match="engine applies it"):
        MemoryPass(slot_tables(), slots=torch.tensor([0]), feedback=True)
