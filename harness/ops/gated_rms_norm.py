"""gated_rms_norm: RMSNorm with an optional SiLU gate, per group of channels.

gated_rms_norm(x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None) -> y
    x, z (T, D); weight (D,). Per group of `group_size` channels (None = D): with z and
    norm_before_gate: rms(x) * weight * silu(z); without norm_before_gate: rms(x * silu(z)) * weight.
"""
from __future__ import annotations

from harness.ops import _checks as ck
from harness.ops import _inputs as I
from harness.ops.spec import OpSpec
from reference.validate import check_tensor, fail


def validate_gated_rms_norm(x, weight, z, eps=1e-6, group_size=None, out=None):
    xs = ck.act_shape(x, 2)
    if xs is not None and ck.eps_ok(eps):
        dev = x.device
        T, Dd = xs
        gs = Dd if group_size is None else group_size
        if type(gs) is int and gs > 0 and Dd % gs == 0 and ck.fits(weight, (Dd,), dev) and ck.opt_ok(z, xs, dev) \
                and ck.out_ok(out, xs, x.dtype, dev):
            return T, Dd, gs
    return check_rules(x, weight, z, eps, group_size, out)


def check_rules(x, weight, z, eps=1e-6, group_size=None, out=None):
    """The validator's rules one by one, the first broken one raising (its slow path)."""
    check_tensor("x", x, ndim=2, dtypes=ck.ACT_DTYPES)
    T, Dd = x.shape
    check_tensor("weight", weight, shape=(Dd,), dtypes=ck.ACT_DTYPES)
    check_tensor("z", z, shape=(T, Dd), dtypes=ck.ACT_DTYPES, optional=True)
    gs = Dd if group_size is None else group_size
    if not isinstance(gs, int) or gs <= 0 or Dd % gs != 0:
        fail("group_size", f"a positive divisor of D={Dd} (or None)", repr(group_size))
    ck.check_eps(eps)
    ck.same_device(x=x, weight=weight, z=z)
    ck.check_out(out, (T, Dd), x.dtype, x.device)
    return T, Dd, gs


def reference(cd, x, weight, z, *, eps=1e-6, group_size=None, norm_before_gate=True, out=None):
    from harness.ops import _ref
    from reference.norms import gated_rms_norm
    validate_gated_rms_norm(x, weight, z, eps, group_size, out)
    up = _ref.up
    y = gated_rms_norm(up(x, cd), up(weight, cd), up(z, cd), eps=eps, group_size=group_size,
                       norm_before_gate=norm_before_gate)
    return _ref.emit(y, x, out)


def inputs(shape, dtype, device, gen):
    T, D = shape["T"], shape["D"]
    return dict(x=I.rand(gen, device, T, D, dtype=dtype),
                weight=I.rand(gen, device, D, dtype=dtype, scale=0.1, shift=1.0),
                z=I.opt(shape, I.rand(gen, device, T, D, dtype=dtype)), eps=1e-6, group_size=shape.get("group"),
                norm_before_gate=bool(shape.get("norm_before_gate", False)))


def nbytes(inp):
    return 2 * I.nbytes(inp["x"]) + I.nbytes(inp.get("z")) + I.nbytes(inp.get("weight"))


def flops(inp):
    """Square-and-sum, scale, weight and gate: about 8 flops per element (SiLU's exponential apart)."""
    return 8 * inp["x"].numel()


def _group4(k):
    k["group_size"] = 4


SPEC = OpSpec(
    name="gated_rms_norm",
    args=("x", "weight", "z"),
    options=dict(eps=1e-6, group_size=None, norm_before_gate=True, out=None),
    validate=validate_gated_rms_norm, checks=check_rules, reference=reference,
    inputs=inputs, bytes=nbytes, flops=flops,
    tokens=I.tokens_T,
    shapes={
        "cpu": [dict(T=64, D=128, group=64), dict(T=256, D=128, group=64)],
        "gpu": [dict(T=4096, D=8192, group=1024), dict(T=16384, D=8192, group=1024)],
        "contract": [dict(T=3, D=6)],
        "aot": [dict(T=40, D=128, group=64), dict(T=40, D=128, group=64, optional=False)],
    },
    bad_inputs=(("group_size not dividing D", "group_size", _group4),),
    doc=__doc__,
)
