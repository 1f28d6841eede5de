"""The calls the ahead-of-time compile drives (:mod:`lstmem_kernels.aot`), inside
:func:`~lstmem_kernels.aot_capture.capture_launches`: the public entry points (``lstmem_scan`` forward
and backward, ``lstmem_step``, ``lstmem_decode_step``) on CPU tensors at the paper's sizes (``n_h = 4``,
``r = 8``, ``d = 2560``, ``T = 2048``) and the kernel tests' edge sizes, over their flags and dtypes:
every pair of factor values (:func:`pairwise`, a covering array) plus each factor's all-off and all-on
rows (:func:`extremes`), or the whole product on demand. :func:`drive` makes the calls of one set.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .aot_capture import scenario


# ---------------------------------------------------------------------- covering the flags
def pairwise(factors: dict[str, list]) -> list[dict]:
    """Rows (one value per factor) in which every pair of values of two factors appears at least once,
    plus the row of every factor's first value and the row of every last value (the factors below list
    their lightest value first and their heaviest last: flags off, then on); greedy, deterministic.

    >>> rows = pairwise({"a": [0, 1], "b": [0, 1], "c": [0, 1, 2]})
    >>> all(any(r["a"] == x and r["c"] == z for r in rows) for x in (0, 1) for z in (0, 1, 2))
    True
    """
    names = list(factors)
    rows = [{n: factors[n][0] for n in names}, {n: factors[n][-1] for n in names}]
    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(range(len(names)), 2)
        for i in range(len(factors[names[a]]))
        for j in range(len(factors[names[b]]))
    }

    def cover(row_idx: list[int]) -> None:
        for a, b in itertools.combinations(range(len(names)), 2):
            uncovered.discard((a, row_idx[a], b, row_idx[b]))

    for row in rows:
        cover([factors[n].index(row[n]) for n in names])
    while uncovered:
        a, i, b, j = min(uncovered)
        choice = {a: i, b: j}
        for c in range(len(names)):
            if c in choice:
                continue

            best, best_gain = 0, -1
            for v in range(len(factors[names[c]])):
                g = sum(((c, v, d, e) if c < d else (d, e, c, v)) in uncovered for d, e in choice.items())
                if g > best_gain:
                    best, best_gain = v, g
            choice[c] = best
        idx = [choice[c] for c in range(len(names))]
        cover(idx)
        rows.append({n: factors[n][k] for n, k in zip(names, idx, strict=True)})
    unique = {repr(sorted(r.items(), key=lambda kv: kv[0])): r for r in rows}
    return list(unique.values())


def extremes(factors: dict[str, list]) -> list[dict]:
    """The row of every factor's first (lightest) value and the row of every last (heaviest) one."""
    return [{n: v[0] for n, v in factors.items()}, {n: v[-1] for n, v in factors.items()}]


def _grid(factors: dict[str, list], mode: str) -> list[dict]:
    if mode == "product":
        return [dict(zip(factors, values, strict=True)) for values in itertools.product(*factors.values())]
    return pairwise(factors)


# ---------------------------------------------------------------------- driving the public entry points
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
PAPER = {"H": 4, "R": 8, "d": 2560, "T": 2048}


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _scan(B, T, H, R, dtype, depth, valid, initial, grad, label, paper) -> None:
    """One ``lstmem_scan(..., backend="triton")`` call, and its backward when ``grad`` names a loss:
    ``"all"`` (every output, every input with a gradient), ``"read"`` (the reads; depth without a
    gradient) or ``"finals"`` (the final states only)."""
    from . import lstmem_scan

    dt = DTYPES[dtype]
    vecs = [_rand(B, T, H, R, dtype=dt) for _ in range(5)]
    dep = _rand(B, T, H, R, R, dtype=dt) if depth else None
    keep = (torch.rand(B, T) > 0.25) if valid else None
    c0 = d0 = None
    if initial:
        c0, d0 = (_rand(B, H, R, R, dtype=DTYPES[initial]) for _ in range(2))
    with scenario(label, paper):
        if grad == "none":
            with torch.no_grad():
                lstmem_scan(*vecs, dep, keep, c0, d0, backend="triton")
            return
        for t in vecs:
            t.requires_grad_()
        if dep is not None and grad == "all":
            dep.requires_grad_()
        for t in (c0, d0):
            if t is not None and grad != "read":
                t.requires_grad_()
        read, hidden, cell_T, hidden_T = lstmem_scan(*vecs, dep, keep, c0, d0, backend="triton")
        terms = {"all": (read, hidden, cell_T, hidden_T), "read": (read,), "finals": (cell_T, hidden_T)}[grad]
        sum(t.float().sum() for t in terms).backward()


def _step(B, H, R, dtype, state, depth, valid, strided, query, out, label, paper) -> None:
    """One ``lstmem_step(..., backend="triton")`` call (in place, or into ``out``)."""
    from . import lstmem_step

    dt = DTYPES[dtype]
    q, k, w, f, o = (_rand(B, H, R, dtype=dt) for _ in range(5))
    cell, hidden = (_rand(B, H, R, R, dtype=DTYPES[state]) for _ in range(2))
    if strided:  # states as the transposes of contiguous tensors
        cell, hidden = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (cell, hidden))
    dep = _rand(B, H, R, R, dtype=dt) if depth else None
    keep = torch.arange(B) % 2 == 0 if valid else None
    target = (torch.empty(B, H, R, R), torch.empty(B, H, R, R)) if out else None
    with scenario(label, paper), torch.no_grad():
        lstmem_step(q if query else None, k, w, f, o, cell, hidden, dep, keep, backend="triton", out=target)


def _decode(B, d, H, R, dtype, weights, state, depth, valid, slots, seq, label, paper) -> None:
    """One ``lstmem_decode_step`` call with the layer's weight shapes; ``slots`` ``"int64"`` or
    ``"int32"``: state tables of ``2 B + 3`` rows stepped in place."""
    from . import lstmem_decode_step

    ds = H * R
    wdt = DTYPES[dtype if weights == "like-x" else weights]
    x = _rand(B, d, dtype=DTYPES[dtype])
    w_in, b_in = _rand(d, 4 * ds, dtype=wdt), _rand(4 * ds, dtype=wdt)
    eau = _rand((4 if depth else 2) * ds, 6 * ds, dtype=wdt)
    b_eau, read = _rand(6 * ds, dtype=wdt), _rand(2 * ds, ds, dtype=wdt)
    rows = 2 * B + 3 if slots else B
    cell, hidden = (_rand(rows, H, R, R, dtype=DTYPES[state]) for _ in range(2))
    index = None
    if slots:
        index = torch.randperm(rows)[:B].to(getattr(torch, slots))
        target = (cell, hidden)  # the serving engine's in-place slot step
    else:
        target = (torch.empty_like(cell), torch.empty_like(hidden))
    dep = _rand(B, H, R, R, dtype=DTYPES[dtype]) if depth else None
    keep = torch.arange(B) % 2 == 0 if valid else None
    hidden_seq = torch.empty(B, H, R, R) if seq else None
    with scenario(label, paper), torch.no_grad():
        lstmem_decode_step(
            x,
            w_in,
            b_in,
            eau,
            b_eau,
            read,
            cell,
            hidden,
            num_heads=H,
            out=target,
            depth=dep,
            valid=keep,
            norm_eps=1e-6,
            slots=index,
            hidden_seq=hidden_seq,
            backend="triton",
        )


FLAGS = [False, True]
SCAN_FLAGS = {
    "dtype": ["f32", "bf16", "f16"],
    "depth": FLAGS,
    "valid": FLAGS,
    "initial": [None, "bf16", "f32"],
    "grad": ["none", "read", "finals", "all"],
}
STEP_FLAGS = {
    "dtype": ["f32", "bf16", "f16"],
    "state": ["f32", "bf16"],
    "depth": FLAGS,
    "valid": FLAGS,
    "strided": FLAGS,
    "query": [False, True],
    "out": FLAGS,
}
DECODE_FLAGS = {
    "dtype": ["f32", "bf16", "f16"],
    "weights": ["like-x", "f32"],
    "state": ["f32", "bf16"],
    "depth": FLAGS,
    "valid": FLAGS,
    "slots": [None, "int32", "int64"],
    "seq": FLAGS,
}


def _label(entry: str, sizes: dict, row: dict) -> str:
    parts = [f"{k}={v}" for k, v in sizes.items()]
    parts += [k if v is True else f"{k}={v}" for k, v in row.items() if v not in (False, None)]
    return f"{entry} " + " ".join(parts)


def _calls(which: str, mode: str) -> list[tuple[Callable, dict]]:
    """``(function, kwargs)`` for every call of the set ``which`` (``fast``, ``paper``, ``edge``, ``full``)."""
    calls = []

    def add(fn, entry, sizes, rows, paper):
        for row in rows:
            calls.append((fn, {**sizes, **row, "label": _label(entry, sizes, row), "paper": paper}))

    H, R, d, T = PAPER["H"], PAPER["R"], PAPER["d"], PAPER["T"]
    if which == "fast":
        heavy_scan = {"depth": True, "valid": True, "initial": "f32", "grad": "all"}
        for dtype in ("f32", "bf16"):
            add(_scan, "scan", {"B": 1, "T": T, "H": H, "R": R}, [{"dtype": dtype, **heavy_scan}], True)
        add(_scan, "scan", {"B": 2, "T": 1, "H": 2, "R": 5}, [{"dtype": "f32", **heavy_scan}], False)
        add(
            _step,
            "step",
            {"B": 4, "H": H, "R": R},
            [dict(dtype="bf16", state="f32", depth=True, valid=True, strided=False, query=True, out=False)],
            True,
        )
        add(
            _decode,
            "decode",
            {"B": 8, "d": d, "H": H, "R": R},
            [{**extremes(DECODE_FLAGS)[1], "dtype": "bf16", "weights": "like-x", "state": "f32"}],
            True,
        )
        return calls
    if which in ("paper", "full"):
        for B in (1, 4):
            add(_scan, "scan", {"B": B, "T": T, "H": H, "R": R}, _grid(SCAN_FLAGS, mode), True)
        for B in (1, 8):
            add(_step, "step", {"B": B, "H": H, "R": R}, _grid(STEP_FLAGS, mode), True)
            add(_decode, "decode", {"B": B, "d": d, "H": H, "R": R}, _grid(DECODE_FLAGS, mode), True)
    if which in ("edge", "full"):  # shapes, not flags: every factor's lightest and heaviest values
        for T_edge, R_edge, H_edge in ((1, 5, 2), (63, 6, 1), (2049, 8, 1), (63, 8, 3)):
            sizes = {"B": 2, "T": T_edge, "H": H_edge, "R": R_edge}
            add(_scan, "scan", sizes, extremes(SCAN_FLAGS), False)
        for R_edge in (5, 6):
            add(_step, "step", {"B": 3, "H": 2, "R": R_edge}, extremes(STEP_FLAGS), False)
            add(_decode, "decode", {"B": 3, "d": 300, "H": 3, "R": R_edge}, extremes(DECODE_FLAGS), False)
    return calls


def drive(which: str = "full", mode: str = "pairwise") -> int:
    """Call the public entry points for the set ``which`` (inside :func:`capture_launches`); returns
    the number of calls."""
    calls = _calls(which, mode)
    torch.manual_seed(0)
    for fn, kwargs in calls:
        fn(**kwargs)
    return len(calls)
