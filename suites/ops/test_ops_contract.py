"""Op contract: bad input raises ValueError (naming the argument) before any kernel runs, for every op
and every implementation that provides it: wrong dtypes or layouts, slot ids outside the pool,
duplicate live slots, query_start_loc inconsistent with the token count, a bad `out=`."""
import re

import pytest
import torch

from harness.testing.checks import assert_bitwise_equal, poison_
from harness.testing.optest import require
from harness.ops import SPECS
from harness.testing import strict_op


def _cases():
    """case id -> (op spec, contract shape): every spec's tiny valid cases (harness.ops)."""
    cases = {}
    for name, sp in SPECS.items():
        shapes = sp.shapes["contract"]
        for sh in shapes:
            cid = name if len(shapes) == 1 else f"{name}/{sh.get('layout', shapes.index(sh))}"
            cases[cid] = (sp, sh)
    return cases


CASES = _cases()
OURS = ("reference", "torch", "triton")  # the implementations of this repository: they decline nothing here


def _build(case, device):
    sp, shape = CASES[case]
    return sp.inputs(shape, torch.float32, device, torch.Generator().manual_seed(0))


def _mutations():
    """(case, mutation name, argument the error must name, mutate(kwargs) -> None): the generic ones
    from each spec's argument roles, plus the spec's own `bad_inputs`."""
    m = []
    for case, (sp, _) in CASES.items():
        a = sp.args[0] if sp.pool != sp.args[0] else sp.args[1]  # the first activation
        m.append((case, "int activations", a, lambda k, a=a: k.__setitem__(a, k[a].to(torch.int32))))
        m.append((case, "extra dim", a, lambda k, a=a: k.__setitem__(a, k[a][None])))
        m.append((case, "out of wrong shape", "out", lambda k, a=a: k.__setitem__("out", torch.empty(
            (k[a].shape[0] + 1,) + tuple(k[a].shape[1:]), dtype=k[a].dtype, device=k[a].device))))
        m.append((case, "out of wrong dtype", "out", lambda k, a=a: k.__setitem__("out", torch.empty_like(
            k[a], dtype=torch.float64 if k[a].dtype != torch.float64 else torch.float32))))
        if sp.index:
            i, p = sp.index, sp.pool
            m.append((case, "slot id past the pool", i, lambda k, i=i, p=p: k[i].__setitem__(0, k[p].shape[0])))
            m.append((case, "negative slot id (not pad)", i, lambda k, i=i: k[i].__setitem__(0, -2)))
            m.append((case, "float slot ids", i, lambda k, i=i: k.__setitem__(i, k[i].float())))
            m.append((case, "duplicate live slots", i, lambda k, i=i: k[i].__setitem__(1, k[i][0].clone())))
        if sp.varlen:
            T = lambda k: int(k["query_start_loc"][-1])  # noqa: E731
            m.append((case, "query_start_loc ends before T", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(-1, T(k) - 1)))
            m.append((case, "query_start_loc ends after T", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(-1, T(k) + 1)))
            m.append((case, "query_start_loc not from 0", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(0, 1)))
            m.append((case, "query_start_loc decreasing", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(1, T(k) + 1)))
            # found by the fuzz test: the offsets were read on the host before their device was checked
            m.append((case, "query_start_loc on the meta device", "query_start_loc",
                      lambda k: k.__setitem__("query_start_loc", k["query_start_loc"].to("meta"))))
        if "has_initial_state" in sp.args:
            m.append((case, "has_initial_state not bool", "has_initial_state",
                      lambda k: k.__setitem__("has_initial_state", k["has_initial_state"].int())))
        if sp.index:
            i, p = sp.index, sp.pool
            m.append((case, "pad_slot_id 1.5", "pad_slot_id", lambda k: k.__setitem__("pad_slot_id", 1.5)))
            m.append((case, "pad_slot_id None", "pad_slot_id", lambda k: k.__setitem__("pad_slot_id", None)))
            m.append((case, "pad_slot_id past int64", "pad_slot_id", lambda k: k.__setitem__("pad_slot_id", 1 << 70)))
            m.append((case, "slot ids on the meta device", i, lambda k, i=i: k.__setitem__(i, k[i].to("meta"))))
            m.append((case, "pool whose slots share memory", p,
                      lambda k, p=p: k.__setitem__(p, k[p][:1].expand(k[p].shape))))
        if "dt_limit" in sp.options:
            m.append((case, "dt_limit of strings", "dt_limit", lambda k: k.__setitem__("dt_limit", ("a", "b"))))
            m.append((case, "dt_limit NaN", "dt_limit", lambda k: k.__setitem__("dt_limit", (float("nan"), 1.0))))
            m.append((case, "dt_limit not a pair", "dt_limit", lambda k: k.__setitem__("dt_limit", 0.5)))
        if "eps" in sp.options:
            m.append((case, "eps a string", "eps", lambda k: k.__setitem__("eps", "1e-6")))
            m.append((case, "eps NaN", "eps", lambda k: k.__setitem__("eps", float("nan"))))
        if "chunk_size" in sp.args:
            m.append((case, "chunk_size True", "chunk_size", lambda k: k.__setitem__("chunk_size", True)))
        if "D" in sp.args:
            m.append((case, "D of int64", "D", lambda k: k.__setitem__("D", torch.ones(
                k["A"].shape[0], dtype=torch.int64, device=k["A"].device))))
            m.append((case, "D complex", "D", lambda k: k.__setitem__("D", torch.ones(
                k["A"].shape[0], dtype=torch.complex64, device=k["A"].device))))
        for what, arg, mutate in sp.bad_inputs:
            m.append((case, what, arg, mutate))
    return m


MUTATIONS = _mutations()


@pytest.mark.parametrize("case,what,arg,mutate", MUTATIONS, ids=[f"{c}-{w}" for c, w, _, _ in MUTATIONS])
def test_bad_input_raises_before_launch(impl, device, case, what, arg, mutate):
    """Bad input raises ValueError naming the argument, and neither the pool nor `out=` is touched
    (nothing launched)."""
    sp = CASES[case][0]
    op = sp.name
    require(impl, op)
    kw = _build(case, device)
    mutate(kw)
    pool_arg = sp.pool
    pool_before = kw[pool_arg].clone() if pool_arg else None
    if "out" in kw:
        poison_(kw["out"])
        out_before = kw["out"].clone()
    with pytest.raises(ValueError) as ei:
        sp.call(strict_op(impl, op), kw)
    assert arg in str(ei.value), f"{op} ({what}): expected the error to name {arg!r}, got: {ei.value}"
    if pool_arg:
        assert_bitwise_equal(f"{op} ({what}): {pool_arg} after a rejected call", kw[pool_arg], pool_before)
    if "out" in kw:
        assert_bitwise_equal(f"{op} ({what}): out after a rejected call", kw["out"], out_before)


@pytest.mark.parametrize("case", list(CASES))
def test_valid_base_case_runs(impl, device, case):
    """The unmutated base cases above are valid (so each bad-input test isolates one defect). Ours must
    run every one; a third-party implementation may decline one it cannot do (e.g. float32, which the
    base cases use): that skips with its reason."""
    sp = CASES[case][0]
    require(impl, sp.name)
    try:
        sp.call(strict_op(impl, sp.name), _build(case, device))
    except NotImplementedError as e:
        if impl.name in OURS:
            raise
        pytest.skip(f"{impl.name} declines the base case of {sp.name}: {e}")


def test_kernels_compile_for_sm90(device):
    """Every Triton kernel variant the ops launch (each op with and without its optional inputs; the SSD
    pipeline with fp32 and activation-dtype pools; the Mamba-1 scan in one and several pieces) compiles for
    sm_90 ahead of time, NVIDIA-only paths (inline PTX) included. The interpreter, which runs the kernels in
    CI, accepts programs the compiler rejects (e.g. a loop-carried variable that changes type) and never
    takes those paths, so this runs the real compiler in a subprocess without TRITON_INTERPRET (bf16
    variants in the ci profile, every dtype in nightly)."""
    import os
    import subprocess
    import sys

    from harness.testing.optest import profile
    dtypes = ["bfloat16", "float16", "float32", "float64"] if profile() == "nightly" else ["bfloat16"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "harness.impls.triton.aot", *dtypes], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 2:
        pytest.skip(f"cannot compile for sm_90 here: {r.stdout.strip().splitlines()[-1:]}")
    assert r.returncode == 0, f"triton kernels failed to compile for sm_90:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


_AOT_SPECIALISATION = r"""
import sys, torch
from harness.impls.triton import aot
from harness.impls.triton.gated_rms_norm import _gated_norm_kernel as k
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
spec = aot._jit_specialisation(k, make_backend(GPUTarget("cuda", 90, 32)))
if spec is None:
    print("no JIT internals"); sys.exit(3)
x = torch.zeros(8, 64)
def div16(args):
    _, _, attrs, _ = spec(args, dict(BG=64, HAS_Z=False, NORM_BEFORE_GATE=False, ACC=torch.float32,
                                     EPS_F64=False, num_warps=4))
    return {i for (i,), a in attrs.items() if ["tt.divisibility", 16] in a}
w = torch.ones(64)
args = [x, w, x, x, w, 64, 1e-6, 64, 1, 1, 64, 1, 64, 1]
aligned = div16(args)
shifted = div16([x.view(-1)[1:].view(7, 73)[:, :64]] + args[1:])
print(sorted(aligned), sorted(shifted))
assert {0, 1, 2, 3, 5, 7, 10, 12} <= aligned, aligned   # aligned pointers, 64s
assert 0 not in shifted and {1, 2, 3} <= shifted, shifted  # x one element past an aligned address
"""


def test_aot_specialises_like_the_jit():
    """The offline compile specialises each launch as Triton's JIT does on a GPU: 16-byte-aligned pointers and
    integers divisible by 16 carry `tt.divisibility` 16 (what lets loads vectorise; without it the resource
    figures are those of scalar loads), and a pointer one element past an aligned address does not."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT_SPECIALISATION], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 3:
        pytest.skip("this Triton has no JIT binder to specialise with (the tool falls back to argument types)")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


_AOT_WIDE = """
import sys
from unittest import mock
import harness.impls.triton.delta_rule_chunk as gdn
from harness.impls.triton import aot
with mock.patch.object(gdn, "WIDE_SPAN", 0):
    sys.exit(aot.main(["--op", "gated_delta_rule_varlen,kda_varlen", "float32"]))
"""


def test_aot_compiles_the_wide_offset_variants():
    """The GDN and KDA prefill kernels' 64-bit tile-offset variants (taken only for views whose chunk rows span
    2**31 elements, so no spec shape reaches them) compile for sm_90: forced here by lowering
    delta_rule_chunk.WIDE_SPAN to 0. (A jit function returning a 32- or 64-bit tensor from two return statements
    compiled under the interpreter but not for the GPU.)"""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT_WIDE], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 2:
        pytest.skip(f"cannot compile for sm_90 here: {r.stdout.strip().splitlines()[-1:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "'WIDE': 'True'" in r.stdout, r.stdout[-2000:]


def test_aot_resources_and_op_filter():
    """`python -m harness.impls.triton.aot --op X --resources` compiles only X's kernels and gives each
    variant's registers, local memory and shared memory; an unknown op or dtype is a usage error."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "harness.impls.triton.aot", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    r = run("float32", "--op", "gated_rms_norm", "--resources", "--digest")
    if r.returncode == 2:
        pytest.skip(f"cannot compile for sm_90 here: {r.stdout.strip().splitlines()[-1:]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("compiled ")]
    assert lines and all("gated_rms_norm" in ln or "_norm" in ln for ln in lines), lines
    assert all("'reg': " in ln and "'stack': " in ln and "'dyn_shared': " in ln for ln in lines), lines
    assert all(re.search(r" ptx [0-9a-f]{12}$", ln) for ln in lines), lines
    assert all("'wgmma': 0" in ln and "'mma_sync': 0" in ln for ln in lines), lines  # a norm has no products
    for bad in (["--op", "nosuch"], ["float8"]):
        r = run(*bad)
        assert r.returncode == 2 and "expected" in r.stderr, r.stderr


def test_aot_mma_kinds_count_each_instruction_form():
    """aot.mma_kinds counts Hopper's warpgroup MMAs and warp-level mma.sync in a kernel's PTX (what told the GDN
    recurrence's value-major state update apart: mma.sync where its other product is a wgmma)."""
    from types import SimpleNamespace

    from harness.impls.triton import aot
    ptx = ("\twgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%f1}, %rd1, %rd2, p, 1, 1;\n"
           "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};\n"
           "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f3}, {%r3}, {%r4}, {%f4};\n")
    assert aot.mma_kinds(SimpleNamespace(asm={"ptx": ptx})) == {"wgmma": 1, "mma_sync": 2}
    assert aot.mma_kinds(SimpleNamespace(asm={"ptx": "\tadd.f32 %f1, %f2, %f3;\n"})) == {"wgmma": 0, "mma_sync": 0}


def test_aot_code_digest_ignores_debug_information():
    """aot.code_digest: the same instructions with other source lines (`.loc`, `$L__tmp` labels, the `.file`
    and `.debug_*` sections after the code) hash alike; another instruction does not."""
    from types import SimpleNamespace

    from harness.impls.triton import aot

    def ptx(loc, op="add.f32", path="/a/conv1d.py"):
        return SimpleNamespace(asm={"ptx": (
            f".visible .entry k(\n)\n{{\n\t.loc\t1 {loc} 5\n$L__tmp0:\n\t{op} \t%f3, %f1, %f2;\n"
            f"\t// begin inline asm\n\tret;\n}}\n\t.file\t1 \"{path}\"\n\t.section\t.debug_abbrev\n{{\n"
            f".b8 {loc}\n}}\n")})
    assert aot.code_digest(ptx(40)) == aot.code_digest(ptx(57, path="/b/conv1d.py"))
    assert aot.code_digest(ptx(40)) != aot.code_digest(ptx(40, op="sub.f32"))
