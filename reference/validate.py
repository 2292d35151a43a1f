"""Argument checks shared by the reference ops (and reused by harness/).

Every failure is a ValueError that names the argument, what was expected and what came.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def fail(arg: str, expected: str, got) -> None:
    raise ValueError(f"{arg}: expected {expected}, got {got}")


def check_int(arg: str, v, lo: int) -> int:
    """`v` as given when it is an int (not a bool) >= lo; else ValueError naming `arg`."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        fail(arg, f"an int >= {lo}", repr(v))
    return v


def _shape_str(shape) -> str:
    return str(tuple('*' if s is None else s for s in shape))


def check_tensor(arg: str, t, ndim: int | None = None, shape: Sequence | None = None,
                 floating: bool | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 optional: bool = False) -> None:
    """Check one tensor argument. `shape` may hold None for "any size" in a position.

    On the success path this builds no message (validators run before every eager call of an op)."""
    if t is None:
        if optional:
            return
        fail(arg, "a tensor", "None")
    if not isinstance(t, torch.Tensor):
        fail(arg, "a torch.Tensor", type(t).__name__)
    if t.is_meta:
        fail(arg, "a tensor with data (not on the meta device)", "a meta tensor")
    if shape is not None:
        got = t.shape
        if len(got) != len(shape):
            fail(arg, f"{len(shape)} dims" + (f" of shape {_shape_str(shape)}" if shape else ""),
                 f"shape {tuple(got)}")
        if None in shape or got != shape:  # one comparison when every size is given and matches
            for i, want in enumerate(shape):
                if want is not None and want != got[i]:
                    fail(arg, f"shape {_shape_str(shape)} (dim {i} = {want})", f"shape {tuple(got)}")
    elif ndim is not None and t.dim() != ndim:
        fail(arg, f"{ndim} dims", f"shape {tuple(t.shape)}")
    if floating is True and not t.is_floating_point():
        fail(arg, "a floating-point tensor", f"dtype {t.dtype}")
    if floating is False and t.is_floating_point():
        fail(arg, "an integer tensor", f"dtype {t.dtype}")
    if dtypes is not None:
        if type(dtypes) is not tuple:  # any iterable; read once
            dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            fail(arg, f"dtype in {[str(d) for d in dtypes]}", f"dtype {t.dtype}")


def check_cu_seqlens(cu_seqlens, num_tokens: int, arg: str = "cu_seqlens") -> torch.Tensor:
    """Validate packed-sequence offsets; return them as an int64 CPU tensor.

    `None` means one sequence of `num_tokens` tokens.
    """
    if cu_seqlens is None:
        return torch.tensor([0, num_tokens], dtype=torch.int64)
    if isinstance(cu_seqlens, (list, tuple)):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    check_tensor(arg, cu_seqlens, ndim=1, floating=False)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    check_offsets(arg, cu.tolist(), num_tokens)
    return cu


def check_offsets(arg: str, values: list, num_tokens: int) -> None:
    """Packed-sequence offsets read to the host (a list of ints): [0, ..., num_tokens], non-decreasing."""
    if len(values) < 2:
        fail(arg, "at least 2 entries [0, ..., T]", f"{len(values)} entries")
    if values[0] != 0:
        fail(arg, "to start at 0", f"{values[0]}")
    if values != sorted(values):
        fail(arg, "non-decreasing offsets", values)
    if values[-1] != num_tokens:
        fail(arg, f"to end at the token count {num_tokens}", f"{values[-1]}")


def check_divides(arg: str, divisor: int, what: str, value: int) -> None:
    if divisor <= 0 or value % divisor != 0:
        fail(arg, f"a positive divisor of {what} = {value}", divisor)


def check_same_dtype(**tensors) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    k0, v0 = items[0]
    for k, v in items[1:]:
        if v.dtype != v0.dtype:
            fail(k, f"dtype {v0.dtype} (same as {k0})", f"dtype {v.dtype}")
