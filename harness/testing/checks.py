"""Checks: tolerance policy per dtype, comparison of an output with a float64 reference.

A comparison passes iff
  * the actual tensor has the expected shape,
  * it holds no NaN/Inf where the reference is finite, and the reference itself is finite
    (NaN never passes),
  * its error ratio ||a - b|| / ||b|| (Frobenius, computed in float64) is <= `ratio`, and
  * every element satisfies |a - b| <= atol + rtol * |b|.

The reference is expected in float64 (or the highest precision available); `actual` is compared
after an upcast to float64.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


# Per-dtype policy for one op against the float64 reference. Recurrent ops accumulate error over
# tokens; the element-wise bound is loose, the error ratio is the sharp test.
POLICY = {
    torch.float64: Tolerance(atol=1e-9, rtol=1e-7, ratio=1e-10),
    torch.float32: Tolerance(atol=2e-3, rtol=2e-3, ratio=2e-4),
    torch.float16: Tolerance(atol=3e-2, rtol=3e-2, ratio=5e-3),
    torch.bfloat16: Tolerance(atol=1.5e-1, rtol=1e-1, ratio=2e-2),
}


def tolerance_for(dtype: torch.dtype, scale: float = 1.0) -> Tolerance:
    """The policy for `dtype`, optionally widened by `scale` (e.g. for long recurrences)."""
    if dtype not in POLICY:
        raise ValueError(f"dtype: expected one of {[str(d) for d in POLICY]}, got {dtype}")
    t = POLICY[dtype]
    return Tolerance(t.atol * scale, t.rtol * scale, t.ratio * scale)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_tolerance(tol: Tolerance, dtype: torch.dtype | None, tf32: str | None = None) -> str:
    """Why a comparison uses `tol`, for failure messages: the dtype's policy (`POLICY`), widened by a factor,
    or a tolerance of the check's own; `tf32` (the implementation's name) when an fp32 case is judged at
    TF32's precision because the implementation multiplies fp32 inputs in TF32."""
    if tf32:
        return f"TF32 matmul for fp32 inputs: {tf32} multiplies fp32 in TF32, judged at (at least) the float16 policy"
    base = POLICY.get(dtype)
    if base is None:
        return "a tolerance the check sets" + (f" (dtype {_dtype_name(dtype)})" if dtype is not None else "")
    name = _dtype_name(dtype)
    if tol == base:
        return f"the {name} policy"
    k = tol.atol / base.atol
    if k > 0 and all(abs(t / b - k) <= 1e-9 * k for t, b in ((tol.rtol, base.rtol), (tol.ratio, base.ratio))):
        return f"the {name} policy widened {k:g}x by the check"
    return f"a tolerance the check sets for {name} (its policy: atol={base.atol:g} rtol={base.rtol:g} " \
           f"ratio={base.ratio:g})"


@dataclass
class Comparison:
    name: str
    shape: tuple
    max_abs_err: float
    err_ratio: float
    worst_index: tuple | None
    worst_actual: float | None
    worst_expected: float | None
    nonfinite: int
    tol: Tolerance
    passed: bool
    reason: str
    why: str = ""  # why this tolerance (`describe_tolerance`), named in the message

    def message(self, context: str = "", reproduce: str = "") -> str:
        lines = [f"{self.name}: {self.reason}",
                 f"  shape {self.shape}, max |a-b| = {self.max_abs_err:.3e}, "
                 f"||a-b||/||b|| = {self.err_ratio:.3e}",
                 f"  tolerance atol={self.tol.atol:g} rtol={self.tol.rtol:g} ratio={self.tol.ratio:g}"
                 + (f" ({self.why})" if self.why else "")]
        if self.worst_index is not None:
            lines.append(f"  worst at index {self.worst_index}: actual {self.worst_actual!r}, "
                         f"expected {self.worst_expected!r}")
        if context:
            lines.append(f"  {context}")
        if reproduce:
            lines.append(f"  reproduce: {reproduce}")
        return "\n".join(lines)


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, why: str = "") -> Comparison:
    """Compare `actual` with the reference `expected`; never raises on mismatch (`harness.testing.checker.Checker.close`
    records and asserts). `why`: why `tol` applies (`describe_tolerance`), for the message."""
    if tuple(actual.shape) != tuple(expected.shape):
        return Comparison(name, tuple(actual.shape), float("inf"), float("inf"), None, None, None, 0, tol,
                          False, f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}",
                          why)
    a = actual.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    shape = tuple(a.shape)
    if a.numel() == 0:
        return Comparison(name, shape, 0.0, 0.0, None, None, None, 0, tol, True, "empty", why)
    fin_a = torch.isfinite(a)
    fin_b = torch.isfinite(b)
    nonfinite = int((~fin_a).sum())
    diff = (a - b).abs()
    diff = torch.where(fin_a & fin_b, diff, torch.full_like(diff, float("inf")))
    bound = tol.atol + tol.rtol * b.abs()
    excess = diff - bound
    flat = int(torch.argmax(torch.nan_to_num(excess, nan=float("inf"), posinf=float("inf"))).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
    max_abs = float(diff.max())
    denom = float(torch.linalg.vector_norm(torch.nan_to_num(b)))
    num = float(torch.linalg.vector_norm(torch.nan_to_num(a - b, nan=float("inf"))))
    ratio = num / denom if denom > 0 else (0.0 if num == 0 else float("inf"))
    if not bool(fin_b.all()):
        reason, ok = f"reference holds {int((~fin_b).sum())} non-finite values", False
    elif nonfinite:
        reason, ok = f"{nonfinite} non-finite values where the reference is finite", False
    elif ratio > tol.ratio:
        reason, ok = f"error ratio {ratio:.3e} exceeds {tol.ratio:g}", False
    elif bool((excess > 0).any()):
        reason, ok = f"{int((excess > 0).sum())} elements exceed atol + rtol*|expected|", False
    else:
        reason, ok = "ok", True
    return Comparison(name, shape, max_abs, ratio, idx, float(actual.reshape(-1)[flat].double()),
                      float(b.reshape(-1)[flat]), nonfinite, tol, ok, reason, why)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of `t` (any shape or strides, 0-dim too) as a flat byte tensor on the host."""
    flat = t.detach().cpu().reshape(-1)
    return torch.empty(flat.shape, dtype=flat.dtype).copy_(flat).view(torch.uint8)


def assert_bitwise_equal(name: str, actual: torch.Tensor, expected: torch.Tensor, context: str = "") -> None:
    """Bit-for-bit equality (untouched pool slots, determinism). NaN payloads compare as bits."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: expected shape {tuple(expected.shape)} {expected.dtype}, "
                             f"got {tuple(actual.shape)} {actual.dtype}. {context}")
    a, b = _bytes(actual), _bytes(expected)
    if not torch.equal(a, b):
        ne = (actual.detach().cpu() != expected.detach().cpu())
        first = tuple(int(i) for i in ne.nonzero()[0]) if ne.any() else "(bits differ in NaN payloads)"
        raise AssertionError(f"{name}: not bitwise equal; {int(ne.sum())} elements differ, first at {first}. {context}")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) or a sentinel (ints) before a kernel runs."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0x5A)
