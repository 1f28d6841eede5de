"""The PEFT tuner on tiny random models: placement, invariants, caches, generation, padding."""

import copy

import pytest
import torch
from oracle import assert_row_equals_alone
from peft import get_peft_model
from tiny_models import ARCHITECTURES, VOCAB, make, randomize_memory, tiny_model

from lstmem_peft import (
    LSTMemConfig,
    LSTMemOutputLayer,
    LSTMemQueryLayer,
    MemoryCache,
    memory_layers,
    write_history,
)


def ids(batch=2, length=12, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- architectures and placement
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_gets_memory_and_zero_memory_equals_base(arch):
    base = tiny_model(arch)
    reference = copy.deepcopy(base)
    model = get_peft_model(base, LSTMemConfig())
    query, output = model.peft_config["default"].target_modules
    wrapped = {
        (name.rsplit(".", 1)[-1], type(m))
        for name, m in model.named_modules()
        if isinstance(m, (LSTMemQueryLayer, LSTMemOutputLayer))
    }
    # one query and one output wrapper per decoder layer, each around the projection of that name
    assert wrapped == {(query, LSTMemQueryLayer), (output, LSTMemOutputLayer)}
    layers = base.config.num_hidden_layers
    assert sum(isinstance(m, LSTMemQueryLayer) for m in model.modules()) == layers
    assert sum(isinstance(m, LSTMemOutputLayer) for m in model.modules()) == layers
    x = ids()
    with torch.no_grad():
        for layer in memory_layers(model):  # zero corrections: outputs must equal the base model's
            layer.w_dq.zero_()
            layer.w_do.zero_()
        torch.testing.assert_close(model(input_ids=x).logits, reference(input_ids=x).logits, rtol=0, atol=0)
    randomize_memory(model)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=x).logits, reference(input_ids=x).logits)
    if arch == "smollm3":  # its no-RoPE layers stay no-RoPE
        assert model.base_model.model.config.no_rope_layers == [1, 0, 1]


def test_delta_q_lands_before_q_norm_and_delta_o_after_o_proj():
    model = make("qwen3")
    attn = model.base_model.model.model.layers[1].self_attn
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, a, o: seen.setdefault("q_norm_in", a[0]))
    attn.q_proj.register_forward_hook(lambda m, a, o: seen.update(x=a[0], q=o))
    attn.o_proj.register_forward_hook(lambda m, a, o: seen.update(attn_out=a[0], o=o))
    with torch.no_grad():
        model(input_ids=ids(1, 6))
        base_q = attn.q_proj.base_layer(seen["x"])
        base_o = attn.o_proj.base_layer(seen["attn_out"])
    assert not torch.allclose(seen["q"], base_q) and not torch.allclose(seen["o"], base_o)
    # q_norm receives the corrected query, head by head
    torch.testing.assert_close(seen["q_norm_in"].flatten(-2), seen["q"])


def test_bad_targets_explain_the_fix():
    # (a model with no known projection names, and unknown fused layouts: tests/test_fused_projections.py)
    with pytest.raises(ValueError, match="not found in the base model"):
        get_peft_model(
            tiny_model(), LSTMemConfig(target_modules=["q_proj", "out_proj"], layers_to_transform=[9])
        )
    with pytest.raises(ValueError, match="does not have"):
        get_peft_model(tiny_model(), LSTMemConfig(layers_to_transform=[1, 7]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(r=0), "r must be a positive integer"),
        (dict(num_heads=-1), "num_heads must be a positive integer"),
        (dict(alpha=0), "alpha must be a positive finite number"),
        (dict(state_dtype="float16"), "state_dtype must be one of"),
        (dict(layers_to_transform=[-1]), "non-negative layer indices"),
        (dict(layers_to_transform=[1, 1]), "duplicates"),
        (dict(target_modules=["q_proj"]), r"\[query projection, output projection\]"),
        (dict(scan_backend="cuda"), "scan_backend must be"),
        (dict(task_type="SEQ_CLS"), "CAUSAL_LM"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LSTMemConfig(**kwargs)


@pytest.mark.parametrize("layers", [[0], [1, 2], [0, 2]])
def test_layer_subsets(layers):
    model = make(layers_to_transform=layers)
    assert [m.layer_idx for m in memory_layers(model)] == layers
    cache = MemoryCache()
    model(input_ids=ids(), memory_cache=cache)
    assert len(cache.layers) == len(layers)


def test_trainable_parameters_are_the_memory_only():
    model = make()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lstmem_memory.default." in n for n in names)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lstmem_memory" not in n)


# ---------------------------------------------------------------------- invariants
def test_disable_adapter_three_step_invariant():
    model = make()
    base = copy.deepcopy(model.get_base_model())
    for m in base.modules():  # a plain copy of the backbone for the reference
        for name, child in list(m.named_children()):
            if isinstance(child, (LSTMemQueryLayer, LSTMemOutputLayer)):
                setattr(m, name, child.base_layer)
    x = ids()
    with torch.no_grad():
        plain = base(input_ids=x).logits
        adapted = model(input_ids=x, memory_cache=MemoryCache()).logits
        assert not torch.allclose(adapted, plain)
        with model.disable_adapter():
            disabled = model(input_ids=x, memory_cache=MemoryCache()).logits
        torch.testing.assert_close(disabled, plain, rtol=0, atol=0)
        again = model(input_ids=x, memory_cache=MemoryCache()).logits
        torch.testing.assert_close(again, adapted, rtol=0, atol=0)


def test_prefill_equals_one_token_steps_logits_and_states():
    model = make()
    x = ids(2, 10)
    full_cache, step_cache = MemoryCache(), MemoryCache()
    with torch.no_grad():
        full = model(input_ids=x, memory_cache=full_cache).logits
        from transformers import DynamicCache

        kv = DynamicCache()
        for t in range(10):
            out = model(
                input_ids=x[:, t : t + 1], past_key_values=kv, use_cache=True, memory_cache=step_cache
            )
            torch.testing.assert_close(out.logits[:, 0], full[:, t], atol=2e-5, rtol=2e-5)
    for a, b in zip(full_cache.layers, step_cache.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-5, rtol=1e-5)
    assert full_cache.tokens_written.tolist() == step_cache.tokens_written.tolist() == [10, 10]


def test_generate_equals_recomputation_from_scratch():
    """Each generated token is the argmax of a fresh forward over prompt + generated-so-far."""
    model = make()
    prompt = ids(2, 7)
    history = ids(2, 30, seed=3)
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, history, cache, block_size=16)
        snapshot = cache.clone()
        out = model.generate(input_ids=prompt, memory_cache=cache, max_new_tokens=6, do_sample=False)
        seq = prompt
        for _ in range(6):
            logits = model(input_ids=seq, memory_cache=snapshot.clone()).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    assert cache.tokens_written.tolist() == [30 + 7 + 5] * 2  # prompt and all but the last token written


def test_generate_without_cache_uses_a_fresh_memory_for_the_call():
    model = make()
    prompt = ids(1, 6)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
        ref = model.generate(input_ids=prompt, memory_cache=MemoryCache(), max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)


def test_read_only_generation_leaves_memory_unchanged():
    model = make(update_during_generation=False)
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, ids(1, 20), cache)
        snap = cache.clone()
        model.generate(input_ids=ids(1, 5, seed=2), memory_cache=cache, max_new_tokens=4, do_sample=False)
    for a, b in zip(cache.layers, snap.layers, strict=True):
        assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)


def test_num_return_sequences_expands_memory():
    model = make(update_during_generation=False)  # read-only, so the expanded rows stay visible
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, ids(2, 20), cache)
        before = [layer.cell.clone() for layer in cache.layers]
        model.generate(
            input_ids=ids(2, 4), memory_cache=cache, max_new_tokens=3, do_sample=True, num_return_sequences=3
        )
    assert cache.batch_size == 6
    for layer, ref in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.cell, ref.repeat_interleave(3, dim=0))


# ---------------------------------------------------------------------- padding and sessions
def _four_d_masks(mask2d, kind):
    B, T = mask2d.shape
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    allowed = causal[None] & mask2d.bool()[:, None, :]
    allowed = allowed[:, None]
    if kind == "bool":
        return allowed
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("mask_kind", ["2d", "bool", "float"])
def test_left_padded_batch_equals_each_row_alone(mask_kind):
    model = make()
    lengths = [9, 5, 2]
    T = max(lengths)
    rows = [ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    batch = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        batch[i, T - n :] = row[0]
        mask[i, T - n :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    attn = mask if mask_kind == "2d" else _four_d_masks(mask, mask_kind)
    cache = MemoryCache()
    with torch.no_grad():
        logits = model(
            input_ids=batch, attention_mask=attn, position_ids=positions, memory_cache=cache
        ).logits
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            alone = MemoryCache()
            ref = model(input_ids=row, memory_cache=alone).logits
            torch.testing.assert_close(logits[i, T - n :], ref[0], atol=2e-5, rtol=2e-5)
            assert_row_equals_alone(cache, i, alone, atol=1e-5, rtol=1e-5)
    assert cache.tokens_written.tolist() == lengths


def test_left_padded_generate_matches_rows_alone():
    model = make()
    short, long_ = ids(1, 3, seed=5), ids(1, 6, seed=6)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long_])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        out = model.generate(
            input_ids=batch,
            attention_mask=mask,
            memory_cache=MemoryCache(),
            max_new_tokens=4,
            do_sample=False,
        )
        a = model.generate(input_ids=short, memory_cache=MemoryCache(), max_new_tokens=4, do_sample=False)
        b = model.generate(input_ids=long_, memory_cache=MemoryCache(), max_new_tokens=4, do_sample=False)
    assert torch.equal(out[0, 3:], a[0]) and torch.equal(out[1], b[0])


def test_interleaved_sessions_equal_each_session_alone():
    model = make()
    chunks_a = [ids(1, 5, seed=s) for s in range(3)]
    chunks_b = [ids(1, 4, seed=10 + s) for s in range(3)]
    with torch.no_grad():
        alone_a, alone_b = MemoryCache(), MemoryCache()
        ref_a = [model(input_ids=c, memory_cache=alone_a).logits for c in chunks_a]
        ref_b = [model(input_ids=c, memory_cache=alone_b).logits for c in chunks_b]
        ca, cb = MemoryCache(), MemoryCache()
        for i in range(3):
            la = model(input_ids=chunks_a[i], memory_cache=ca).logits
            lb = model(input_ids=chunks_b[i], memory_cache=cb).logits
            assert torch.equal(la, ref_a[i]) and torch.equal(lb, ref_b[i])
    for x, y in zip(ca.layers, alone_a.layers, strict=True):
        assert torch.equal(x.cell, y.cell)
    assert not any(isinstance(v, torch.Tensor) for m in model.modules() for v in vars(m).values())


def test_batch_size_mismatch_is_an_error():
    model = make()
    cache = MemoryCache()
    model(input_ids=ids(2, 4), memory_cache=cache)
    with pytest.raises(ValueError, match="batch size 3"):
        model(input_ids=ids(3, 4), memory_cache=cache)


def test_cache_from_another_adapter_layout_is_refused():
    cache = MemoryCache()
    make(layers_to_transform=[0, 1])(input_ids=ids(1, 3), memory_cache=cache)
    with pytest.raises(ValueError, match="another adapter layout"):
        make(layers_to_transform=[1, 2])(input_ids=ids(1, 3), memory_cache=cache)


def test_snapshot_and_saved_cache_continue_bit_exactly(tmp_path):
    model = make()
    cache = MemoryCache()
    question = ids(1, 5, seed=9)
    with torch.no_grad():
        write_history(model, ids(1, 40), cache, block_size=16)
        snap = cache.clone()
        cache.save(tmp_path / "memory.safetensors")
        first = model(input_ids=question, memory_cache=cache).logits
        from lstmem_peft import memory_layout

        loaded = MemoryCache.load(tmp_path / "memory.safetensors", layout=memory_layout(model))
        assert torch.equal(model(input_ids=question, memory_cache=snap).logits, first)
        assert torch.equal(model(input_ids=question, memory_cache=loaded).logits, first)
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)


# ---------------------------------------------------------------------- history writing
def test_write_history_feedback_after_every_block():
    model = make()
    hist = ids(2, 40)
    with torch.no_grad():
        with_fb = write_history(model, hist, MemoryCache(), block_size=16)
        blocks = MemoryCache()
        for s in range(0, 40, 16):  # the same blocks written one by one
            write_history(model, hist[:, s : s + 16], blocks, block_size=16)
        no_fb = write_history(make(block_feedback=False), hist, MemoryCache(), block_size=16)
    for a, b in zip(with_fb.layers, blocks.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell)
    assert not torch.allclose(with_fb.layers[0].cell, no_fb.layers[0].cell)


def test_write_history_fills_the_kv_cache():
    from transformers import DynamicCache

    model = make()
    kv = DynamicCache()
    with torch.no_grad():
        write_history(model, ids(1, 40), MemoryCache(), block_size=16, past_key_values=kv)
    assert kv.get_seq_length() == 40


@pytest.mark.parametrize("padded", [False, True])
def test_a_history_without_kv_cache_stops_each_block_after_the_topmost_memory_layer(padded):
    """Without a KV cache and without gradients, nothing above the topmost memory layer can change
    memory: those decoder layers and the head never run, and memory is what whole forwards write."""
    model = make(layers_to_transform=[0, 1])  # 3 decoder layers
    hist = ids(2, 40)
    mask = torch.ones_like(hist)
    if padded:
        mask[1, :9] = 0
    ran = []
    decoder = model.base_model.model.model
    handles = [
        m.register_forward_hook(lambda *a, n=name: ran.append(n))
        for name, m in (
            ("layer 2", decoder.layers[2]),
            ("norm", decoder.norm),
            ("head", model.base_model.model.lm_head),
        )
    ]
    with torch.no_grad():
        stopped = write_history(model, hist, MemoryCache(), attention_mask=mask, block_size=16)
    for handle in handles:
        handle.remove()
    assert ran == []
    whole = MemoryCache()  # the same blocks, whole forwards (what a gradient-enabled write runs)
    write_history(model, hist, whole, attention_mask=mask, block_size=16)
    for a, b in zip(stopped.layers, whole.layers, strict=True):
        assert torch.equal(a.cell, b.cell) and torch.equal(a.hidden, b.hidden)
    assert torch.equal(stopped.tokens_written, whole.tokens_written)


def test_a_failure_while_committing_a_stopped_forward_reaches_the_caller(monkeypatch):
    """torch silences errors raised in a forward hook while another error propagates: a stopped
    forward's commit error (here feedback's) must still reach the caller, with the cache unchanged."""
    from lstmem_peft.memory import feedback  # the pass's block ends run feedback from there

    model = make()
    cache = MemoryCache()
    with torch.no_grad():
        write_history(model, ids(1, 16), cache, block_size=16)
        before = [(s.cell.clone(), s.hidden.clone()) for s in cache.layers]

        def broken(*args, **kwargs):
            raise FloatingPointError("feedback broke")

        monkeypatch.setattr(feedback, "block_feedback", broken)
        with pytest.raises(FloatingPointError, match="feedback broke"):
            write_history(model, ids(1, 16, seed=1), cache, block_size=16)
    for state, (cell, hidden) in zip(cache.layers, before, strict=True):
        assert torch.equal(state.cell, cell) and torch.equal(state.hidden, hidden)


def test_memory_only_forwards_are_refused_where_they_would_skip_needed_work():
    from transformers import DynamicCache

    model = make()
    x = ids(1, 8)
    with torch.no_grad():
        for kwargs in (dict(memory_write=False), dict(past_key_values=DynamicCache(), use_cache=True)):
            with pytest.raises(ValueError, match="memory_only=True"):
                model(input_ids=x, memory_cache=MemoryCache(), memory_only=True, **kwargs)


def test_write_history_validates_inputs():
    model = make()
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        write_history(model, ids(1, 8), MemoryCache(), attention_mask=torch.ones(1, 5))
    with pytest.raises(TypeError, match="carries no LSTMem adapter"):
        write_history(tiny_model(), ids(1, 8), MemoryCache())


def test_reentrant_gradient_checkpointing_is_refused_with_a_clear_error():
    """transformers' default (non-reentrant) checkpointing is exact (tests/test_checkpointing.py)."""
    model = make()
    model.train()
    model.get_base_model().gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    with pytest.raises(RuntimeError, match='gradient checkpointing.*"use_reentrant": False'):
        model(input_ids=ids(1, 4), memory_cache=MemoryCache())
    model.get_base_model().gradient_checkpointing_enable()
    model(input_ids=ids(1, 4), memory_cache=MemoryCache()).logits.sum().backward()


# ---------------------------------------------------------------------- adapters, merge, unload
def test_named_adapters_and_set_adapter():
    model = make()
    model.add_adapter("other", LSTMemConfig(layers_to_transform=[2]))
    x = ids(1, 6)
    with torch.no_grad():
        first = model(input_ids=x, memory_cache=MemoryCache()).logits
        model.set_adapter("other")
        assert [m.layer_idx for m in memory_layers(model)] == [2]
        other = model(input_ids=x, memory_cache=MemoryCache()).logits
        model.set_adapter("default")
        assert torch.equal(model(input_ids=x, memory_cache=MemoryCache()).logits, first)
    assert not torch.allclose(first, other)


def test_merge_is_refused_and_unload_restores_the_plain_model():
    model = make()
    with pytest.raises(NotImplementedError, match="stateful memory"):
        model.merge_and_unload()
    plain = model.unload()
    assert not any(isinstance(m, (LSTMemQueryLayer, LSTMemOutputLayer)) for m in plain.modules())
    assert all(isinstance(layer.self_attn.q_proj, torch.nn.Linear) for layer in plain.model.layers)
    assert not plain._forward_pre_hooks and not plain._forward_hooks
    assert not plain.model._forward_pre_hooks and not plain.model._forward_hooks
    assert "generate" not in vars(plain) and "prepare_inputs_for_generation" not in vars(plain)
    ref = tiny_model()
    torch.testing.assert_close(plain(input_ids=ids()).logits, ref(input_ids=ids()).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_write_history_peak_memory_does_not_grow_with_history_length():
    """16x the history, same peak RSS (fresh processes); retaining each block's depth sequence
    would add about 32 MB here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "write_peak_rss.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peak = {}
    for n in (1024, 16384):
        out = subprocess.run(
            [sys.executable, str(script), str(n)], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        peak[n] = int(out.stdout.strip().splitlines()[-1])  # KiB
    assert peak[16384] - peak[1024] < 16 * 1024, peak


# ---------------------------------------------------------------------- fast paths inside the model
def test_validity_from_masks_needs_no_host_read_off_cpu():
    from lstmem_peft.tuner.hooks import valid_from_attention_mask

    ones = torch.ones(2, 6, dtype=torch.long)
    assert valid_from_attention_mask(ones, 2, 3) is None  # CPU, no padding: nothing to mask
    padded = ones.clone()
    padded[1, :4] = 0
    assert valid_from_attention_mask(padded, 2, 3).tolist() == [[True] * 3, [False, True, True]]
    assert valid_from_attention_mask(padded.bool(), 2, 3).tolist() == [[True] * 3, [False, True, True]]
    # off the CPU the mask is never read back (no device synchronisation): it is returned as is
    meta = valid_from_attention_mask(torch.ones(2, 6, dtype=torch.long, device="meta"), 2, 3)
    assert (
        meta is not None and meta.device.type == "meta" and meta.shape == (2, 3) and meta.dtype == torch.bool
    )


def test_generate_sees_weights_changed_between_calls():
    model = make()
    prompt = ids(1, 6)
    with torch.no_grad():
        before = model(input_ids=prompt, memory_cache=MemoryCache()).logits
        model.generate(input_ids=prompt, memory_cache=MemoryCache(), max_new_tokens=3, do_sample=False)
        randomize_memory(model, scale=0.5, seed=7)  # in place, like an optimiser step
        after = model(input_ids=prompt, memory_cache=MemoryCache()).logits
        assert not torch.allclose(before, after)
        fresh = copy.deepcopy(model)  # no cached plans
        out = model.generate(input_ids=prompt, memory_cache=MemoryCache(), max_new_tokens=4, do_sample=False)
        ref = fresh.generate(input_ids=prompt, memory_cache=MemoryCache(), max_new_tokens=4, do_sample=False)
        torch.testing.assert_close(after, fresh(input_ids=prompt, memory_cache=MemoryCache()).logits)
    assert torch.equal(out, ref)


def test_hooked_projections_take_the_unfused_path_with_the_same_result():
    """With a hook on the wrapped projection the correction is added after it (the hook sees the
    plain projection); the logits equal those of the fused path."""
    model = make()
    x = ids(2, 5)
    seen = []
    with torch.no_grad():
        fused_prefill = model(input_ids=x, memory_cache=MemoryCache()).logits
        q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        handle = q_proj.register_forward_hook(lambda m, a, o: seen.append((a[0].clone(), o.clone())))
        hooked = model(input_ids=x, memory_cache=MemoryCache()).logits
        handle.remove()
    torch.testing.assert_close(hooked, fused_prefill, atol=1e-5, rtol=1e-5)
    assert len(seen) == 1
    inputs, output = seen[0]
    torch.testing.assert_close(
        output, torch.nn.functional.linear(inputs, q_proj.weight)
    )  # no correction inside


def test_memory_grads_in_training_mode_reach_every_memory_parameter():
    """Autograd through the model: gradients reach every memory parameter, and the forward gives
    the same logits with and without gradients."""
    model = make().train()
    x = ids(2, 6)
    out = model(input_ids=x, memory_cache=MemoryCache(), labels=x)
    out.loss.backward()
    layers = memory_layers(model)
    assert all(layer.w_in.grad is not None and layer.w_in.grad.abs().sum() > 0 for layer in layers)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x, memory_cache=MemoryCache()).logits, out.logits)


def test_which_layers_get_memory_is_defined_once_on_the_config():
    """The tuner and the vLLM plugin ask the config which layers carry memory and which receive a
    depth input; a layer the model does not have is an error naming it."""
    from lstmem_peft import LSTMemConfig

    every, some = LSTMemConfig(), LSTMemConfig(layers_to_transform=[3, 1])
    assert every.memory_layer_indices(4) == [0, 1, 2, 3] and some.memory_layer_indices(4) == [1, 3]
    assert some.carries_memory(3) and not some.carries_memory(2)
    assert [every.receives_depth(d) for d in range(3)] == [False, True, True]
    assert not LSTMemConfig(depth_coupling=False).receives_depth(2)
    with pytest.raises(
        ValueError, match=r"decoder layers \[3\] that the model does not have \(it has 2 layers\)"
    ):
        some.memory_layer_indices(2)


def test_the_memory_spec_read_without_peft_is_the_configs_and_builds_the_same_layers(tmp_path):
    """Issue 46 item 5: the vLLM plugin and the server's facts read an adapter's
    :class:`~lstmem_peft.memory.spec.MemorySpec` from its ``adapter_config.json`` without PEFT; it is
    the one the config gives (:meth:`LSTMemConfig.memory_spec`), it checks the options as the config
    does, and :func:`~lstmem_peft.memory.spec.memory_layer` builds the memory layer the tuner injects."""
    import json

    from lstmem_peft import LSTMemConfig
    from lstmem_peft.memory.spec import MemorySpec, memory_layer, read_memory_spec

    config = LSTMemConfig(r=4, num_heads=2, alpha=8, layers_to_transform=[2, 0], scan_backend="torch")
    model = get_peft_model(tiny_model("qwen3"), config)
    model.save_pretrained(tmp_path)
    saved = model.peft_config["default"]
    spec = read_memory_spec(tmp_path)
    assert spec == saved.memory_spec()
    assert spec.layers_to_transform == (0, 2) and spec.query_module == saved.query_module
    assert spec.memory_id == saved.memory_id and spec.base_model_name_or_path == saved.base_model_name_or_path
    injected = memory_layers(model)[1]
    built = memory_layer(spec, injected.hidden_size, injected.query_size, 2)
    assert built.extra_repr() == injected.extra_repr() and built.backend == injected.backend == "torch"
    assert {n: p.shape for n, p in built.named_parameters()} == {
        n: p.shape for n, p in injected.named_parameters()
    }
    for bad, match in (
        ({"r": 0}, "r must be a positive integer"),
        ({"block_feedback": "false"}, "block_feedback must be true or false"),
        ({"layers_to_transform": [1, 1]}, "layers_to_transform has duplicates"),
        ({"state_dtype": "float16"}, "state_dtype must be one of"),
    ):
        with pytest.raises(ValueError, match=match):
            LSTMemConfig(**bad)
        with pytest.raises(ValueError, match=match):
            MemorySpec(**bad)
    options = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**options, "peft_type": "LORA"}))
    with pytest.raises(ValueError, match="the config of a LORA adapter, not of an LSTMem one"):
        read_memory_spec(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        read_memory_spec(tmp_path / "empty")
