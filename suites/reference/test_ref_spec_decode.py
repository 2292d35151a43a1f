"""reference.spec_decode against independent formulations: speculative decode steps (true tokens followed by
rejected junk drafts, a random number accepted each step) give, on the accepted tokens, the outputs and the
final states of the prefill ops over the accepted tokens alone (`ssd_chunked` for Mamba-2, `selective_scan`
for Mamba-1, `causal_conv1d` for the conv), in float64."""
import random

import pytest
import torch

from harness.testing.checks import Tolerance, compare
from reference.conv1d import causal_conv1d
from reference.selective_scan import selective_scan
from reference.spec_decode import spec_conv1d_update, spec_rows, spec_state_update
from reference.ssd import ssd_chunked
from reference.testing import cu_seqlens_from, gen, make_conv_inputs, make_mamba1_inputs, make_ssd_inputs

TIGHT = Tolerance(atol=1e-10, rtol=1e-9, ratio=1e-10)
PAD = -1


def _problem(kind, lengths, seed):
    """(prefill y, prefill final states, per-token inputs by the spec op's names, static kwargs, initial states,
    run(pool, tokens, **layout) -> (y, pool))."""
    cu = cu_seqlens_from(lengths)
    T = sum(lengths)
    if kind == "mamba2":
        d = make_ssd_inputs(T, H=2, P=3, N=4, G=1, seed=seed, cu_seqlens=cu, initial_states=True, D="head_dim",
                            dt_limit=(1e-3, 0.5))
        y, fin = ssd_chunked(**{**d, "chunk_size": 3})
        toks = {k: d[k] for k in ("x", "dt", "B", "C", "z")}
        static = dict(A=d["A"], D=d["D"], dt_bias=d["dt_bias"], dt_softplus=d["dt_softplus"], dt_limit=d["dt_limit"])

        def run(pool, t, **lay):
            return spec_state_update(pool, t["x"], t["dt"], static["A"], t["B"], t["C"], static["D"], t["z"],
                                     dt_bias=static["dt_bias"], dt_softplus=static["dt_softplus"],
                                     dt_limit=static["dt_limit"], **lay)
    elif kind == "mamba1":
        d = make_mamba1_inputs(T, Dm=5, N=3, G=1, seed=seed, cu_seqlens=cu, initial_states=True)
        y, fin = selective_scan(**d)
        toks = dict(x=d["u"], dt=d["delta"], B=d["B"], C=d["C"], z=d["z"])

        def run(pool, t, **lay):
            return spec_state_update(pool, t["x"], t["dt"], d["A"], t["B"], t["C"], d["D"], t["z"],
                                     dt_bias=d["delta_bias"], dt_softplus=d["delta_softplus"], **lay)
    else:
        d = make_conv_inputs(T, D=4, K=4, seed=seed, cu_seqlens=cu, initial_states=True)
        y, fin = causal_conv1d(**d)
        toks = dict(x=d["x"])

        def run(pool, t, **lay):
            return spec_conv1d_update(t["x"], pool, d["weight"], d["bias"], activation=d["activation"], **lay)
    return y, fin, toks, d["initial_states"], run


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["mamba2", "mamba1", "conv"])
def test_accepted_tokens_equal_prefill_of_the_accepted_stream(kind, seed):
    rng = random.Random(seed)
    R, S = rng.randint(1, 3), rng.randint(1, 4)
    lengths = [rng.randint(0, 9) for _ in range(R)]
    y_true, fin_true, toks, init, run = _problem(kind, lengths, seed)
    starts = [sum(lengths[:r]) for r in range(R)]
    num_slots = R * S + 2
    ids = rng.sample(range(num_slots), R * S)
    table = torch.tensor(ids).reshape(R, S)
    g = gen(seed + 1)
    pool = torch.randn((num_slots,) + tuple(init.shape[1:]), generator=g, dtype=torch.float64)
    acc = [rng.randint(1, S) for _ in range(R)]
    for r in range(R):
        pool[table[r, acc[r] - 1]] = init[r]
    done = [0] * R  # accepted tokens so far
    while any(done[r] < lengths[r] for r in range(R)):
        parts, true_pos = {k: [] for k in toks}, []
        lens = []
        for r in range(R):
            left = lengths[r] - done[r]
            a = rng.randint(1, min(S, left)) if left else 0
            n = rng.randint(a, S) if a else 0  # rejected junk drafts after the accepted ones
            for k, v in toks.items():
                if v is None:
                    continue
                true = v[starts[r] + done[r]: starts[r] + done[r] + a]
                junk = torch.randn((n - a,) + tuple(v.shape[1:]), generator=g, dtype=v.dtype)
                parts[k].append(torch.cat([true, junk]))
            true_pos.append((r, a))
            lens.append(n)
        t = {k: (torch.cat(p) if toks[k] is not None else None) for k, p in parts.items()}
        qsl = cu_seqlens_from(lens)
        lay = dict(query_start_loc=qsl, state_indices=table, num_accepted_tokens=torch.tensor(acc))
        rows = spec_rows(qsl, table, lay["num_accepted_tokens"], int(qsl[-1]), num_slots, PAD)
        before = pool.clone()
        y, pool = run(pool, t, **lay)
        for r, a in true_pos:
            if a == 0:
                continue
            got = y[int(qsl[r]): int(qsl[r]) + a]
            want = y_true[starts[r] + done[r]: starts[r] + done[r] + a]
            c = compare(f"{kind} row {r}: outputs of its accepted tokens", got, want, TIGHT)
            assert c.passed, c.message()
            done[r] += a
            acc[r] = a
        written = {sl[j] for s0, e0, i0, sl in rows if i0 != PAD for j in range(e0 - s0)}
        for s in set(range(num_slots)) - written:
            assert torch.equal(pool[s], before[s]), f"{kind}: slot {s} changed though the step does not write it"
    for r in range(R):
        c = compare(f"{kind} row {r}: state after the last accepted token", pool[table[r, acc[r] - 1]], fin_true[r],
                    TIGHT)
        assert c.passed, c.message()


def test_padding_and_bad_layouts():
    x = torch.randn(3, 2, dtype=torch.float64)
    pool = torch.randn(6, 2, 1, dtype=torch.float64)
    w = torch.randn(2, 2, dtype=torch.float64)
    lay = dict(query_start_loc=torch.tensor([0, 3, 3]), state_indices=torch.tensor([[1, PAD, 2], [3, 4, 5]]),
               num_accepted_tokens=torch.tensor([2, 1]))
    y, new = spec_conv1d_update(x, pool, w, **lay)
    assert torch.equal(new, pool), "a row whose start slot is pad, and a row without tokens, write nothing"
    for arg, change in [("num_accepted_tokens", dict(num_accepted_tokens=torch.tensor([0, 1]))),
                        ("num_accepted_tokens", dict(num_accepted_tokens=torch.tensor([4, 1]))),
                        ("state_indices", dict(state_indices=torch.tensor([[1, 2, 3], [3, 4, 5]]))),
                        ("state_indices", dict(state_indices=torch.tensor([[1, 2, 6], [3, 4, 5]]))),
                        ("query_start_loc", dict(state_indices=torch.tensor([[1, 2], [3, 4]]),
                                                 num_accepted_tokens=torch.tensor([1, 1])))]:
        with pytest.raises(ValueError, match=arg):
            spec_conv1d_update(x, pool, w, **{**lay, **change})
