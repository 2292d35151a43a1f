"""Adapters: third-party kernels (mamba_ssm, causal-conv1d, flash-linear-attention) behind the op
contract of `harness.ops`. Each module registers its Impl at import whether or not the package is
installed; `Impl.unavailable()` imports the package lazily and says why it cannot be used.

Shared by the adapters: `import_peer(module)` imports a peer module; when `HARNESS_PEERS_STUB_CUDA=1` (set by
scripts/peers_setup.sh) and only mamba_ssm's compiled `selective_scan_cuda` is missing, it installs a
placeholder module of that name (flagged `__harness_placeholder__`) so mamba_ssm's Triton ops import.

Slot indices: `host_slots` reads them on the host (a synchronisation). Inside `harness.ops.no_index_checks()`
(CUDA-graph capture, the benchmark loop) `host_reads_ok()` is False and the decode paths read nothing on the
host: the slot ids go to kernels that skip pads themselves, or `gather_slots`, `scatter_slots` and
`mask_rows` handle the pads on the device with index tensors of static shape (every row runs; pad rows
read zeros, write no slot, and their outputs are masked to zero).
"""
from __future__ import annotations

import importlib
import os
import sys
import types

import torch

from harness.ops._checks import index_checks_on


def import_peer(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == "selective_scan_cuda" and os.environ.get("HARNESS_PEERS_STUB_CUDA") == "1":
            stub = types.ModuleType("selective_scan_cuda")
            stub.__harness_placeholder__ = True
            sys.modules["selective_scan_cuda"] = stub
            return importlib.import_module(name)
        raise


def unavailable_reason(package: str, *modules: str) -> str | None:
    for m in modules:
        try:
            import_peer(m)
        except Exception as e:  # noqa: BLE001 - any import failure makes the peer unusable
            return f"package {package} not importable: {type(e).__name__}: {e}"
    return None


def host_slots(indices, pad_slot_id):
    """Host list of slot ids and the positions of live (non-pad) requests."""
    idx = [int(i) for i in indices.detach().cpu().tolist()]
    return idx, [i for i, s in enumerate(idx) if s != pad_slot_id]


def host_reads_ok() -> bool:
    """May an adapter read indices or values on the host? False inside `harness.ops.no_index_checks()`: a read
    would synchronise, and under CUDA-graph capture copying a device tensor to the host fails."""
    return index_checks_on()


# The fla lineage's chunked KDA (fla-core's chunk_kda and the copies SGLang and vLLM carry) factors each pairwise
# decay exp(G_i - G_j) inside a 16-token sub-chunk into exp(G_i - C) * exp(C - G_j) around a reference point C.
# fla-core bounds those factors for per-token log-decays in [-5, 0] (the lower bound of its "safe gate"); much
# stronger decays overflow the fp32 factors (fla-core) or clamp them (SGLang), and pairwise decays that should
# vanish come out near 1 (docs/findings.md).
KDA_CHUNK_GATE_FLOOR = -5.0


def require_kda_gate_floor(g, who: str, floor: float = KDA_CHUNK_GATE_FLOOR) -> None:
    """Decline (NotImplementedError, naming the limit) a chunked KDA call whose log-decays g go below `floor`
    anywhere. A host read of min(g): skipped inside `no_index_checks()` (see `host_reads_ok`)."""
    if g.numel() and host_reads_ok():
        lo = float(g.min())
        if lo < floor:
            raise NotImplementedError(
                f"{who}: per-token log-decays g >= {floor:g} only (the fla lineage factors the decays of a "
                f"16-token sub-chunk around one point; fla-core's safe-gate bound), got min g = {lo:.4g}")


def no_live_rows(indices, pad_slot_id, pool) -> bool:
    """A decode batch with no live row: no rows at all, an empty pool (only pads can name none of its slots),
    or pads only where the host may read the indices. Inside `no_index_checks()` a batch of pads only is not
    recognised: it runs like any other (its rows read and write no slot)."""
    if indices.shape[0] == 0 or pool.shape[0] == 0:
        return True
    return host_reads_ok() and not host_slots(indices, pad_slot_id)[1]


def _rows(mask, like):
    """`mask` (n,) viewed to broadcast over the trailing dims of `like` (n, ...)."""
    return mask.reshape((-1,) + (1,) * (like.dim() - 1))


def gather_slots(pool, indices, use, dtype=None):
    """The slots named by `indices` (n,) where `use` (n, bool), zeros elsewhere: (n, *slot), in `dtype`
    (default the pool's), on the device, with no host read. A row not used reads slot 0 and drops it
    (a pad id is never used as an index); an empty pool gives zeros."""
    n = indices.shape[0]
    shape = (n,) + tuple(pool.shape[1:])
    dtype = pool.dtype if dtype is None else dtype
    if n == 0 or pool.shape[0] == 0:
        return torch.zeros(shape, dtype=dtype, device=pool.device)
    safe = torch.where(use, indices.to(torch.int64), 0)
    got = pool.index_select(0, safe).to(dtype)
    return torch.where(_rows(use, got), got, 0)


def scatter_slots(pool, indices, live, states):
    """pool[indices[i]] = states[i] for the rows where `live` (n, bool), through the (possibly strided) pool
    view, in one indexed write of static shape and with no host read. Every other slot keeps its bits: a
    row not live is pointed at the slot of the first live row with that row's value (equal values, so the
    order of the duplicate writes does not matter), or, when no row is live, at slot 0 with slot 0's own
    bits. Live slot ids must be distinct (the contract's rule)."""
    n = indices.shape[0]
    if n == 0 or pool.shape[0] == 0:
        return
    vals = states.to(pool.dtype)
    idx = indices.to(torch.int64)
    first = torch.argmax(live.to(torch.int32)).reshape(1)  # the first live row (row 0 when none is)
    any_live = live.index_select(0, first)
    ref = torch.where(any_live, idx.index_select(0, first), 0)
    fill = torch.where(_rows(any_live, vals[:1]), vals.index_select(0, first), pool.index_select(0, ref))
    tgt = torch.where(live, idx, ref)
    pool.index_put_((tgt,), torch.where(_rows(live, vals), vals, fill))


def mask_rows(y, live):
    """`y` (n, ...) with the rows where `live` is False set to zero (on the device)."""
    return torch.where(_rows(live, y), y, 0)


def zero_pad_tokens(y, query_start_loc, cache_indices, pad_slot_id):
    """y[tokens of pad requests] = 0 on the device, without a host read (a packed varlen output; a peer that
    has no pad ids computes or skips those tokens, and the contract wants them 0)."""
    T = y.shape[0]
    if T == 0 or cache_indices.numel() == 0:
        return y
    q = query_start_loc.to(torch.int64)
    pad = torch.repeat_interleave(cache_indices.to(torch.int64) == pad_slot_id, q[1:] - q[:-1], output_size=T)
    return y.masked_fill_(pad.reshape((T,) + (1,) * (y.dim() - 1)), 0)
