"""The fewest bytes each op must move: every input read once, every output written once.

One function per op, `bytes_<op>(inputs) -> int`, taking the op's keyword arguments (the input set
the benchmark passes). State pools count only the slots the batch names: read where the request has
an initial state, written always. Index tensors (query_start_loc, cache indices) are counted too.
`op_bytes(op, inputs)` dispatches by name; ops without a function have no GB/s.
"""
from __future__ import annotations

import torch


def _nb(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _slot_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def _live(idx: torch.Tensor, pad: int) -> int:
    if idx.device.type == "meta":  # shape-only inputs (e.g. byte counts of large shapes): all live
        return idx.numel()
    return int((idx != pad).sum())


def _initial(has_initial_state) -> int:
    if has_initial_state is None:
        return 0
    if has_initial_state.device.type == "meta":
        return has_initial_state.numel()
    return int(has_initial_state.sum())


def bytes_causal_conv1d_varlen(inp: dict) -> int:
    x, w, pool = inp["x"], inp["weight"], inp["conv_states"]
    idx = inp["cache_indices"]
    n = _live(idx, inp.get("pad_slot_id", -1))
    return (2 * _nb(x) + _nb(w) + _nb(inp.get("bias")) + _nb(inp["query_start_loc"]) + _nb(idx)
            + _nb(inp.get("has_initial_state")) + (_initial(inp.get("has_initial_state")) + n) * _slot_bytes(pool))


def bytes_causal_conv1d_update(inp: dict) -> int:
    x, pool, idx = inp["x"], inp["conv_states"], inp["conv_state_indices"]
    n = _live(idx, inp.get("pad_slot_id", -1))
    return 2 * _nb(x) + _nb(inp["weight"]) + _nb(inp.get("bias")) + _nb(idx) + 2 * n * _slot_bytes(pool)


def bytes_selective_scan_varlen(inp: dict) -> int:
    u = inp["u"]
    pool, idx = inp["ssm_states"], inp["cache_indices"]
    n = _live(idx, inp.get("pad_slot_id", -1))
    per_token = _nb(u) + _nb(inp["delta"]) + _nb(inp.get("z")) + _nb(u)  # u, delta, z read; y written
    return (per_token + _nb(inp["B"]) + _nb(inp["C"]) + _nb(inp["A"]) + _nb(inp.get("D"))
            + _nb(inp.get("delta_bias")) + _nb(inp["query_start_loc"]) + _nb(idx)
            + _nb(inp.get("has_initial_state"))
            + (_initial(inp.get("has_initial_state")) + n) * _slot_bytes(pool))


def bytes_selective_state_update(inp: dict) -> int:
    state, x, idx = inp["state"], inp["x"], inp["state_batch_indices"]
    n = _live(idx, inp.get("pad_slot_id", -1))
    return (2 * _nb(x) + _nb(inp["dt"]) + _nb(inp["A"]) + _nb(inp["B"]) + _nb(inp["C"]) + _nb(inp.get("D"))
            + _nb(inp.get("z")) + _nb(inp.get("dt_bias")) + _nb(idx) + 2 * n * _slot_bytes(state))


def bytes_ssd_varlen(inp: dict) -> int:
    x = inp["x"]
    pool, idx = inp["ssm_states"], inp["cache_indices"]
    n = _live(idx, inp.get("pad_slot_id", -1))
    return (2 * _nb(x) + _nb(inp.get("z")) + _nb(inp["dt"]) + _nb(inp["A"]) + _nb(inp["B"]) + _nb(inp["C"])
            + _nb(inp.get("D")) + _nb(inp.get("dt_bias")) + _nb(inp["query_start_loc"]) + _nb(idx)
            + _nb(inp.get("has_initial_state"))
            + (_initial(inp.get("has_initial_state")) + n) * _slot_bytes(pool))


def bytes_gated_rms_norm(inp: dict) -> int:
    x = inp["x"]
    return 2 * _nb(x) + _nb(inp.get("z")) + _nb(inp.get("weight"))


def bytes_copy(inp: dict) -> int:
    return _nb(inp["src"]) + _nb(inp["dst"])


def bytes_mamba2_mixer(inp: dict) -> int:
    """Model level: the layer's weights and its input/output activations (the fewest a layer moves)."""
    return sum(_nb(v) for k, v in inp.items() if k.startswith("w_")) + 2 * _nb(inp["hidden"]) \
        + sum(_nb(v) for k, v in inp.items() if k.endswith("_states"))


BYTES = {name[len("bytes_"):]: fn for name, fn in globals().items() if name.startswith("bytes_")}


def op_bytes(op: str, inputs: dict) -> int | None:
    fn = BYTES.get(op)
    return int(fn(inputs)) if fn else None
