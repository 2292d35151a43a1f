"""Op suite: edge cases of the tiled decode kernels of `gated_delta_rule_update` and `kda_update`, every
implementation against the float64 oracle.

A kernel that splits each head's (V, K) state into blocks of value rows, with K as its vector axis and
the pool addressed through its strides, has failure modes the general suite's draws rarely reach: a
value width that leaves the last block partial after full ones, a key width that is not a power of two,
a pool that is a strided view of a larger buffer (another layer's state between its slots, an inner
layout whose K axis is not contiguous), activations and `out=` that are views of fused buffers, a pad id
that is a slot number, offsets computed in int64. Each case compares the outputs of the live rows and the
final states of the live slots with the oracle, and checks that every byte of the buffer behind the pool
outside the live slots is unchanged.
"""
import pytest
import torch
import triton.language as tl

from harness.testing.checks import assert_bitwise_equal, poison_
from harness.testing.optest import check_pad_rows, rand, randn, require
from reference.testing import gen
from harness.impls.reference_impl import oracle

OPS = {"gdn": "gated_delta_rule_update", "kda": "kda_update"}
KINDS = tuple(OPS)


def _activations(kind, g_, B, Hk, H, K, V, device):
    """q, k ~ N(0, 1/K), v ~ N(0, 1), g = -U(0, 1) (per head or per key channel), beta ~ U(0, 1)."""
    q = randn(g_, (B, Hk, K), torch.float32, device, scale=K ** -0.5)
    k = randn(g_, (B, Hk, K), torch.float32, device, scale=K ** -0.5)
    v = randn(g_, (B, H, V), torch.float32, device)
    g = -rand(g_, (B, H, K) if kind == "kda" else (B, H), torch.float32, device)
    beta = rand(g_, (B, H), torch.float32, device)
    return q, k, v, g, beta


def _paged(num_slots, H, V, K, device, seed, *, key_major=False, fill=None):
    """(buffer, pool): the buffer holds two layers' states per page, (num_slots, 2, H, V, K); the pool is
    layer 1, a strided view with layer 0 between its slots. key_major: pages store (H, K, V) and the
    pool is their transpose (K not the contiguous axis). `fill` (e.g. NaN) replaces layer 0's values."""
    inner = (H, K, V) if key_major else (H, V, K)
    buf = randn(gen(seed), (num_slots, 2) + inner, torch.float32, device, scale=0.1)
    if fill is not None:
        buf[:, 0] = fill
    pool = buf[:, 1]
    return buf, pool.transpose(-1, -2) if key_major else pool


def _check(check, impl, name, fn_args, kw, buf, pool, slots, *, out=None, shapes=None):
    """Run the op (into a NaN-poisoned `out=` unless one is given), compare the live rows' outputs and the
    live slots' states with the oracle, and check the buffer behind the pool bitwise outside the live slots."""
    before = buf.clone()
    idx = torch.tensor(slots, dtype=torch.int32, device=pool.device)
    o_ref, p_ref = oracle(name, *fn_args, pool, idx, **kw)
    if out is None:
        out = poison_(torch.empty_like(fn_args[2]))
    o = impl.op(name)(*fn_args, pool, idx, out=out, **kw)
    assert o is out, f"{name}: expected the op to return the `out=` tensor it was given"
    check_pad_rows(name, o, [*fn_args, pool, idx], kw, "o")
    pad = kw.get("pad_slot_id", -1)
    live_rows = torch.tensor([s != pad for s in slots])
    live = sorted(s for s in slots if s != pad)
    check.close(f"{name}.o", o.cpu()[live_rows], o_ref.cpu()[live_rows], op=name, impl=impl, dtype=torch.float32,
                shapes=shapes)
    if live:
        li = torch.tensor(live)
        check.close(f"{name}.pool[live]", pool.cpu()[li], p_ref.cpu()[li], op=name, impl=impl, dtype=torch.float32,
                    shapes=shapes)
    # every byte of the buffer outside the live slots' states: the other layer, unnamed and pads' slots
    keep = torch.ones(buf.shape, dtype=torch.bool, device=buf.device)
    region = keep[:, 1]
    if pool.stride(-1) != 1:  # key-major pages: the pool is their transpose
        region = region.transpose(-1, -2)
    for s in live:
        region[s] = False
    assert_bitwise_equal(f"{name}: buffer outside the live slots", buf[keep], before[keep])
    return o


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K,V", [(5, 37), (12, 37), (16, 8)], ids=["K5-V37", "K12-V37", "K16-V8"])
def test_partial_value_block_and_odd_key_width(impl, kind, K, V, device, check):
    """V = 37 leaves the last block of value rows partial after full ones (at the interpreter's blocks of 8
    and the GPU's of 16-64 alike); K = 5 and 12 are not powers of two; the pool is page-major with another
    layer's state between its slots; a pad row and an unnamed slot are in the batch."""
    name = OPS[kind]
    require(impl, name, torch.float32)
    Hk, H = (1, 2) if kind == "gdn" else (2, 2)
    slots = [2, -1, 0]
    q, k, v, g, beta = _activations(kind, gen(K * V), len(slots), Hk, H, K, V, device)
    buf, pool = _paged(4, H, V, K, device, seed=K + V)
    for l2 in (False, True):
        _check(check, impl, name, [q, k, v, g, beta], dict(use_qk_l2norm=l2), buf, pool, slots,
               shapes=dict(K=K, V=V, H=H, l2norm=l2))


@pytest.mark.parametrize("kind", KINDS)
def test_other_layer_nan_never_read(impl, kind, device, check):
    """The page's other layer holds NaN: the kernel, reading its slots through the pool's strides, never
    touches it (outputs and states match the oracle, finite), and leaves it bitwise as it was."""
    name = OPS[kind]
    require(impl, name, torch.float32)
    H, K, V = 2, 8, 12
    slots = [1, 3, -1]
    q, k, v, g, beta = _activations(kind, gen(3), len(slots), H, H, K, V, device)
    buf, pool = _paged(4, H, V, K, device, seed=3, fill=float("nan"))
    o = _check(check, impl, name, [q, k, v, g, beta], {}, buf, pool, slots)
    assert bool(torch.isfinite(o[:2]).all()), f"{name}: NaN from the page's other layer reached a live row"


@pytest.mark.parametrize("kind", KINDS)
def test_key_major_pages_and_fused_activations(impl, kind, device, check):
    """The pool is the transpose of key-major pages (K strided, V contiguous); q, k, v are views of one
    fused projection (row stride past their width), g and beta columns of a wider tensor, and `out=` a
    transposed view into a larger buffer (V strided), whose other elements stay as they were."""
    name = OPS[kind]
    require(impl, name, torch.float32)
    Hk, H, K, V = (1, 3, 6, 10) if kind == "gdn" else (2, 2, 6, 10)
    B = 3
    g_ = gen(11)
    fused = randn(g_, (B, 2 * Hk * K + H * V + 5), torch.float32, device)
    q = fused[:, :Hk * K].unflatten(1, (Hk, K))
    k = fused[:, Hk * K:2 * Hk * K].unflatten(1, (Hk, K))
    v = fused[:, 2 * Hk * K:2 * Hk * K + H * V].unflatten(1, (H, V))
    _, _, _, g0, b0 = _activations(kind, g_, B, Hk, H, K, V, device)
    gb = torch.cat([g0.flatten(1), b0, torch.zeros(B, 3, device=device)], dim=1)
    g = gb[:, :g0[0].numel()].view(g0.shape)
    beta = gb[:, g0[0].numel():g0[0].numel() + H]
    assert not q.is_contiguous() and not v.is_contiguous() and not beta.is_contiguous()
    wide = poison_(torch.empty(B, V + 2, H, device=device))
    out = wide[:, 1:V + 1].transpose(1, 2)  # (B, H, V), V strided
    buf, pool = _paged(4, H, V, K, device, seed=11, key_major=True)
    assert pool.stride(-1) != 1
    slots = [3, -1, 1]
    _check(check, impl, name, [q, k, v, g, beta], dict(scale=0.3), buf, pool, slots, out=out)
    assert bool(wide[:, 0].isnan().all() and wide[:, V + 1].isnan().all()), \
        f"{name}: wrote outside the `out=` view"


@pytest.mark.parametrize("kind", KINDS)
def test_pad_id_that_is_a_slot_number(impl, kind, device, check):
    """pad_slot_id = 0, a valid slot number: rows naming slot 0 are pads, slot 0 is neither read nor
    written (NaN there never reaches a live row)."""
    name = OPS[kind]
    require(impl, name, torch.float32)
    H, K, V = 2, 4, 9
    slots = [0, 2, 0, 1]
    q, k, v, g, beta = _activations(kind, gen(5), len(slots), H, H, K, V, device)
    buf, pool = _paged(3, H, V, K, device, seed=5)
    pool[0] = float("nan")
    _check(check, impl, name, [q, k, v, g, beta], dict(pad_slot_id=0), buf, pool, slots)


@pytest.mark.parametrize("kind", KINDS)
def test_int64_offsets(impl, kind, device, check, monkeypatch):
    """The int64 offset variant (taken for pools past 2^31 elements) computes the same step: forced here on
    a small case, since a pool that large does not fit a CPU run."""
    name = OPS[kind]
    require(impl, name, torch.float32)
    if impl.name != "triton":
        pytest.skip("the int64 offset variant is a Triton kernel variant (impl 'triton' only)")
    from harness.impls.triton import delta_rule_update as TR
    monkeypatch.setattr(TR, "index_type", lambda *ts, **kw: tl.int64)
    H, K, V = 2, 8, 12
    slots = [2, -1]
    q, k, v, g, beta = _activations(kind, gen(9), len(slots), H, H, K, V, device)
    buf, pool = _paged(3, H, V, K, device, seed=9)
    _check(check, impl, name, [q, k, v, g, beta], dict(use_qk_l2norm=True), buf, pool, slots)
