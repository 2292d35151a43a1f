"""Closed-form edge cases of the reference ops: each test states a case where the answer is known without
running the recurrence (dt = 0, total forgetting, one-hot conv kernels, norm identities, group mapping)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from harness.testing.checks import Tolerance
from reference.conv1d import causal_conv1d, causal_conv1d_update
from reference.norms import gated_rms_norm, rms_norm
from reference.selective_scan import selective_scan, selective_state_update
from reference.ssd import ssd_chunked, ssd_scan, ssd_state_update
from reference.testing import (cu_seqlens_from, make_conv_inputs, make_mamba1_inputs, make_norm_inputs,
                               make_ssd_inputs, seqlens)

TIGHT = Tolerance(atol=1e-11, rtol=1e-10, ratio=1e-10)
seeds = st.integers(0, 2**31 - 1)
SSD_FORMS = {"scan": ssd_scan, "chunked": lambda **kw: ssd_chunked(**kw, chunk_size=4)}


def _silu(z):
    return z * torch.sigmoid(z)


# ---------------------------------------------------------------------------------------------
# dt = 0: nothing is written, nothing decays


@pytest.mark.parametrize("form", list(SSD_FORMS))
@given(lengths=seqlens(1, 3, 0, 9), G=st.sampled_from([1, 2, 4]), D=st.sampled_from(["head", "head_dim", None]),
       z=st.booleans(), seed=seeds)
def test_ssd_dt_zero_keeps_state(form, lengths, G, D, z, seed, check):
    """With dt = 0 (no softplus, no bias) the state never changes: final state = initial state and
    y_t = (h0 C_t + D x_t) * silu(z_t), with head h reading group h // (H // G)."""
    H, P, N = 4, 2, 3
    inp = make_ssd_inputs(sum(lengths), H, P, N, G, seed=seed, cu_seqlens=cu_seqlens_from(lengths),
                          initial_states=True, D=D, z=z, dt_bias=False, dt_softplus=False)
    inp["dt"] = torch.zeros_like(inp["dt"])
    y, s = SSD_FORMS[form](**inp)
    h0 = inp["initial_states"]
    expected = torch.empty_like(inp["x"])
    cu = inp["cu_seqlens"].tolist()
    for si, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(a, b):
            for h in range(H):
                c = inp["C"][t, h // (H // G)]  # (N,)
                yt = h0[si, h] @ c
                if D is not None:  # D[h] is a scalar (per head) or a (P,) vector (per head x dim)
                    yt = yt + inp["D"][h] * inp["x"][t, h]
                expected[t, h] = yt * (_silu(inp["z"][t, h]) if z else 1)
    check.close("final_states", s, h0, op="ssd", impl="reference", tol=TIGHT, seed=seed)
    check.close("y", y, expected, op="ssd", impl="reference", tol=TIGHT, seed=seed)


@given(lengths=seqlens(1, 3, 0, 9), G=st.sampled_from([1, 2]), seed=seeds)
def test_selective_scan_dt_zero_keeps_state(lengths, G, seed, check):
    """Mamba-1 with delta = 0 (no bias, no softplus): final state = initial state and
    y_t[d] = (sum_n C_t[g(d), n] h0[d, n] + D[d] u_t[d]) * silu(z_t[d])."""
    Dm = 4
    inp = make_mamba1_inputs(sum(lengths), Dm, 3, G, seed=seed, cu_seqlens=cu_seqlens_from(lengths),
                             initial_states=True, delta_bias=False, delta_softplus=False)
    inp["delta"] = torch.zeros_like(inp["delta"])
    y, s = selective_scan(**inp)
    h0, cu = inp["initial_states"], inp["cu_seqlens"].tolist()
    expected = torch.empty_like(inp["u"])
    for si, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(a, b):
            for d in range(Dm):
                c = inp["C"][t, d // (Dm // G)]
                expected[t, d] = (h0[si, d] @ c + inp["D"][d] * inp["u"][t, d]) * _silu(inp["z"][t, d])
    check.close("final_states", s, h0, op="selective_scan", impl="reference", tol=TIGHT, seed=seed)
    check.close("y", y, expected, op="selective_scan", impl="reference", tol=TIGHT, seed=seed)


# ---------------------------------------------------------------------------------------------
# dt preprocessing: bias, then softplus, then the dt_limit clamp


@pytest.mark.parametrize("form", list(SSD_FORMS) + ["update"])
@given(bites=st.sampled_from(["lo", "hi", "both"]), seed=seeds)
def test_ssd_dt_is_bias_softplus_then_clamp(form, bites, seed, check):
    """The effective step is clamp(softplus(dt + dt_bias), *dt_limit): the op on raw dt equals the op
    given that effective dt directly (no bias, no softplus, no limit). The limit is set between quantiles
    of softplus(dt + dt_bias), so the low end, the high end or both really clamp."""
    inp = make_ssd_inputs(8, 4, 2, 3, 2, seed=seed, initial_states=True, D="head")
    raw = F.softplus(inp["dt"] + inp["dt_bias"])
    lo = float(raw.quantile(0.3)) if bites in ("lo", "both") else 0.0
    hi = float(raw.quantile(0.7)) if bites in ("hi", "both") else float("inf")
    inp["dt_limit"] = (lo, hi)
    eff = raw.clamp(lo, hi)
    pre = dict(inp, dt=eff, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")))
    if form == "update":
        keys = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "dt_limit")
        state = inp["initial_states"].expand(8, 4, 2, 3)
        got = ssd_state_update(state, **{k: inp[k] for k in keys})
        want = ssd_state_update(state, **{k: pre[k] for k in keys})
    else:
        got, want = SSD_FORMS[form](**inp), SSD_FORMS[form](**pre)
    check.close("y", got[0], want[0], op="ssd", impl="reference", tol=TIGHT, seed=seed)
    check.close("final_states", got[1], want[1], op="ssd", impl="reference", tol=TIGHT, seed=seed)


@pytest.mark.parametrize("form", ["scan", "update"])
@given(softplus=st.booleans(), seed=seeds)
def test_selective_scan_delta_is_bias_then_softplus(form, softplus, seed, check):
    """Mamba-1's step is softplus(delta + delta_bias) (or delta + delta_bias without softplus): the op on
    raw delta equals the op given that step directly with no bias and no softplus."""
    inp = make_mamba1_inputs(6, 4, 3, 2, seed=seed, initial_states=True, delta_softplus=softplus)
    eff = inp["delta"] + inp["delta_bias"]
    eff = F.softplus(eff) if softplus else eff
    pre = dict(inp, delta=eff, delta_bias=None, delta_softplus=False)
    if form == "update":
        def run(d):
            return selective_state_update(d["initial_states"].expand(6, 4, 3), d["u"], d["delta"], d["A"], d["B"],
                                          d["C"], d["D"], d["z"], dt_bias=d["delta_bias"],
                                          dt_softplus=d["delta_softplus"])
        got, want = run(inp), run(pre)
    else:
        got, want = selective_scan(**inp), selective_scan(**pre)
    check.close("y", got[0], want[0], op="selective_scan", impl="reference", tol=TIGHT, seed=seed)
    check.close("final_states", got[1], want[1], op="selective_scan", impl="reference", tol=TIGHT, seed=seed)


# ---------------------------------------------------------------------------------------------
# very negative A: everything but the current token is forgotten


@pytest.mark.parametrize("form", list(SSD_FORMS) + ["update"])
@given(T=st.integers(1, 9), G=st.sampled_from([1, 2, 4]), seed=seeds)
def test_ssd_total_forgetting(form, T, G, seed, check):
    """With A = -1e30 (exp(dt*A) = 0 exactly) the state after token t is dt_t x_t (outer) B_t of that token
    alone, whatever the initial state, and y_t = (dt_t x_t (outer) B_t) C_t + D x_t."""
    H, P, N = 4, 2, 3
    inp = make_ssd_inputs(T, H, P, N, G, seed=seed, initial_states=True, D="head", z=False)
    inp["A"] = torch.full_like(inp["A"], -1e30)
    dt = F.softplus(inp["dt"] + inp["dt_bias"])  # (T, H)
    Bh = inp["B"].repeat_interleave(H // G, dim=1)
    Ch = inp["C"].repeat_interleave(H // G, dim=1)
    states = dt[:, :, None, None] * inp["x"][:, :, :, None] * Bh[:, :, None, :]  # (T, H, P, N)
    expected_y = torch.einsum("thpn,thn->thp", states, Ch) + inp["D"][:, None] * inp["x"]
    if form == "update":
        # every token as its own batch row, all starting from the same initial state
        y, s = ssd_state_update(inp["initial_states"].expand(T, H, P, N), inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                                dt_bias=inp["dt_bias"])
        check.close("new_state", s, states, op="ssd", impl="reference", tol=TIGHT, seed=seed)
    else:
        y, s = SSD_FORMS[form](**inp)
        assert torch.isfinite(y).all()
        check.close("final_states", s, states[-1:], op="ssd", impl="reference", tol=TIGHT, seed=seed)
    check.close("y", y, expected_y, op="ssd", impl="reference", tol=TIGHT, seed=seed)


@pytest.mark.parametrize("form", ["scan", "update"])
@given(T=st.integers(1, 9), G=st.sampled_from([1, 2]), seed=seeds)
def test_selective_scan_total_forgetting(form, T, G, seed, check):
    """Mamba-1 with A = -1e30: the state after token t is dt_t * B_t[g(d)] * u_t[d] of that token alone and
    y_t = <C_t, h_t> + D u_t (then * silu(z_t))."""
    Dm, N = 4, 3
    inp = make_mamba1_inputs(T, Dm, N, G, seed=seed, initial_states=True)
    inp["A"] = torch.full_like(inp["A"], -1e30)
    dt = F.softplus(inp["delta"] + inp["delta_bias"])  # (T, Dm)
    Bd = inp["B"].repeat_interleave(Dm // G, dim=1)
    Cd = inp["C"].repeat_interleave(Dm // G, dim=1)
    states = (dt * inp["u"])[:, :, None] * Bd  # (T, Dm, N)
    expected_y = ((states * Cd).sum(-1) + inp["D"] * inp["u"]) * _silu(inp["z"])
    if form == "update":
        y, s = selective_state_update(inp["initial_states"].expand(T, Dm, N), inp["u"], inp["delta"], inp["A"],
                                      inp["B"], inp["C"], inp["D"], inp["z"], dt_bias=inp["delta_bias"],
                                      dt_softplus=True)
        check.close("new_state", s, states, op="selective_scan", impl="reference", tol=TIGHT, seed=seed)
    else:
        y, s = selective_scan(**inp)
        check.close("final_states", s, states[-1:], op="selective_scan", impl="reference", tol=TIGHT, seed=seed)
    check.close("y", y, expected_y, op="selective_scan", impl="reference", tol=TIGHT, seed=seed)


# ---------------------------------------------------------------------------------------------
# conv1d with a one-hot kernel is a shift


@given(K=st.integers(2, 8), tap=st.data(), L=st.integers(0, 12), seed=seeds)
def test_conv_one_hot_kernel_shifts(K, tap, L, seed, check):
    """With weight[:, j] = 1 and all other taps 0 (no bias, no activation), y[t] = x[t - s] with
    s = K-1-j, where positions before the sequence start read the initial state (column K-1-s+t);
    the final state is the last K-1 of [initial state, x], i.e. for L < K-1 the state's tail then x."""
    j = tap.draw(st.integers(0, K - 1), label="tap")
    D = 3
    inp = make_conv_inputs(L, D, K, seed=seed, initial_states=True, bias=False, activation=None)
    w = torch.zeros(D, K, dtype=torch.float64)
    w[:, j] = 1.0
    inp["weight"] = w
    y, fs = causal_conv1d(**inp)
    x, h0 = inp["x"], inp["initial_states"][0]  # (L, D), (D, K-1)
    s = K - 1 - j
    expected = torch.empty_like(x)
    for t in range(L):
        expected[t] = x[t - s] if t >= s else h0[:, K - 1 - s + t]
    expected_state = torch.empty(D, K - 1, dtype=torch.float64)
    for i in range(K - 1):  # column i holds input number L - (K-1) + i (negative: from the initial state)
        src = L - (K - 1) + i
        expected_state[:, i] = x[src] if src >= 0 else h0[:, K - 1 + src]
    check.close("y", y, expected, op="causal_conv1d", impl="reference", tol=TIGHT, seed=seed)
    check.close("final_states", fs[0], expected_state, op="causal_conv1d", impl="reference", tol=TIGHT, seed=seed)
    # the decode step with the same kernel is the same shift
    if L >= 1:
        yu, su = causal_conv1d_update(x[-1:], inp["initial_states"], w)
        exp_u = x[-1] if s == 0 else h0[:, K - 1 - s]
        check.close("y_update", yu[0], exp_u, op="causal_conv1d", impl="reference", tol=TIGHT, seed=seed)
        check.close("state_update", su[0], torch.cat([h0[:, 1:], x[-1:].T], dim=1), op="causal_conv1d",
                    impl="reference", tol=TIGHT, seed=seed)


def test_conv_silu_and_bias():
    """activation='silu' is silu(conv + bias): with a zero kernel the output is silu(bias) everywhere."""
    inp = make_conv_inputs(5, 3, 4, seed=1, activation="silu")
    inp["weight"] = torch.zeros_like(inp["weight"])
    y, _ = causal_conv1d(**inp)
    assert torch.equal(y, _silu(inp["bias"]).expand(5, 3))


# ---------------------------------------------------------------------------------------------
# norms


@given(shape=st.sampled_from([(6,), (3, 8), (2, 3, 12)]), seed=seeds,
       eps=st.sampled_from([0.0, 1e-6, 1e-2]))
def test_gated_rms_norm_without_gate_is_rms_norm_times_weight(shape, seed, eps, check):
    """gated_rms_norm(x, w, z=None) = rms_norm(x, w) = rms_norm(x) * w = x / sqrt(mean(x^2) + eps) * w."""
    inp = make_norm_inputs(shape, seed=seed, z=False, eps=eps)
    x, w = inp["x"], inp["weight"]
    direct = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    for name, got in (("gated", gated_rms_norm(**inp)), ("rms_w", rms_norm(x, w, eps)),
                      ("rms_times_w", rms_norm(x, eps=eps) * w)):
        check.close(name, got, direct, op="gated_rms_norm", impl="reference", tol=TIGHT, seed=seed)


@given(groups=st.sampled_from([1, 2, 4]), before=st.booleans(), seed=seeds)
def test_gated_rms_norm_groups_and_gate_order(groups, before, seed, check):
    """Per-group gated norm equals rms_norm applied to each group_size slice:
    norm_before_gate=True -> rms_norm(x_g) * w_g * silu(z_g); False -> rms_norm(x_g * silu(z_g)) * w_g."""
    Dn = 8
    inp = make_norm_inputs((5, Dn), seed=seed, group_size=Dn // groups, norm_before_gate=before)
    x, w, z, gs = inp["x"], inp["weight"], inp["z"], Dn // groups
    parts = []
    for g in range(groups):
        sl = slice(g * gs, (g + 1) * gs)
        if before:
            parts.append(rms_norm(x[:, sl], eps=inp["eps"]) * w[sl] * _silu(z[:, sl]))
        else:
            parts.append(rms_norm(x[:, sl] * _silu(z[:, sl]), eps=inp["eps"]) * w[sl])
    check.close("y", gated_rms_norm(**inp), torch.cat(parts, dim=1), op="gated_rms_norm", impl="reference",
                tol=TIGHT, seed=seed)


def test_weightless_rms_norm_has_unit_rms():
    """With eps = 0 the weightless rms_norm output has mean square exactly 1 (to rounding) on every row."""
    x = make_norm_inputs((4, 16), seed=3)["x"] * 7.0
    y = rms_norm(x, eps=0.0)
    assert torch.allclose((y * y).mean(-1), torch.ones(4, dtype=torch.float64), atol=1e-14, rtol=0)


# ---------------------------------------------------------------------------------------------
# group -> head mapping is repeat_interleave (contiguous blocks), not repeat (tiling)


@pytest.mark.parametrize("form", list(SSD_FORMS) + ["update"])
def test_ssd_groups_map_to_heads_by_repeat_interleave(form, check):
    """With G = 2 and H = 4, heads 0, 1 read group 0 and heads 2, 3 read group 1: if only group 0's B is
    non-zero (and no initial state), heads 0, 1 get a non-zero state and heads 2, 3 stay exactly zero;
    and the op equals the G = H op with B, C expanded per head by h // 2 (`repeat` would give heads 0, 2)."""
    inp = make_ssd_inputs(6, 4, 2, 3, 2, seed=11, D=None, z=False)
    inp["B"][:, 1] = 0.0
    expanded = dict(inp, B=inp["B"][:, [0, 0, 1, 1]], C=inp["C"][:, [0, 0, 1, 1]])
    if form == "update":
        state = torch.zeros(6, 4, 2, 3, dtype=torch.float64)
        kw = dict(A=inp["A"], dt_bias=inp["dt_bias"])
        y, s = ssd_state_update(state, inp["x"], inp["dt"], B=inp["B"], C=inp["C"], **kw)
        y_e, s_e = ssd_state_update(state, inp["x"], inp["dt"], B=expanded["B"], C=expanded["C"], **kw)
    else:
        y, s = SSD_FORMS[form](**inp)
        y_e, s_e = SSD_FORMS[form](**expanded)
    assert bool((s[:, :2].abs() > 0).any()), "heads 0, 1 must see group 0's non-zero B"
    assert torch.equal(s[:, 2:], torch.zeros_like(s[:, 2:])), "heads 2, 3 must see group 1's zero B"
    check.close("y", y, y_e, op="ssd", impl="reference", tol=TIGHT)
    check.close("final_states", s, s_e, op="ssd", impl="reference", tol=TIGHT)


@pytest.mark.parametrize("form", ["scan", "update"])
def test_selective_scan_groups_map_to_channels_by_repeat_interleave(form):
    """Mamba-1 with G = 2 and Dm = 4: channels 0, 1 read group 0 and channels 2, 3 read group 1 (a zero B in
    group 1 leaves exactly channels 2, 3 with a zero state)."""
    inp = make_mamba1_inputs(5, 4, 3, 2, seed=12)
    inp["B"][:, 1] = 0.0
    if form == "update":
        _, s = selective_state_update(torch.zeros(5, 4, 3, dtype=torch.float64), inp["u"], inp["delta"],
                                      inp["A"], inp["B"], inp["C"], dt_bias=inp["delta_bias"], dt_softplus=True)
    else:
        _, s = selective_scan(**inp)
    assert bool((s[:, :2].abs() > 0).any())
    assert torch.equal(s[:, 2:], torch.zeros_like(s[:, 2:]))


# ---------------------------------------------------------------------------------------------
# contract: inputs are never modified; outputs keep the input dtype


def _all_calls():
    conv = make_conv_inputs(7, 3, 4, seed=0, cu_seqlens=[0, 2, 7], initial_states=True)
    m1 = make_mamba1_inputs(7, 4, 3, 2, seed=0, cu_seqlens=[0, 2, 7], initial_states=True)
    ssd = make_ssd_inputs(7, 4, 2, 3, 2, seed=0, cu_seqlens=[0, 2, 7], initial_states=True, D="head_dim")
    norm = make_norm_inputs((3, 8), seed=0, group_size=4)
    return [
        (causal_conv1d, conv),
        (causal_conv1d_update, dict(x=conv["x"][:2], conv_state=conv["initial_states"], weight=conv["weight"],
                                    bias=conv["bias"], activation="silu")),
        (selective_scan, m1),
        (selective_state_update, dict(state=m1["initial_states"], x=m1["u"][:2], dt=m1["delta"][:2], A=m1["A"],
                                      B=m1["B"][:2], C=m1["C"][:2], D=m1["D"], z=m1["z"][:2],
                                      dt_bias=m1["delta_bias"], dt_softplus=True)),
        (ssd_scan, ssd),
        (lambda **kw: ssd_chunked(**kw, chunk_size=3), ssd),
        (ssd_state_update, dict(state=ssd["initial_states"], x=ssd["x"][:2], dt=ssd["dt"][:2], A=ssd["A"],
                                B=ssd["B"][:2], C=ssd["C"][:2], D=ssd["D"], z=ssd["z"][:2], dt_bias=ssd["dt_bias"])),
        (gated_rms_norm, norm),
        (rms_norm, dict(x=norm["x"], weight=norm["weight"])),
    ]


@pytest.mark.parametrize("i", range(9))
def test_ops_do_not_modify_inputs(i):
    """Every op leaves every input tensor bit-for-bit unchanged."""
    fn, kw = _all_calls()[i]
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    fn(**kw)
    for k, v in before.items():
        assert torch.equal(kw[k], v), f"input {k} was modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_outputs_keep_input_dtype(dtype):
    """An op given float32/float16/bfloat16 inputs computes in and returns that dtype (outputs and states)."""
    for fn, kw in _all_calls():
        kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in kw.items()}
        out = fn(**kw)
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            assert o.dtype == dtype
            assert torch.isfinite(o).all()
