"""Op suite: multi-token decode for speculative decoding (`selective_state_update_spec` in both layouts,
`causal_conv1d_update_spec`, `gated_delta_rule_update_spec`, `kda_update_spec`), every implementation that
provides it.

An engine's steps are replayed: each step every row carries 1..num_spec+1 random tokens (some none, some
rows padding), starts from the slot of its last accepted position of the previous step, and afterwards a
random number of its positions is accepted. Per step:
  * every position's output and state (accepted or later rejected) is what the implementation's own
    one-token op gives when run token by token from the same start state, to within a few ulps of the
    compute dtype (the pool holds the compute dtype, so both keep the same precision between tokens;
    vectorised kernels may round differently for another batch size);
  * every slot the step does not write (unnamed slots, slots past a row's tokens, padding rows' slots) is
    bit for bit unchanged, and the padding rows' tokens get y = 0 in a NaN-filled `out=`;
and at the end each request's final state and its accepted tokens' outputs match float64 plain decoding
(the reference's one-token op) over the accepted tokens only.
"""
import random

import pytest
import torch

from harness.impls.reference_impl import oracle
from harness.ops import PAD_SLOT_ID, SPECS
from harness.testing import CONV_LAYOUTS, LAYOUTS, make_pool, pad_rows
from harness.testing.checks import Tolerance, assert_bitwise_equal, compare, poison_, tolerance_for
from harness.testing.optest import check_pad_rows, interp_small, randn, require
from reference.testing import gen

KINDS = ("mamba1", "mamba2", "conv", "gdn", "kda")
SPEC_OP = {"mamba1": "selective_state_update_spec", "mamba2": "selective_state_update_spec",
           "conv": "causal_conv1d_update_spec", "gdn": "gated_delta_rule_update_spec", "kda": "kda_update_spec"}
PLAIN_OP = {"mamba1": "selective_state_update", "mamba2": "selective_state_update", "conv": "causal_conv1d_update",
            "gdn": "gated_delta_rule_update", "kda": "kda_update"}
OUT_LIKE = {"gdn": "v", "kda": "v"}  # the per-token input the output is shaped like (default x)
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
DT_IDS = [str(d).replace("torch.", "") for d in DTYPES]
STEPS = 3


def _setup(kind, rng, g, dtype, device, small):
    """(slot shape, static params by name, per-token shapes by name, options)."""
    pd = torch.float64 if dtype == torch.float64 else torch.float32
    if kind in ("gdn", "kda"):
        return _setup_delta(kind, rng, small)
    if kind == "conv":
        D, K = rng.choice([1, 4, 6] if small else [1, 4, 6, 33]), rng.choice([2, 3, 4])
        params = dict(weight=randn(g, (D, K), dtype, device, scale=0.5),
                      bias=randn(g, (D,), dtype, device, scale=0.1) if rng.random() < 0.5 else None)
        return (D, K - 1), params, dict(x=(D,)), dict(activation=rng.choice([None, "silu"]))
    N = rng.choice([1, 3, 8])
    opts = dict(dt_softplus=rng.random() < 0.7, dt_limit=rng.choice([(0.0, float("inf")), (1e-3, 0.2)]))
    if kind == "mamba2":
        H, P = rng.choice([1, 2, 4]), rng.choice([1, 3, 4])
        G = rng.choice([d for d in (1, 2, H) if H % d == 0])
        chans, slot, xs, dts, Ash = H, (H, P, N), (H, P), (H,), (H,)
        Dsh = rng.choice([None, (H,), (H, P)])
    else:
        Dm = rng.choice([1, 3, 8])
        G = rng.choice([d for d in (1, Dm) if Dm % d == 0])
        chans, slot, xs, dts, Ash = Dm, (Dm, N), (Dm,), (Dm,), (Dm, N)
        Dsh = rng.choice([None, (Dm,)])
    params = dict(A=-torch.exp(randn(g, Ash, pd, device, scale=0.5)),
                  D=randn(g, Dsh, pd, device) if Dsh else None,
                  dt_bias=randn(g, (chans,), pd, device, scale=0.3) if rng.random() < 0.5 else None)
    toks = dict(x=xs, dt=dts, B=(G, N), C=(G, N))
    if rng.random() < 0.5:
        toks["z"] = xs
    else:
        params["z"] = None
    return slot, params, toks, opts


def _setup_delta(kind, rng, small):
    """Gated DeltaNet (value heads a multiple of the key heads) or KDA (one head count): no static parameters;
    per token q, k, v, g (a log-decay per value head, or per key channel) and beta."""
    Hk = rng.choice([1, 2])
    Hv = Hk * rng.choice([1, 2]) if kind == "gdn" else Hk
    K, V = rng.choice([3, 8] if small else [3, 8, 16]), rng.choice([2, 5])
    toks = dict(q=(Hk, K), k=(Hk, K), v=(Hv, V), g=(Hv,) if kind == "gdn" else (Hv, K), beta=(Hv,))
    opts = dict(use_qk_l2norm=rng.random() < 0.5, scale=rng.choice([None, 0.5]))
    return (Hv, V, K), {}, toks, opts


def _tokens(g, toks, T, dtype, device):
    t = {k: randn(g, (T,) + tuple(s), dtype, device, shift=-3.0 if k == "dt" else 0.0) for k, s in toks.items()}
    if "beta" in t:  # the delta rule's log-decays in (-1, 0), write strengths in (0, 1), keys of norm ~1
        pd = torch.float64 if dtype == torch.float64 else torch.float32
        t["g"] = -torch.sigmoid(t["g"].to(pd)) * 0.5
        t["beta"] = torch.sigmoid(t["beta"].to(pd))
        t["k"] = t["k"] * t["k"].shape[-1] ** -0.5
    return t


def _ulps(cd, scale: float) -> Tolerance:
    """A few units in the last place of the compute dtype (relative to `scale`, the magnitude compared):
    vectorised kernels may round an exp, a fused multiply-add or a sum differently for another batch size."""
    eps = torch.finfo(cd).eps
    return Tolerance(atol=16 * eps * max(scale, 1.0), rtol=16 * eps, ratio=16 * eps)


def _rows(t: dict, rows: list) -> dict:
    return {k: None if v is None else v[rows] for k, v in t.items()}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_spec_decode_is_plain_decode_of_accepted_tokens(impl, device, kind, dtype, seed):
    op, plain = SPEC_OP[kind], PLAIN_OP[kind]
    require(impl, op, dtype, device)
    if plain not in impl.ops:
        pytest.skip(f"implementation {impl.name!r} provides {op} but not {plain}, which this suite compares it with")
    sp, pp = SPECS[op], SPECS[plain]
    small = interp_small(device, impl)
    rng = random.Random(seed * 7919 + KINDS.index(kind))
    g = gen(seed)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    slot_shape, params, toks, opts = _setup(kind, rng, g, dtype, device, small)
    Bsz, S = rng.randint(1, 2 if small else 4), rng.randint(2, 4)
    num_slots = Bsz * S + rng.randint(1, 3)
    ids = rng.sample(range(num_slots), Bsz * S)
    pad_rows = {b for b in range(Bsz) if Bsz > 1 and rng.random() < 0.25}
    table_l = [[PAD_SLOT_ID if b in pad_rows else ids[b * S + j] for j in range(S)] for b in range(Bsz)]
    itype = rng.choice([torch.int32, torch.int64])
    table = torch.tensor(table_l, dtype=itype, device=device)
    layout = rng.choice(CONV_LAYOUTS if kind == "conv" else LAYOUTS)
    pool = make_pool(num_slots, slot_shape, cd, device, layout=layout, seed=seed)
    live = [b for b in range(Bsz) if b not in pad_rows]
    acc = [rng.randint(1, S) for _ in range(Bsz)]
    initial = {b: pool[table_l[b][acc[b] - 1]].clone() for b in live}
    accepted = {b: [] for b in live}  # per request and step: (the accepted tokens' inputs, their outputs)
    fn, plain_fn = impl.op(op), impl.op(plain)
    ctx = f"{impl.name} {op} {kind} {dtype} seed={seed} layout={layout}"

    for step in range(STEPS):
        lens = [rng.choice([0] + [S] * 3 + list(range(1, S + 1))) for _ in range(Bsz)]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        T = qsl[-1]
        t = _tokens(g, toks, T, dtype, device)
        before = pool.clone()
        starts = {b: pool[table_l[b][acc[b] - 1]].clone() for b in live if lens[b]}
        kw = {**params, **t, sp.pool: pool, sp.index: table, **opts,
              "query_start_loc": torch.tensor(qsl, dtype=itype, device=device),
              "num_accepted_tokens": torch.tensor(acc, dtype=itype, device=device)}
        out = poison_(torch.empty_like(t[OUT_LIKE.get(kind, "x")]))
        y = sp.call(fn, {**kw, "out": out})
        assert y is out, f"{ctx}: the op must return out="
        check_pad_rows(op, y, [], kw, context=f"{ctx} step {step}; out= was filled with NaN before the call")

        # position by position: the one-token op from the same start states, on a scratch pool
        ulps = _ulps(cd, float(y.detach().abs().max()) if T else 0.0)
        ulps_state = _ulps(cd, float(pool.detach().abs().max()))
        scratch = torch.zeros((Bsz + 1,) + slot_shape, dtype=cd, device=device)
        for b, s in starts.items():
            scratch[b + 1] = s
        for j in range(S):
            rows = [b for b in starts if lens[b] > j]
            if not rows:
                continue
            tok = [qsl[b] + j for b in rows]
            pkw = {**params, **_rows(t, tok), pp.pool: scratch, **opts,
                   pp.index: torch.tensor([b + 1 for b in rows], dtype=itype, device=device)}
            yp = pp.call(plain_fn, pkw)
            for i, b in enumerate(rows):
                where = f"{ctx} step {step} row {b} position {j}"
                c = compare(f"{where}: output", y[tok[i]], yp[i].to(torch.float64), ulps)
                assert c.passed, c.message()
                if table_l[b][j] != PAD_SLOT_ID:
                    c = compare(f"{where}: state in slot {table_l[b][j]}", pool[table_l[b][j]],
                                scratch[b + 1].to(torch.float64), ulps_state)
                    assert c.passed, c.message()
        written = {table_l[b][j] for b in starts for j in range(lens[b])}
        for s in range(num_slots):
            if s not in written:
                assert_bitwise_equal(f"{ctx} step {step}: slot {s} (not written by the step)", pool[s], before[s])

        for b in starts:  # the verifier accepts a random prefix of each row's tokens
            a = rng.randint(1, lens[b])
            acc[b] = a
            accepted[b].append((_rows(t, [qsl[b] + i for i in range(a)]), y[qsl[b]:qsl[b] + a].clone()))

    # end to end: float64 plain decoding over the accepted tokens only
    tol = tolerance_for(dtype, scale=2.0)
    for b in live:
        h = initial[b][None].to(torch.float64)
        for tk, ys in accepted[b]:
            for i in range(ys.shape[0]):
                pkw = {**params, **_rows(tk, [i]), pp.pool: h, **opts,
                       pp.index: torch.tensor([0], dtype=itype, device=device)}
                pos, opt = pp.split(pkw)
                yref, h = oracle(plain, *pos, **opt)
                c = compare(f"{ctx} request {b}: output of an accepted token", ys[i:i + 1], yref, tol)
                assert c.passed, c.message()
        final = pool[table_l[b][acc[b] - 1]][None]
        c = compare(f"{ctx} request {b}: state after its last accepted token", final, h, tol)
        assert c.passed, c.message()


@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_and_empty_rows_touch_nothing(impl, device, kind):
    """A row whose start slot is the pad id, and a row without tokens, write no slot; an all-padding batch
    leaves the whole pool bit for bit unchanged, and the padding row's tokens get y = 0 in a NaN-filled
    `out=`."""
    op = SPEC_OP[kind]
    require(impl, op, torch.float32, device)
    sp = SPECS[op]
    rng, g = random.Random(1), gen(1)
    slot_shape, params, toks, opts = _setup(kind, rng, g, torch.float32, device, True)
    pool = make_pool(8, slot_shape, torch.float32, device, seed=3)
    before = pool.clone()
    # row 0: start slot is pad (position 1), row 1: no tokens
    table = torch.tensor([[2, PAD_SLOT_ID, 3], [4, 5, 6]], dtype=torch.int32, device=device)
    t = _tokens(g, toks, 3, torch.float32, device)
    kw = {**params, **t, sp.pool: pool, sp.index: table, **opts,
          "query_start_loc": torch.tensor([0, 3, 3], dtype=torch.int32, device=device),
          "num_accepted_tokens": torch.tensor([2, 1], dtype=torch.int32, device=device)}
    y = sp.call(impl.op(op), {**kw, "out": poison_(torch.empty_like(t[OUT_LIKE.get(kind, "x")]))})
    assert_bitwise_equal(f"{impl.name} {op}: pool after a batch of padding rows", pool, before)
    assert pad_rows(op, [], kw).tolist() == [True] * 3
    check_pad_rows(op, y, [], kw, context=f"{impl.name}; out= was filled with NaN before the call")
