"""Explicit delta-rule cases for the peer-adapter tests (suites/ops/test_peer_adapter_*.py): one packed
batch given by its lengths, has_initial_state flags and slots, run through an op and judged against the
float64 reference recurrence (reference.delta_rule) through the op contract.

`EMPTY_SEQUENCE_CASES` are batches with empty sequences (live or pads) next to non-empty ones: chunked
delta-rule kernels whose chunk tables number the sequences by their chunks (fla's `prepare_chunk_indices`
lineage) give the chunks after an empty sequence the wrong sequence.
"""
from __future__ import annotations

import torch

from harness.ops import PAD_SLOT_ID
from harness.testing import assert_untouched, make_pool
from harness.testing.optest import coarser, rand, randn, token_mask
from reference import delta_rule as R
from reference.testing import cu_seqlens_from, gen

F, T = False, True
# (lengths, has_initial_state, slots); pad slot -1
EMPTY_SEQUENCE_CASES = [
    ([0, 2, 0], [F, T, T], [1, 2, 0]),
    ([0, 0, 2, 0], [T, T, F, F], [2, 0, 1, -1]),
    ([63, 0, 2, 0], [T, T, F, F], [2, 0, 1, -1]),
    ([0, 2, 2], [F, T, T], [1, 2, 0]),
]


# (cu_seqlens, the (sequence, chunk) table that names each chunk's owner at chunk size 64): an empty sequence
# owns no chunk, so the chunks after it belong to the next non-empty sequence
CHUNK_OWNER_CASES = [([0, 0, 2, 2], [[1, 0]]), ([0, 2, 2, 4], [[0, 0], [2, 0]])]


def case_id(case) -> str:
    lengths, hi, slots = case
    flags = "".join("T" if h else "F" for h in hi)
    return f"len{'-'.join(map(str, lengths))}_init{flags}_slots{'_'.join(map(str, slots))}"


def activations(kind, seed, rows, Hk, H, K, V, dtype, device):
    """q, k ~ N(0, 1/K) (no l2norm: |k| ~ 1), v ~ N(0, 1), g = -U(0, 1) (per head for GDN, per key channel for
    KDA), beta = sigmoid(N(0, 1)); g and beta in float32, as engines keep them."""
    g_ = gen(seed)
    s = K ** -0.5
    q = randn(g_, (rows, Hk, K), dtype, device, scale=s)
    k = randn(g_, (rows, Hk, K), dtype, device, scale=s)
    v = randn(g_, (rows, H, V), dtype, device)
    g = -rand(g_, (rows, H, K) if kind == "kda" else (rows, H), torch.float32, device)
    beta = torch.sigmoid(randn(g_, (rows, H), torch.float32, device))
    return q, k, v, g, beta


def _f64(t):
    return t.detach().to("cpu", torch.float64)


def run_varlen_case(check, fn, impl_name, op, kind, case, *, Hk, Hv, K, V, dtype, device, layout="contiguous",
                    pool_dtype=torch.float32, seed=0, l2=False, scale=None):
    """Run the varlen op `fn` on `case` with a NaN-poisoned `out=` (and `use_qk_l2norm=l2`, `scale`) and judge
    it: `out` returned; outputs of the live sequences' tokens and the live slots (final states; an empty live
    sequence keeps its initial state, zeros without one) match the float64 reference; every other slot is
    bitwise unchanged."""
    lengths, hi, slots = case
    n_tok = sum(lengths)
    q, k, v, g, beta = activations(kind, seed, n_tok, Hk, Hv, K, V, dtype, device)
    num_slots = max(slots) + 2  # one slot no request names
    pool = make_pool(num_slots, (Hv, V, K), pool_dtype, device, layout=layout, seed=seed)
    before = pool.clone()
    qsl = cu_seqlens_from(lengths, device, dtype=torch.int32)
    idx = torch.tensor(slots, dtype=torch.int32, device=device)
    has = torch.tensor(hi, dtype=torch.bool, device=device)
    init = torch.zeros((len(slots), Hv, V, K), dtype=torch.float64)
    for i, (s, h) in enumerate(zip(slots, hi)):
        if s != PAD_SLOT_ID and h:
            init[i] = _f64(before[s])
    ref = R.gated_delta_rule if kind == "gdn" else R.kda
    o_ref, fin = ref(_f64(q), _f64(k), _f64(v), _f64(g), _f64(beta), cu_seqlens=qsl.cpu().long(),
                     initial_states=init, scale=scale, use_qk_l2norm=l2)
    p_ref = _f64(before).clone()
    for i, s in enumerate(slots):
        if s != PAD_SLOT_ID:
            p_ref[s] = fin[i]
    out = torch.full((n_tok, Hv, V), float("nan"), dtype=dtype, device=device)
    o = fn(q, k, v, g, beta, pool, qsl, idx, has, out=out, **({"use_qk_l2norm": True} if l2 else {}),
           **({"scale": scale} if scale is not None else {}))
    assert o is out, f"{op}: expected the op to return the `out=` tensor it was given"
    shapes = dict(lengths=lengths, has_initial_state=hi, slots=slots, Hk=Hk, Hv=Hv, K=K, V=V, layout=layout,
                  pool_dtype=str(pool_dtype), use_qk_l2norm=l2, scale=scale)
    m = token_mask(lengths, slots)
    check.close(f"{op}.o", o.cpu()[m], o_ref[m], op=op, impl=impl_name, dtype=dtype, shapes=shapes, seed=seed)
    live = sorted(s for s in slots if s != PAD_SLOT_ID)
    check.close(f"{op}.pool[live]", pool.cpu()[live], p_ref[live], op=op, impl=impl_name,
                dtype=coarser(dtype, pool_dtype), shapes=shapes, seed=seed)
    assert_untouched(before, pool, slots, name=f"{op} pool")


def run_empty_update(fn, op, kind, *, B, slots, Hk, K, V, dtype, device, num_slots=2, pool_dtype=torch.float32,
                     l2=False, scale=None, seed=0):
    """A decode call with no live row (B = 0, or pads only): returns `out=`, zeros on every row, and leaves
    the whole pool bitwise unchanged."""
    assert len(slots) == B and all(s == PAD_SLOT_ID for s in slots)
    q, k, v, g, beta = activations(kind, seed, B, Hk, Hk, K, V, dtype, device)
    pool = make_pool(num_slots, (Hk, V, K), pool_dtype, device, seed=seed)
    before = pool.clone()
    out = torch.full((B, Hk, V), float("nan"), dtype=dtype, device=device)
    o = fn(q, k, v, g, beta, pool, torch.tensor(slots, dtype=torch.int64, device=device), scale=scale,
           use_qk_l2norm=l2, out=out)
    assert o is out, f"{op}: expected the op to return the `out=` tensor it was given"
    assert o.shape == (B, Hk, V)
    assert bool((o == 0).all()), f"{op}: rows of pads should be zero, got {o}"
    assert_untouched(before, pool, [], name=f"{op} pool")
