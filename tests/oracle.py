"""The oracle of the generation tests: recomputation with plain forwards from the starting memory."""

import torch

PAD = 0


def states(cache):
    return [(s.cell.clone(), s.hidden.clone()) for s in cache.layers], cache.tokens_written.clone()


def assert_same_memory(cache, expected, **tol):
    layers, tokens = expected
    assert cache.tokens_written.tolist() == tokens.tolist()
    for state, (cell, hidden) in zip(cache.layers, layers, strict=True):
        torch.testing.assert_close(state.cell, cell, **tol)
        torch.testing.assert_close(state.hidden, hidden, **tol)


def expand(start, repeats):
    cache = start.clone()
    if repeats > 1:
        cache.batch_repeat_interleave(repeats)
    return cache


def forward_logits(model, start, ids, mask):
    """Last-position logits of one forward over ``ids`` from the memory ``start`` (not modified)."""
    with torch.no_grad():
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            memory_cache=start.clone(),
            use_cache=False,
        ).logits[:, -1]


def expected_memory(model, start, prompt, mask, generated, kept):
    """Starting memory + each row's valid prompt tokens + its first ``kept[b]`` generated tokens."""
    n = int(kept.max())
    steps = torch.arange(generated.shape[1])
    kept_mask = (steps[None, :n] < kept[:, None]).long()
    ids = torch.cat([prompt, generated[:, :n]], 1)
    full = torch.cat([mask, kept_mask], 1)
    cache = start.clone()
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=full,
            position_ids=(full.cumsum(-1) - 1).clamp_min(0),
            memory_cache=cache,
            use_cache=False,
        )
    return states(cache)


def kept_lengths(generated, stop_token=None):
    """Generated tokens forwarded while each row was unfinished: all but the last, or up to (not
    including) the first ``stop_token``."""
    n = generated.shape[1]
    kept = torch.full((generated.shape[0],), n - 1)
    if stop_token is not None:
        for b in range(generated.shape[0]):
            hits = (generated[b] == stop_token).nonzero()
            if len(hits):
                kept[b] = int(hits[0])
    return kept


def check_contract(model, start, prompt, mask, out, cache, repeats=1, stop_token=None, *, atol, rtol):
    """(a) per-step logits vs recomputation (rows still running), (b) final memory vs recomputation.

    ``out``: ``generate``'s output with ``return_dict_in_generate=True, output_logits=True``;
    ``start``: the memory the call started from; ``repeats``: ``num_return_sequences``."""
    TOL = dict(atol=atol, rtol=rtol)
    prompt, mask = prompt.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
    start = expand(start, repeats)
    generated = out.sequences[:, prompt.shape[1] :]
    kept = kept_lengths(generated, stop_token)
    for j, logits in enumerate(out.logits):
        running = kept >= j  # rows that had not finished before generating token j
        ids = torch.cat([prompt, generated[:, :j]], 1)
        full = torch.cat([mask, torch.ones_like(generated[:, :j])], 1)
        ref = forward_logits(model, start, ids, full)
        torch.testing.assert_close(logits[running].double(), ref[running].double(), **TOL)
    assert_same_memory(cache, expected_memory(model, start, prompt, mask, generated, kept), **TOL)


def assert_row_equals_alone(batch_cache, row, alone, **tol):
    """Row ``row`` of ``batch_cache`` holds the memory of the one-row cache ``alone``."""
    for a, b in zip(batch_cache.layers, alone.layers, strict=True):
        torch.testing.assert_close(a.cell[row], b.cell[0], **tol)
        torch.testing.assert_close(a.hidden[row], b.hidden[0], **tol)
