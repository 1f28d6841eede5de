"""A stack of memory layers driven through MemoryPass, without a transformer."""

import pytest
import torch
from oracle import assert_row_equals_alone
from tiny_models import memory_stack

from lstmem_peft import MemoryCache, MemoryLayout, MemoryPass

D = 32
L = 3


def make_stack(seed=0):
    return memory_stack(D, L, seed)


def new_cache(batch, **layout):
    cache = MemoryCache(MemoryLayout(tuple(range(L)), 4, 8, **layout))
    cache.ensure(batch, torch.device("cpu"))
    return cache


def run(layers, cache, xs, valid=None, **kw):
    p = MemoryPass(cache, valid, **kw)
    outs = [p.run(i, layer, x) for i, (layer, x) in enumerate(zip(layers, xs, strict=True))]
    return outs, p.finish()


def test_left_padded_batch_equals_each_row_alone():
    layers = make_stack()
    T = 20
    lengths = [20, 13, 5]
    xs = [torch.randn(3, T, D) for _ in range(L)]
    valid = torch.zeros(3, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True
    batch = new_cache(3)
    outs, res = run(layers, batch, xs, valid, feedback=True)
    for b, n in enumerate(lengths):
        alone = new_cache(1)
        single_outs, _ = run(layers, alone, [x[b : b + 1, T - n :] for x in xs], feedback=True)
        for o_batch, o_single in zip(outs, single_outs, strict=True):
            torch.testing.assert_close(
                o_batch.correction(0)[b, T - n :], o_single.correction(0)[0], atol=1e-5, rtol=1e-5
            )
        assert_row_equals_alone(batch, b, alone, atol=1e-5, rtol=1e-5)
    assert batch.tokens_written.tolist() == lengths


def test_prefill_equals_decode_steps_through_the_stack():
    layers = make_stack()
    T = 10
    xs = [torch.randn(2, T, D) for _ in range(L)]
    full = new_cache(2)
    full_outs, _ = run(layers, full, xs)
    steps = new_cache(2)
    for t in range(T):
        outs, _ = run(layers, steps, [x[:, t : t + 1] for x in xs])
        for o, ref in zip(outs, full_outs, strict=True):
            torch.testing.assert_close(o.correction(1)[:, 0], ref.correction(1)[:, t], atol=1e-5, rtol=1e-5)
    for a, b in zip(full.layers, steps.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)


def test_depth_input_is_the_hidden_sequence_of_the_layer_below():
    layers = make_stack()
    xs = [torch.randn(1, 6, D) for _ in range(L)]
    outs, _ = run(layers, new_cache(1), xs)
    cache = new_cache(1)
    layer1 = layers[1](xs[1], cache.layers[1].cell, cache.layers[1].hidden, depth=outs[0].hidden_seq)
    torch.testing.assert_close(layer1.hidden, outs[1].hidden)
    off, _ = run(layers, new_cache(1), xs, depth_coupling=False)
    alone = layers[1](xs[1], cache.layers[1].cell, cache.layers[1].hidden, depth=None)
    torch.testing.assert_close(off[1].hidden, alone.hidden)


def test_feedback_changes_the_carried_state_only():
    layers = make_stack()
    xs = [torch.randn(2, 40, D) for _ in range(L)]
    with_fb, without = new_cache(2), new_cache(2)
    outs_fb, res = run(layers, with_fb, xs, feedback=True)
    outs_plain, none = run(layers, without, xs)
    assert none is None and res is not None
    for a, b in zip(outs_fb, outs_plain, strict=True):  # outputs inside the block are unchanged
        assert torch.equal(a.correction(0), b.correction(0))
    assert not torch.equal(with_fb.layers[0].cell, without.layers[0].cell)
    assert torch.equal(with_fb.layers[-1].cell, without.layers[-1].cell)


def test_read_only_pass_leaves_the_cache_alone():
    layers = make_stack()
    cache = new_cache(2)
    run(layers, cache, [torch.randn(2, 8, D) for _ in range(L)])
    snap = cache.clone()
    run(layers, cache, [torch.randn(2, 5, D) for _ in range(L)], write=False)
    for a, b in zip(cache.layers, snap.layers, strict=True):
        assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)
    assert torch.equal(cache.tokens_written, snap.tokens_written)


def test_layers_out_of_order_or_missing_are_errors():
    layers = make_stack()
    cache = new_cache(1)
    p = MemoryPass(cache)
    with pytest.raises(RuntimeError, match="shallow to deep"):
        p.run(1, layers[1], torch.randn(1, 3, D))
    p.run(0, layers[0], torch.randn(1, 3, D))
    with pytest.raises(RuntimeError, match="only 1 of 3"):
        p.finish()
    with pytest.raises(ValueError, match="writing pass"):
        MemoryPass(cache, write=False, feedback=True)


def test_gradients_reach_every_layer_through_history_and_feedback():
    layers = make_stack()
    cache = new_cache(2)
    run(layers, cache, [torch.randn(2, 30, D) for _ in range(L)], feedback=True)
    outs, _ = run(layers, cache, [torch.randn(2, 4, D) for _ in range(L)], write=False)
    sum(o.correction(0).square().sum() + o.correction(1).square().sum() for o in outs).backward()
    for layer in layers:  # the first has no W~_pred (no depth input): every parameter gets a gradient
        assert [n for n, p in layer.named_parameters() if p.grad is None] == []
        assert layer.w_in.grad.abs().sum() > 0 and layer.w_gate.grad.abs().sum() > 0


def test_cached_weights_give_what_each_forward_derives():
    """What decoding runs: each layer's weights derived once and cached, over blocks, one-token
    steps, padding and read-only passes; bit-exact against layers that derive them in every forward."""
    import copy

    layers = make_stack()
    fresh = copy.deepcopy(layers)
    for layer in fresh:  # derive in every forward
        layer.derived_weights = layer.weights
    given_cache, own_cache = new_cache(2), new_cache(2)
    g = torch.Generator().manual_seed(5)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :4] = False
    blocks = [(9, valid, True), (1, None, True), (1, torch.tensor([[True], [False]]), True), (3, None, False)]
    with torch.no_grad():
        for T, v, write in blocks:
            xs = [torch.randn(2, T, D, generator=g) for _ in range(L)]
            given, _ = run(layers, given_cache, xs, v, write=write)
            own, _ = run(fresh, own_cache, xs, v, write=write)
            for a, b in zip(given, own, strict=True):
                assert torch.equal(a.correction(0), b.correction(0))
                assert torch.equal(a.correction(1), b.correction(1))
    for a, b in zip(given_cache.layers, own_cache.layers, strict=True):
        assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)
    assert torch.equal(given_cache.tokens_written, own_cache.tokens_written)


def test_feedback_block_of_one_token_equals_a_padded_two_token_block():
    """A history block of a single token (the one-token step) gives feedback the same samples as a
    two-token block whose second token is padding (the scan)."""
    layers = make_stack()
    xs = [torch.randn(2, 1, D) for _ in range(L)]
    padded = [torch.cat([x, torch.randn(2, 1, D)], 1) for x in xs]
    valid = torch.tensor([[True, False], [True, False]])
    one_cache, two_cache = new_cache(2), new_cache(2)
    with torch.no_grad():
        _, one = run(layers, one_cache, xs, feedback=True)
        _, two = run(layers, two_cache, padded, valid, feedback=True)
    assert (one.losses > 0).all()
    torch.testing.assert_close(one.losses, two.losses, atol=1e-5, rtol=1e-5)
    for a, b in zip(one_cache.layers, two_cache.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)
