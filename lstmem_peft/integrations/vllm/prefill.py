"""How a step's prefill chunks reach the memory scan: groups of similar length, one padded scan each.

A vLLM step that prefills several requests holds a chunk of each, of any lengths (one long prompt
beside a few short ones is common under chunked prefill). One block scan over all of them, padded
to the longest, does the work of ``P * T_max`` tokens; one scan per chunk does ``sum(T_i)`` but
calls the layer ``P`` times. The plugin takes the sequence boundaries (vLLM's
``query_start_loc_cpu``, its ``cu_seqlens``) and groups the chunks: longest first, a chunk joins the
current group while the group's padded size stays within :data:`PADDING_LIMIT` times its tokens,
else it starts a new group. Equal chunks stay one scan; a long chunk no longer pads the short ones
to its length (what that saves: ``benchmarks/bench_prefill_padding.py``; figures in docs/vllm.md).

Everything here is host arithmetic on the boundaries, once per step (the metadata builder's); the
result is tensors on the step's device. No vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The most padded positions a group of prefill chunks runs per token it holds.
PADDING_LIMIT = 1.5


def group_chunks(lengths: list[int], limit: float = PADDING_LIMIT) -> list[list[int]]:
    """The chunks (indices into ``lengths``) in groups: longest first, a chunk joins the current
    group while ``len(group) * longest <= limit * tokens`` holds with it, else starts the next one.
    Each group lists its chunks in their order in the step.

    Args:
        lengths: each prefill chunk's token count (positive).
        limit: at least 1; 1 pads nothing (only equal chunks share a scan).
    """
    if limit < 1:
        raise ValueError(f"a padding limit is at least 1 (no padding), got {limit}")
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= limit * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return [sorted(group) for group in groups]


@dataclass(frozen=True)
class PrefillGroup:
    """Prefill chunks of one step that run as one padded block scan.

    Attributes:
        rows: the chunks, as their rows among the step's prefill chunks (host).
        slots: ``(G,)`` int64 state slots of their requests.
        read_only: ``(G,)`` bool: the request only reads its memory.
        gather: ``(G, T)`` int64 rows of the flat batch each padded position takes (``T`` the
            group's longest chunk; padding repeats the chunk's last token, masked out).
        write: ``(G, T)`` bool: the positions the write takes in (``False`` at padding and at every
            token of a read-only request).
        pick: ``(n,)`` int64 positions, in the flattened ``(G T)`` padded batch, of the group's
            ``n`` tokens, chunk by chunk.
        put: ``(n,)`` int64 the same tokens' places among the step's prefill tokens.
    """

    rows: tuple[int, ...]
    slots: torch.Tensor
    read_only: torch.Tensor
    gather: torch.Tensor
    write: torch.Tensor
    pick: torch.Tensor
    put: torch.Tensor


def prefill_groups(
    starts: torch.Tensor, slots: torch.Tensor, read_only: torch.Tensor, limit: float = PADDING_LIMIT
) -> tuple[PrefillGroup, ...]:
    """The step's prefill chunks in :func:`group_chunks` groups.

    Args:
        starts: ``(P + 1,)`` int64 on the host: chunk ``i`` is the flat batch's rows
            ``starts[i] .. starts[i + 1] - 1`` (vLLM's ``query_start_loc_cpu`` from the first prefill).
        slots: ``(P,)`` int64 state slots of the chunks' requests (on the step's device).
        read_only: ``(P,)`` bool (on the step's device).
        limit: see :func:`group_chunks`.
    """
    lengths = starts[1:] - starts[:-1]
    device = slots.device
    out = []
    for rows in group_chunks(lengths.tolist(), limit):
        index = torch.tensor(rows)
        first, count = starts[:-1][index], lengths[index]
        offsets = torch.arange(int(count.max()))
        valid = offsets[None, :] < count[:, None]
        gather = first[:, None] + torch.minimum(offsets[None, :], count[:, None] - 1)
        pick = (torch.arange(len(rows))[:, None] * offsets.numel() + offsets[None, :])[valid]
        on_device = index.to(device, non_blocking=True)
        group_read_only = read_only[on_device]
        out.append(
            PrefillGroup(
                rows=tuple(rows),
                slots=slots[on_device],
                read_only=group_read_only,
                gather=gather.to(device, non_blocking=True),
                write=valid.to(device, non_blocking=True) & ~group_read_only[:, None],
                pick=pick.to(device, non_blocking=True),
                put=(gather[valid] - starts[0]).to(device, non_blocking=True),
            )
        )
    return tuple(out)
