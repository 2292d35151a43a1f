"""Varlen, split and decode invariances of every reference op (conv1d, Mamba-1 scan, both SSD forms):

* packed varlen input equals running each sequence alone;
* splitting a sequence anywhere (pieces may be empty or shorter than the conv's K-1) and carrying the
  final state into the next piece equals running the whole sequence;
* repeating the single-step decode op token by token equals the scan.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import Tolerance
from reference.conv1d import causal_conv1d, causal_conv1d_update
from reference.selective_scan import selective_scan, selective_state_update
from reference.ssd import ssd_chunked, ssd_scan, ssd_state_update
from reference.testing import (cu_seqlens_from, make_conv_inputs, make_mamba1_inputs, make_ssd_inputs,
                               seqlens, slice_tokens, split_points)

TIGHT = Tolerance(atol=1e-11, rtol=1e-10, ratio=1e-10)

# op under test -> (function, key in reference.testing.TOKEN_ARGS, op name in records)
OPS = {
    "causal_conv1d": (causal_conv1d, "causal_conv1d", "causal_conv1d"),
    "selective_scan": (selective_scan, "selective_scan", "selective_scan"),
    "ssd_scan": (ssd_scan, "ssd", "ssd"),
    "ssd_chunked": (ssd_chunked, "ssd", "ssd"),
}
seeds = st.integers(0, 2**31 - 1)


def draw_inputs(draw, op: str, lengths, initial_states: bool) -> dict:
    """Random float64 inputs for `op` over packed sequences of `lengths`, varying the op's options."""
    T, cu, seed = sum(lengths), cu_seqlens_from(lengths), draw(seeds)
    if op == "causal_conv1d":
        return make_conv_inputs(T, 3, draw(st.integers(2, 8)), seed=seed, cu_seqlens=cu,
                                initial_states=initial_states, bias=draw(st.booleans()),
                                activation=draw(st.sampled_from([None, "silu"])))
    if op == "selective_scan":
        return make_mamba1_inputs(T, 4, 3, draw(st.sampled_from([1, 2, 4])), seed=seed, cu_seqlens=cu,
                                  initial_states=initial_states, D=draw(st.booleans()), z=draw(st.booleans()),
                                  delta_softplus=draw(st.booleans()))
    inp = make_ssd_inputs(T, 4, 2, 3, draw(st.sampled_from([1, 2, 4])), seed=seed, cu_seqlens=cu,
                          initial_states=initial_states, D=draw(st.sampled_from(["head", "head_dim", None])),
                          z=draw(st.booleans()), dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.0, 0.03)])))
    if op == "ssd_chunked":
        inp["chunk_size"] = draw(st.sampled_from([1, 3, 4, 16]))
    return inp


def compare(check, name, got, want, context):
    """Compare (y, final_states) pairs; `name` is the op name written to the records."""
    (y, s), (y_ref, s_ref) = got, want
    check.close("y", y, y_ref, op=name, impl="reference", tol=TIGHT, context=context)
    check.close("final_states", s, s_ref, op=name, impl="reference", tol=TIGHT, context=context)


@pytest.mark.parametrize("op", list(OPS))
@given(data=st.data())
def test_packed_equals_per_sequence(op, data, check):
    """Running S packed sequences (some empty) in one call gives, for every sequence, the same outputs and
    final state as running that sequence alone with its own initial state."""
    fn, key, _ = OPS[op]
    lengths = data.draw(seqlens(min_seqs=1, max_seqs=4, min_len=0, max_len=10), label="lengths")
    init = data.draw(st.booleans(), label="initial_states")
    inp = draw_inputs(data.draw, op, lengths, init)
    y_all, s_all = fn(**inp)
    cu = inp["cu_seqlens"].tolist()
    ys, ss = [], []
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        h0 = inp["initial_states"][s:s + 1] if init else None
        y, fs = fn(**slice_tokens(inp, key, a, b, initial_states=h0))
        ys.append(y)
        ss.append(fs)
    compare(check, OPS[op][2], (torch.cat(ys), torch.cat(ss)), (y_all, s_all), f"lengths={lengths}")


def run_split(fn, key, inp, cuts):
    """Run one sequence as pieces [0, c0), [c0, c1), ..., carrying each piece's final state."""
    bounds = [0, *cuts, int(inp["cu_seqlens"][-1])]
    state, ys = inp["initial_states"], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        y, state = fn(**slice_tokens(inp, key, a, b, initial_states=state))
        ys.append(y)
    return torch.cat(ys), state


@pytest.mark.parametrize("op", list(OPS))
@given(data=st.data())
def test_split_anywhere_and_carry_equals_whole(op, data, check):
    """Cutting one sequence at arbitrary points (empty pieces and pieces shorter than the conv's K-1
    included) and feeding each piece's final state to the next gives the whole sequence's y and final state."""
    fn, key, _ = OPS[op]
    L = data.draw(st.integers(0, 16), label="length")
    inp = draw_inputs(data.draw, op, [L], data.draw(st.booleans(), label="initial_states"))
    cuts = data.draw(split_points(L, max_cuts=5), label="cuts")
    got = run_split(fn, key, inp, cuts)
    whole = fn(**inp)
    compare(check, OPS[op][2], got, whole, f"L={L} cuts={cuts}")


@pytest.mark.parametrize("K", [4, 8])
def test_conv_split_into_pieces_shorter_than_window(K, check):
    """Conv state carried across pieces all shorter than K-1 (lengths 1, 2, 0, 1, 3, ...) equals the whole:
    the state must mix the previous state's tail with the few new inputs in the right order."""
    inp = make_conv_inputs(14, 5, K, seed=K, cu_seqlens=[0, 14], initial_states=True)
    cuts = [1, 3, 3, 4, 7, 8, 10, 11]
    got = run_split(causal_conv1d, "causal_conv1d", inp, cuts)
    compare(check, "causal_conv1d", got, causal_conv1d(**inp), f"K={K} cuts={cuts}")


# ---------------------------------------------------------------------------------------------
# decode: the single-step op repeated equals the scan


def _batch_steps(inp, key_map, Bsz, L):
    """Per-step batch views: token t of sequence b is packed token b*L + t."""
    for t in range(L):
        yield {new: (inp[old].reshape(Bsz, L, *inp[old].shape[1:])[:, t] if inp[old] is not None else None)
               for old, new in key_map.items()}


def _decode_case(data):
    Bsz = data.draw(st.integers(1, 3), label="batch")
    L = data.draw(st.integers(1, 8), label="steps")
    return Bsz, L, cu_seqlens_from([L] * Bsz), data.draw(seeds, label="seed")


@given(data=st.data())
def test_conv_update_repeated_equals_conv(data, check):
    """causal_conv1d_update applied token by token from the initial state gives causal_conv1d's outputs
    and final state."""
    Bsz, L, cu, seed = _decode_case(data)
    K = data.draw(st.integers(2, 8), label="K")
    inp = make_conv_inputs(Bsz * L, 3, K, seed=seed, cu_seqlens=cu, initial_states=True,
                           bias=data.draw(st.booleans()), activation=data.draw(st.sampled_from([None, "silu"])))
    y_ref, s_ref = causal_conv1d(**inp)
    state, ys = inp["initial_states"], []
    for step in _batch_steps(inp, {"x": "x"}, Bsz, L):
        y, state = causal_conv1d_update(step["x"], state, inp["weight"], inp["bias"], activation=inp["activation"])
        ys.append(y)
    y = torch.stack(ys, dim=1).reshape(Bsz * L, -1)
    compare(check, "causal_conv1d", (y, state), (y_ref, s_ref), f"Bsz={Bsz} L={L} K={K}")


@given(data=st.data())
def test_selective_state_update_repeated_equals_scan(data, check):
    """selective_state_update applied token by token equals selective_scan (groups, D, z, delta_bias,
    softplus varied)."""
    Bsz, L, cu, seed = _decode_case(data)
    inp = make_mamba1_inputs(Bsz * L, 4, 3, data.draw(st.sampled_from([1, 2, 4])), seed=seed, cu_seqlens=cu,
                             initial_states=True, D=data.draw(st.booleans()), z=data.draw(st.booleans()),
                             delta_softplus=data.draw(st.booleans()))
    y_ref, s_ref = selective_scan(**inp)
    state, ys = inp["initial_states"], []
    for step in _batch_steps(inp, {"u": "x", "delta": "dt", "B": "B", "C": "C", "z": "z"}, Bsz, L):
        y, state = selective_state_update(state, A=inp["A"], D=inp["D"], dt_bias=inp["delta_bias"],
                                          dt_softplus=inp["delta_softplus"], **step)
        ys.append(y)
    y = torch.stack(ys, dim=1).reshape(Bsz * L, -1)
    compare(check, "selective_scan", (y, state), (y_ref, s_ref), f"Bsz={Bsz} L={L}")


@given(data=st.data())
def test_ssd_state_update_repeated_equals_scan(data, check):
    """ssd_state_update applied token by token equals ssd_scan (n_groups, D per head / per head x dim, z,
    dt_limit varied)."""
    Bsz, L, cu, seed = _decode_case(data)
    inp = make_ssd_inputs(Bsz * L, 4, 2, 3, data.draw(st.sampled_from([1, 2, 4])), seed=seed, cu_seqlens=cu,
                          initial_states=True, D=data.draw(st.sampled_from(["head", "head_dim", None])),
                          z=data.draw(st.booleans()), dt_limit=data.draw(st.sampled_from([(0.0, float("inf")),
                                                                                           (0.002, 0.02)])))
    y_ref, s_ref = ssd_scan(**inp)
    state, ys = inp["initial_states"], []
    for step in _batch_steps(inp, {"x": "x", "dt": "dt", "B": "B", "C": "C", "z": "z"}, Bsz, L):
        y, state = ssd_state_update(state, A=inp["A"], D=inp["D"], dt_bias=inp["dt_bias"],
                                    dt_softplus=inp["dt_softplus"], dt_limit=inp["dt_limit"], **step)
        ys.append(y)
    y = torch.stack(ys, dim=1).reshape(Bsz * L, *inp["x"].shape[1:])
    compare(check, "ssd", (y, state), (y_ref, s_ref), f"Bsz={Bsz} L={L}")
