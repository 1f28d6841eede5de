"""Memory is never lost, corrupted or silently wrong: interrupts, nonfinite values, bad files and bad
arguments either leave the user's state exactly as it was or fail with an error that names the fix."""

import json

import pytest
import torch
from oracle import assert_row_equals_alone
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, make

from lstmem_peft import LSTMemConfig, MemoryCache, memory_layout, write_history
from lstmem_peft.tuner.context import current_pass


def history(rows=2, length=48, seed=0):
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def snapshot(cache):
    return [(s.cell.clone(), s.hidden.clone()) for s in cache.layers], cache.tokens_written.clone()


def assert_same(cache, snap):
    layers, tokens = snap
    assert torch.equal(cache.tokens_written, tokens)
    for state, (cell, hidden) in zip(cache.layers, layers, strict=True):
        assert torch.equal(state.cell, cell) and torch.equal(state.hidden, hidden)


class Interrupt:
    """Raise ``KeyboardInterrupt`` inside the forward of decoder layer ``layer``'s query projection,
    on its ``after``-th call from now."""

    def __init__(self, model, layer=1, after=1):
        self.q_proj = model.base_model.model.model.layers[layer].self_attn.q_proj
        self.calls, self.after = 0, after

    def __enter__(self):
        original = type(self.q_proj).forward

        def forward(module, x, *args, **kwargs):
            self.calls += 1
            if self.calls == self.after:
                raise KeyboardInterrupt
            return original(module, x, *args, **kwargs)

        self.q_proj.forward = forward.__get__(self.q_proj)
        return self

    def __exit__(self, *exc):
        del self.q_proj.forward


# ---------------------------------------------------------------------- transactional memory
def test_an_interrupt_inside_a_history_block_leaves_the_cache_as_it_was_and_resuming_is_exact():
    model = make()
    ids = history()
    with torch.no_grad():
        whole = MemoryCache()
        write_history(model, ids, whole, block_size=16, progress=False)
        cache = MemoryCache()
        write_history(model, ids[:, :16], cache, block_size=16, progress=False)
        after_first = snapshot(cache)
        with pytest.raises(KeyboardInterrupt), Interrupt(model, layer=1):
            write_history(model, ids[:, 16:32], cache, block_size=16, progress=False)
        assert current_pass() is None  # the interrupt left no pass open on its way out
        assert_same(cache, after_first)  # no layer, no feedback, no token count half-applied
        # an unrelated forward afterwards neither reads nor writes the interrupted session
        other = MemoryCache()
        model(input_ids=ids[:, :5], memory_cache=other)
        assert_same(cache, after_first)
        assert other.tokens_written.tolist() == [5, 5]
        # resume from where the cache says it is: bit-exact with the uninterrupted run
        start = int(cache.tokens_written[0])
        write_history(model, ids[:, start:], cache, block_size=16, progress=False)
    assert_same(cache, snapshot(whole))


def test_an_interrupt_inside_a_plain_forward_drops_the_pass():
    model = make()
    cache = MemoryCache()
    with torch.no_grad():
        model(input_ids=history(length=6), memory_cache=cache)
        before = snapshot(cache)
        with pytest.raises(KeyboardInterrupt), Interrupt(model, layer=2):
            model(input_ids=history(length=4, seed=1), memory_cache=cache)
        assert_same(cache, before)
        out = model(input_ids=history(length=4, seed=1), memory_cache=cache)
    assert out.logits.isfinite().all() and cache.tokens_written.tolist() == [10, 10]
    assert current_pass() is None  # the interrupted pass is gone, not merely bypassed


# ---------------------------------------------------------------------- nonfinite values
def test_a_nonfinite_input_row_is_refused_at_the_block_end_and_nothing_is_committed():
    model = make()
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, history(length=16), cache, block_size=16, progress=False)
        before = snapshot(cache)
        embeds = model.get_input_embeddings()(history(length=16, seed=2))
        embeds[1, 3, 0] = float("nan")
        with pytest.raises(FloatingPointError, match=r"row\(s\) \[1\]"):
            model(inputs_embeds=embeds, memory_cache=cache, memory_feedback=True)
    assert_same(cache, before)


def test_save_refuses_nonfinite_states(tmp_path):
    model = make()
    cache = MemoryCache()
    with torch.no_grad():
        model(input_ids=history(length=6), memory_cache=cache)
    cache.layers[1].hidden[0, 0, 0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"row\(s\) \[0\]"):
        cache.save(tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alpha=float("inf")), "alpha"),
        (dict(alpha=float("nan")), "alpha"),
        (dict(depth_coupling="false"), "depth_coupling must be true or false"),
        (dict(block_feedback="no"), "block_feedback must be true or false"),
        (dict(update_during_generation=1), "update_during_generation must be true or false"),
        (dict(layers_to_transform=True), "layers_to_transform"),
        (dict(layers_to_transform=[0, "1"]), "layers_to_transform"),
    ],
)
def test_config_values_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LSTMemConfig(**kwargs)


def test_write_history_refuses_a_zero_block_size():
    model = make()
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        write_history(model, history(), MemoryCache(), block_size=0)


# ---------------------------------------------------------------------- cache files
@pytest.fixture
def saved(tmp_path):
    model = make()
    cache = MemoryCache()
    with torch.no_grad():
        model(input_ids=history(length=6), memory_cache=cache)
    path = tmp_path / "memory.safetensors"
    cache.save(path)
    return model, path


def rewrite(path, drop=(), tensors=None, metadata=None):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata())
    data = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    data.update(tensors or {})
    meta.update(metadata or {})
    save_file(data, str(path), metadata=meta)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(drop=["layers.1.cell"]), "missing tensor 'layers.1.cell'"),
        (dict(drop=["tokens_written"]), "missing tensor 'tokens_written'"),
        (dict(tensors={"tokens_written": torch.zeros(3, dtype=torch.long)}), "tokens_written has 3 rows"),
        (dict(tensors={"layers.9.cell": torch.zeros(1)}), "unexpected tensor 'layers.9.cell'"),
        (dict(metadata={"layout": "{not json"}), "layout metadata is not valid JSON"),
        (
            dict(metadata={"layout": json.dumps({"layer_indices": [0, 1, 2], "num_heads": 4})}),
            "layout metadata",
        ),
        (dict(metadata={"fingerprint": "0" * 16}), "fingerprint"),
    ],
)
def test_damaged_cache_files_are_refused_with_the_field_named(saved, change, message):
    model, path = saved
    rewrite(path, **change)
    with pytest.raises(ValueError, match=message) as err:
        MemoryCache.load(path, layout=memory_layout(model))
    assert str(path) in str(err.value)


def test_cache_dtype_changes_that_break_the_layout_are_refused(saved):
    model, path = saved
    cache = MemoryCache.load(path, layout=memory_layout(model))
    with pytest.raises(ValueError, match="state_dtype"):
        cache.to(torch.bfloat16)
    assert cache.layers[0].cell.dtype == torch.float32
    cache.to("cpu")  # a device move is fine


def test_batch_select_with_a_boolean_mask_selects_the_masked_rows():
    cache = MemoryCache()
    model = make()
    with torch.no_grad():
        model(input_ids=history(rows=3, length=4), memory_cache=cache)
    rows = [layer.cell.clone() for layer in cache.layers]
    cache.batch_select_indices(torch.tensor([True, False, True]))
    assert cache.batch_size == 2
    for layer, ref in zip(cache.layers, rows, strict=True):
        assert torch.equal(layer.cell, ref[[0, 2]])
    with pytest.raises(IndexError, match="mask"):
        cache.batch_select_indices(torch.tensor([True, False, True]))


# ---------------------------------------------------------------------- per-row history blocks
@pytest.mark.parametrize("padding", ["left", "right"])
def test_each_row_is_cut_into_blocks_of_its_own_tokens(padding):
    """Rows shorter than, equal to and longer than a block, in one padded batch: each row's memory
    equals its history written alone (the 40-token row with 8 columns of padding is 32 + 8, not 8 + 32)."""
    model = make()
    block, lengths = 16, [40, 16, 9, 33]
    T = max(lengths) + 8
    rows = [history(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        span = slice(T - n, T) if padding == "left" else slice(0, n)
        ids[i, span], mask[i, span] = row, 1
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, ids, cache, attention_mask=mask, block_size=block, progress=False)
        for i, row in enumerate(rows):
            alone = MemoryCache()
            write_history(model, row[None], alone, block_size=block, progress=False)
            assert_row_equals_alone(cache, i, alone, atol=1e-5, rtol=1e-5)
    assert cache.tokens_written.tolist() == lengths


def test_a_kv_cache_with_rows_starting_at_different_columns_is_refused():
    from transformers import DynamicCache

    model = make()
    ids = history(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = MemoryCache()
    with pytest.raises(ValueError, match="same column"):
        write_history(model, ids, cache, attention_mask=mask, block_size=8, past_key_values=DynamicCache())
    assert cache.tokens_written is None


def test_adapter_weights_with_nan_are_refused_at_load(tmp_path):
    from peft import PeftModel
    from tiny_models import tiny_model

    model = make()
    model.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("w_gate"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"NaN or inf in \['w_gate'\]"):
        PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter")


def test_an_adapter_file_missing_some_weights_is_refused(tmp_path):
    from peft import PeftModel
    from tiny_models import tiny_model

    make().save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    dropped = next(k for k in tensors if k.endswith("b_read"))
    del tensors[dropped]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lack 1 of its .* tensors .*\['b_read'\]"):
        PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter")


def test_an_adapter_file_whose_shapes_disagree_with_its_config_is_refused(tmp_path):
    """Weights saved for r=4 under a config that says r=8: the load fails in one sentence naming both
    widths (tests/test_refusals.py has the other cases), and nothing is loaded silently."""
    import json

    from peft import PeftModel
    from tiny_models import tiny_model

    make(r=4).save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["r"] = 8
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"num_heads \* r = 16 .* r=8 \(num_heads \* r = 32\)"):
        PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter")
