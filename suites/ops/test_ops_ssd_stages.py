"""Stage suite: each Triton stage of the SSD pipeline (harness/impls/triton/ssd_*.py) alone, against a
small float64 torch computation written here from the stage's definition.

Runs on the device under test (CPU through the Triton interpreter, fp32 / fp64 there). Stages:
chunk_cumsum (chunk table of the per-sequence grid + dt processing), chunk_state, state_passing
(pool reads / writes, pads, page-major pools), bmm, chunk_scan (D skip, z gate, large |A|).
"""
import math
import random

import pytest
import torch
from hypothesis import given, strategies as st

from harness.testing.checks import assert_bitwise_equal
from harness.testing.optest import pool_like, rand, randn
from reference.testing import cu_seqlens_from, gen, seqlens
from harness.testing import LAYOUTS, assert_untouched, choose_slots, make_pool

OP = "ssd_varlen"
seeds = st.integers(0, 2**31 - 1)


def _stages(device):
    from harness.impls.triton._common import has_gpu, interpreting
    if device.startswith("cpu") and not interpreting():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (pytest --device cpu sets it)")
    if not device.startswith("cpu") and not has_gpu():
        pytest.skip("no GPU for Triton")
    import harness.impls.triton.ssd as ssd
    return ssd


def _dtypes(device):
    # The interpreter's half-precision arithmetic is wrong: fp32/fp64 there; fp32 and bf16 on a GPU.
    return [torch.float32, torch.float64] if device.startswith("cpu") else [torch.float32, torch.bfloat16]


def _table(lengths, cs):
    """Per-sequence chunk grid: list of (start, len, seq)."""
    out, q = [], 0
    for s, n in enumerate(lengths):
        for c0 in range(q, q + n, cs):
            out.append((c0, min(cs, q + n - c0), s))
        q += n
    return out


def _eff_dt(dt, bias, softplus, limit):
    d = dt.double() + (0 if bias is None else bias.double())
    if softplus:
        d = torch.logaddexp(d, torch.zeros_like(d))
    return d.clamp(limit[0], limit[1])


@st.composite
def stage_case(draw, device, cs_choices=(16,)):
    small = device.startswith("cpu")
    lengths = draw(seqlens(edge_lengths=True, max_seqs=3 if small else 5, max_len=24 if small else 200,
                              max_total=48 if small else None), label="lengths")
    H = draw(st.sampled_from([2, 4] if small else [2, 4, 8]), label="H")
    G = draw(st.sampled_from([1, 2, H]), label="G")
    P = draw(st.sampled_from([3, 16] if small else [5, 16, 64]), label="P")
    N = draw(st.sampled_from([7, 16] if small else [7, 16, 64]), label="N")
    cs = draw(st.sampled_from(cs_choices if small else (16, 64, 256)), label="chunk")
    stress = draw(st.booleans(), label="stress")
    seed = draw(seeds, label="seed")
    return dict(lengths=lengths, H=H, G=G, P=P, N=N, cs=cs, stress=stress, seed=seed)


def _inputs(c, device, dtype):
    g = gen(c["seed"])
    T = sum(c["lengths"])
    H, G, P, N = c["H"], c["G"], c["P"], c["N"]
    A = -torch.exp(rand(g, (H,), torch.float32, device, 0.0, 6.0 if c["stress"] else 1.0))
    return dict(T=T, x=randn(g, (T, H, P), dtype, device), dt=randn(g, (T, H), dtype, device, shift=-2.0),
                A=A, B=randn(g, (T, G, N), dtype, device), C=randn(g, (T, G, N), dtype, device),
                bias=randn(g, (H,), torch.float32, device, scale=0.5), qsl=cu_seqlens_from(c["lengths"], device, dtype=torch.int32))


def _cd(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@given(data=st.data())
def test_chunk_cumsum_stage(device, check, data):
    """ssd_chunk_cumsum: the chunk table is the per-sequence grid (chunk k of sequence s starts at
    q[s] + k*cs, empty sequences have none, unused slots have length 0 and sequence -1, seq_first points
    at each sequence's first chunk), including non-power-of-two chunk sizes; dt_out equals
    clamp(softplus(dt + bias)) and dA_cs the cumulative dt*A from the chunk's first token."""
    ssd = _stages(device)
    from harness.impls.triton.ssd_chunk_cumsum import chunk_table_size
    c = data.draw(stage_case(device, cs_choices=(5, 16)), label="case")
    dtype = data.draw(st.sampled_from(_dtypes(device)), label="dtype")
    softplus = data.draw(st.booleans(), label="softplus")
    limit = data.draw(st.sampled_from([(0.0, math.inf), (0.05, 0.5)]), label="dt_limit")
    i = _inputs(c, device, dtype)
    dt_out, dA, seq, start, ln, first = ssd.ssd_chunk_cumsum(i["dt"], i["A"], i["bias"], i["qsl"], c["cs"],
                                                          dt_softplus=softplus, dt_limit=limit,
                                                          compute_dtype=_cd(dtype))
    table = _table(c["lengths"], c["cs"])
    NC = chunk_table_size(i["T"], len(c["lengths"]), c["cs"])
    assert seq.numel() == NC and len(table) <= NC
    got = list(zip(start.tolist(), ln.tolist(), seq.tolist()))
    assert got[:len(table)] == table, f"chunk table: expected {table}, got {got[:len(table)]}"
    assert all(n == 0 and s == -1 for _, n, s in got[len(table):]), f"unused chunk slots: {got[len(table):]}"
    for s in range(len(c["lengths"])):
        if c["lengths"][s]:
            k = [j for j, t in enumerate(table) if t[2] == s][0]
            assert int(first[s]) == k, f"seq_first[{s}]: expected {k}, got {int(first[s])}"
    eff = _eff_dt(i["dt"], i["bias"], softplus, limit)
    for k, (s0, n, _) in enumerate(table):
        exp_dt = eff[s0:s0 + n].T
        check.close(f"ssd_chunk_cumsum.dt[{k}]", dt_out[:, k, :n], exp_dt, op=OP, impl="triton", dtype=dtype,
                    seed=c["seed"], shapes=c)
        check.close(f"ssd_chunk_cumsum.dA_cs[{k}]", dA[:, k, :n], torch.cumsum(exp_dt * i["A"].double()[:, None], 1),
                    op=OP, impl="triton", dtype=dtype, seed=c["seed"], shapes=c)


def _front(ssd, c, i, dtype):
    return ssd.ssd_chunk_cumsum(i["dt"], i["A"], i["bias"], i["qsl"], c["cs"], compute_dtype=_cd(dtype))


@given(data=st.data())
def test_chunk_state_stage(device, check, data):
    """ssd_chunk_state: states[c, h] = sum_j exp(dA_cs[last] - dA_cs[j]) dt_j x_j (outer) B_j[g(h)] over the
    chunk's tokens, with heads mapped to groups by h // (H // G)."""
    ssd = _stages(device)
    c = data.draw(stage_case(device), label="case")
    dtype = data.draw(st.sampled_from(_dtypes(device)), label="dtype")
    i = _inputs(c, device, dtype)
    dt_out, dA, _, start, ln, _ = _front(ssd, c, i, dtype)
    states = ssd.ssd_chunk_state(i["x"], i["B"], dt_out, dA, start, ln, compute_dtype=_cd(dtype))
    hpg = c["H"] // c["G"]
    for k, (s0, n, _) in enumerate(_table(c["lengths"], c["cs"])):
        d = dA[:, k, :n].double()
        w = torch.exp(d[:, -1:] - d) * dt_out[:, k, :n].double()  # (H, n)
        Bh = i["B"][s0:s0 + n].double().repeat_interleave(hpg, dim=1)  # (n, H, N)
        exp = torch.einsum("hj,jhp,jhn->hpn", w, i["x"][s0:s0 + n].double(), Bh)
        check.close(f"ssd_chunk_state.states[{k}]", states[k], exp, op=OP, impl="triton", dtype=dtype,
                    seed=c["seed"], shapes=c)


@given(data=st.data())
def test_state_passing_stage(device, check, data):
    """ssd_state_passing: per sequence, h starts at the pool slot (has_initial_state, not a pad) or zeros,
    prev[c] = h before chunk c, h <- exp(dA_cs[c, last]) h + states[c]; the final h lands in the slot of
    each live request (empty sequences write their initial state or zeros); pad and unnamed slots stay
    bitwise unchanged; page-major pools behave like contiguous ones."""
    ssd = _stages(device)
    c = data.draw(stage_case(device), label="case")
    dtype = data.draw(st.sampled_from(_dtypes(device)), label="dtype")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    i = _inputs(c, device, dtype)
    cd = _cd(dtype)
    dt_out, dA, _, start, ln, first = _front(ssd, c, i, dtype)
    S = len(c["lengths"])
    rng = random.Random(c["seed"])
    slots = choose_slots(S, S + 2, rng, pad_prob=0.3)
    hi = torch.tensor([rng.random() < 0.6 for _ in range(S)], device=device)
    H, P, N = c["H"], c["P"], c["N"]
    NC = ln.numel()
    states = randn(gen(c["seed"] + 1), (NC, H, P, N), cd, device)
    pool = make_pool(S + 2, (H, P, N), torch.float32, device, layout=layout, seed=c["seed"])
    before = pool.clone()
    prev = ssd.ssd_state_passing(states, dA, ln, first, i["qsl"], pool,
                                 torch.tensor(slots, dtype=torch.int32, device=device), hi, c["cs"])
    table = _table(c["lengths"], c["cs"])
    for s in range(S):
        live = slots[s] >= 0
        h = before[slots[s]].double() if live and bool(hi[s]) else torch.zeros(H, P, N, dtype=torch.float64,
                                                                                 device=device)
        for k, (_, n, sq) in enumerate(table):
            if sq != s:
                continue
            check.close(f"ssd_state_passing.prev[{k}]", prev[k], h, op=OP, impl="triton", dtype=cd,
                        seed=c["seed"], shapes=c)
            h = torch.exp(dA[:, k, n - 1].double())[:, None, None] * h + states[k].double()
        if live:
            check.close(f"ssd_state_passing.pool[{slots[s]}]", pool[slots[s]], h, op=OP, impl="triton",
                        dtype=torch.float32, seed=c["seed"], shapes=c)
    assert_untouched(before, pool, slots)


@given(data=st.data())
def test_bmm_stage(device, check, data):
    """ssd_bmm: CB[c, g, i, j] = C_i . B_j over the chunk's tokens for every j <= i (the causal part the
    scan reads)."""
    ssd = _stages(device)
    c = data.draw(stage_case(device), label="case")
    dtype = data.draw(st.sampled_from(_dtypes(device)), label="dtype")
    i = _inputs(c, device, dtype)
    _, _, _, start, ln, _ = _front(ssd, c, i, dtype)
    cb = ssd.ssd_bmm(i["C"], i["B"], start, ln, c["cs"], compute_dtype=_cd(dtype))
    for k, (s0, n, _) in enumerate(_table(c["lengths"], c["cs"])):
        exp = torch.einsum("ign,jgn->gij", i["C"][s0:s0 + n].double(), i["B"][s0:s0 + n].double())
        tril = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        check.close(f"ssd_bmm.cb[{k}]", cb[k, :, :n, :n][:, tril], exp[:, tril], op=OP, impl="triton",
                    dtype=dtype, seed=c["seed"], shapes=c)


@given(data=st.data())
def test_chunk_scan_stage(device, check, data):
    """ssd_chunk_scan: y_i = exp(dA_i) C_i . prev[c] + sum_{j<=i} CB_ij exp(dA_i - dA_j) dt_j x_j
    (+ D x_i, D per head or per head x dim) (* silu(z_i)), written into a NaN-poisoned `out`; finite and
    right with |A| up to e^6 (the masked upper triangle never overflows)."""
    ssd = _stages(device)
    c = data.draw(stage_case(device), label="case")
    dtype = data.draw(st.sampled_from(_dtypes(device)), label="dtype")
    D_kind = data.draw(st.sampled_from([None, "head", "head_dim"]), label="D")
    has_z = data.draw(st.booleans(), label="z")
    i = _inputs(c, device, dtype)
    cd = _cd(dtype)
    H, P, N, T = c["H"], c["P"], c["N"], i["T"]
    dt_out, dA, _, start, ln, _ = _front(ssd, c, i, dtype)
    cb = ssd.ssd_bmm(i["C"], i["B"], start, ln, c["cs"], compute_dtype=cd)
    g = gen(c["seed"] + 2)
    prev = randn(g, (ln.numel(), H, P, N), cd if dtype == torch.float32 else dtype, device)
    D = {None: None, "head": randn(g, (H,), torch.float32, device),
         "head_dim": randn(g, (H, P), torch.float32, device)}[D_kind]
    z = randn(g, (T, H, P), dtype, device) if has_z else None
    out = torch.full((T, H, P), float("nan"), dtype=dtype, device=device)
    ssd.ssd_chunk_scan(i["x"], z, i["C"], D, cb, dt_out, dA, prev, start, ln, out, compute_dtype=cd)
    hpg = H // c["G"]
    for k, (s0, n, _) in enumerate(_table(c["lengths"], c["cs"])):
        d = dA[:, k, :n].double()  # (H, n)
        Ch = i["C"][s0:s0 + n].double().repeat_interleave(hpg, dim=1)  # (n, H, N)
        Bh = i["B"][s0:s0 + n].double().repeat_interleave(hpg, dim=1)
        xs = i["x"][s0:s0 + n].double()
        y = torch.einsum("ihn,hpn->ihp", Ch, prev[k].double()) * torch.exp(d).T[:, :, None]
        seg = d[:, :, None] - d[:, None, :]  # (H, i, j)
        tril = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        L = torch.where(tril, torch.exp(seg.clamp(max=0)), torch.zeros_like(seg))
        w = torch.einsum("ihn,jhn->hij", Ch, Bh) * L * dt_out[:, k, :n].double()[:, None, :]
        y = y + torch.einsum("hij,jhp->ihp", w, xs)
        if D is not None:
            y = y + (D.double()[:, None] if D.dim() == 1 else D.double()) * xs
        if z is not None:
            y = y * torch.nn.functional.silu(z[s0:s0 + n].double())
        check.close(f"ssd_chunk_scan.y[{k}]", out[s0:s0 + n], y, op=OP, impl="triton", dtype=dtype,
                    seed=c["seed"], shapes=c)
    assert bool(torch.isfinite(out).all()), "ssd_chunk_scan: rows left unwritten or non-finite"


def test_stage_pipeline_pool_page_major_equals_contiguous(device):
    """The full pipeline gives bitwise the same y and final states with a page-major pool as with a
    contiguous one (strides honoured, nothing copied back)."""
    ssd = _stages(device)
    c = dict(lengths=[5, 0, 19, 1], H=2, G=1, P=3, N=7, cs=16, stress=False, seed=3)
    i = _inputs(c, device, torch.float32)
    idx = torch.tensor([2, -1, 0, 4], dtype=torch.int32, device=device)
    hi = torch.tensor([True, True, False, True], device=device)
    res = []
    base = make_pool(5, (2, 3, 7), torch.float32, device, seed=9)
    for layout in LAYOUTS:
        pool = pool_like(base, layout, seed=10)
        y = ssd.ssd_varlen(i["x"], i["dt"], i["A"], i["B"], i["C"], 16, None, None, i["bias"], pool, i["qsl"],
                           idx, hi)
        res.append((y, pool.contiguous()))
    assert_bitwise_equal("y page_major vs contiguous", res[1][0], res[0][0])
    assert_bitwise_equal("pool page_major vs contiguous", res[1][1], res[0][1])
