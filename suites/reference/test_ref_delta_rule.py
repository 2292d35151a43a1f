"""Gated DeltaNet and KDA references (reference.delta_rule): the token recurrence, the chunked WY form and
the decode step agree with each other in float64, packed varlen equals per-sequence, states carry, and all
of them equal transformers' own torch functions (Qwen3-Next's gated delta rule, Kimi Linear's KDA), run in
float64 with the state transposed to their key-major (K, V) layout.

A planted broken chunked form (a tail chunk padded with g != 0, the decay applied after the write) is
rejected by the same property, so the chunked-vs-recurrence test does catch that bug class.
"""
import inspect
import math
import re
import types

import pytest
import torch
from hypothesis import Phase, example, given, settings, strategies as st

from harness.testing.checks import Tolerance, compare
from reference.delta_rule import (gated_delta_rule, gated_delta_rule_chunked, gated_delta_rule_update, kda,
                                  kda_chunked, kda_update, l2norm)
from reference.testing import cu_seqlens_from, seqlens, split_points

F64 = torch.float64
TIGHT = Tolerance(atol=1e-11, rtol=1e-10, ratio=1e-10)
seeds = st.integers(0, 2**31 - 1)

FORMS = {  # kind -> (recurrence, chunked, decode step)
    "gdn": (gated_delta_rule, gated_delta_rule_chunked, gated_delta_rule_update),
    "kda": (kda, kda_chunked, kda_update),
}
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------
# inputs

def make_inputs(kind, lengths, Hk, Hv, K, V, seed, *, initial_states=False, use_qk_l2norm=False, scale=None,
                g_kind="uniform", dtype=F64):
    """kwargs for the reference ops. q, k ~ N(0, 1) (with l2norm) or N(0, 1/K) (so |k| ~ 1 and the
    recurrence stays bounded without it); v ~ N(0, 1); beta = sigmoid(N(0, 1)); g <= 0:
    "uniform" -U(0, 1), "strong" -U(0, 30) (decays that underflow), "ln2" -ln2 * {0, 1, 2}, "zero" 0."""
    g_ = torch.Generator().manual_seed(int(seed))
    T, S = sum(lengths), len(lengths)
    H = Hk if kind == "kda" else Hv
    r = lambda *shape: torch.randn(*shape, generator=g_, dtype=F64)
    qk_scale = 1.0 if use_qk_l2norm else K ** -0.5
    g_shape = (T, H, K) if kind == "kda" else (T, H)
    u = torch.rand(*g_shape, generator=g_, dtype=F64)
    g = {"uniform": -u, "strong": -30.0 * u, "zero": torch.zeros(g_shape, dtype=F64),
         "ln2": -LN2 * torch.floor(3 * u)}[g_kind]
    d = dict(q=qk_scale * r(T, Hk, K), k=qk_scale * r(T, Hk, K), v=r(T, H, V), g=g,
             beta=torch.sigmoid(r(T, H)), scale=scale, use_qk_l2norm=use_qk_l2norm,
             cu_seqlens=cu_seqlens_from(lengths),
             initial_states=r(S, H, V, K) if initial_states else None)
    return {k_: (v_.to(dtype) if isinstance(v_, torch.Tensor) and v_.is_floating_point() else v_)
            for k_, v_ in d.items()}


@st.composite
def cases(draw, kind, max_len=12, max_seqs=3, g_kinds=("uniform", "strong", "zero")):
    Hk = draw(st.sampled_from([1, 2]), label="Hk")
    Hv = Hk * draw(st.sampled_from([1, 2, 3]), label="Hv/Hk") if kind == "gdn" else Hk
    return dict(kind=kind, lengths=draw(seqlens(min_seqs=1, max_seqs=max_seqs, max_len=max_len), label="lengths"),
                Hk=Hk, Hv=Hv, K=draw(st.sampled_from([1, 3, 4]), label="K"),
                V=draw(st.sampled_from([1, 2, 5]), label="V"), seed=draw(seeds, label="seed"),
                initial_states=draw(st.booleans(), label="initial_states"),
                use_qk_l2norm=draw(st.booleans(), label="use_qk_l2norm"),
                scale=draw(st.sampled_from([None, 0.3]), label="scale"),
                g_kind=draw(st.sampled_from(g_kinds), label="g_kind"))


def inputs_of(case):
    c = dict(case)
    return make_inputs(c.pop("kind"), c.pop("lengths"), c.pop("Hk"), c.pop("Hv"), c.pop("K"), c.pop("V"),
                       c.pop("seed"), **c)


def strict_close(name, got, want, tol=TIGHT, context=""):
    """`check.close` without a results record (for the planted broken forms, whose failures are expected)."""
    c = compare(name, got, want, tol)
    if not c.passed:
        raise AssertionError(c.message(context))


# ----------------------------------------------------------------------------------------------
# recurrence vs chunked

def chunked_matches_recurrence(case, chunked, close):
    """The property: for every chunk size 1..max_len+1 (so every sequence's last chunk is short for some
    size, and for the largest size every sequence is one short chunk), `chunked` equals the recurrence."""
    kind = case["kind"]
    inp = inputs_of(case)
    o_ref, s_ref = FORMS[kind][0](**inp)
    for cs in range(1, max(case["lengths"]) + 2):
        o, s = chunked(**inp, chunk_size=cs)
        ctx = f"chunk_size={cs} case={case}"
        close("o", o, o_ref, context=ctx)
        close("final_states", s, s_ref, context=ctx)


_EX = dict(Hk=2, K=3, V=2, seed=3, initial_states=True, use_qk_l2norm=True, scale=None, g_kind="uniform")


@pytest.mark.parametrize("kind", list(FORMS))
@given(data=st.data())
@example(data=None)
def test_chunked_equals_recurrence_float64(kind, data, check):
    """For any packed batch (empty sequences included), every chunk size from 1 to past the longest
    sequence (short last chunks, one-chunk sequences), Hv > Hk for GDN, with/without l2norm, explicit or
    default scale, initial states, weak / strong (underflowing) / zero decays: the chunked WY form's
    outputs and final states equal the recurrence's to 1e-10 relative error."""
    case = data.draw(cases(kind), label="case") if data is not None else \
        dict(_EX, kind=kind, lengths=[5, 0, 11], Hv=4 if kind == "gdn" else 2)
    close = lambda name, got, want, context: check.close(name, got, want, op=kind, impl="reference",
                                                         tol=TIGHT, seed=case["seed"], context=context)
    chunked_matches_recurrence(case, FORMS[kind][1], close)


# planted broken chunked forms

def _padded_tail(kind, pad_g):
    """A chunked form that pads each sequence's tail chunk to a full chunk with q = k = v = beta = 0
    and g = `pad_g(g_last)` (a known bug class of chunked kernels)."""
    chunked = FORMS[kind][1]

    def form(q, k, v, g, beta, *, cu_seqlens, chunk_size, **kw):
        cu = cu_seqlens.tolist()
        pieces = {n: [] for n in "qkvgb"}
        keep = []
        for a, b in zip(cu[:-1], cu[1:]):
            n = b - a
            pad = (-n) % chunk_size
            for name, t in zip("qkvgb", (q, k, v, g, beta)):
                tail = torch.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype)
                if name == "g" and n:
                    tail = tail + pad_g(t[b - 1])
                pieces[name].append(torch.cat([t[a:b], tail]))
            keep.append(torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]))
        lens = [int(p.shape[0]) for p in pieces["q"]]
        o, s = chunked(*(torch.cat(pieces[n]) for n in "qkvgb"), cu_seqlens=cu_seqlens_from(lens),
                       chunk_size=chunk_size, **kw)
        return o[torch.cat(keep)], s
    return form


def _decay_after_write(kind):
    """A form that writes u k^T first and decays afterwards (u still read from the undecayed state)."""
    def form(q, k, v, g, beta, *, scale, use_qk_l2norm, cu_seqlens, initial_states, chunk_size):
        T, Hk, K = q.shape
        H = v.shape[1]
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = (q * (K ** -0.5 if scale is None else scale)).repeat_interleave(H // Hk, dim=1)
        k = k.repeat_interleave(H // Hk, dim=1)
        cu = cu_seqlens.tolist()
        o = torch.empty((T, H, v.shape[2]), dtype=F64)
        fin = []
        for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            S = torch.zeros((H, v.shape[2], K), dtype=F64) if initial_states is None else initial_states[s]
            for t in range(a, b):
                u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
                S = S + u[:, :, None] * k[t][:, None, :]
                S = S * (torch.exp(g[t])[:, None, :] if kind == "kda" else torch.exp(g[t])[:, None, None])
                o[t] = torch.einsum("hvk,hk->hv", S, q[t])
            fin.append(S)
        return o, torch.stack(fin)
    return form


def _property_rejects(kind, form):
    """Run the chunked-vs-recurrence property of test_chunked_equals_recurrence_float64 on `form`, with
    its strategy (decays kept non-zero, as a planted decay bug needs); True when it finds a failure."""
    @settings(max_examples=25, derandomize=True, database=None, phases=(Phase.generate,), deadline=None)
    @given(case=cases(kind, g_kinds=("uniform",)))
    def prop(case):
        chunked_matches_recurrence(case, form, strict_close)
    try:
        prop()
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("kind", list(FORMS))
@pytest.mark.parametrize("broken", ["tail padded with g of the last token", "tail padded with g = -0.1",
                                    "decay after the write"])
def test_property_rejects_a_planted_broken_chunked_form(kind, broken):
    """The chunked-vs-recurrence property fails on a chunked form whose tail chunk is zero-padded (q, k, v,
    beta = 0) but with g != 0 (the padding decays the final state), and on a form that decays after the
    write: the suite catches both bug classes."""
    form = {"tail padded with g of the last token": lambda: _padded_tail(kind, lambda g_last: g_last),
            "tail padded with g = -0.1": lambda: _padded_tail(kind, lambda g_last: torch.full_like(g_last, -0.1)),
            "decay after the write": lambda: _decay_after_write(kind)}[broken]()
    assert _property_rejects(kind, form), f"the property accepted a planted broken form ({broken})"


@pytest.mark.parametrize("kind", list(FORMS))
def test_tail_padded_with_zero_decay_and_beta_is_harmless(kind):
    """The control of the planted test: padding the tail with g = 0 and beta = 0 (what transformers does)
    leaves outputs and final states exact, so the rejection above is due to g != 0 in the padding."""
    assert not _property_rejects(kind, _padded_tail(kind, lambda g_last: torch.zeros_like(g_last)))


# ----------------------------------------------------------------------------------------------
# varlen, state carrying, decode

@pytest.mark.parametrize("form", ["recurrence", "chunked"])
@pytest.mark.parametrize("kind", list(FORMS))
@given(data=st.data())
def test_packed_equals_per_sequence(kind, form, data, check):
    """S packed sequences (some empty) in one call give, for every sequence, the outputs and final state of
    that sequence run alone from its own initial state."""
    case = data.draw(cases(kind, max_len=10, max_seqs=4), label="case")
    cs = data.draw(st.integers(1, 6), label="chunk_size")
    fn = FORMS[kind][0] if form == "recurrence" else (lambda **kw: FORMS[kind][1](**kw, chunk_size=cs))
    inp = inputs_of(case)
    o_all, s_all = fn(**inp)
    cu = inp["cu_seqlens"].tolist()
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        one = dict(inp, q=inp["q"][a:b], k=inp["k"][a:b], v=inp["v"][a:b], g=inp["g"][a:b],
                   beta=inp["beta"][a:b], cu_seqlens=None,
                   initial_states=None if inp["initial_states"] is None else inp["initial_states"][s:s + 1])
        o, fs = fn(**one)
        ctx = f"sequence {s} of lengths {case['lengths']}"
        check.close("o", o_all[a:b], o, op=kind, impl="reference", tol=TIGHT, context=ctx)
        check.close("final_states", s_all[s:s + 1], fs, op=kind, impl="reference", tol=TIGHT, context=ctx)


@pytest.mark.parametrize("kind", list(FORMS))
@given(data=st.data())
def test_split_anywhere_and_carry_equals_whole(kind, data, check):
    """Cutting one sequence at arbitrary points (empty pieces included) and feeding each piece's final
    state to the next as its initial state gives the whole sequence's outputs and final state."""
    case = data.draw(cases(kind, max_len=14, max_seqs=1), label="case")
    L = case["lengths"][0]
    cuts = data.draw(split_points(L, max_cuts=4), label="cuts")
    inp = inputs_of(case)
    o_ref, s_ref = FORMS[kind][0](**inp)
    state, os_ = inp["initial_states"], []
    for a, b in zip([0, *cuts], [*cuts, L]):
        piece = dict(inp, q=inp["q"][a:b], k=inp["k"][a:b], v=inp["v"][a:b], g=inp["g"][a:b],
                     beta=inp["beta"][a:b], cu_seqlens=None, initial_states=state)
        o, state = FORMS[kind][1](**piece, chunk_size=3)
        os_.append(o)
    ctx = f"L={L} cuts={cuts}"
    check.close("o", torch.cat(os_), o_ref, op=kind, impl="reference", tol=TIGHT, context=ctx)
    check.close("final_states", state, s_ref, op=kind, impl="reference", tol=TIGHT, context=ctx)


@pytest.mark.parametrize("kind", list(FORMS))
@given(data=st.data())
def test_decode_steps_equal_recurrence(kind, data, check):
    """The decode step (Householder form) applied token by token to a batch of rows, each from its own
    state, gives the recurrence's outputs and final states."""
    Bsz = data.draw(st.integers(1, 3), label="batch")
    L = data.draw(st.integers(1, 6), label="steps")
    case = data.draw(cases(kind), label="case")
    case.update(lengths=[L] * Bsz, initial_states=True)
    inp = inputs_of(case)
    o_ref, s_ref = FORMS[kind][0](**inp)
    rows = lambda t, x: x.reshape(Bsz, L, *x.shape[1:])[:, t]
    state, os_ = inp["initial_states"], []
    for t in range(L):
        o, state = FORMS[kind][2](*(rows(t, inp[n]) for n in ("q", "k", "v", "g", "beta")), state,
                                  scale=inp["scale"], use_qk_l2norm=inp["use_qk_l2norm"])
        os_.append(o)
    o = torch.stack(os_, dim=1).reshape(o_ref.shape)
    check.close("o", o, o_ref, op=kind, impl="reference", tol=TIGHT, context=f"case={case}")
    check.close("final_states", state, s_ref, op=kind, impl="reference", tol=TIGHT, context=f"case={case}")


def test_default_scale_is_inverse_sqrt_of_key_dim():
    """scale=None means K ** -0.5 (bitwise the same as passing it)."""
    inp = make_inputs("gdn", [6], 2, 4, 4, 3, seed=1, initial_states=True)
    a = gated_delta_rule(**inp)
    b = gated_delta_rule(**dict(inp, scale=4 ** -0.5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kind", list(FORMS))
def test_low_precision_stays_near_float64(kind, check):
    """All three forms compute in the dtype they are given (float32 here) and stay within float32's
    policy of the float64 result."""
    inp64 = make_inputs(kind, [9, 4], 2, 2, 4, 3, seed=2, initial_states=True, use_qk_l2norm=True)
    o64, s64 = FORMS[kind][0](**inp64)
    inp = make_inputs(kind, [9, 4], 2, 2, 4, 3, seed=2, initial_states=True, use_qk_l2norm=True,
                      dtype=torch.float32)
    for name, fn in (("recurrence", FORMS[kind][0]), ("chunked", lambda **kw: FORMS[kind][1](**kw, chunk_size=4))):
        o, s = fn(**inp)
        assert o.dtype == torch.float32 and s.dtype == torch.float32
        check.close(f"o[{name}]", o, o64, op=kind, impl="reference", dtype=torch.float32)
        check.close(f"final_states[{name}]", s, s64, op=kind, impl="reference", dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# against transformers' own functions

def _in_float64(fn):
    """transformers' torch function `fn` (the plain torch path, unwrapped from the kernel-hub decorator)
    with its `torch.float32` casts computing in float64: the same code object, run with a `torch` global
    whose float32 is float64. Their tensor methods (e.g. KDA chunked's `.float()`) are not affected."""
    f = inspect.unwrap(fn)

    class Torch64(types.ModuleType):
        float32 = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    return types.FunctionType(f.__code__, {**f.__globals__, "torch": Torch64("torch")}, f.__name__,
                              f.__defaults__, f.__closure__)


def _hf():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                             reason="transformers without Qwen3-Next")
    kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                             reason="transformers without Kimi Linear")
    return {"gdn": (qn.torch_recurrent_gated_delta_rule, qn.torch_chunk_gated_delta_rule),
            "kda": (kl.recurrent_kimi_delta_attention, kl.chunk_kimi_delta_attention)}


def run_hf(kind, form, inp, Bsz, L, chunk_size=None):
    """transformers' `form` ("recurrent" / "chunked") on our packed inputs of Bsz sequences of L tokens:
    (B, L, H, D) batches, the state in their key-major (B, H, K, V) layout; returns (o packed, states
    value-major)."""
    rec, chk = _hf()[kind]
    fn = _in_float64(rec if form == "recurrent" else chk)
    b = lambda x: x.reshape(Bsz, L, *x.shape[1:])
    init = inp["initial_states"]
    kw = dict(initial_state=None if init is None else init.transpose(-1, -2).contiguous(),
              output_final_state=True, use_qk_l2norm_in_kernel=inp["use_qk_l2norm"])
    if form == "chunked":
        kw["chunk_size"] = chunk_size
    q, k = inp["q"], inp["k"]
    rep = inp["v"].shape[1] // q.shape[1]
    if rep > 1:  # value heads share key heads; versions differ on whether the function repeats them itself
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    o, s = fn(b(q), b(k), b(inp["v"]), b(inp["g"]), b(inp["beta"]), **kw)
    assert o.dtype == F64 and s.dtype == F64, "transformers' function did not compute in float64"
    return o.reshape(Bsz * L, *o.shape[2:]), s.transpose(-1, -2)


@st.composite
def hf_cases(draw, kind, g_kinds):
    c = draw(cases(kind, g_kinds=g_kinds))
    Bsz = draw(st.integers(1, 2), label="batch")
    L = draw(st.integers(1, 11), label="L")
    c.update(lengths=[L] * Bsz, scale=None)  # transformers always scales q by K ** -0.5
    return c, Bsz, L, draw(st.sampled_from([2, 3, 4, 8, 16]), label="chunk_size")


def _vs_hf(kind, form, case, Bsz, L, cs, check, g_kind_note=""):
    inp = inputs_of(case)
    o_ref, s_ref = FORMS[kind][0](**inp)
    o, s = run_hf(kind, form, inp, Bsz, L, cs)
    ctx = f"transformers {form}, chunk_size={cs}, case={case}{g_kind_note}"
    check.close("o", o, o_ref, op=kind, impl="transformers", tol=TIGHT, context=ctx)
    check.close("final_states", s, s_ref, op=kind, impl="transformers", tol=TIGHT, context=ctx)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@given(data=st.data())
def test_gdn_equals_transformers(form, data, check):
    """Our GDN recurrence equals transformers' torch_recurrent_gated_delta_rule and
    torch_chunk_gated_delta_rule (float64, Hv > Hk through their repeat_interleave, with/without l2norm,
    initial states given transposed to (K, V), lengths that do or do not fill the last chunk) to 1e-10."""
    case, Bsz, L, cs = data.draw(hf_cases("gdn", ("uniform", "strong", "zero")), label="case")
    _vs_hf("gdn", form, case, Bsz, L, cs, check)


@given(data=st.data())
def test_kda_equals_transformers_recurrent(data, check):
    """Our KDA recurrence equals transformers' recurrent_kimi_delta_attention (float64, per-channel g,
    with/without l2norm, initial states transposed to (K, V)) to 1e-10."""
    case, Bsz, L, cs = data.draw(hf_cases("kda", ("uniform", "strong", "zero")), label="case")
    _vs_hf("kda", "recurrent", case, Bsz, L, cs, check)


@given(data=st.data())
def test_kda_equals_transformers_chunked_with_fp32_exact_decays(data, check):
    """Our KDA recurrence equals transformers' chunk_kimi_delta_attention to 1e-10 when every pairwise decay
    exp(b_t - b_j) is a power of two (g in -ln2 * {0, 1, 2}): their intra-chunk decay mask is cast with
    `.float()` (see the test below), which is then exact."""
    case, Bsz, L, cs = data.draw(hf_cases("kda", ("ln2", "zero")), label="case")
    _vs_hf("kda", "chunked", case, Bsz, L, cs, check, " (g in -ln2 * {0, 1, 2})")


def test_kda_transformers_chunked_rounds_its_decay_mask_to_float32():
    """Recorded fact (transformers 5.24): chunk_kimi_delta_attention builds its intra-chunk decay mask
    with `.exp().float()`, so even on float64 inputs it agrees with the recurrence only to float32
    precision when the decays are not powers of two: error far above float64's, far below float32's eps.
    (The recurrent form and GDN's chunked form have no such cast.) Should a later version drop the cast,
    this test fails and the test above can cover every g."""
    inp = make_inputs("kda", [10, 10], 2, 2, 4, 3, seed=4, initial_states=True, use_qk_l2norm=True)
    o_ref, s_ref = kda(**inp)
    o, s = run_hf("kda", "chunked", inp, 2, 10, chunk_size=4)
    err = float((o - o_ref).abs().max() / o_ref.abs().max())
    assert 1e-12 < err < 1e-5, f"relative error {err:.3e}: expected the float32 rounding of the decay mask"


@pytest.mark.parametrize("kind", list(FORMS))
@pytest.mark.parametrize("L,chunk_size", [(13, 4), (5, 16), (17, 8)], ids=["13-by-4", "5-by-16", "17-by-8"])
def test_transformers_chunked_tail_padding_is_exact(kind, L, chunk_size, check):
    """Recorded fact (transformers 5.24): their chunked forms pad the sequence to a multiple of the chunk
    size with g = 0, beta = 0 and k = v = q = 0, which is exact: with strong decays and initial states,
    for lengths that leave a short last chunk, their final state and outputs equal the recurrence to 1e-10
    (a tail padded with g != 0 would decay the final state; see the planted test above)."""
    inp = make_inputs(kind, [L, L], 2, 4 if kind == "gdn" else 2, 3, 2, seed=L, initial_states=True,
                      use_qk_l2norm=True, g_kind="ln2" if kind == "kda" else "uniform")
    o_ref, s_ref = FORMS[kind][0](**inp)
    o, s = run_hf(kind, "chunked", inp, 2, L, chunk_size)
    assert float(s_ref.abs().max()) > 1e-3, "the final state must be large enough to show a padding decay"
    check.close("o", o, o_ref, op=kind, impl="transformers", tol=TIGHT)
    check.close("final_states", s, s_ref, op=kind, impl="transformers", tol=TIGHT)


# ----------------------------------------------------------------------------------------------
# bad input

def r(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


def gdn(fn=gated_delta_rule, **over):
    kw = make_inputs("gdn", [3, 4], 2, 4, 3, 5, seed=0, initial_states=True)
    if fn is gated_delta_rule_chunked:
        kw["chunk_size"] = 2
    kw.update(over)
    return lambda: fn(**kw)


def kda_(fn=kda, **over):
    kw = make_inputs("kda", [3, 4], 2, 2, 3, 5, seed=0, initial_states=True)
    if fn is kda_chunked:
        kw["chunk_size"] = 2
    kw.update(over)
    return lambda: fn(**kw)


def step(kind, **over):
    i = make_inputs(kind, [1, 1], 2, 4 if kind == "gdn" else 2, 3, 5, seed=0, initial_states=True)
    kw = dict(q=i["q"], k=i["k"], v=i["v"], g=i["g"], beta=i["beta"], state=i["initial_states"])
    kw.update(over)
    fn = gated_delta_rule_update if kind == "gdn" else kda_update
    return lambda: fn(**kw)


CASES = [
    ("gdn int q", gdn(q=torch.ones(7, 2, 3, dtype=torch.int64)), "q"),
    ("gdn q 2-d", gdn(q=r(7, 6)), "q"),
    ("gdn k shape", gdn(k=r(7, 2, 4)), "k"),
    ("gdn v tokens", gdn(v=r(6, 4, 5)), "v"),
    ("gdn key heads do not divide value heads", gdn(q=r(7, 3, 3), k=r(7, 3, 3)), "k"),
    ("gdn per-channel g", gdn(g=-r(7, 4, 3).abs()), "g"),
    ("gdn g heads", gdn(g=-r(7, 2).abs()), "g"),
    ("gdn beta shape", gdn(beta=r(7, 2)), "beta"),
    ("gdn scale 0", gdn(scale=0.0), "scale"),
    ("gdn scale nan", gdn(scale=float("nan")), "scale"),
    ("gdn scale tensor", gdn(scale=torch.tensor(0.5)), "scale"),
    ("gdn use_qk_l2norm not bool", gdn(use_qk_l2norm=1), "use_qk_l2norm"),
    ("gdn mixed dtype g", gdn(g=-r(7, 4, dtype=torch.float32).abs()), "g"),
    ("gdn int beta", gdn(beta=torch.ones(7, 4, dtype=torch.int64)), "beta"),
    ("gdn initial_states key-major", gdn(initial_states=r(2, 4, 3, 5)), "initial_states"),
    ("gdn initial_states count", gdn(initial_states=r(3, 4, 5, 3)), "initial_states"),
    ("gdn initial_states 3-d", gdn(initial_states=r(2, 4, 15)), "initial_states"),
    ("gdn initial_states dtype", gdn(initial_states=r(2, 4, 5, 3, dtype=torch.float32)), "initial_states"),
    ("gdn cu_seqlens end", gdn(cu_seqlens=torch.tensor([0, 3, 8])), "cu_seqlens"),
    ("gdn cu_seqlens start", gdn(cu_seqlens=torch.tensor([1, 3, 7])), "cu_seqlens"),
    ("gdn cu_seqlens decreasing", gdn(cu_seqlens=torch.tensor([0, 5, 3, 7])), "cu_seqlens"),
    ("gdn cu_seqlens float", gdn(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "cu_seqlens"),
    ("gdn_chunked chunk_size 0", gdn(gated_delta_rule_chunked, chunk_size=0), "chunk_size"),
    ("gdn_chunked chunk_size float", gdn(gated_delta_rule_chunked, chunk_size=2.0), "chunk_size"),
    ("gdn_chunked per-channel g", gdn(gated_delta_rule_chunked, g=-r(7, 4, 3).abs()), "g"),
    ("gdn_chunked initial_states key-major", gdn(gated_delta_rule_chunked, initial_states=r(2, 4, 3, 5)),
     "initial_states"),
    ("kda per-head g", kda_(g=-r(7, 2).abs()), "g"),
    ("kda g key dim", kda_(g=-r(7, 2, 4).abs()), "g"),
    ("kda value heads differ", kda_(v=r(7, 4, 5), beta=r(7, 4)), "v"),
    ("kda beta heads", kda_(beta=r(7, 3)), "beta"),
    ("kda initial_states key-major", kda_(initial_states=r(2, 2, 3, 5)), "initial_states"),
    ("kda mixed dtype v", kda_(v=r(7, 2, 5, dtype=torch.float32)), "v"),
    ("kda_chunked chunk_size -1", kda_(kda_chunked, chunk_size=-1), "chunk_size"),
    ("kda_chunked g 2-d", kda_(kda_chunked, g=-r(7, 2).abs()), "g"),
    ("gdn_update state key-major", step("gdn", state=r(2, 4, 3, 5)), "state"),
    ("gdn_update state rows", step("gdn", state=r(3, 4, 5, 3)), "state"),
    ("gdn_update state None", step("gdn", state=None), "state"),
    ("gdn_update g per-channel", step("gdn", g=-r(2, 4, 3).abs()), "g"),
    ("gdn_update v rows", step("gdn", v=r(3, 4, 5)), "v"),
    ("gdn_update heads", step("gdn", q=r(2, 3, 3), k=r(2, 3, 3)), "k"),
    ("kda_update g per-head", step("kda", g=-r(2, 2).abs()), "g"),
    ("kda_update state dtype", step("kda", state=r(2, 2, 5, 3, dtype=torch.float32)), "state"),
]


@pytest.mark.parametrize("call,arg", [(c, a) for _, c, a in CASES], ids=[n for n, _, _ in CASES])
def test_bad_input_names_the_argument(call, arg):
    """The call raises ValueError whose message starts with the offending argument's name and says what
    was expected and what came ("arg: expected ..., got ...")."""
    with pytest.raises(ValueError, match=rf"^{re.escape(arg)}: expected .+, got .+") as e:
        call()
    assert "\n" not in str(e.value)


def test_key_major_state_message_says_how_to_fix():
    """A state in the key-major (K, V) layout (transformers' / FLA's) is named as such."""
    with pytest.raises(ValueError, match=r"key-major .*transpose\(-1, -2\)"):
        gdn(initial_states=r(2, 4, 3, 5))()


def test_good_inputs_of_the_bad_input_table_are_accepted():
    """The unmodified inputs behind the table above are valid (so each bad case fails for its own reason)."""
    for fn in (gdn(), gdn(gated_delta_rule_chunked), kda_(), kda_(kda_chunked), step("gdn"), step("kda")):
        fn()
