"""Token ids are a tensor of shape ``(batch, length)``: a string, a list, one unbatched sequence or
float ids get an error naming the expected type and shape and the usual fix, from ``write_history``,
the model's forward with memory and ``generate`` (the prompt by keyword or by position), and the
memory is left as it was (issue 37, item 3)."""

import pytest
import torch
from tiny_models import make

from lstmem_peft import MemoryCache, write_history

NOT_IDS = {
    "a string": ("hello", TypeError, "must be a torch.Tensor of token ids with shape (batch, length)"),
    "a list": ([[5, 6, 7]], TypeError, "must be a torch.Tensor of token ids with shape (batch, length)"),
    "one sequence": (torch.tensor([5, 6, 7]), ValueError, "must have shape (batch, length), got (3,)"),
    "float ids": (torch.ones(1, 3), TypeError, "must hold integer token ids (torch.long), got torch.float32"),
}


@pytest.mark.parametrize("name", list(NOT_IDS))
def test_write_history_names_the_expected_type_and_shape(name):
    value, error, expected = NOT_IDS[name]
    model, cache = make(), MemoryCache()
    with pytest.raises(error) as refused:
        write_history(model, value, cache)
    assert str(refused.value).startswith("input_ids ") and expected in str(refused.value)
    assert cache.tokens_written is None  # nothing written


@pytest.mark.parametrize("name", list(NOT_IDS))
def test_forward_and_generate_with_memory_name_the_expected_type_and_shape(name):
    value, error, expected = NOT_IDS[name]
    model, cache = make(), MemoryCache()
    with pytest.raises(error) as refused:
        model(input_ids=value, memory_cache=cache)
    assert str(refused.value).startswith("input_ids ") and expected in str(refused.value)
    with pytest.raises(error) as refused:
        model.generate(input_ids=value, memory_cache=cache, max_new_tokens=2)
    assert expected in str(refused.value)
    with pytest.raises(error) as refused:
        model.generate(value, memory_cache=cache, max_new_tokens=2)  # the prompt as `inputs`
    assert expected in str(refused.value) and str(refused.value).startswith("inputs ")
    assert cache.tokens_written is None
    ids = torch.tensor([[5, 6, 7]])
    assert model.generate(input_ids=ids, memory_cache=cache, max_new_tokens=2).shape == (1, 5)
