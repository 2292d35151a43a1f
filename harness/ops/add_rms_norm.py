"""add_rms_norm: a pre-norm layer's residual add fused with the next RMSNorm, the residual updated in place.

add_rms_norm(x, residual, weight, *, eps=1e-6, out=None) -> y
    x (T, D) float: the layer's output (a mixer's, an MLP's), in the engine dtype.
    residual (T, D) float, written in place (the spec's `pool`): the residual stream, in float32 or in x's
        dtype (any float dtype is accepted). It must not overlap itself, x or weight.
    weight (D,) float: the norm's weight. eps > 0.
    y (T, D) in x's dtype (`out=` when given; it shares no memory with any argument).

    residual <- residual + x       summed in float32 (float64 when x or residual is float64), stored in
                                   residual's dtype
    h         = residual.to(x.dtype)
    y         = h / sqrt(mean(h^2 over D) + eps) * weight    in float32 (float64 when x is float64), stored in
                                                              x's dtype

    For a half or float32 x and a residual in float32 or in x's dtype (what engines keep) this is bit for bit
    the unfused sequence `residual = residual + x` (the fp32 sum of an fp32 residual and a half x; two half
    tensors added in fp32 and rounded) followed by `gated_rms_norm(residual.to(x.dtype), weight, None, eps=eps)`,
    in one pass that reads x and residual once and writes residual and y once. Rows are independent; T = 0
    writes nothing.

    residual is the spec's `pool` without an `index`: every row is written, and the generic suites compare it
    with the oracle's and leave it out of their read-only-inputs checks.
"""
from __future__ import annotations

import torch

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail

_OWN = "memory of its own (it is written in place: no element shared with x or weight, and none with itself)"


def _alone(residual, x, weight) -> bool:
    """The residual's elements are distinct and lie apart from x's and weight's."""
    return ck.slots_disjoint(residual) and ck.extents_apart(residual, x) and ck.extents_apart(residual, weight)


def validate_add_rms_norm(x, residual, weight, eps=1e-6, out=None):
    xs = ck.act_shape(x, 2)
    if xs is not None and xs[1] > 0 and ck.eps_ok(eps):
        dev = x.device
        if ck.fits(residual, xs, dev) and ck.fits(weight, (xs[1],), dev) and ck.out_ok(out, xs, x.dtype, dev) \
                and _alone(residual, x, weight):
            return xs[0], xs[1]
    return check_rules(x, residual, weight, eps, out)


def check_rules(x, residual, weight, eps=1e-6, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("x", x, ndim=2, dtypes=ck.ACT_DTYPES)
    T, Dd = x.shape
    if Dd < 1:
        fail("x", "shape (T, D) with D >= 1", f"shape {tuple(x.shape)}")
    check_tensor("residual", residual, shape=(T, Dd), dtypes=ck.ACT_DTYPES)
    check_tensor("weight", weight, shape=(Dd,), dtypes=ck.ACT_DTYPES)
    ck.check_eps(eps)
    ck.same_device(x=x, residual=residual, weight=weight)
    if not ck.slots_disjoint(residual):
        fail("residual", _OWN,
             f"shape {tuple(residual.shape)} with strides {tuple(residual.stride())} (elements overlap)")
    for name, t in (("x", x), ("weight", weight)):
        if ck.shares_memory(residual, t):
            fail("residual", _OWN, f"elements shared with {name}")
    ck.check_out(out, (T, Dd), x.dtype, x.device)
    return T, Dd


def reference(cd, x, residual, weight, *, eps=1e-6, out=None):
    """The sum and the norm of `reference/` in `cd` (float64 for the oracle: no intermediate rounding); the new
    residual is written into `residual` (the oracle's float64 copy of it)."""
    from harness.ops import _ref
    from reference.norms import add_rms_norm
    validate_add_rms_norm(x, residual, weight, eps, out)
    y, h = add_rms_norm(_ref.up(x, cd), _ref.up(residual, cd), _ref.up(weight, cd), eps=eps)
    residual.copy_(h)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    """x and weight in `dtype`; residual in float32 (float64 for float64), or per the shape's `pool_dtype`
    ("act": x's dtype)."""
    T, D = shape["T"], shape["D"]
    res = I.pool_dtype(shape, torch.promote_types(dtype, torch.float32), dtype)
    return dict(x=I.rand(gen, device, T, D, dtype=dtype), residual=I.rand(gen, device, T, D, dtype=res, scale=4.0),
                weight=I.rand(gen, device, D, dtype=dtype, scale=0.1, shift=1.0), eps=1e-6)


def nbytes(inp):
    """x read and y written (x's dtype), residual read and written, weight read once."""
    return 2 * I.nbytes(inp["x"]) + 2 * I.nbytes(inp["residual"]) + I.nbytes(inp["weight"])


def flops(inp):
    """Add, square-and-sum, scale and weight: about 5 flops per element."""
    return 5 * inp["x"].numel()


def _residual_rows(k):
    k["residual"] = k["residual"][:, :-1]


def _residual_int(k):
    k["residual"] = k["residual"].to(torch.int32)


def _residual_expanded(k):
    k["residual"] = k["residual"][:1].expand(k["residual"].shape)


def _residual_is_x(k):
    k["residual"] = k["x"]


def _weight_short(k):
    k["weight"] = k["weight"][:-1]


SPEC = OpSpec(
    name="add_rms_norm",
    args=("x", "residual", "weight"),
    options=dict(eps=1e-6, out=None),
    pool="residual",
    validate=validate_add_rms_norm, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, D=1024), dict(T=256, D=1024)],
        "gpu": [dict(T=256, D=4096), dict(T=16384, D=4096)],
        "contract": [dict(T=3, D=6), dict(T=3, D=6, pool_dtype="act")],
        "aot": [dict(T=40, D=128), dict(T=40, D=100, pool_dtype="act"), dict(T=4, D=4096)],
    },
    bad_inputs=(("residual not (T, D)", "residual", _residual_rows),
                ("residual of int32", "residual", _residual_int),
                ("residual overlapping itself", "residual", _residual_expanded),
                ("residual sharing x's memory", "residual", _residual_is_x),
                ("weight not (D,)", "weight", _weight_short)),
    doc=__doc__,
)
