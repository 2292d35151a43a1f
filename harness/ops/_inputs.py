"""Helpers for the specs' input builders, byte and FLOP counts (private to `harness.ops`).

Shape keys every varlen builder understands: `T` tokens split into `S` sequences of (nearly) equal
length; the batch uses slots 1..S of a pool of S+1 (slot 0 stays untouched, as an engine's pad slot
would); the last `fresh` sequences start without an initial state (default 0: every pool slot is read).
`optional=False` leaves the optional tensors out (None).
"""
from __future__ import annotations

import torch

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def rand(gen, device, *shape, dtype=torch.float32, scale=1.0, shift=0.0) -> torch.Tensor:
    """Seeded normal values drawn in fp32 on the generator's device, cast and moved to `device`."""
    if torch.device(device).type == "meta":  # shape-only inputs (byte counts of large shapes)
        return torch.empty(*shape, device="meta", dtype=dtype)
    t = torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float32)
    return (t * scale + shift).to(device, dtype)


def opt(shape: dict, t):
    """`t` unless the shape asks for the variant without optional inputs."""
    return t if shape.get("optional", True) else None


def seqs(T: int, S: int, device) -> torch.Tensor:
    """query_start_loc of S sequences of (nearly) equal length over T tokens."""
    S = max(1, min(S, T)) if T else max(1, S)
    return torch.tensor([round(i * T / S) for i in range(S + 1)], dtype=torch.int32, device=device)


def slots(shape: dict, S: int, device):
    """(cache_indices, has_initial_state): slots 1..S; the last `fresh` sequences start from zeros."""
    fresh = int(shape.get("fresh", 0))
    init = torch.ones(S, dtype=torch.bool, device=device)
    if fresh:
        init[-fresh:] = False
    return torch.arange(1, S + 1, dtype=torch.int32, device=device), init


def pool_dtype(shape: dict, default, act):
    """The pool's dtype: the shape's `pool_dtype` ("act": the activations' dtype `act`), else `default`."""
    p = shape.get("pool_dtype", default)
    return act if p == "act" else p


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def slot_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def live(idx: torch.Tensor, pad: int) -> int:
    if idx.device.type == "meta":  # shape-only inputs: all live
        return idx.numel()
    return int((idx != pad).sum())


def initial(has_initial_state) -> int:
    if has_initial_state is None:
        return 0
    if has_initial_state.device.type == "meta":
        return has_initial_state.numel()
    return int(has_initial_state.sum())


def pool_traffic(inp: dict, pool: str, index: str, flags: str | None) -> int:
    """Bytes of the named slots: read where the request has an initial state (always for decode), written
    for every live request."""
    p, idx = inp[pool], inp[index]
    n = live(idx, inp.get("pad_slot_id", -1))
    reads = initial(inp.get(flags)) if flags else n
    return (reads + n) * slot_bytes(p)


def tokens_T(shape) -> int:
    return shape["T"]


def tokens_B(shape) -> int:
    return shape["B"]
