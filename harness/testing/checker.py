"""`Checker`: compare, record, assert — the one path every suite comparison goes through."""
from __future__ import annotations

import torch

from harness.testing.checks import Tolerance, compare, describe_tolerance, tolerance_for


def _shapes(shapes):
    if shapes is None:
        return None
    return {k: (list(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in shapes.items()}


class Checker:
    def __init__(self, test_id: str, device: str, writer=None):
        self.test_id = test_id
        self.device = device
        self.writer = writer
        self.count = 0

    def close(self, name: str, actual: torch.Tensor, expected: torch.Tensor, *, op: str,
              impl="reference", dtype: torch.dtype | None = None, tol: Tolerance | None = None,
              shapes: dict | None = None, seed=None, context: str = "", reproduce: str = ""):
        """Compare `actual` with the reference `expected` under the dtype's policy (or `tol`). `impl` is the
        implementation under test or its name (an Impl object carries its fp32 precision, see below).

        Writes a `comparison` record when a results file is open, then fails with a message naming
        what was compared, where it differs, the tolerance and why it applies (the dtype's policy, a widening
        by the check, or TF32 matmul for fp32 inputs) and how to reproduce.
        """
        dtype = dtype or actual.dtype
        tol = tol or tolerance_for(dtype)
        tf32 = dtype == torch.float32 and not self.device.startswith("cpu") and _uses_tf32(impl)
        impl = getattr(impl, "name", impl)  # an Impl or its name; records keep the name
        if tf32:  # a TF32 kernel is judged at TF32's precision (that of fp16); a wrong state still fails
            loose = tolerance_for(torch.float16)
            tol = Tolerance(max(tol.atol, loose.atol), max(tol.rtol, loose.rtol), max(tol.ratio, loose.ratio))
            context = (context + "; " if context else "") + f"TF32 tolerance: {impl} multiplies fp32 in TF32"
        c = compare(name, actual, expected, tol, describe_tolerance(tol, dtype, impl if tf32 else None))
        self.count += 1
        if self.writer is not None:
            self.writer.write(
                "comparison", test_id=self.test_id, name=name, op=op, impl=impl, device=self.device,
                dtype=str(dtype).replace("torch.", ""), shapes=_shapes(shapes) or {"actual": list(actual.shape)},
                max_abs_err=c.max_abs_err, err_ratio=c.err_ratio, tolerance=tol.as_dict(),
                verdict="pass" if c.passed else "fail", reason=c.reason, seed=seed,
                worst_index=list(c.worst_index) if c.worst_index is not None else None,
                reproduce=reproduce or None)
        if not c.passed:
            ctx = f"op={op} impl={impl} device={self.device} dtype={dtype} seed={seed}"
            if context:
                ctx += f"; {context}"
            repro = reproduce or f"pytest '{self.test_id}' --device {self.device.split(':')[0]}" \
                                 f" --hypothesis-seed=<printed above>"
            raise AssertionError(c.message(ctx, repro))
        return c


def _uses_tf32(impl) -> bool:
    from harness.impls.registry import all_impls
    # a name completed by the engine ("fla+torch") is judged by the implementation it completes
    i = impl if hasattr(impl, "fp32_matmul") else all_impls().get(str(impl).split("+")[0])
    return i is not None and getattr(i, "fp32_matmul", "ieee") == "tf32"
