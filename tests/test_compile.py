"""``torch.compile(model)`` decodes with LSTMem memory: exact, no graph break per layer, no
recompile per step.

In a captured inference graph each wrapper calls one opaque operation (``lstmem::query_correction``,
``lstmem::output_correction``) that runs its layer's memory against the open pass; the context
variable that carries the pass is read only by the backbone's hooks, once per forward.
"""

import contextlib

import pytest
import torch
import torch._dynamo as dynamo
from tiny_models import make
from transformers import DynamicCache

from lstmem_peft import MemoryCache, traceable_memory

CONFIG = dict(r=4, num_heads=2)


def decode(model, prompt, steps, warmup=None):
    """Prefill ``prompt`` then feed ``steps`` one token at a time; logits of every forward and the
    memory. ``warmup``: after that many steps, any recompilation raises."""
    cache, kv, logits = MemoryCache(), DynamicCache(), []
    with torch.no_grad():
        logits.append(model(input_ids=prompt, memory_cache=cache, past_key_values=kv, use_cache=True).logits)
        for t in range(steps.shape[1]):
            if t == warmup:
                torch.compiler.set_stance("fail_on_recompile")
            logits.append(
                model(
                    input_ids=steps[:, t : t + 1], memory_cache=cache, past_key_values=kv, use_cache=True
                ).logits
            )
    torch.compiler.set_stance("default")
    return logits, cache


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (2, 8), generator=g), torch.randint(3, 90, (2, 8), generator=g)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    dynamo.reset()


@pytest.mark.parametrize("arch", ["qwen3", "gpt-neox"])  # and a fused q/k/v projection (tuner/attention.py)
def test_compiled_decoding_equals_eager_and_does_not_recompile_per_step(arch):
    model = make(arch, **CONFIG)
    prompt, steps = inputs()
    expected, expected_cache = decode(model, prompt, steps)
    # the "eager" backend runs the captured graphs op by op. One difference: eager decoding adds a
    # correction in one product (addmm(y, u, C)), the graph adds the formed correction (y + (u C)):
    # float32 rounding of one sum per projection, carried through a few layers
    got, cache = decode(torch.compile(model, backend="eager"), prompt, steps, warmup=3)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.equal(cache.tokens_written, expected_cache.tokens_written)
    for ours, theirs in zip(cache.layers, expected_cache.layers, strict=True):
        torch.testing.assert_close(ours.cell, theirs.cell, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours.hidden, theirs.hidden, atol=1e-6, rtol=1e-5)


def test_a_decode_step_breaks_the_graph_only_at_the_pass_boundary_not_per_layer():
    prompt, steps = inputs(1)
    breaks = {}
    for layers in (1, 3):
        model = make("qwen3", layers_to_transform=list(range(layers)), **CONFIG)
        cache, kv = MemoryCache(), DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt, memory_cache=cache, past_key_values=kv, use_cache=True)

            def step(ids, model=model, cache=cache, kv=kv):
                return model(input_ids=ids, memory_cache=cache, past_key_values=kv, use_cache=True).logits

            explained = dynamo.explain(step)(steps[:, :1])
        breaks[layers] = explained.graph_break_count
        for reason in explained.break_reasons:  # none inside the projection wrappers
            assert not any(
                frame.filename.endswith("lstmem_peft/tuner/layer.py") for frame in reason.user_stack
            )
        dynamo.reset()
    assert breaks[1] == breaks[3] <= 1, breaks


@pytest.mark.slow
def test_inductor_compiled_decoding_matches_eager_within_float32_rounding():
    """The default backend generates fused kernels for the backbone: the same tokens' logits and
    memory up to float32 rounding (a few ulps of these magnitudes)."""
    model = make("qwen3", **CONFIG)
    prompt, steps = inputs(2)
    expected, expected_cache = decode(model, prompt, steps[:, :3])
    got, cache = decode(torch.compile(model), prompt, steps[:, :3])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(cache.layers, expected_cache.layers, strict=True):
        torch.testing.assert_close(ours.cell, theirs.cell, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- host synchronisation
class _HostSyncs:
    """Counts the operator that reads a tensor value on the host (``aten._local_scalar_dense``:
    ``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``); on a GPU each one stalls the stream and
    breaks a CUDA graph."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True])
def test_memory_adds_no_host_synchronisation_to_a_decode_step(padded, cache):
    """One decode step (``model(...)`` with a KV cache, and a step of ``generate``, on a dynamic or a
    static cache), padded rows included: the memory reads no tensor value on the host; the step
    synchronises exactly as often as the plain backbone's (transformers' own mask and stopping
    checks). A static cache keeps its length on the device: memory follows its own count."""
    model = make("qwen3", **CONFIG)
    prompt, steps = inputs()
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :3] = 0

    def forward_step(memory: bool) -> int:
        kv, cache = DynamicCache(), MemoryCache()
        kw = dict(memory_cache=cache) if memory else {}
        with torch.no_grad(), contextlib.nullcontext() if memory else model.disable_adapter():
            model(input_ids=prompt, attention_mask=mask, past_key_values=kv, use_cache=True, **kw)
            full = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            with _HostSyncs() as syncs:
                model(input_ids=steps[:, :1], attention_mask=full, past_key_values=kv, use_cache=True, **kw)
        return syncs.count

    def generate_steps(memory: bool, n: int) -> int:
        kw = dict(memory_cache=MemoryCache()) if memory else {}
        gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if cache == "static":
            gen["cache_implementation"] = "static"
        with torch.no_grad(), contextlib.nullcontext() if memory else model.disable_adapter():
            with _HostSyncs() as syncs:
                model.generate(input_ids=prompt, attention_mask=mask, **gen, **kw)
        return syncs.count

    assert forward_step(True) == forward_step(False)
    per_step = {m: generate_steps(m, 5) - generate_steps(m, 1) for m in (True, False)}
    assert per_step[True] == per_step[False], per_step


def test_a_decode_step_derives_no_weights_once_they_are_cached(monkeypatch):
    """Plain ``model(...)`` decoding and ``generate`` reuse each layer's derived weights: after the
    first forward no step derives them again (they would cost as many operators as the step)."""
    from lstmem_peft import LSTMemLayer

    model = make("qwen3", **CONFIG)
    prompt, steps = inputs()
    calls = []
    derive = LSTMemLayer.weights
    monkeypatch.setattr(LSTMemLayer, "weights", lambda self: calls.append(self) or derive(self))
    decode(model, prompt, steps[:, :1])  # the first forward derives them
    first = len(calls)
    decode(model, prompt, steps)
    with torch.no_grad():
        model.generate(input_ids=prompt, memory_cache=MemoryCache(), max_new_tokens=4, do_sample=False)
    assert first == 3 and len(calls) == first  # one per memory layer, then none


def test_compiled_static_cache_generate_gives_the_eager_tokens_and_memory():
    """``generate(cache_implementation="static", compile_config=...)`` with a ``memory_cache``:
    transformers compiles the decoding forward (counted), and the tokens and memory are the eager
    call's (memory within float32 rounding: the graph adds the formed correction, eager adds it in
    one product with the projection's output)."""
    from transformers import CompileConfig

    model = make("qwen3", **CONFIG)
    prompt, _ = inputs()
    kw = dict(input_ids=prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    eager_cache, compiled_cache = MemoryCache(), MemoryCache()
    config = CompileConfig(fullgraph=False, backend="eager")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise
    dynamo.reset()
    dynamo.utils.counters.clear()
    with torch.no_grad():
        eager = model.generate(memory_cache=eager_cache, **kw)
        compiled = model.generate(memory_cache=compiled_cache, compile_config=config, **kw)
    assert dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the forward really was compiled
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_cache.tokens_written, eager_cache.tokens_written)
    for a, b in zip(compiled_cache.layers, eager_cache.layers, strict=True):
        torch.testing.assert_close(a.cell, b.cell, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- traceable_memory: whole graphs
def _traceable_decode(model, compile_step, prompt, steps, warmup=None):
    """:func:`decode` inside ``traceable_memory()``, each forward through ``compile_step(forward)``."""
    with traceable_memory():
        return decode(compile_step(lambda **kw: model(**kw)), prompt, steps, warmup)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_decode_step_inside_traceable_memory_is_one_graph_without_a_break(layers):
    """The pass, the memory's math and the commit are traced: zero graph breaks, one graph, whatever
    the number of memory layers (what ``fullgraph=True`` and a CUDA graph need)."""
    model = make("qwen3", layers_to_transform=list(range(layers)), **CONFIG)
    prompt, steps = inputs(1)
    cache, kv = MemoryCache(), DynamicCache()
    with torch.no_grad(), traceable_memory():
        model(input_ids=prompt, memory_cache=cache, past_key_values=kv, use_cache=True)

        def step(ids):
            return model(input_ids=ids, memory_cache=cache, past_key_values=kv, use_cache=True).logits

        explained = dynamo.explain(step)(steps[:, :1])
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    # the memory runs inside the graph, not in an opaque operation
    ops = [str(op) for graph in explained.ops_per_graph for op in graph]
    assert not any("lstmem." in op for op in ops), ops
    assert torch.equal(cache.tokens_written, torch.full((2,), 9))  # the prompt (8), then the step once


def test_fullgraph_compiled_decoding_inside_traceable_memory_equals_eager():
    """``torch.compile(step, fullgraph=True)`` of prefill and decode steps: the eager logits and
    memory (the "eager" backend runs the traced graph op by op: the same operations in the same
    order), no recompilation after the first steps; the default mode (graph breaks allowed) too."""
    model = make("qwen3", **CONFIG)
    prompt, steps = inputs()
    expected, expected_cache = _traceable_decode(model, lambda f: f, prompt, steps)
    for fullgraph in (True, False):
        dynamo.reset()
        got, cache = _traceable_decode(
            model,
            lambda f, fg=fullgraph: torch.compile(f, fullgraph=fg, backend="eager"),
            prompt,
            steps,
            warmup=3,
        )
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert torch.equal(cache.tokens_written, expected_cache.tokens_written)
        for ours, theirs in zip(cache.layers, expected_cache.layers, strict=True):
            assert torch.equal(ours.cell, theirs.cell) and torch.equal(ours.hidden, theirs.hidden)


@pytest.mark.slow
def test_inductor_fullgraph_decoding_inside_traceable_memory_matches_eager():
    """Inductor fuses the memory's elementwise math with the backbone's: the eager logits and memory
    up to float32 rounding (a few ulps of these magnitudes)."""
    model = make("qwen3", **CONFIG)
    prompt, steps = inputs(2)
    expected, expected_cache = _traceable_decode(model, lambda f: f, prompt, steps[:, :4])
    compile_fullgraph = lambda f: torch.compile(f, fullgraph=True)  # noqa: E731
    got, cache = _traceable_decode(model, compile_fullgraph, prompt, steps[:, :4], warmup=2)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(cache.layers, expected_cache.layers, strict=True):
        torch.testing.assert_close(ours.cell, theirs.cell, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.hidden, theirs.hidden, rtol=1e-5, atol=1e-5)


def test_compiled_static_cache_generate_inside_traceable_memory_is_whole_graphs():
    """``generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))``
    inside ``traceable_memory()``: transformers compiles each decoding step into whole graphs (the
    memory's positions are the static cache's device count, not host integers), the tokens and
    memory are the eager call's (memory within float32 rounding: the compiled steps do not run
    operator for operator as eager decoding does; measured up to 1.4e-6 on states of magnitude up to
    6), a second call compiles nothing, and the cache ends holding exactly the tokens kept."""
    from transformers import CompileConfig

    model = make("qwen3", **CONFIG)
    prompt, _ = inputs()
    kw = dict(input_ids=prompt, max_new_tokens=8, do_sample=False, cache_implementation="static")
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise
    eager_cache = MemoryCache()
    with torch.no_grad():
        eager = model.generate(memory_cache=eager_cache, **kw)
        with traceable_memory():
            dynamo.utils.counters.clear()
            caches = [MemoryCache(), MemoryCache()]
            outputs = [model.generate(memory_cache=caches[0], compile_config=config, **kw)]
            assert dynamo.utils.counters["stats"]["unique_graphs"] > 0  # compiled, with fullgraph=True
            dynamo.utils.counters.clear()
            outputs.append(model.generate(memory_cache=caches[1], compile_config=config, **kw))
            assert not dynamo.utils.counters["stats"]  # the second call reuses the graphs
    for out, cache in zip(outputs, caches, strict=True):
        assert torch.equal(out, eager)
        assert torch.equal(cache.tokens_written, eager_cache.tokens_written)
        for a, b in zip(cache.layers, eager_cache.layers, strict=True):
            torch.testing.assert_close(a.cell, b.cell, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(a.hidden, b.hidden, atol=1e-6, rtol=1e-5)


def test_traceable_memory_refuses_another_thread():
    """One memory context per process while it is on: a forward in another thread is refused, not
    mixed with this thread's pass; eager ``generate`` inside it is the eager call."""
    import threading

    model = make("qwen3", **CONFIG)
    prompt, _ = inputs()
    errors = []

    def other_thread():
        try:
            with torch.no_grad():
                model(input_ids=prompt, memory_cache=MemoryCache())
        except RuntimeError as err:
            errors.append(str(err))

    with torch.no_grad(), traceable_memory():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(timeout=120)
        assert errors and "another thread while traceable_memory() is on" in errors[0]
        cache = MemoryCache()
        out = model.generate(input_ids=prompt, memory_cache=cache, max_new_tokens=3, do_sample=False)
    reference = MemoryCache()
    with torch.no_grad():
        expected = model.generate(input_ids=prompt, memory_cache=reference, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, expected)
    assert torch.equal(cache.layers[0].cell, reference.layers[0].cell)


def test_a_compiled_step_reads_the_cached_weights_and_follows_optimizer_steps_and_loads():
    """Inside ``traceable_memory()`` a compiled step derives no weights (the layers' cached
    ``LayerWeights`` are graph inputs: no ``eye``/``cat`` of the derivation in the graph), and the
    cache follows the parameters where they change without an eager forward in between: after an
    optimizer step and after ``load_state_dict`` the compiled step gives the eager step's logits."""
    import copy

    from lstmem_peft import memory_layers

    model = make("qwen3", **CONFIG)
    prompt, steps = inputs(3)
    cache, kv = MemoryCache(), DynamicCache()
    with torch.no_grad(), traceable_memory():
        model(input_ids=prompt, memory_cache=cache, past_key_values=kv, use_cache=True)  # caches the weights

        def step(ids, cache, kv):
            return model(input_ids=ids, memory_cache=cache, past_key_values=kv, use_cache=True).logits

        explained = dynamo.explain(step)(steps[:, :1], cache.clone(), copy.deepcopy(kv))
        ops = [str(op) for graph in explained.ops_per_graph for op in graph]
        assert not any("eye" in op for op in ops), ops  # LSTMemLayer.weights() builds an identity
        dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="eager")

        def agree(t):
            got = compiled(
                steps[:, t : t + 1], cache.clone(), copy.deepcopy(kv)
            )  # first, before any eager step
            want = step(steps[:, t : t + 1], cache.clone(), copy.deepcopy(kv))
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            return got

        agree(0)
        before = agree(1)
        state = {k: v.clone() for k, v in model.state_dict().items() if "lstmem" in k}
        params = [p for layer in memory_layers(model) for p in layer.parameters()]
        optimizer = torch.optim.SGD(params, lr=0.5)
        for p in params:
            p.grad = torch.randn_like(p)
        with torch.enable_grad():
            optimizer.step()
        changed = agree(1)
        assert not torch.equal(before, changed)  # the step changed the weights, and the graph saw it
        model.load_state_dict(state, strict=False)  # back to the weights before the step, by a load
        assert torch.equal(agree(1), before)
