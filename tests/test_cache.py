"""MemoryCache: lazy allocation, snapshots, batch/beam operations, save/load with a fingerprint."""

import pytest
import torch

from lstmem_peft import MemoryCache, MemoryLayout

LAYOUT = MemoryLayout(layer_indices=(0, 2, 3), num_heads=4, head_dim=8, identity="test")


def filled(batch=3, layout=LAYOUT, seed=0):
    torch.manual_seed(seed)
    cache = MemoryCache(layout)
    cache.ensure(batch, torch.device("cpu"))
    for layer in cache.layers:
        layer.cell = torch.randn_like(layer.cell)
        layer.hidden = torch.randn_like(layer.hidden)
    cache.tokens_written = torch.arange(batch) + 10
    return cache


def test_lazy_allocation_and_shapes():
    cache = MemoryCache(LAYOUT)
    assert not cache.is_initialized and cache.batch_size is None and cache.nbytes == 0
    cache.ensure(2, torch.device("cpu"))
    assert cache.is_initialized and len(cache) == 3
    assert cache.layers[1].cell.shape == (2, 4, 8, 8) and cache.layers[1].hidden.dtype == torch.float32
    assert not cache.layers[0].cell.any()
    assert cache.tokens_written.tolist() == [0, 0]


def test_paper_state_sizes_for_qwen3_4b():
    """36 layers, n_h = 4, r = 8: 36 KiB per sequence in bf16 (the paper), 72 KiB in float32."""
    for dtype, kib in (("bfloat16", 36), ("float32", 72)):
        cache = MemoryCache(MemoryLayout(tuple(range(36)), 4, 8, dtype))
        cache.ensure(1, torch.device("cpu"))
        assert cache.nbytes == kib * 1024


def test_batch_mismatch_is_an_error_not_a_reset():
    cache = filled(3)
    before = cache.layers[0].cell.clone()
    with pytest.raises(ValueError, match="batch size 2"):
        cache.ensure(2, torch.device("cpu"))
    assert torch.equal(cache.layers[0].cell, before)


def test_layout_mismatch_is_refused():
    cache = filled(2)
    with pytest.raises(ValueError, match="another adapter layout"):
        cache.bind(MemoryLayout((0, 2, 3), 4, 16, identity="test"))
    cache.bind(LAYOUT)  # the same layout is fine


def test_clone_is_an_independent_snapshot():
    cache = filled(2)
    snap = cache.clone()
    cache.layers[0].cell.add_(1)
    cache.tokens_written += 5
    assert not torch.equal(snap.layers[0].cell, cache.layers[0].cell)
    assert snap.tokens_written.tolist() == [10, 11]


def test_reorder_select_and_repeat():
    cache = filled(3)
    ref = [layer.cell.clone() for layer in cache.layers]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.layers[1].cell, ref[1][[2, 0, 0]])
    assert cache.tokens_written.tolist() == [12, 10, 10]
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.batch_size == 1 and torch.equal(cache.layers[2].cell, ref[2][[0]])
    cache.batch_repeat_interleave(3)
    assert cache.batch_size == 3 and torch.equal(cache.layers[0].cell, ref[0][[0, 0, 0]])
    with pytest.raises(IndexError, match="batch size 3"):
        cache.batch_select_indices(torch.tensor([3]))


def test_reset_detach_and_to():
    cache = filled(2)
    cache.layers[0].cell.requires_grad_(True)
    cache.detach_()
    assert not cache.layers[0].cell.requires_grad
    with pytest.raises(ValueError, match="state_dtype"):
        cache.to(dtype=torch.float64)  # the layout says float32: refused, nothing changed
    assert cache.layers[0].cell.dtype == torch.float32
    cache.to("cpu")
    cache.reset()
    assert not cache.is_initialized and cache.batch_size is None
    cache.ensure(5, torch.device("cpu"))  # a reset cache takes any batch size
    assert cache.batch_size == 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_exact(tmp_path, dtype):
    layout = MemoryLayout((0, 2, 3), 4, 8, dtype, "test")
    cache = filled(2, layout)
    cache.save(tmp_path / "mem.safetensors")
    back = MemoryCache.load(tmp_path / "mem.safetensors", layout=layout)
    assert back.layout == layout
    assert back.tokens_written.tolist() == [10, 11]
    for a, b in zip(cache.layers, back.layers, strict=True):
        assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)


def test_load_refuses_another_layout_and_bad_files(tmp_path):
    path = tmp_path / "mem.safetensors"
    filled(2).save(path)
    with pytest.raises(ValueError, match="was saved for"):
        MemoryCache.load(path, layout=MemoryLayout((0, 2, 3), 4, 8, identity="another adapter"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        MemoryCache.load(tmp_path / "junk.safetensors")
    with pytest.raises(ValueError, match="nothing to save"):
        MemoryCache(LAYOUT).save(tmp_path / "empty.safetensors")


def test_load_refuses_nonfinite_states(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cache = filled(2)
    cache.save(tmp_path / "bad.safetensors")  # save() itself refuses nonfinite states: damage the file
    with safe_open(str(tmp_path / "bad.safetensors"), framework="pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(tmp_path / "bad.safetensors"))
    tensors["layers.1.hidden"][1, 0, 0, 0] = float("inf")
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=metadata)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] holds NaN or inf"):
        MemoryCache.load(tmp_path / "bad.safetensors")


def test_unbound_cache_explains_itself():
    with pytest.raises(RuntimeError, match="not bound"):
        MemoryCache().ensure(1, torch.device("cpu"))
    with pytest.raises(IndexError, match="out of range"):
        filled(1)[5]
