"""Op contract: tensor arguments may be strided views (harness.ops, "Strided inputs"). Engines hand kernels
views of one projection's output: the Mamba mixers split in_proj's (T, 2·D) output into x and z (row stride
2·D, z starting D elements in), Mamba-2's x, B and C come out of one conv output, GDN's q, k and v out of one
qkv projection. A kernel that takes a row as `base + t * D` reads the neighbouring columns there — another
tensor's values, silently — while every suite that builds its inputs with `torch.randn` hands it contiguous
rows and passes.

For every op (each spec's contract variants and its first `cpu` benchmark shape) and implementation: the op
runs once on the inputs as built and once with every floating-point tensor argument of two or more dims but
the pool (its layouts are the pool suites' business) replaced by a view: of a wider buffer (rows twice as far
apart, every other argument starting half a row in), or of a buffer holding its dims in reverse order (no unit
stride along the last dim: vLLM's conv takes x as the transpose of a (D, T) buffer); each call with its own
copy of the pool. Outputs and
final pools must agree to the dtype's tolerance (an implementation may take another path for strided rows,
not other values)."""

import pytest
import torch

from harness.testing.optest import interp_small, require, spec_cases

DTYPES = (torch.float32, torch.bfloat16)


CASES = spec_cases()


def row_strided(t: torch.Tensor, offset: bool) -> torch.Tensor:
    """`t`'s values in a view whose first dim strides twice the row's size (the rows of a (n, 2·row) buffer),
    starting `row` elements into the buffer if `offset` (the second half, as z of an x|z projection)."""
    n, row = t.shape[0], t[0].numel() if t.shape[0] else 0
    buf = torch.full((n, 2 * row), float("nan"), dtype=t.dtype, device=t.device)
    half = buf[:, row:] if offset else buf[:, :row]
    view = half.as_strided(t.shape, (2 * row, *t[0].stride()) if t.dim() > 1 else (2 * row,))
    view.copy_(t)
    return view


def transposed(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view of a buffer holding its dims in reverse order (a (T, D) activation as the
    transpose of a (D, T) buffer, as vLLM's conv keeps x): no dim has unit stride but the first."""
    buf = torch.full(tuple(reversed(t.shape)), float("nan"), dtype=t.dtype, device=t.device)
    view = buf.permute(*reversed(range(t.dim())))
    view.copy_(t)
    return view


LAYOUTS = ("rows", "transposed")


def strided_args(sp, kwargs: dict, layout: str = "rows") -> tuple[dict, list[str]]:
    """kwargs with every floating-point tensor of two or more dims but the pool and `out` as a view of
    `layout`: "rows", row-strided (alternately offset); "transposed"; and the names replaced."""
    out, names = dict(kwargs), []
    for name in sp.args:
        t = kwargs.get(name)
        if (name == sp.pool or not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2
                or not t.is_contiguous() or t.shape[0] == 0):
            continue
        out[name] = row_strided(t, offset=len(names) % 2 == 1) if layout == "rows" else transposed(t)
        names.append(name)
    return out, names


def same_results(check, impl, sp, fn, kwargs, strided, dtype, shapes, tag, what):
    """Run op `fn` on `kwargs`, then on `strided` (the same values as views) with its own copy of the pool:
    the outputs and the final pools must agree to the dtype's tolerance."""
    pool0 = kwargs.get(sp.pool).clone() if sp.pool else None
    pos, opt = sp.split(kwargs)
    y = fn(*pos, **opt)
    if sp.pool:
        strided[sp.pool] = pool0
    spos, sopt = sp.split(strided)
    ys = fn(*spos, **sopt)
    check.close(f"{sp.name}.y[{tag}]", ys, y, op=sp.name, impl=impl, dtype=dtype, shapes=shapes, seed=0,
                context=what)
    if sp.pool:
        check.close(f"{sp.name}.{sp.pool}[{tag}]", pool0, kwargs[sp.pool], op=sp.name, impl=impl, dtype=dtype,
                    shapes=shapes, seed=0, context=what)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
@pytest.mark.parametrize("case", sorted(CASES))
def test_strided_inputs_give_the_same_results(impl, device, check, case, dtype, layout):
    """Every op of every implementation gives the same output and final pool for strided views of its
    activations and parameters (row-strided, or transposed buffers) as for the contiguous tensors."""
    sp, shape, where = CASES[case]
    require(impl, sp.name, dtype, device)
    if where == "cpu" and interp_small(device, impl):
        pytest.skip("the cpu benchmark shape is too long for the Triton interpreter (minutes); the contract "
                    "shapes cover this implementation there")
    fn = impl.op(sp.name)
    kwargs = sp.inputs(shape, dtype, device, torch.Generator().manual_seed(0))
    kwargs.pop("out", None)
    strided, names = strided_args(sp, kwargs, layout)
    if not names:
        pytest.skip(f"{sp.name}: no tensor argument of two or more dims besides the pool in this case")
    what = f"inputs {', '.join(names)} as {'row-strided' if layout == 'rows' else 'transposed'} views"
    same_results(check, impl, sp, fn, kwargs, strided, dtype, dict(shape, strided=names, layout=layout),
                 "strided inputs", what)


def strided_ids(t: torch.Tensor) -> torch.Tensor:
    """`t` (an integer or bool tensor: offsets, slot ids, flags, a slot table) as a view with its last dim
    strided twice apart: every element stands twice in the buffer (for a table, every row twice), so a kernel
    that reads element i at `base + i` gets a neighbour's value, still a valid one (no read leaves the pool or
    the tokens), and computes something else."""
    if t.dim() == 1:
        return t.repeat_interleave(2)[::2]
    return torch.cat([t, t], dim=-1)[..., :t.shape[-1]] if t.dim() == 2 else t


@pytest.mark.parametrize("case", sorted(CASES))
def test_strided_index_tensors_give_the_same_results(impl, device, check, case):
    """Every op of every implementation gives the same output and final pool when its offsets, slot ids, flags
    and slot tables are strided views (an engine slices them out of wider metadata: one column of a slot table,
    every other row of a padded batch) as when they are contiguous."""
    sp, shape, where = CASES[case]
    require(impl, sp.name, torch.float32, device)
    if where == "cpu" and interp_small(device, impl):
        pytest.skip("the cpu benchmark shape is too long for the Triton interpreter (minutes); the contract "
                    "shapes cover this implementation there")
    fn = impl.op(sp.name)
    kwargs = sp.inputs(shape, torch.float32, device, torch.Generator().manual_seed(0))
    kwargs.pop("out", None)
    strided, names = dict(kwargs), []
    for name in sp.args:
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() > 1 and t.dim() in (1, 2):
            strided[name] = strided_ids(t)
            names.append(name)
    if not names:
        pytest.skip(f"{sp.name}: no index tensor of two or more elements in this case")
    same_results(check, impl, sp, fn, kwargs, strided, torch.float32, dict(shape, strided=names), "strided ids",
                 f"index tensors {', '.join(names)} as strided views")
