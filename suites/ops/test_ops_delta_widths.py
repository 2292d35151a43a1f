"""Op suite: the chunked GDN and KDA prefill at every key and value width class, in every dtype, with and
without the in-kernel l2 norm.

A compiled kernel is a different program for each block size its launch derives from K and V (powers of two,
at least 16), for half and fp32 operands, and with or without the l2 normalisation of q and k: a compiler
fault at one of them shows at that class only. Triton 3.6 compiled our GDN output launch to an out-of-range
shared-memory address for half inputs with K <= 64 and at most 8 value columns, with the l2 norm only
(docs/findings.md); the drawn cases of test_ops_delta_rule.py reach such a class rarely. This grid runs each
class once on a small batch: two requests of 5 and 1 tokens, the first from zeros, the second from its slot,
GQA 2 -> 4 heads for GDN, scale 0.25, against the float64 reference recurrence.

On the CPU the Triton interpreter runs a corner of the grid (its fp32 programs, minutes for the whole); the
peers' adapters are left out (their kernels autotune per width class: minutes each; the drawn cases of the
other suites cover them)."""

import pytest
import torch

from harness.testing.delta_cases import run_varlen_case
from harness.testing.optest import interp_small, require

OPS = {"gdn": "gated_delta_rule_varlen", "kda": "kda_varlen"}
KS = (16, 32, 64, 128)
VS = (5, 8, 16, 64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INTERP = {(16, 5), (64, 8), (128, 16)}  # the interpreter's corner: (K, V)
CASE = ([5, 1], [False, True], [0, 2])


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
@pytest.mark.parametrize("V", VS, ids=[f"V{v}" for v in VS])
@pytest.mark.parametrize("K", KS, ids=[f"K{k}" for k in KS])
@pytest.mark.parametrize("kind", sorted(OPS))
def test_prefill_at_every_width_class(impl, kind, K, V, dtype, l2, device, check):
    op = OPS[kind]
    require(impl, op, dtype, device)
    fn = impl.op(op)
    if getattr(fn, "__module__", "").startswith("harness.impls.adapters"):
        pytest.skip(f"{impl.name}: a peer's adapter; its kernels autotune per width class (minutes each), the "
                    "drawn cases of test_ops_delta_rule.py cover it")
    if interp_small(device, impl) and (K, V) not in INTERP:
        pytest.skip(f"the Triton interpreter runs the corner {sorted(INTERP)} of the (K, V) grid on the CPU "
                    "(minutes for the whole); the GPU runs all of it")
    Hk, Hv = (2, 4) if kind == "gdn" else (2, 2)
    run_varlen_case(check, fn, impl.name, op, kind, CASE, Hk=Hk, Hv=Hv, K=K, V=V, dtype=dtype, device=device,
                    seed=K * 1000 + V, l2=l2, scale=0.25)


@pytest.mark.parametrize("V", [64, 128], ids=["V64", "V128"])
def test_gdn_half_k128_outputs_every_time(impl, V, device, check):
    """GDN at fp16, K = 128, l2norm, run four times: Triton 3.6 compiled the output launch's one-pass loop over
    one whole (64, 128) block per operand at two pipeline stages to outputs off by 10-30 % on the H200 in most
    runs, not all (docs/findings.md); the launch now walks 64-column blocks. The width grid runs this class
    once; here a run that comes out right by chance does not hide the fault."""
    op = OPS["gdn"]
    require(impl, op, torch.float16, device)
    fn = impl.op(op)
    if getattr(fn, "__module__", "").startswith("harness.impls.adapters"):
        pytest.skip(f"{impl.name}: a peer's adapter; the drawn cases of test_ops_delta_rule.py cover it")
    if interp_small(device, impl):
        pytest.skip("a fault of the GPU compile at half inputs; the Triton interpreter runs no compiled code")
    for _ in range(4):
        run_varlen_case(check, fn, impl.name, op, "gdn", CASE, Hk=2, Hv=4, K=128, V=V, dtype=torch.float16,
                        device=device, seed=128 * 1000 + V, l2=True, scale=0.25)
