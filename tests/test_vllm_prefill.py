"""How the vLLM plugin batches a step's prefill chunks (lstmem_peft/integrations/vllm/prefill.py),
which needs no vLLM: groups of similar length from the step's sequence boundaries, each one padded
block scan. Every chunk runs in exactly one group, its tokens go back where they came from, and a
group's scan gives each chunk what a scan of that chunk alone gives (the memory layer masks the
padding). The plugin's forward over real steps: tests/test_vllm.py."""

from __future__ import annotations

import random

import pytest
import torch

from lstmem_peft.integrations.vllm.prefill import PADDING_LIMIT, group_chunks, prefill_groups
from lstmem_peft.memory.layer import LSTMemLayer


def test_equal_chunks_share_one_scan_and_a_long_chunk_pads_no_short_one():
    assert group_chunks([64, 64, 64]) == [[0, 1, 2]]
    assert group_chunks([32, 1024, 32, 32, 32]) == [[1], [0, 2, 3, 4]]
    assert group_chunks([256, 128, 64, 32]) == [[0, 1], [2, 3]]
    assert group_chunks([5, 5, 5], limit=1) == [[0, 1, 2]] and group_chunks([5, 4], limit=1) == [[0], [1]]
    with pytest.raises(ValueError, match="at least 1"):
        group_chunks([3], limit=0.5)


@pytest.mark.parametrize("seed", range(20))
def test_every_chunk_runs_once_within_the_padding_limit(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 7, 16, 33, 100, 512]) for _ in range(rng.randint(1, 9))]
    groups = group_chunks(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert g == sorted(g)
        longest = max(lengths[i] for i in g)
        assert len(g) == 1 or len(g) * longest <= PADDING_LIMIT * sum(lengths[i] for i in g)


def test_the_groups_put_every_token_back_where_it_came_from():
    lengths = [3, 40, 5, 38, 1]
    decodes = 2  # the flat batch's first rows are decodes: the prefill boundaries start after them
    starts = torch.tensor([decodes, *[decodes + sum(lengths[: i + 1]) for i in range(len(lengths))]])
    slots = torch.tensor([11, 12, 13, 14, 15])
    read_only = torch.tensor([False, False, True, False, False])
    flat = torch.arange(decodes + sum(lengths))  # each row's value is its own index
    groups = prefill_groups(starts, slots, read_only)
    assert [g.rows for g in groups] == [(1, 2, 3), (0, 4)]  # 40, 38 and 5 pad to 120 <= 1.5 x 83
    seen = torch.cat([g.put for g in groups])
    assert sorted(seen.tolist()) == list(range(sum(lengths)))  # every prefill token once
    for g in groups:
        assert torch.equal(flat[g.gather].flatten()[g.pick], decodes + g.put)
        assert g.slots.tolist() == [int(slots[r]) for r in g.rows]
        for i, row in enumerate(g.rows):  # the write takes a chunk's own tokens, none of a read-only one
            assert int(g.write[i].sum()) == (0 if read_only[row] else lengths[row])


def test_a_group_scan_gives_each_chunk_what_its_own_scan_gives():
    """The padded scan of a group of chunks (the plugin's call: ``valid`` masks the padding) against
    each chunk scanned alone, float64: reads, hidden states at every token and final states agree
    to rounding."""
    torch.manual_seed(0)
    layer = LSTMemLayer(hidden_size=32, query_size=32, num_heads=2, head_dim=4, dtype=torch.float64).eval()
    lengths = [9, 2, 7, 1]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(starts[-1]), 32, dtype=torch.float64)
    cells = torch.randn(4, 2, 4, 4, dtype=torch.float64) * 0.1
    hiddens = torch.randn(4, 2, 4, 4, dtype=torch.float64) * 0.1
    slots = torch.arange(4)
    with torch.no_grad():
        for g in prefill_groups(starts, slots, torch.zeros(4, dtype=torch.bool), limit=2.0):
            out = layer(x[g.gather], cells[g.slots], hiddens[g.slots], valid=g.write, aux=False)
            reads = out.read.reshape(-1, out.read.shape[-1])[g.pick]
            offset = 0
            for i, row in enumerate(g.rows):
                a, b = int(starts[row]), int(starts[row + 1])
                alone = layer(x[a:b][None], cells[row : row + 1], hiddens[row : row + 1], aux=False)
                torch.testing.assert_close(
                    reads[offset : offset + b - a], alone.read[0], rtol=1e-12, atol=1e-12
                )
                torch.testing.assert_close(out.cell[i], alone.cell[0], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(out.hidden[i], alone.hidden[0], rtol=1e-12, atol=1e-12)
                offset += b - a
