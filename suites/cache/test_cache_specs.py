"""Cache layout specs (reference/cache.py): shape and byte arithmetic, TP sharding, the Mamba-1-in-Mamba-2
mapping, slot counts per cache mode, snapshot positions, and rejection of bad configurations.

Bug class 14 (two places compute the state shape and disagree) is what these properties guard: every
derived number is recomputed here independently from the fields and compared.
"""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from reference import cache
from reference.cache import (GDNSpec, KDASpec, Mamba1Spec, Mamba2Spec, mamba1_as_mamba2, slots_needed,
                             snapshot_positions)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
dtypes = st.sampled_from(DTYPES)
tps = st.sampled_from([1, 2, 4, 8])
kernels = st.integers(2, 8)


@st.composite
def mamba1_specs(draw, tp=None):
    tp = draw(tps) if tp is None else tp
    return Mamba1Spec(intermediate_size=tp * draw(st.integers(1, 64)), state_size=draw(st.integers(1, 32)),
                      conv_kernel=draw(kernels), tp_size=tp, conv_dtype=draw(dtypes),
                      recurrent_dtype=draw(dtypes))


@st.composite
def mamba2_specs(draw, tp=None):
    tp = draw(tps) if tp is None else tp
    replicated = draw(st.booleans())
    groups = 1 if replicated else tp * draw(st.integers(1, 3))
    heads = groups * tp * draw(st.integers(1, 3)) if not replicated else tp * draw(st.integers(1, 6))
    return Mamba2Spec(num_heads=heads, head_dim=draw(st.integers(1, 16)), state_size=draw(st.integers(1, 32)),
                      n_groups=groups, conv_kernel=draw(kernels), tp_size=tp, conv_dtype=draw(dtypes),
                      recurrent_dtype=draw(dtypes))


@st.composite
def gdn_specs(draw, tp=None):
    tp = draw(tps) if tp is None else tp
    hk = tp * draw(st.integers(1, 4))
    hv = hk * draw(st.integers(1, 3))
    return GDNSpec(num_k_heads=hk, num_v_heads=hv, head_k_dim=draw(st.integers(1, 32)),
                   head_v_dim=draw(st.integers(1, 32)), conv_kernel=draw(kernels), tp_size=tp,
                   conv_dtype=draw(dtypes), recurrent_dtype=draw(dtypes))


@st.composite
def kda_specs(draw, tp=None):
    tp = draw(tps) if tp is None else tp
    return KDASpec(num_heads=tp * draw(st.integers(1, 4)), head_dim=draw(st.integers(1, 32)),
                   conv_kernel=draw(kernels), tp_size=tp, conv_dtype=draw(dtypes))


any_spec = st.one_of(mamba1_specs(), mamba2_specs(), gdn_specs(), kda_specs())


def _expected_shapes(spec):
    """The shapes per the issue text, recomputed independently of reference/cache.py's properties."""
    t, km1 = spec.tp_size, spec.conv_kernel - 1
    if isinstance(spec, Mamba1Spec):
        d = spec.intermediate_size
        return (d // t, km1), (d // t, spec.state_size)
    if isinstance(spec, Mamba2Spec):
        d = spec.num_heads * spec.head_dim
        g_rank = 1 if spec.n_groups == 1 else spec.n_groups // t
        conv = d // t + (2 * g_rank * spec.state_size if spec.bc_in_conv else 0)
        return (conv, km1), (spec.num_heads // t, spec.head_dim, spec.state_size)
    if isinstance(spec, GDNSpec):
        conv = (2 * spec.num_k_heads * spec.head_k_dim + spec.num_v_heads * spec.head_v_dim) // t
        return (conv, km1), (spec.num_v_heads // t, spec.head_v_dim, spec.head_k_dim)
    if isinstance(spec, KDASpec):
        return (3 * spec.num_heads * spec.head_dim // t, km1), (spec.num_heads // t, spec.head_dim, spec.head_dim)
    raise AssertionError(type(spec))


@given(any_spec)
def test_shapes_match_the_issue_formulas(spec):
    """conv state (conv_dim/TP, K-1) and recurrent state shapes equal the per-kind formulas."""
    conv, rec = _expected_shapes(spec)
    assert spec.conv_shape == conv
    assert spec.recurrent_shape == rec
    assert spec.shapes == {"conv": conv, "recurrent": rec}


@given(any_spec)
def test_bytes_are_numel_times_itemsize(spec):
    """bytes_per_slot == page_size == sum over states of numel * itemsize, with itemsize from a real tensor."""
    total = 0
    for name, shape in spec.shapes.items():
        t = torch.empty(shape, dtype=spec.dtypes[name])
        total += t.numel() * t.element_size()
    assert spec.conv_bytes == torch.empty(spec.conv_shape, dtype=spec.conv_dtype).nbytes
    assert spec.recurrent_bytes == torch.empty(spec.recurrent_shape, dtype=spec.recurrent_dtype).nbytes
    assert spec.bytes_per_slot == spec.page_size == total


@given(any_spec, st.integers(1, 1 << 16))
def test_padded_page_size(spec, multiple):
    """padded_page_size(m) is the smallest multiple of m that is >= page_size."""
    p = spec.padded_page_size(multiple)
    assert p >= spec.page_size
    assert p % multiple == 0
    assert p - multiple < spec.page_size


@given(st.one_of(*(f(tp=1) for f in (mamba1_specs, mamba2_specs, gdn_specs, kda_specs))),
       st.sampled_from([2, 4, 8]), st.data())
def test_tp_shards_reassemble(base, tp, data):
    """TP shards re-assemble the unsharded state: recurrent dim 0 and every sharded conv segment times
    tp_size give the unsharded size; replicated segments (Mamba-2 with n_groups == 1) are whole on
    every rank; the conv segments sum to the rank's conv_dim."""
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__ if base.__dataclass_fields__[k].init}
    # scale the sharded fields so that the configuration is valid under tp
    if isinstance(base, Mamba1Spec):
        fields["intermediate_size"] *= tp
    elif isinstance(base, Mamba2Spec):
        fields["num_heads"] *= tp * fields["n_groups"] * (1 if fields["n_groups"] == 1 else tp)
        if fields["n_groups"] != 1:
            fields["n_groups"] *= tp
    elif isinstance(base, GDNSpec):
        fields["num_k_heads"] *= tp
        fields["num_v_heads"] *= tp
    else:
        fields["num_heads"] *= tp
    full = type(base)(**{**fields, "tp_size": 1})
    shard = type(base)(**{**fields, "tp_size": tp})
    assert shard.unsharded() == full
    assert shard.recurrent_shape[0] * tp == full.recurrent_shape[0]
    assert shard.recurrent_shape[1:] == full.recurrent_shape[1:]
    assert shard.conv_shape[1] == full.conv_shape[1]
    assert sum(s[2] for s in shard.conv_segments()) == shard.conv_dim
    assert sum(s[1] for s in full.conv_segments()) == full.conv_dim
    for (n, whole, per_rank, replicated), (n_full, whole_full, _, _) in zip(shard.conv_segments(),
                                                                             full.conv_segments()):
        assert n == n_full and whole == whole_full
        assert per_rank == (whole if replicated else whole // tp)
        if not replicated:
            assert per_rank * tp == whole
    # re-assemble real tensors: concatenating the rank shards of a random unsharded recurrent state
    # along dim 0 gives it back
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    whole = torch.randn(full.recurrent_shape, generator=g)
    shards = whole.chunk(tp, dim=0)
    assert all(s.shape == shard.recurrent_shape for s in shards)
    assert torch.equal(torch.cat(shards, 0), whole)


def test_mamba2_replicated_group_example():
    """Hand-computed: H=8, P=64, N=128, G=1, TP=4 -> conv dim 8*64/4 + 2*128 = 384; recurrent (2, 64, 128)."""
    s = Mamba2Spec(num_heads=8, head_dim=64, state_size=128, n_groups=1, conv_kernel=4, tp_size=4,
                   conv_dtype=torch.bfloat16, recurrent_dtype=torch.float32)
    assert s.conv_shape == (384, 3)
    assert s.recurrent_shape == (2, 64, 128)
    assert s.bytes_per_slot == 384 * 3 * 2 + 2 * 64 * 128 * 4
    g8 = Mamba2Spec(num_heads=8, head_dim=64, state_size=128, n_groups=8, tp_size=4)
    assert g8.conv_shape == (8 * 64 // 4 + 2 * 2 * 128, 3)


def test_known_model_examples():
    """Hand-computed numbers for real model shapes (Mamba-130m, Qwen3-Next GDN at TP=2, Kimi-Linear KDA)."""
    m1 = Mamba1Spec(intermediate_size=1536, state_size=16, conv_kernel=4,
                    conv_dtype=torch.float16, recurrent_dtype=torch.float16)
    assert (m1.conv_shape, m1.recurrent_shape, m1.bytes_per_slot) == ((1536, 3), (1536, 16),
                                                                      1536 * 3 * 2 + 1536 * 16 * 2)
    g = GDNSpec(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, tp_size=2)
    assert g.conv_shape == ((2 * 2048 + 4096) // 2, 3) and g.recurrent_shape == (16, 128, 128)
    k = KDASpec(num_heads=32, head_dim=128, tp_size=4, conv_dtype=torch.bfloat16)
    assert k.conv_shape == (3 * 32 * 128 // 4, 3) and k.recurrent_shape == (8, 128, 128)
    assert k.recurrent_dtype == torch.float32


@given(mamba1_specs())
def test_mamba1_full_rank_mapping(m1):
    """mamba1_as_mamba2: num_heads = D, head_dim = 1; recurrent (D/TP, 1, N) is Mamba-1's (D/TP, N) up to
    reshape (numel, bytes, dtype equal), conv state identical, total bytes per slot identical."""
    m2 = mamba1_as_mamba2(m1)
    assert isinstance(m2, Mamba2Spec)
    assert (m2.num_heads, m2.head_dim, m2.n_groups) == (m1.intermediate_size, 1, 1)
    assert m2.recurrent_shape == (m1.recurrent_shape[0], 1, m1.recurrent_shape[1])
    assert m2.recurrent_numel == m1.recurrent_numel and m2.recurrent_bytes == m1.recurrent_bytes
    assert m2.conv_shape == m1.conv_shape and m2.dtypes == m1.dtypes
    assert m2.bytes_per_slot == m1.bytes_per_slot
    x = torch.arange(m1.recurrent_numel).reshape(m1.recurrent_shape)
    assert torch.equal(x.reshape(m2.recurrent_shape).reshape(m1.recurrent_shape), x)


def test_mamba1_mapping_rejects_other_specs():
    """Only a Mamba1Spec maps; anything else is a ValueError naming `spec`."""
    with pytest.raises(ValueError, match="^spec: "):
        mamba1_as_mamba2(KDASpec(num_heads=2, head_dim=4))


block_sizes = st.integers(1, 64).map(lambda b: 8 * b)


@given(st.sampled_from(cache.CACHE_MODES), st.integers(0, 10_000), st.integers(0, 10_000), block_sizes,
       st.integers(0, 4))
def test_slots_needed_formula_and_monotone(mode, a, b, bs, spec):
    """slots_needed: none -> 1 + num_spec; all/align -> 1 + num_spec + max_len // block_size; monotone
    (non-decreasing) in max_len and in num_spec; never below 1."""
    lo, hi = sorted((a, b))
    want = 1 + spec + (0 if mode == "none" else hi // bs)
    assert slots_needed(mode, hi, bs, spec) == want
    assert 1 <= slots_needed(mode, lo, bs, spec) <= slots_needed(mode, hi, bs, spec)
    assert slots_needed(mode, hi, bs, spec) <= slots_needed(mode, hi, bs, spec + 1)


def test_slots_needed_examples():
    """Hand-computed slot counts."""
    assert slots_needed("none", 1000, 16) == 1
    assert slots_needed("none", 1000, 16, num_spec=3) == 4
    assert slots_needed("all", 1000, 16) == 1 + 62
    assert slots_needed("align", 1000, 16, num_spec=2) == 3 + 62
    assert slots_needed("all", 15, 16) == 1
    assert slots_needed("all", 16, 16) == 2
    assert slots_needed("all", 0, 8) == 1


@given(st.sampled_from(cache.CACHE_MODES), st.integers(0, 500), st.integers(0, 300), block_sizes)
def test_snapshot_positions(mode, start, n, bs):
    """snapshot_positions: all -> exactly the block multiples in (start, start+n]; align -> [end] iff end is a
    block multiple (and n > 0); none -> []. Positions are increasing and inside the step."""
    end = start + n
    pos = snapshot_positions(mode, start, n, bs)
    assert pos == sorted(set(pos))
    assert all(start < p <= end and p % bs == 0 for p in pos)
    if mode == "all":
        assert pos == [p for p in range(start + 1, end + 1) if p % bs == 0]
    elif mode == "align":
        assert pos == ([end] if n > 0 and end % bs == 0 else [])
    else:
        assert pos == []
    # the all-mode snapshots over a whole sequence never need more slots than slots_needed grants
    if mode != "none":
        assert len(snapshot_positions("all", 0, end, bs)) + 1 <= slots_needed(mode, end, bs)


def test_snapshot_positions_example():
    """Hand-computed: a step over tokens [5, 45) with block 16 crosses boundaries 16 and 32."""
    assert snapshot_positions("all", 5, 40, 16) == [16, 32]
    assert snapshot_positions("align", 5, 40, 16) == []
    assert snapshot_positions("align", 5, 43, 16) == [48]
    assert snapshot_positions("all", 16, 16, 16) == [32]
    assert snapshot_positions("none", 0, 64, 16) == []


BAD = [
    (lambda: Mamba2Spec(num_heads=6, head_dim=4, state_size=8, tp_size=4),
     r"^num_heads: expected a multiple of tp_size=4, got 6$"),
    (lambda: Mamba2Spec(num_heads=8, head_dim=4, state_size=8, n_groups=2, tp_size=4), r"^n_groups: "),
    (lambda: Mamba2Spec(num_heads=8, head_dim=4, state_size=8, n_groups=3), r"^n_groups: .*divisor of num_heads"),
    (lambda: Mamba2Spec(num_heads=0, head_dim=4, state_size=8), r"^num_heads: "),
    (lambda: Mamba2Spec(num_heads=4, head_dim=4, state_size=8, bc_in_conv=1), r"^bc_in_conv: "),
    (lambda: Mamba1Spec(intermediate_size=30, state_size=16, tp_size=4), r"^intermediate_size: .*tp_size=4"),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=0), r"^state_size: "),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=4, conv_kernel=1), r"^conv_kernel: "),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=4, conv_kernel=9), r"^conv_kernel: "),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=4, tp_size=0), r"^tp_size: "),
    (lambda: Mamba1Spec(intermediate_size=32.0, state_size=4), r"^intermediate_size: "),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=4, conv_dtype=torch.int8), r"^conv_dtype: "),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=4, recurrent_dtype="float32"), r"^recurrent_dtype: "),
    (lambda: GDNSpec(num_k_heads=2, num_v_heads=6, head_k_dim=8, head_v_dim=8, tp_size=4), r"^num_k_heads: "),
    (lambda: GDNSpec(num_k_heads=4, num_v_heads=6, head_k_dim=8, head_v_dim=8), r"^num_v_heads: "),
    (lambda: KDASpec(num_heads=6, head_dim=8, tp_size=4), r"^num_heads: .*tp_size=4"),
    (lambda: KDASpec(num_heads=4, head_dim=8, recurrent_dtype=torch.bfloat16), r"^recurrent_dtype: .*float32"),
    (lambda: slots_needed("some", 10, 16), r"^mode: "),
    (lambda: slots_needed("all", 10, 12), r"^block_size: .*multiple of 8"),
    (lambda: slots_needed("all", 10, 0), r"^block_size: "),
    (lambda: slots_needed("all", -1, 16), r"^max_len: "),
    (lambda: slots_needed("all", 10, 16, num_spec=-1), r"^num_spec: "),
    (lambda: snapshot_positions("all", 0, 10, 4), r"^block_size: "),
    (lambda: cache.make_spec("mamba3"), r"^kind: "),
    (lambda: Mamba1Spec(intermediate_size=32, state_size=4).padded_page_size(0), r"^multiple: "),
]


@pytest.mark.parametrize("make,pattern", BAD, ids=[p.split(":")[0].strip("^") + str(i) for i, (_, p) in enumerate(BAD)])
def test_invalid_configurations_rejected(make, pattern):
    """Every invalid configuration is a ValueError whose message starts with the offending field's name."""
    with pytest.raises(ValueError, match=pattern):
        make()


@given(st.sampled_from([4, 8]), st.integers(1, 40))
def test_mamba2_tp_rejection_names_field(tp, heads):
    """Mamba-2 accepts num_heads iff tp_size divides it; otherwise the error names num_heads and tp_size."""
    if heads % tp == 0:
        assert Mamba2Spec(num_heads=heads, head_dim=2, state_size=4, tp_size=tp).recurrent_shape[0] == heads // tp
    else:
        with pytest.raises(ValueError, match=rf"^num_heads: expected a multiple of tp_size={tp}, got {heads}$"):
            Mamba2Spec(num_heads=heads, head_dim=2, state_size=4, tp_size=tp)


def test_specs_are_frozen_and_hashable():
    """Specs are frozen dataclasses (assignment raises) usable as dict keys."""
    s = KDASpec(num_heads=2, head_dim=4)
    with pytest.raises(Exception):
        s.num_heads = 4  # type: ignore[misc]
    assert {s: 1}[KDASpec(num_heads=2, head_dim=4)] == 1
    assert math.prod(s.recurrent_shape) == s.recurrent_numel
