"""Memory follows the KV cache on every transformers release the metadata admits (issue 44).

transformers 5.24 renamed the KV cache argument of forwards, ``generate`` and outputs from
``past_key_values`` to ``cache`` (the old name deprecated until 5.40). The hooks read the cache in one
place (``lstmem_peft.tuner.kv_argument``), by name and by type, so whichever name or position a caller
uses is followed; the library's own calls use the name the installed release declares; and a release
that passes the cache by a way the hooks cannot see is refused at run time, naming the version, with
the user's memory untouched, never a silently wrong token.

These run on whatever transformers is installed: the main tier's pin, and the newest and the floor of
the metadata's range (.ci/run-versions).
"""

import inspect
import warnings

import pytest
import torch
import transformers
from oracle import PAD, assert_same_memory, states
from peft import get_peft_model
from tiny_models import VOCAB, randomize_memory, tiny_model
from transformers import DynamicCache

import lstmem_peft.tuner.hooks as hooks_module
from lstmem_peft import LSTMemConfig, MemoryCache, write_history
from lstmem_peft.tuner.kv_argument import CACHE_NAMES, cache_keyword, kv_cache_in, kv_kwargs

TOL = dict(atol=1e-5, rtol=1e-5)  # float64 model, float32 states (tests/test_generation.py)
#: the name this release's forwards declare for the KV cache
NAME = cache_keyword(tiny_model("qwen3"))
#: every name this release's generate and forwards accept (the old one stays, deprecated, after a rename)
ACCEPTED = ["cache", "past_key_values"] if NAME == "cache" else ["past_key_values"]


@pytest.fixture(scope="module")
def model():
    model = get_peft_model(tiny_model("qwen3", 0).double(), LSTMemConfig())
    randomize_memory(model, seed=1)
    return model.eval()


def history(model, rows=2, seed=3):
    cache = MemoryCache()
    ids = torch.randint(3, VOCAB, (rows, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        write_history(model, ids, cache, block_size=8, progress=False)
    return cache


def prompt(rows=2, length=6, seed=0):
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_the_cache_is_found_by_any_name_position_or_type():
    kv, other = DynamicCache(), DynamicCache()
    for name in CACHE_NAMES:
        assert kv_cache_in((), {name: kv, "use_cache": True}) is kv
    assert kv_cache_in((torch.ones(1, 2), None, None, kv), {}) is kv  # positional
    assert kv_cache_in((), {"kv_state": kv}) is kv  # a name a later release might choose
    assert kv_cache_in((), {"past_key_values": None, "use_cache": True}) is None
    assert kv_cache_in((), {"cache": kv, "past_key_values": kv}) is kv
    with pytest.raises(ValueError, match="two KV caches"):
        kv_cache_in((), {"cache": kv, "past_key_values": other})


def test_the_library_passes_the_name_this_release_declares(model):
    """The keyword matches the backbone's own signature (through the PEFT wrapper), and the library's
    calls with a KV cache raise no deprecation warning of a renamed argument."""
    forward = inspect.signature(type(model.get_base_model()).forward).parameters
    assert NAME in forward and kv_kwargs(model, None) == {NAME: None}
    kv, memory = DynamicCache(), MemoryCache()
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=".*(past_key_values|cache_params).*deprecated", category=FutureWarning
        )
        with torch.no_grad():
            write_history(model, prompt(1, 12), memory, block_size=4, past_key_values=kv, progress=False)
            model.generate(
                input_ids=prompt(1, 14), memory_cache=memory, max_new_tokens=3, do_sample=False, **{NAME: kv}
            )


def write_head(model, head, name="past_key_values"):
    """Memory and a KV cache that both hold ``head`` (``write_history`` with the cache under ``name``)."""
    memory, kv = MemoryCache(), DynamicCache()
    with torch.no_grad():
        write_history(model, head, memory, block_size=4, progress=False, **{name: kv})
    return memory, kv


def stepwise(model, head, tail, steps):
    """The reference: greedy decoding by explicit forwards, each given the KV cache by keyword."""
    memory, kv = write_head(model, head)
    logits, token, out = [], tail, []
    with torch.no_grad():
        for _ in range(steps):
            step = model(input_ids=token, memory_cache=memory, use_cache=True, **kv_kwargs(model, kv)).logits[
                :, -1
            ]
            logits.append(step)
            token = step.argmax(-1, keepdim=True)
            out.append(token)
    return torch.cat(out, 1), logits


@pytest.mark.parametrize("name", ACCEPTED)
def test_generate_is_exact_whichever_name_the_caller_uses(model, name):
    """Memory and a KV cache holding a history, then ``generate`` with that cache under either name the
    release accepts: tokens, logits and the final memory equal explicit step-by-step forwards."""
    head, tail, steps = prompt(1, 8, seed=4), prompt(1, 3, seed=5), 5
    ref_tokens, ref_logits = stepwise(model, head, tail, steps)
    memory, kv = write_head(model, head, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # a deprecated name, passed on purpose
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.cat([head, tail], dim=1),
                memory_cache=memory,
                max_new_tokens=steps,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=PAD,
                **{name: kv},
            )
    assert torch.equal(out.sequences[:, head.shape[1] + tail.shape[1] :], ref_tokens)
    for got, want in zip(out.logits, ref_logits, strict=True):
        torch.testing.assert_close(got.double(), want.double(), **TOL)
    # generate forwards every token but the last one it produced; the reference forwarded all of them
    rewound, kv = write_head(model, head)
    with torch.no_grad():
        fed = torch.cat([tail, ref_tokens[:, :-1]], dim=1)
        model(input_ids=fed, memory_cache=rewound, use_cache=True, **kv_kwargs(model, kv))
    assert_same_memory(memory, states(rewound), **TOL)


def test_a_positional_cache_is_followed(model):
    """``model(input_ids, attention_mask, position_ids, kv)``: the forward's memory is the keyword one's."""
    ids = prompt(1, 5, seed=6)
    token = prompt(1, 1, seed=7)
    results = []
    for positional in (False, True):
        memory, kv = MemoryCache(), DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, memory_cache=memory, use_cache=True, **kv_kwargs(model, kv))
            base = model.get_base_model()
            position = torch.tensor([[ids.shape[1]]])
            if positional:
                logits = base(token, None, position, kv, memory_cache=memory, use_cache=True).logits
            else:
                logits = base(
                    input_ids=token,
                    position_ids=position,
                    memory_cache=memory,
                    use_cache=True,
                    **kv_kwargs(model, kv),
                ).logits
        results.append((logits, memory))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    assert_same_memory(results[1][1], states(results[0][1]), atol=0, rtol=0)


def hide_the_cache(monkeypatch):
    """Simulate a transformers release that passes the KV cache by a way the hooks do not read."""
    monkeypatch.setattr(hooks_module, "kv_cache_in", lambda args, kwargs: None)


def test_generate_refuses_a_cache_it_cannot_see(model, monkeypatch):
    """Attention would see the prompt through the cache while memory restarted at every step: the
    call raises, naming the transformers version, and the caller's memory is as it was."""
    cache = history(model)
    before = states(cache)
    hide_the_cache(monkeypatch)
    with pytest.raises(
        RuntimeError, match=f"transformers {transformers.__version__}.*memory was left as it was"
    ):
        with torch.no_grad():
            model.generate(
                input_ids=prompt(), memory_cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=PAD
            )
    assert_same_memory(cache, before, atol=0, rtol=0)


def test_a_forward_refuses_a_cache_it_cannot_see(model, monkeypatch):
    """A decode step whose returned KV cache holds tokens the hooks never saw commits nothing."""
    memory, kv = history(model, rows=1), DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt(1, 5), memory_cache=memory, use_cache=True, **kv_kwargs(model, kv))
    before = states(memory)
    hide_the_cache(monkeypatch)
    with pytest.raises(
        RuntimeError, match=f"transformers {transformers.__version__}.*holds 6 tokens, this forward fed 1"
    ):
        with torch.no_grad():
            model(input_ids=prompt(1, 1), memory_cache=memory, use_cache=True, **kv_kwargs(model, kv))
    assert_same_memory(memory, before, atol=0, rtol=0)
