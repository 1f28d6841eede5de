"""One invariant battery over every supported architecture and the adapter's main configurations:
zero memory is the base model, generation meets its exactness contract with padding and a row that
finishes early, and a history written in blocks continues exactly from a saved snapshot."""

import pytest
import torch
from oracle import PAD, check_contract
from peft import get_peft_model
from tiny_models import ARCHITECTURES, VOCAB, randomize_memory, tiny_model

from lstmem_peft import LSTMemConfig, MemoryCache, write_history

CONFIGS = {
    "all layers": dict(),
    "layers 0 and 2": dict(layers_to_transform=[0, 2]),
    "no depth coupling": dict(depth_coupling=False),
    "no feedback": dict(block_feedback=False),
    "bf16 states": dict(state_dtype="bfloat16"),
}
# float64 backbone and adapter: the states' own precision bounds the differences between paths
# (float32: 2^-24 per step; bfloat16: 2^-8 per rounding, a few dozen roundings here)
TOLERANCES = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=5e-2, rtol=5e-2)}


def make(arch, config):
    model = get_peft_model(tiny_model(arch).double(), LSTMemConfig(**config))
    randomize_memory(model)
    return model.eval()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_invariants(arch, config):
    model = make(arch, CONFIGS[config])
    tol = TOLERANCES[model.peft_config["default"].state_dtype]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=g)
    prompt[1, :2] = PAD
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [2]])).long()
    with torch.no_grad():
        # zero memory == the base model, exactly
        with model.disable_adapter():
            base_logits = model(input_ids=prompt, attention_mask=mask).logits
        start = MemoryCache()
        write_history(
            model, torch.randint(3, VOCAB, (2, 24), generator=g), start, block_size=10, progress=False
        )
        # generation: pick an EOS that row 0 generates at its second step, then check the contract
        free = model.generate(
            input_ids=prompt,
            attention_mask=mask,
            memory_cache=start.clone(),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=None,
        )
        eos = int(free[0, 7])
        cache = start.clone()
        out = model.generate(
            input_ids=prompt,
            attention_mask=mask,
            memory_cache=cache,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_logits=True,
        )
    assert not torch.equal(out.logits[0].double(), base_logits[:, -1].double())  # memory matters
    check_contract(model, start, prompt, mask, out, cache, stop_token=eos, **tol)
