"""The vLLM adapter (harness/impls/adapters/vllm.py) on batches the op suites reach only by chance: what it
must keep from vLLM's kernels, which never see such batches in vLLM itself.

* Chunked GDN / KDA prefill with empty sequences next to non-empty ones (CUDA, bf16): the kernels' chunk
  table (`prepare_chunk_indices`, vLLM's copy of fla) gives every chunk after an empty sequence the wrong
  sequence, so the adapter runs the live non-empty sequences only. The table itself is checked on the CPU
  (xfail, strict: the finding in docs/findings.md).
* Speculative decode (`causal_conv1d_update_spec`, `selective_state_update_spec`,
  `gated_delta_rule_update_spec`, `kda_update_spec`): bad input and declined cases fail before any kernel or
  slot write (for GDN / KDA: a live row that starts from or writes slot 0, the recurrent kernels' null
  block, and a pad id > 0), a slot 0 that the kernels would not read or write is not declined, steps
  without a live row run no kernel (CPU); and vLLM's own conv layout for speculative steps -- one slot per
  request, K - 1 + num_spec columns wide, slid over from step to step -- holds the same windows and gives
  the same outputs as the adapter on our per-position slots over two steps (CUDA).
* Decode batches with no live row (no rows at all, or pads only) and prefills of empty sequences only: no
  kernel runs (an empty batch fails fused_recurrent_kda_fwd's stride asserts); the output is empty or zero
  and no slot changes, except that an empty live request without an initial state gets zeros. These reach
  no kernel, so they run on the CPU too.

Skipped where vllm is not importable (CI): `python scripts/peers_fetch.py vllm` and
`PYTHONPATH=$PWD/.peers/src`.
"""
import types

import pytest
import torch

from harness.impls.adapters import import_peer, unavailable_reason
from harness.impls.adapters import vllm as adapter
from harness.ops import SPECS
from harness.testing.delta_cases import (CHUNK_OWNER_CASES, EMPTY_SEQUENCE_CASES, case_id, run_empty_update,
                                         run_varlen_case)

_MISSING = unavailable_reason("vllm (or its extracted kernels: python scripts/peers_fetch.py vllm)",
                              *adapter._MODULES)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


def _cuda(device):
    if not device.startswith("cuda"):
        pytest.skip("needs a CUDA device (vLLM's fla-derived GDN / KDA kernels do not run in Triton's interpreter)")
    return device


def _case(op, device, dtype=torch.float32, **shape):
    sp = SPECS[op]
    base = dict(sp.shapes["contract"][0])
    base.update(shape)
    return sp, sp.inputs(base, dtype, device, torch.Generator().manual_seed(0))


def _call(sp, kw):
    return adapter.OPS[sp.name](*[kw[a] for a in sp.args], **{k: kw[k] for k in sp.options if k in kw})


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="vllm 0.33.0 third_party/flash_linear_attention prepare_chunk_indices "
                   "numbers the sequences by their chunks: after an empty sequence (no chunk) every chunk gets the "
                   "previous sequence; see docs/findings.md")
@pytest.mark.parametrize("cu,want", CHUNK_OWNER_CASES)
def test_vllm_chunk_indices_skip_empty_sequences(cu, want):
    """The (sequence, chunk) table of the chunked GDN / KDA kernels names, for each chunk, the sequence that
    owns it (an empty sequence owns none). Pure torch: runs on the CPU."""
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices
    got = prepare_chunk_indices(torch.tensor(cu, dtype=torch.int64), 64).tolist()
    assert got == want


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("heads", [(1, 2), (2, 4)], ids=lambda h: f"Hk{h[0]}_Hv{h[1]}")
@pytest.mark.parametrize("case", EMPTY_SEQUENCE_CASES, ids=case_id)
def test_gdn_varlen_with_empty_sequences(check, device, case, heads, layout):
    """Empty sequences (live or pads) next to non-empty ones, bf16: outputs and states match the reference;
    an empty live request keeps its initial state (zeros without one)."""
    Hk, Hv = heads
    run_varlen_case(check, adapter.gated_delta_rule_varlen, "vllm", "gated_delta_rule_varlen", "gdn", case,
                    Hk=Hk, Hv=Hv, K=128, V=5, dtype=torch.bfloat16, device=_cuda(device), layout=layout)


@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("H", [1, 2])
@pytest.mark.parametrize("case", EMPTY_SEQUENCE_CASES, ids=case_id)
def test_kda_varlen_with_empty_sequences(check, device, case, H, layout):
    """The same batches through KDA's chunked prefill."""
    run_varlen_case(check, adapter.kda_varlen, "vllm", "kda_varlen", "kda", case, Hk=H, Hv=H, K=128, V=5,
                    dtype=torch.bfloat16, device=_cuda(device), layout=layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("slots,num_slots", [([], 0), ([], 2), ([-1, -1], 2)], ids=["B0", "B0_pool2", "pads_only"])
@pytest.mark.parametrize("kind,op", [("gdn", "gated_delta_rule_update"), ("kda", "kda_update")])
def test_delta_update_with_no_live_row(device, kind, op, slots, num_slots, dtype):
    """A decode batch of no rows (the shrunk case: Hk = 1, K = 3, V = 5, fp32 pool, no l2norm, default scale)
    or of pads only returns its (empty or zero) output and touches no slot."""
    run_empty_update(adapter.OPS[op], op, kind, B=len(slots), slots=slots, Hk=1, K=3, V=5, dtype=dtype,
                     device=device, num_slots=num_slots)


@pytest.mark.parametrize("op", ["causal_conv1d_update", "selective_state_update"])
def test_mamba_update_with_empty_batch(device, op):
    """An empty decode batch of the conv and the Mamba state update returns an empty output, pool unchanged."""
    sp, kw = _case(op, device, B=0)
    before = kw[sp.pool].clone()
    y = _call(sp, kw)
    assert y.shape[0] == 0
    assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op", ["causal_conv1d_varlen", "ssd_varlen", "gated_delta_rule_varlen", "kda_varlen"])
def test_prefill_of_empty_sequences_only(device, op):
    """A prefill batch of empty sequences only (T = 0): empty output; a live request with an initial state
    keeps it, one without gets zeros, a pad's slot and unnamed slots are unchanged."""
    sp, kw = _case(op, device, dtype=torch.bfloat16, T=0, S=3, fresh=1)
    pool = kw[sp.pool]
    kw["cache_indices"] = torch.tensor([1, -1, 3], dtype=torch.int32, device=device)
    kw["has_initial_state"] = torch.tensor([True, True, False], device=device)
    before = pool.clone()
    y = _call(sp, kw)
    assert y.shape[0] == 0
    want = before.clone()
    want[3] = 0
    assert torch.equal(pool, want)


# ---- speculative decode --------------------------------------------------------------------------------------

SPEC_OPS = ("causal_conv1d_update_spec", "selective_state_update_spec", "gated_delta_rule_update_spec",
            "kda_update_spec")
DELTA_SPEC_OPS = ("gated_delta_rule_update_spec", "kda_update_spec")
OUT_LIKE = {"gated_delta_rule_update_spec": "v", "kda_update_spec": "v"}  # the input the output is shaped like


def _spec_kernels(device):
    """vLLM's decode kernels run on CUDA; Triton's interpreter rejects their masks (INTERPRETER_LIMITS)."""
    if not device.startswith("cuda"):
        pytest.skip("needs a CUDA device (under Triton's interpreter: "
                    + adapter.INTERPRETER_LIMITS["causal_conv1d_update_spec"] + ")")
    return device


def _spec_mutations():
    m = []
    for op in SPEC_OPS:
        sp = SPECS[op]
        m.append((op, "slot id past the pool", sp.index,
                  lambda k, sp=sp: k[sp.index].__setitem__((0, 0), k[sp.pool].shape[0])))
        m += [(op, what, arg, mutate) for what, arg, mutate in sp.bad_inputs]
    return m


@pytest.mark.parametrize("op,what,arg,mutate", _spec_mutations(), ids=[f"{o}-{w}" for o, w, _, _ in _spec_mutations()])
def test_spec_bad_input_is_rejected_before_anything_is_written(op, what, arg, mutate):
    """The speculative ops validate with the contract first: bad input is a ValueError naming the argument
    and nothing is written. Reaches no kernel: runs on the CPU."""
    sp, kw = _case(op, "cpu")
    mutate(kw)
    before = kw[sp.pool].clone()
    with pytest.raises(ValueError) as ei:
        _call(sp, kw)
    assert arg in str(ei.value), f"{op} ({what}): expected the error to name {arg!r}, got: {ei.value}"
    assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op,shape,options,reason", [
    ("selective_state_update_spec", dict(layout="mamba2"), dict(dt_limit=(1e-3, 0.5)), "no dt_limit clamp"),
    ("selective_state_update_spec", dict(layout="mamba1", Dm=4, G=2), {}, "one group of B/C only"),
    ("causal_conv1d_update_spec", dict(K=7), {}, "kernel widths 2..6 only"),
], ids=["dt_limit", "mamba1_groups", "width7"])
def test_spec_declines_name_the_limit(op, shape, options, reason):
    """Cases vLLM's kernels cannot do decline (NotImplementedError naming vllm and the limit) before any
    kernel runs or any slot is written. Runs on the CPU."""
    sp, kw = _case(op, "cpu", **shape, optional=True)
    kw.update(options)
    before = kw[sp.pool].clone()
    with pytest.raises(NotImplementedError, match=rf"^vllm .*{reason}"):
        _call(sp, kw)
    assert torch.equal(kw[sp.pool], before)


@pytest.mark.parametrize("op", DELTA_SPEC_OPS)
@pytest.mark.parametrize("what,row,col,options", [
    ("start slot 0", 0, 0, {}),  # row 0 accepts 1 token: it starts from table[0, 0]
    ("a token's slot 0", 1, 2, {}),  # row 1 has 3 tokens: position 2 is written
    ("pad id > 0", None, None, dict(pad_slot_id=99)),
], ids=["start_slot0", "written_slot0", "positive_pad"])
def test_spec_delta_null_block_declines(monkeypatch, op, what, row, col, options):
    """The recurrent kernels skip every slot index <= 0 (vLLM's null block): a live row that starts from slot 0
    or writes a position into slot 0, and a pad id > 0, decline (NotImplementedError naming vllm and the null
    block) before any kernel runs or any slot is written. Runs on the CPU."""
    def unreachable(name):
        raise AssertionError(f"the peer ({name}) was reached")
    monkeypatch.setattr(adapter, "import_peer", unreachable)
    sp, kw = _case(op, "cpu", accepted=[1, 2])
    if row is not None:
        kw[sp.index][row, col] = 0
    kw.update(options)
    before = kw[sp.pool].clone()
    with pytest.raises(NotImplementedError, match=r"^vllm .*null block"):
        _call(sp, kw)
    assert torch.equal(kw[sp.pool], before)


class _Reached(Exception):
    pass


@pytest.mark.parametrize("op", DELTA_SPEC_OPS)
@pytest.mark.parametrize("lens,accepted,padding_row", [([3, 1], [1, 2], False), ([3, 2], [1, 3], True)],
                         ids=["past_the_row", "padding_row"])
def test_spec_delta_slot0_the_kernel_never_touches_is_not_declined(monkeypatch, op, lens, accepted, padding_row):
    """Slot 0 at a position past the row's tokens (row 1, position 2 of 1 token), or in a padding row (row 1
    with its start slot the pad id), is neither read nor written by the step: the call reaches the kernel (a
    stand-in here). Runs on the CPU."""
    def reached(*a, **kw):
        raise _Reached
    ns = types.SimpleNamespace(fused_recurrent_gated_delta_rule=reached, fused_recurrent_kda_fwd=reached)
    monkeypatch.setattr(adapter, "import_peer", lambda name: ns)
    sp, kw = _case(op, "cpu", lens=lens, accepted=accepted)
    if padding_row:
        kw[sp.index][1, accepted[1] - 1] = -1
        kw[sp.index][1, 0] = 0
    else:
        kw[sp.index][1, 2] = 0
    with pytest.raises(_Reached):
        _call(sp, kw)


@pytest.mark.parametrize("op", SPEC_OPS)
@pytest.mark.parametrize("lens,accepted", [([0, 0], [1, 3]), ([2, 3], [2, 1]), ([0, 3], [1, 2])],
                         ids=["no_tokens", "padding_rows", "empty_and_padding"])
def test_spec_batch_without_live_row_runs_no_kernel(op, lens, accepted):
    """A step whose rows are all empty or padding (start slot = pad id) reaches no kernel: zero output, every
    slot unchanged. Runs on the CPU."""
    sp, kw = _case(op, "cpu", lens=lens, accepted=accepted, optional=True)
    for b, n in enumerate(lens):
        if n:
            kw[sp.index][b, accepted[b] - 1] = -1
    before = kw[sp.pool].clone()
    y = _call(sp, kw)
    assert y.shape == kw[OUT_LIKE.get(op, "x")].shape and not bool(y.any())
    assert torch.equal(kw[sp.pool], before)


def test_vllm_native_conv_slot_over_two_steps(device):
    """vLLM's own layout for two speculative steps in a row: one conv slot per request, K - 1 + num_spec
    columns wide (block ids from 1, vLLM's null block 0 by default), the first step from the window at
    columns 0.. with rows shorter than num_spec + 1 (the slot's later columns then keep older inputs), the
    second from each row's accepted position. Both steps' outputs equal the adapter's on per-position slots,
    and after each step the window at columns j.. of a row's slot equals the slot of its position j."""
    device = _spec_kernels(device)
    conv = import_peer(adapter._CONV)
    g = torch.Generator().manual_seed(5)
    Bsz, D, K, num_spec = 4, 40, 4, 3
    S = num_spec + 1

    def rn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device)

    wide = rn(Bsz + 1, D, K - 1 + num_spec)
    table = torch.arange(1, Bsz * S + 1, device=device, dtype=torch.int32).reshape(Bsz, S)
    ours = rn(Bsz * S + 1, D, K - 1)
    ours[table[:, 0].long()] = wide[1:, :, :K - 1]
    lines = torch.arange(1, Bsz + 1, device=device, dtype=torch.int32)
    w, bias = rn(D, K, scale=0.5), rn(D, scale=0.1)
    for lens, acc in (([4, 2, 3, 1], [1, 1, 1, 1]), ([4, 4, 1, 3], [3, 1, 2, 1])):
        qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)
        acc_t = torch.tensor(acc, device=device, dtype=torch.int32)
        x = rn(sum(lens), D)
        y_vllm = torch.empty_like(x)
        conv.causal_conv1d_update(x, wide, w, bias, "silu", conv_state_indices=lines, num_accepted_tokens=acc_t,
                                  query_start_loc=qsl, max_query_len=S, out=y_vllm)
        y = adapter.causal_conv1d_update_spec(x, ours, w, bias, qsl, table, acc_t, activation="silu")
        torch.testing.assert_close(y, y_vllm, rtol=1e-6, atol=1e-6)
        for b, n in enumerate(lens):
            for j in range(n):
                torch.testing.assert_close(ours[int(table[b, j])], wide[b + 1, :, j:j + K - 1], rtol=0, atol=0)
