"""The peers' own kernels as benchmark backends (`<peer>.native`), timed in the same run as ours.

The adapters in harness.impls.adapters put a peer behind the op contract (validation, host-side slot
lists, per-sequence calls, layout copies), which is right for the suites but is not what the peer's
kernel costs. These backends call the kernel itself on inputs laid out the way it wants them, the
layout work done once outside the timed call, as the peers' own benchmarks do:

  selective_scan_varlen  mamba_ssm_cuda.native  mamba_ssm selective_scan_fn (its CUDA kernel), (1, D, L) layout
  causal_conv1d_varlen   causal_conv1d.native   causal_conv1d_fn (CUDA), channel-last (1, D, L)
  causal_conv1d_update   causal_conv1d.native   causal_conv1d_update (CUDA) on a dense state batch
  selective_state_update mamba_ssm.native       mamba_ssm's Triton selective_state_update (stride-0 views for Mamba-2)
  ssd_varlen             mamba_ssm.native       mamba_ssm's Triton mamba_chunk_scan_combined, batch 1
  gated_rms_norm         mamba_ssm.native       mamba_ssm's Triton rmsnorm_fn
  add_rms_norm           mamba_ssm.native       mamba_ssm's Triton rms_norm_fn with residual=, prenorm=True (the sum
                                                returned as a new tensor, not written over the residual)
  gated_delta_rule_varlen fla.native            fla chunk_gated_delta_rule, (1, T, H, D), cu_seqlens, dense fp32 h0
  kda_varlen             fla.native             fla chunk_kda, likewise
  gated_delta_rule_update fla.native            fla fused_recurrent_gated_delta_rule, one token of each of B rows
                                                as a batch, dense fp32 initial states (B, Hv, V, K) in and out
  kda_update             fla.native             fla fused_recurrent_kda, likewise

They take one sequence (S = 1, the benchmark shapes of docs/targets.md) and no initial state, like the
peers' kernels; the state pools are not written (fla's take and return dense per-sequence states, which is
how fla is called: the pool gather/scatter an engine adds around it is not timed). CUDA only; a peer that is not importable is listed as
skipped with the reason (`harness bench peers` shows them next to ours, eager and CUDA graph).
"""
from __future__ import annotations

from harness.bench.registry import register_benchmark


def _peer(module: str, attr: str | None = None):
    from harness.impls.adapters import import_peer
    m = import_peer(module)
    return getattr(m, attr) if attr else m


def _needs(*modules: str):
    """An `available` check: None when every module imports (and mamba_ssm's CUDA scan is the real one)."""
    def check():
        from harness.impls.adapters import unavailable_reason
        why = unavailable_reason(modules[0].split(".")[0], *modules)
        if why is None and "selective_scan_cuda" in modules:
            if getattr(_peer("selective_scan_cuda"), "__harness_placeholder__", False):
                why = "selective_scan_cuda is a placeholder (mamba_ssm's CUDA extension is not built)"
        return why
    return check


def _one_sequence(inp: dict, what: str) -> None:
    if "query_start_loc" in inp and int(inp["query_start_loc"].numel()) != 2:
        raise ValueError(f"{what}: expected one sequence (S=1, as the peer's kernel takes it), "
                         f"got {int(inp['query_start_loc'].numel()) - 1}")


NATIVE = dict(devices=("cuda",), peer=True)


@register_benchmark(op="selective_scan_varlen", impl="mamba_ssm_cuda.native",
                    available=_needs("mamba_ssm.ops.selective_scan_interface", "selective_scan_cuda"), **NATIVE)
def mamba_ssm_cuda_scan(inp):
    _one_sequence(inp, "mamba_ssm_cuda.native")
    fn = _peer("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn")
    u, d, z = (t.t().contiguous().unsqueeze(0) for t in (inp["u"], inp["delta"], inp["z"]))
    B, C = (t[:, 0].t().contiguous().unsqueeze(0) for t in (inp["B"], inp["C"]))
    A, D, db = inp["A"], inp["D"], inp["delta_bias"]
    softplus = bool(inp.get("delta_softplus", True))
    return lambda: fn(u, d, A, B, C, D, z, db, softplus, True)


@register_benchmark(op="causal_conv1d_varlen", impl="causal_conv1d.native",
                    available=_needs("causal_conv1d", "causal_conv1d_cuda"), **NATIVE)
def causal_conv1d_fn_native(inp):
    _one_sequence(inp, "causal_conv1d.native")
    fn = _peer("causal_conv1d", "causal_conv1d_fn")
    x = inp["x"].t().contiguous().unsqueeze(0)
    w, b, act = inp["weight"], inp["bias"], inp.get("activation")
    return lambda: fn(x, w, b, activation=act)


@register_benchmark(op="causal_conv1d_update", impl="causal_conv1d.native",
                    available=_needs("causal_conv1d", "causal_conv1d_cuda"), **NATIVE)
def causal_conv1d_update_native(inp):
    fn = _peer("causal_conv1d", "causal_conv1d_update")
    x, w, b, act = inp["x"], inp["weight"], inp["bias"], inp.get("activation")
    st = inp["conv_states"][inp["conv_state_indices"].long()].clone()
    return lambda: fn(x, st, w, b, act)


@register_benchmark(op="selective_state_update", impl="mamba_ssm.native",
                    available=_needs("mamba_ssm.ops.triton.selective_state_update"), **NATIVE)
def mamba_ssm_state_update(inp):
    fn = _peer("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")
    st, x, dt, A, B, C, D, z, db = (inp[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    idx, sp = inp["state_batch_indices"], bool(inp.get("dt_softplus", True))
    if st.dim() == 4:  # Mamba-2 layout: per-head scalars broadcast over P (and N) with stride-0 views
        H, P, N = st.shape[1:]
        A3, dt3 = A[:, None, None].expand(H, P, N), dt[:, :, None].expand(dt.shape[0], H, P)
        D3, db3 = D[:, None].expand(H, P), db[:, None].expand(H, P)
        return lambda: fn(st, x, dt3, A3, B, C, D3, z, db3, dt_softplus=sp, state_batch_indices=idx)
    B1, C1 = B[:, 0], C[:, 0]
    return lambda: fn(st, x, dt, A, B1, C1, D, z, db, dt_softplus=sp, state_batch_indices=idx)


@register_benchmark(op="ssd_varlen", impl="mamba_ssm.native",
                    available=_needs("mamba_ssm.ops.triton.ssd_combined"), **NATIVE)
def mamba_ssm_ssd(inp):
    _one_sequence(inp, "mamba_ssm.native")
    fn = _peer("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    x, dt, B, C, z = (inp[k][None] for k in ("x", "dt", "B", "C", "z"))
    A, D, db, cs = inp["A"], inp["D"], inp["dt_bias"], inp["chunk_size"]
    sp = bool(inp.get("dt_softplus", True))
    return lambda: fn(x, dt, A, B, C, cs, D=D, z=z, dt_bias=db, dt_softplus=sp, return_final_states=True)


@register_benchmark(op="gated_rms_norm", impl="mamba_ssm.native",
                    available=_needs("mamba_ssm.ops.triton.layernorm_gated"), **NATIVE)
def mamba_ssm_norm(inp):
    fn = _peer("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn")
    x, w, z = inp["x"], inp["weight"], inp["z"]
    eps, gs, nbg = inp.get("eps", 1e-6), inp.get("group_size"), bool(inp.get("norm_before_gate", True))
    return lambda: fn(x, w, None, z=z, eps=eps, group_size=gs, norm_before_gate=nbg)


@register_benchmark(op="add_rms_norm", impl="mamba_ssm.native",
                    available=_needs("mamba_ssm.ops.triton.layer_norm"), **NATIVE)
def mamba_ssm_add_norm(inp):
    import torch
    fn = _peer("mamba_ssm.ops.triton.layer_norm", "rms_norm_fn")
    x, r, w = inp["x"], inp["residual"], inp["weight"]
    eps, fp32 = inp.get("eps", 1e-6), r.dtype == torch.float32
    return lambda: fn(x, w, None, residual=r, eps=eps, prenorm=True, residual_in_fp32=fp32)


def _fla_varlen(module: str, attr: str):
    def make(inp):
        import torch
        _one_sequence(inp, "fla.native")
        fn = _peer(module, attr)
        q, k, v, g, beta = (inp[n][None] for n in ("q", "k", "v", "g", "beta"))
        T, Hv, V = inp["v"].shape
        K = inp["q"].shape[2]
        h0 = torch.zeros((1, Hv, V, K), dtype=torch.float32, device=v.device)
        cu = torch.tensor([0, T], dtype=torch.long, device=v.device)
        l2 = bool(inp.get("use_qk_l2norm", True))
        return lambda: fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2, state_v_first=True, cu_seqlens=cu)
    return make


def _fla_update(module: str, attr: str):
    def make(inp):
        fn = _peer(module, attr)
        q, k, v, g, beta = (inp[n][:, None] for n in ("q", "k", "v", "g", "beta"))
        Bsz = inp["v"].shape[0]
        h0 = inp["ssm_states"][:Bsz].float().contiguous()
        l2 = bool(inp.get("use_qk_l2norm", True))
        return lambda: fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2, state_v_first=True)
    return make


for _op, _mod, _attr, _make in (
        ("gated_delta_rule_varlen", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule", _fla_varlen),
        ("kda_varlen", "fla.ops.kda", "chunk_kda", _fla_varlen),
        ("gated_delta_rule_update", "fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", _fla_update),
        ("kda_update", "fla.ops.kda", "fused_recurrent_kda", _fla_update)):
    register_benchmark(op=_op, impl="fla.native", available=_needs(_mod), **NATIVE)(_make(_mod, _attr))
