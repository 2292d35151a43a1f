"""Input builders and hypothesis strategies for testing the reference ops and the kernels against them.

Builders return a dict of keyword arguments that can be passed straight to the matching reference op
(and, by construction, to any implementation that follows the same contract)::

    from reference.testing import make_ssd_inputs, seqlens, cu_seqlens_from
    from reference.ssd import ssd_scan

    inp = make_ssd_inputs(T=40, H=4, P=8, N=16, G=2, seed=3, cu_seqlens=[0, 7, 40], initial_states=True)
    y, final_states = ssd_scan(**inp)

Values are realistic for the mixer they serve (negative A, dt around 1e-3..1e-1 after softplus,
unit-scale activations), drawn on the CPU in float64 from a seeded generator, then cast to `dtype`
and moved to `device`; the same seed gives the same values in every dtype and on every device.

Helpers:
    * `TOKEN_ARGS[op]`: which keyword arguments of an op are token-major (sliced with the tokens);
    * `slice_tokens(inputs, op, start, end, initial_states=...)`: the inputs of tokens [start, end) as
      one sequence, e.g. to compute one sequence of a packed batch alone, or one piece of a split;
    * `to_dtype(inputs, dtype)`: cast every floating tensor (e.g. a float64 oracle copy of fp32 inputs).

Strategies (hypothesis):
    * `seqlens(...)`: a list of sequence lengths; `cu_seqlens_from(lengths)` turns it into offsets;
    * `cu_seqlens(...)`: offsets (int64 tensor) directly;
    * `split_points(length)`: sorted cut positions inside [0, length] (possibly repeated / at the ends).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "TOKEN_ARGS", "make_conv_inputs", "make_mamba1_inputs", "make_ssd_inputs", "make_norm_inputs",
    "cu_seqlens_from", "lengths_from", "slice_tokens", "to_dtype", "seqlens", "cu_seqlens",
    "split_points", "inverse_softplus",
]

# The keyword arguments of each reference op that are token-major (first dim = packed token index).
TOKEN_ARGS = {
    "causal_conv1d": ("x",),
    "selective_scan": ("u", "delta", "B", "C", "z"),
    "ssd": ("x", "dt", "B", "C", "z"),
}


# ----------------------------------------------------------------------------------------------
# small helpers

def cu_seqlens_from(lengths: Sequence[int], device="cpu", dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[3, 0, 5] -> tensor([0, 3, 3, 8]) (int64 unless `dtype` says otherwise)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=dtype, device=device)


def lengths_from(cu_seqlens) -> list[int]:
    """The inverse of `cu_seqlens_from`."""
    cu = torch.as_tensor(cu_seqlens).tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (y > 0)."""
    return y + torch.log(-torch.expm1(-y))


def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed` (inputs are drawn on the CPU, then moved)."""
    return torch.Generator().manual_seed(int(seed))


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rand(g, *shape):
    return torch.rand(*shape, generator=g, dtype=torch.float64)


def _num_seqs(T: int, cu) -> tuple[int, torch.Tensor | None]:
    if cu is None:
        return 1, None
    cu = torch.as_tensor(cu, dtype=torch.int64)
    if int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens: expected to end at T = {T}, got {int(cu[-1])}")
    return cu.numel() - 1, cu


def _finish(d: dict, dtype, device) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
        out[k] = v
    return out


def to_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    """A copy of `inputs` with every floating tensor cast to `dtype` (ints and non-tensors unchanged)."""
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inputs.items()}


def slice_tokens(inputs: dict, op: str, start: int, end: int, initial_states=None) -> dict:
    """The inputs of tokens [start, end) as ONE sequence (cu_seqlens=None).

    `op` is a key of TOKEN_ARGS. `initial_states` replaces the inputs' initial states and must have a
    leading sequence dim of 1 (e.g. `final_states[s:s+1]` of a previous piece, or
    `inputs["initial_states"][s:s+1]`); None means zeros.
    """
    out = dict(inputs)
    for k in TOKEN_ARGS[op]:
        if out.get(k) is not None:
            out[k] = out[k][start:end]
    out["cu_seqlens"] = None
    out["initial_states"] = initial_states
    return out


# ----------------------------------------------------------------------------------------------
# builders

def make_conv_inputs(T: int, D: int, K: int = 4, dtype=torch.float64, seed: int = 0, *, cu_seqlens=None,
                     initial_states: bool = False, bias: bool = True, activation="silu",
                     device="cpu") -> dict:
    """kwargs for `causal_conv1d`: x (T, D), weight (D, K) ~ U(-1, 1)/sqrt(K), bias, activation,
    cu_seqlens (passed through; a list becomes an int64 tensor), initial_states (S, D, K-1) or None."""
    g = gen(seed)
    S, cu = _num_seqs(T, cu_seqlens)
    d = dict(x=_randn(g, T, D),
             weight=(2 * _rand(g, D, K) - 1) / math.sqrt(K),
             bias=0.1 * _randn(g, D) if bias else None,
             activation=activation, cu_seqlens=cu,
             initial_states=_randn(g, S, D, K - 1) if initial_states else None)
    return _finish(d, dtype, device)


def make_mamba1_inputs(T: int, Dm: int, N: int = 16, G: int = 1, dtype=torch.float64, seed: int = 0, *,
                       cu_seqlens=None, initial_states: bool = False, D: bool = True, z: bool = True,
                       delta_bias: bool = True, delta_softplus: bool = True, bc_2d: bool = False,
                       device="cpu") -> dict:
    """kwargs for `selective_scan`: u, delta, z (T, Dm); A (Dm, N) = -(1..N) * U(0.5, 1.5) (S4D-real
    like); B, C (T, G, N) ((T, N) if bc_2d and G == 1); D (Dm,); delta_bias = softplus^-1 of dt in
    [1e-3, 1e-1] (log-uniform), delta ~ 0.5 N(0, 1); initial_states (S, Dm, N) or None."""
    g = gen(seed)
    S, cu = _num_seqs(T, cu_seqlens)
    A = -torch.arange(1, N + 1, dtype=torch.float64).expand(Dm, N) * (0.5 + _rand(g, Dm, 1))
    dt0 = torch.exp(math.log(1e-3) + _rand(g, Dm) * (math.log(1e-1) - math.log(1e-3)))
    bc_shape = (T, N) if (bc_2d and G == 1) else (T, G, N)
    d = dict(u=_randn(g, T, Dm), delta=0.5 * _randn(g, T, Dm), A=A.contiguous(),
             B=_randn(g, *bc_shape), C=_randn(g, *bc_shape),
             D=_randn(g, Dm) if D else None,
             z=_randn(g, T, Dm) if z else None,
             delta_bias=inverse_softplus(dt0) if delta_bias else None,
             delta_softplus=delta_softplus, cu_seqlens=cu,
             initial_states=_randn(g, S, Dm, N) if initial_states else None)
    return _finish(d, dtype, device)


def make_ssd_inputs(T: int, H: int, P: int, N: int = 16, G: int = 1, dtype=torch.float64, seed: int = 0, *,
                    cu_seqlens=None, initial_states: bool = False, D: str | None = "head", z: bool = True,
                    dt_bias: bool = True, dt_softplus: bool = True, dt_limit=(0.0, float("inf")),
                    device="cpu") -> dict:
    """kwargs for `ssd_scan` / `ssd_chunked`: x, z (T, H, P); dt (T, H) ~ 0.5 N(0, 1); A (H,) ~ -U(1, 16);
    B, C (T, G, N); D: "head" -> (H,), "head_dim" -> (H, P), None -> None; dt_bias = softplus^-1 of dt
    in [1e-3, 1e-1] (log-uniform); initial_states (S, H, P, N) or None."""
    if D not in ("head", "head_dim", None):
        raise ValueError(f"D: expected 'head', 'head_dim' or None, got {D!r}")
    g = gen(seed)
    S, cu = _num_seqs(T, cu_seqlens)
    dt0 = torch.exp(math.log(1e-3) + _rand(g, H) * (math.log(1e-1) - math.log(1e-3)))
    d = dict(x=_randn(g, T, H, P), dt=0.5 * _randn(g, T, H), A=-(1 + 15 * _rand(g, H)),
             B=_randn(g, T, G, N), C=_randn(g, T, G, N),
             D={"head": lambda: _randn(g, H), "head_dim": lambda: _randn(g, H, P), None: lambda: None}[D](),
             z=_randn(g, T, H, P) if z else None,
             dt_bias=inverse_softplus(dt0) if dt_bias else None,
             dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), cu_seqlens=cu,
             initial_states=_randn(g, S, H, P, N) if initial_states else None)
    return _finish(d, dtype, device)


def make_norm_inputs(shape: Sequence[int], dtype=torch.float64, seed: int = 0, *, z: bool = True,
                     group_size: int | None = None, norm_before_gate: bool = True, eps: float = 1e-6,
                     device="cpu") -> dict:
    """kwargs for `gated_rms_norm`: x, z of `shape`, weight (shape[-1],) ~ 1 + 0.1 N(0, 1)."""
    g = gen(seed)
    d = dict(x=_randn(g, *shape), weight=1 + 0.1 * _randn(g, shape[-1]),
             z=_randn(g, *shape) if z else None, eps=eps, group_size=group_size,
             norm_before_gate=norm_before_gate)
    return _finish(d, dtype, device)


# ----------------------------------------------------------------------------------------------
# hypothesis strategies (hypothesis is imported lazily so that the builders work without it)

def seqlens(min_seqs: int = 1, max_seqs: int = 4, min_len: int = 0, max_len: int = 24, max_total=None,
            edge_lengths: bool = False):
    """Strategy: a list of sequence lengths (empty sequences allowed when min_len = 0). With `edge_lengths`,
    lengths are drawn half the time from the edge values 0, 1, 2, 3, 5, 7 (raised to min_len): empty,
    single-token and odd requests beside long ones."""
    from hypothesis import strategies as st
    length = st.integers(min_len, max_len)
    if edge_lengths:
        length = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7]).map(lambda v: max(min_len, v)), length)
    s = st.lists(length, min_size=min_seqs, max_size=max_seqs)
    if max_total is not None:
        s = s.filter(lambda ls: sum(ls) <= max_total)
    return s


def cu_seqlens(min_seqs: int = 1, max_seqs: int = 4, min_len: int = 0, max_len: int = 24):
    """Strategy: cu_seqlens offsets (int64 tensor (S+1,)) from `seqlens`."""
    return seqlens(min_seqs, max_seqs, min_len, max_len).map(cu_seqlens_from)


def split_points(length: int, max_cuts: int = 3):
    """Strategy: sorted cut positions in [0, length] (repeats and the ends allowed, i.e. empty pieces)."""
    from hypothesis import strategies as st
    return st.lists(st.integers(0, length), min_size=0, max_size=max_cuts).map(sorted)
