"""Op contract: bad input raises ValueError (naming the argument) before any kernel runs, for every op
and every implementation that provides it: wrong dtypes or layouts, slot ids outside the pool,
duplicate live slots, query_start_loc inconsistent with the token count, a bad `out=`."""
import pytest
import torch

from harness.checks import assert_bitwise_equal, poison_
from harness.impls.optest import require
from harness.testing import strict_op

I32 = torch.int32


def _conv_varlen(dev):
    T, D, K = 5, 4, 3
    return dict(x=torch.randn(T, D, device=dev), weight=torch.randn(D, K, device=dev), bias=None,
                conv_states=torch.randn(3, D, K - 1, device=dev),
                query_start_loc=torch.tensor([0, 2, 5], dtype=I32, device=dev),
                cache_indices=torch.tensor([2, 0], dtype=I32, device=dev),
                has_initial_state=torch.tensor([True, False], device=dev))


def _conv_update(dev):
    D, K = 4, 3
    return dict(x=torch.randn(2, D, device=dev), conv_states=torch.randn(3, D, K - 1, device=dev),
                weight=torch.randn(D, K, device=dev), bias=None,
                conv_state_indices=torch.tensor([1, 2], dtype=I32, device=dev))


def _scan(dev):
    T, Dm, N = 5, 4, 3
    return dict(u=torch.randn(T, Dm, device=dev), delta=torch.randn(T, Dm, device=dev),
                A=-torch.rand(Dm, N, device=dev), B=torch.randn(T, 1, N, device=dev),
                C=torch.randn(T, 1, N, device=dev), D=None, z=None, delta_bias=None,
                ssm_states=torch.randn(3, Dm, N, device=dev),
                query_start_loc=torch.tensor([0, 2, 5], dtype=I32, device=dev),
                cache_indices=torch.tensor([2, 0], dtype=I32, device=dev),
                has_initial_state=torch.tensor([True, False], device=dev))


def _ssu2(dev):
    H, P, N = 2, 3, 4
    return dict(state=torch.randn(3, H, P, N, device=dev), x=torch.randn(2, H, P, device=dev),
                dt=torch.randn(2, H, device=dev), A=-torch.rand(H, device=dev), B=torch.randn(2, 1, N, device=dev),
                C=torch.randn(2, 1, N, device=dev), D=None, z=None, dt_bias=None,
                state_batch_indices=torch.tensor([0, 2], dtype=I32, device=dev))


def _ssu1(dev):
    Dm, N = 4, 3
    return dict(state=torch.randn(3, Dm, N, device=dev), x=torch.randn(2, Dm, device=dev),
                dt=torch.randn(2, Dm, device=dev), A=-torch.rand(Dm, N, device=dev),
                B=torch.randn(2, 1, N, device=dev), C=torch.randn(2, 1, N, device=dev), D=None, z=None,
                dt_bias=None, state_batch_indices=torch.tensor([0, 2], dtype=I32, device=dev))


def _ssd(dev):
    T, H, P, N = 5, 2, 3, 4
    return dict(x=torch.randn(T, H, P, device=dev), dt=torch.randn(T, H, device=dev), A=-torch.rand(H, device=dev),
                B=torch.randn(T, 1, N, device=dev), C=torch.randn(T, 1, N, device=dev), chunk_size=4, D=None,
                z=None, dt_bias=None, ssm_states=torch.randn(3, H, P, N, device=dev),
                query_start_loc=torch.tensor([0, 2, 5], dtype=I32, device=dev),
                cache_indices=torch.tensor([2, 0], dtype=I32, device=dev),
                has_initial_state=torch.tensor([True, False], device=dev))


def _norm(dev):
    return dict(x=torch.randn(3, 6, device=dev), weight=torch.randn(6, device=dev), z=torch.randn(3, 6, device=dev))


# op -> (builder, pool argument or None, positional arg names in order)
CASES = {
    "causal_conv1d_varlen": (_conv_varlen, "conv_states"),
    "causal_conv1d_update": (_conv_update, "conv_states"),
    "selective_scan_varlen": (_scan, "ssm_states"),
    "selective_state_update/mamba2": (_ssu2, "state"),
    "selective_state_update/mamba1": (_ssu1, "state"),
    "ssd_varlen": (_ssd, "ssm_states"),
    "gated_rms_norm": (_norm, None),
}

_qsl_ops = ("causal_conv1d_varlen", "selective_scan_varlen", "ssd_varlen")
_idx_arg = {"causal_conv1d_varlen": "cache_indices", "selective_scan_varlen": "cache_indices",
            "ssd_varlen": "cache_indices", "causal_conv1d_update": "conv_state_indices",
            "selective_state_update/mamba2": "state_batch_indices",
            "selective_state_update/mamba1": "state_batch_indices"}
_first = {"causal_conv1d_varlen": "x", "causal_conv1d_update": "x", "selective_scan_varlen": "u",
          "selective_state_update/mamba2": "x", "selective_state_update/mamba1": "x", "ssd_varlen": "x",
          "gated_rms_norm": "x"}


def _mutations():
    """(case, mutation name, argument the error must name, mutate(kwargs) -> None)."""
    m = []
    for case in CASES:
        a = _first[case]
        m.append((case, "int activations", a, lambda k, a=a: k.__setitem__(a, k[a].to(torch.int32))))
        m.append((case, "extra dim", a, lambda k, a=a: k.__setitem__(a, k[a][None])))
        m.append((case, "out of wrong shape", "out", lambda k, a=a: k.__setitem__("out", torch.empty(
            (k[a].shape[0] + 1,) + tuple(k[a].shape[1:]), dtype=k[a].dtype, device=k[a].device))))
        m.append((case, "out of wrong dtype", "out", lambda k, a=a: k.__setitem__("out", torch.empty_like(
            k[a], dtype=torch.float64 if k[a].dtype != torch.float64 else torch.float32))))
        if case in _idx_arg:
            i = _idx_arg[case]
            m.append((case, "slot id past the pool", i, lambda k, i=i: k[i].__setitem__(0, 3)))
            m.append((case, "negative slot id (not pad)", i, lambda k, i=i: k[i].__setitem__(0, -2)))
            m.append((case, "float slot ids", i, lambda k, i=i: k.__setitem__(i, k[i].float())))
            m.append((case, "duplicate live slots", i, lambda k, i=i: k[i].__setitem__(1, int(k[i][0]))))
        if case in _qsl_ops:
            m.append((case, "query_start_loc ends before T", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(-1, 4)))
            m.append((case, "query_start_loc ends after T", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(-1, 6)))
            m.append((case, "query_start_loc not from 0", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(0, 1)))
            m.append((case, "query_start_loc decreasing", "query_start_loc",
                      lambda k: k["query_start_loc"].__setitem__(1, 6)))
            m.append((case, "has_initial_state not bool", "has_initial_state",
                      lambda k: k.__setitem__("has_initial_state", k["has_initial_state"].int())))
        if case.startswith("selective_state_update") or case in ("selective_scan_varlen", "ssd_varlen"):
            m.append((case, "B with a group count not dividing", "B",
                      lambda k: k.__setitem__("B", torch.cat([k["B"]] * 3, dim=1))))
        if case == "causal_conv1d_varlen" or case == "causal_conv1d_update":
            m.append((case, "kernel width 9", "weight", lambda k: k.__setitem__("weight", torch.randn(
                k["weight"].shape[0], 9, device=k["weight"].device))))
        if case == "selective_state_update/mamba2":
            m.append((case, "state with 5 dims", "state", lambda k: k.__setitem__("state", k["state"][..., None])))
            m.append((case, "D of wrong shape", "D", lambda k: k.__setitem__("D", torch.randn(
                5, device=k["x"].device))))
        if case == "gated_rms_norm":
            m.append((case, "group_size not dividing D", "group_size", lambda k: k.__setitem__("group_size", 4)))
    return m


MUTATIONS = _mutations()


@pytest.mark.parametrize("case,what,arg,mutate", MUTATIONS, ids=[f"{c}-{w}" for c, w, _, _ in MUTATIONS])
def test_bad_input_raises_before_launch(impl, device, case, what, arg, mutate):
    """Bad input raises ValueError naming the argument, and neither the pool nor `out=` is touched
    (nothing launched)."""
    op = case.split("/")[0]
    require(impl, op)
    build, pool_arg = CASES[case]
    kw = build(device)
    mutate(kw)
    pool_before = kw[pool_arg].clone() if pool_arg else None
    if "out" in kw:
        poison_(kw["out"])
        out_before = kw["out"].clone()
    names = list(kw)
    posn = [n for n in names if n not in ("out", "group_size")]
    args = [kw[n] for n in posn]
    extra = {n: kw[n] for n in ("out", "group_size") if n in kw}
    with pytest.raises(ValueError) as ei:
        strict_op(impl, op)(*args, **extra)
    assert arg in str(ei.value), f"{op} ({what}): expected the error to name {arg!r}, got: {ei.value}"
    if pool_arg:
        assert_bitwise_equal(f"{op} ({what}): {pool_arg} after a rejected call", kw[pool_arg], pool_before)
    if "out" in kw:
        assert_bitwise_equal(f"{op} ({what}): out after a rejected call", kw["out"], out_before)


@pytest.mark.parametrize("case", list(CASES))
def test_valid_base_case_runs(impl, device, case):
    """The unmutated base cases above are valid (so each bad-input test isolates one defect)."""
    op = case.split("/")[0]
    require(impl, op)
    kw = CASES[case][0](device)
    strict_op(impl, op)(*kw.values())


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

    from harness.impls.optest import profile
    dtypes = ["bfloat16", "float16", "float32", "float64"] if profile() == "nightly" else ["bfloat16"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "harness.impls.triton.aot", *dtypes], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 2:
        pytest.skip(f"cannot compile for sm_90 here: {r.stdout.strip().splitlines()[-1:]}")
    assert r.returncode == 0, f"triton kernels failed to compile for sm_90:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
