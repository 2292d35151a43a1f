"""The SGLang adapter (harness/impls/adapters/sglang.py) on its own: what the op suites cannot show.

* On the CPU, where the `sglang` Impl does not run (its Triton entry points are CUDA-only): every op
  validates before anything else (bad input is a ValueError naming the argument, and nothing is written),
  and a valid call declines with a NotImplementedError naming sglang.
* On CUDA: the regression examples of the SGLang bugs in docs/findings.md (xfail(strict=True): they
  document the bug, and turn into failures once it is fixed), and the batches the adapter must keep from
  the kernels: empty sequences next to non-empty ones in the chunked GDN / KDA prefill (SGLang's chunk
  tables misnumber the sequences after one), prefills of empty sequences only, decode batches of no rows
  or pads only, speculative steps without a live row.

Skipped where sglang is not importable (CI): `python scripts/peers_fetch.py sglang` and
`PYTHONPATH=$PWD/.peers/src`.
"""
import pytest
import torch

from harness.ops import SPECS
from harness.impls.adapters import sglang as adapter
from harness.testing.delta_cases import (CHUNK_OWNER_CASES, EMPTY_SEQUENCE_CASES, case_id, run_empty_update,
                                         run_varlen_case)

_MISSING = adapter.unavailable_reason("sglang", *adapter.MODULES)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

OPS = {"causal_conv1d_varlen": adapter.causal_conv1d_varlen, "causal_conv1d_update": adapter.causal_conv1d_update,
       "causal_conv1d_update_spec": adapter.causal_conv1d_update_spec,
       "selective_state_update": adapter.selective_state_update,
       "selective_state_update_spec": adapter.selective_state_update_spec, "ssd_varlen": adapter.ssd_varlen,
       "gated_rms_norm": adapter.gated_rms_norm, "gated_delta_rule_varlen": adapter.gated_delta_rule_varlen,
       "gated_delta_rule_update": adapter.gated_delta_rule_update,
       "gated_delta_rule_update_spec": adapter.gated_delta_rule_update_spec, "kda_varlen": adapter.kda_varlen,
       "kda_update": adapter.kda_update}
OUT_LIKE = {"gated_delta_rule_update_spec": "v"}  # the input a speculative op's output is shaped like (else x)


def _case(op, device="cpu", dtype=torch.float32, **shape):
    sp = SPECS[op]
    base = dict(sp.shapes["contract"][0])
    base.update(shape)
    kw = sp.inputs(base, dtype, device, torch.Generator().manual_seed(0))
    return sp, kw


def _call(op, sp, kw):
    return OPS[op](*[kw[a] for a in sp.args], **{k: kw[k] for k in sp.options if k in kw})


@pytest.mark.parametrize("op", sorted(OPS))
def test_cpu_bad_input_is_rejected_before_anything_is_written(op):
    """A slot id past the pool (or, without one, a weight of the wrong length) is a ValueError naming the
    argument, and the pool is unchanged: validation comes before the CUDA-only decline."""
    sp, kw = _case(op)
    if sp.index:
        n = kw[sp.pool].shape[0]
        kw[sp.index] = torch.full_like(kw[sp.index], n)
        arg = sp.index
    else:
        kw["weight"] = kw["weight"][:-1]
        arg = "weight"
    before = kw[sp.pool].clone() if sp.pool else None
    with pytest.raises(ValueError, match=rf"^{arg}"):
        _call(op, sp, kw)
    if sp.pool:
        assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op", sorted(OPS))
def test_cpu_valid_call_declines_naming_sglang(op):
    """A valid call on CPU tensors declines (NotImplementedError naming sglang) and writes nothing."""
    sp, kw = _case(op)
    before = kw[sp.pool].clone() if sp.pool else None
    with pytest.raises(NotImplementedError, match=r"^sglang .*CUDA only"):
        _call(op, sp, kw)
    if sp.pool:
        assert torch.equal(kw[sp.pool], before)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the sglang Triton kernels run on CUDA only)")
    return "cuda"


def test_conv_width_above_five_declines():
    """The Triton causal conv keeps its window in named registers for widths 2..5: wider ones decline."""
    sp, kw = _case("causal_conv1d_update", K=6)
    with pytest.raises(NotImplementedError, match="kernel widths 2..5"):
        adapter._conv_width(kw["weight"])


@pytest.mark.xfail(strict=True, reason="sglang 0.5.23 causal_conv1d_triton: width 5 is accepted but the tap loop "
                   "covers widths 2-4 only (every tap uses the first window column); see docs/findings.md")
@pytest.mark.parametrize("op", ["causal_conv1d_varlen", "causal_conv1d_update", "causal_conv1d_update_spec"])
def test_conv_width_five_matches_reference(op):
    """Kernel width 5 (the contract admits 2..8) gives the reference's outputs and windows (the speculative
    form: also the windows the verify kernel records after each token)."""
    device = _cuda()
    sp, kw = _case(op, device=device, K=5)
    ref_kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    y = _call(op, sp, kw)
    y_ref = sp.reference(torch.float64, *[ref_kw[a] for a in sp.args],
                         **{k: ref_kw[k] for k in sp.options if k in ref_kw})
    torch.testing.assert_close(y.double(), y_ref.double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kw[sp.pool].double(), ref_kw[sp.pool].double(), rtol=1e-4, atol=1e-4)


# ---- empty sequences and empty batches ----------------------------------------------------------------------

@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="sglang 0.5.23 fla/index.py prepare_chunk_indices numbers the sequences by their "
                   "chunks: after an empty sequence (no chunk) every chunk gets the previous sequence; "
                   "see docs/findings.md")
@pytest.mark.parametrize("cu,want", CHUNK_OWNER_CASES)
def test_sglang_chunk_indices_skip_empty_sequences(cu, want):
    """The (sequence, chunk) table of the chunked GDN / KDA kernels names, for each chunk, the sequence that
    owns it (an empty sequence owns none). Pure torch: runs on the CPU."""
    from sglang.kernels.ops.attention.fla.index import prepare_chunk_indices
    got = prepare_chunk_indices(torch.tensor(cu, dtype=torch.int64), 64).tolist()
    assert got == want


GDN_HEADS = [(1, 2), (2, 4)]  # (Hk, Hv)


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("heads", GDN_HEADS, ids=lambda h: f"Hk{h[0]}_Hv{h[1]}")
@pytest.mark.parametrize("case", EMPTY_SEQUENCE_CASES, ids=case_id)
def test_gdn_varlen_with_empty_sequences(check, case, heads, layout):
    """Empty sequences (live or pads) next to non-empty ones, bf16: the adapter runs the live non-empty
    sequences only and gives an empty live one the contract's result (its slot keeps its initial state,
    zeros without one); outputs and states match the reference."""
    device = _cuda()
    Hk, Hv = heads
    run_varlen_case(check, adapter.gated_delta_rule_varlen, "sglang", "gated_delta_rule_varlen", "gdn", case,
                    Hk=Hk, Hv=Hv, K=128, V=5, dtype=torch.bfloat16, device=device, layout=layout)


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("case", EMPTY_SEQUENCE_CASES, ids=case_id)
def test_kda_varlen_with_empty_sequences(check, case, H, layout):
    """The same batches through KDA's chunked prefill."""
    device = _cuda()
    run_varlen_case(check, adapter.kda_varlen, "sglang", "kda_varlen", "kda", case, Hk=H, Hv=H, K=128, V=5,
                    dtype=torch.bfloat16, device=device, layout=layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("slots", [[], [-1, -1]], ids=["B0", "pads_only"])
@pytest.mark.parametrize("kind,op", [("gdn", "gated_delta_rule_update"), ("kda", "kda_update")])
def test_delta_update_with_no_live_row(kind, op, slots, dtype):
    """A decode batch of no rows (or pads only) returns its (empty or zero) output and touches no slot."""
    device = _cuda()
    run_empty_update(OPS[op], op, kind, B=len(slots), slots=slots, Hk=1, K=3, V=5, dtype=dtype, device=device)


@pytest.mark.parametrize("op", ["causal_conv1d_update", "selective_state_update"])
def test_mamba_update_with_empty_batch(op):
    """An empty decode batch of the conv and the Mamba state update returns an empty output, pool unchanged."""
    device = _cuda()
    sp, kw = _case(op, device=device, B=0)
    before = kw[sp.pool].clone()
    y = _call(op, sp, kw)
    assert y.shape[0] == 0
    assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op", ["causal_conv1d_update_spec", "selective_state_update_spec",
                                "gated_delta_rule_update_spec"])
@pytest.mark.parametrize("lens,accepted", [([0, 0], [1, 3]), ([2, 3], [2, 1])], ids=["no_tokens", "padding_rows"])
def test_spec_batch_without_live_row(op, lens, accepted):
    """A speculative step whose rows are all empty or padding (start slot = pad id) reaches no kernel: zero
    output, every slot unchanged."""
    device = _cuda()
    sp, kw = _case(op, device=device, lens=lens, accepted=accepted)
    for b, n in enumerate(lens):
        if n:
            kw[sp.index][b, accepted[b] - 1] = -1
    before = kw[sp.pool].clone()
    y = _call(op, sp, kw)
    assert y.shape == kw[OUT_LIKE.get(op, "x")].shape and not bool(y.any())
    assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op", ["causal_conv1d_varlen", "ssd_varlen", "gated_delta_rule_varlen", "kda_varlen"])
def test_prefill_of_empty_sequences_only(op):
    """A prefill batch of empty sequences only (T = 0): empty output; a live request with an initial state
    keeps it, one without gets zeros, a pad's slot and unnamed slots are unchanged."""
    device = _cuda()
    sp, kw = _case(op, device=device, dtype=torch.bfloat16, T=0, S=3, fresh=1)
    pool = kw[sp.pool]
    kw["cache_indices"] = torch.tensor([1, -1, 3], dtype=torch.int32, device=device)
    kw["has_initial_state"] = torch.tensor([True, True, False], device=device)
    before = pool.clone()
    y = _call(op, sp, kw)
    assert y.shape[0] == 0
    want = before.clone()
    want[3] = 0
    assert torch.equal(pool, want)


def test_conv_prefill_zeroes_the_slot_of_an_empty_request():
    """A conv prefill with an empty request among others (docs/findings.md: SGLang's kernel leaves that
    request's slot as it was): the adapter gives the slot zeros where the request has no initial state, keeps
    it where it has one, and the request of one token gets its window; unnamed slots are unchanged."""
    device = _cuda()
    D, K = 8, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, D, generator=g).to(device)
    weight = torch.randn(D, K, generator=g).to(device)
    pool = torch.full((4, D, K - 1), float("nan"), device=device)
    pool[2] = 5.0
    qsl = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=device)
    slots = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    has = torch.tensor([False, True, False], device=device)
    before = pool.clone()
    adapter.causal_conv1d_varlen(x, weight, None, pool, qsl, slots, has)
    assert torch.equal(pool[0], torch.zeros_like(pool[0])), "the empty fresh request's slot is not zeros"
    assert torch.equal(pool[2], before[2]), "the empty request's initial state changed"
    want = torch.zeros(D, K - 1, device=device)
    want[:, -1] = x[0]
    assert torch.equal(pool[1], want), "the one-token request's window"
    assert bool(pool[3].isnan().all()), "an unnamed slot was written"
