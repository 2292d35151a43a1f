"""Reproduce, on the CPU, the mamba_ssm 2.3.2 varlen-state bug the engine oracle found on the H200
(docs/findings.md).

mamba_ssm's own Triton kernels run under TRITON_INTERPRET=1 (autotune cut to its first config, and
torch.cuda.device made a no-op, both only in this process), through our adapter, next to the float64
reference op. A sequence that starts from a state and ends inside its first chunk gets a final state
without the initial state's contribution (its y is right); across a chunk boundary, or with no initial
state, the states agree. Needs .peers/mamba_ssm-2.3.2.post1.tar.gz (scripts/peers_setup.sh).

    python scripts/peer_ssd_state_cpu.py            # ~1 min on 2 cores
    PYTHONPATH=scripts python -m pytest suites/ops/test_ops_ssd.py --device cpu -k "first_chunk or (matches_oracle and float32)" \
        --impl peer_ssd_state_cpu:IMPL              # the suites against the peer's kernels on the CPU
"""
import contextlib
import glob
import os
import sys
import tarfile

os.environ["TRITON_INTERPRET"] = "1"
os.environ["HARNESS_PEERS_STUB_CUDA"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
src = "/tmp/peers/mamba_ssm-2.3.2.post1"
if not os.path.isdir(src):
    sdist = glob.glob(os.path.join(ROOT, ".peers", "mamba_ssm-*.tar.gz"))
    if not sdist:
        sys.exit("needs .peers/mamba_ssm-2.3.2.post1.tar.gz")
    with tarfile.open(sdist[0]) as t:
        t.extractall("/tmp/peers")
sys.path[:0] = [ROOT, src]

import triton  # noqa: E402

_autotune = triton.autotune
triton.autotune = lambda configs, *a, **k: _autotune(configs[:1], *a, **k)  # the interpreter takes one config
import torch  # noqa: E402

torch.cuda.device = lambda index: contextlib.nullcontext()  # mamba_ssm enters the tensor's CUDA device

from harness.impls import registry  # noqa: E402
from harness.impls.adapters import mamba_ssm as peer  # noqa: E402

from harness.impls.registry import Impl  # noqa: E402

ref = registry.get("reference").ops["ssd_varlen"]
# the adapter's ssd_varlen as a CPU implementation (for --impl peer_ssd_state_cpu:IMPL)
IMPL = Impl(name="mamba_ssm_cpu", devices=("cpu",), dtypes=(torch.float32,), ops={"ssd_varlen": peer.ssd_varlen},
            description="mamba_ssm 2.3.2 Triton SSD under the CPU interpreter (scripts/peer_ssd_state_cpu.py)")
H, P, N, CHUNK = 2, 4, 4, 8


def case(lengths, from_state, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lengths), len(lengths)
    x, dt = torch.randn(T, H, P, generator=g), torch.rand(T, H, generator=g) * 0.5
    B, Cm = torch.randn(T, 1, N, generator=g), torch.randn(T, 1, N, generator=g)
    A, D, dtb = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g), torch.rand(H, generator=g) * 0.1
    qsl = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(S)], dtype=torch.int32)
    idx, hi = torch.arange(S, dtype=torch.int32), torch.tensor(from_state)
    pool0 = torch.randn(S, H, P, N, generator=g)
    res = []
    for op in (ref, peer.ssd_varlen):
        pool = pool0.clone()
        y = op(x, dt, A, B, Cm, CHUNK, D, None, dtb, pool, qsl, idx, hi, dt_softplus=True)
        res.append((y, pool))
    (yr, sr), (yp, sp) = res
    # what a dropped initial state would miss: exp(sum of dt*A over the sequence) * initial state
    dA = (torch.nn.functional.softplus(dt + dtb) * A)
    miss = [float((torch.exp(dA[qsl[i]:qsl[i + 1]].sum(0))[:, None, None] * pool0[i]).abs().max())
            if from_state[i] else 0.0 for i in range(S)]
    print(f"lengths {lengths} from_state {from_state} chunk {CHUNK}: max|dy| {float((yr - yp).abs().max()):.1e}; "
          f"per sequence max|state diff| {[f'{float((sr[i] - sp[i]).abs().max()):.1e}' for i in range(S)]}, "
          f"|decayed initial state| {[f'{m:.1e}' for m in miss]}")


if __name__ == "__main__":
    case([5], [True])
    case([5, 6], [True, False])
    case([13], [True])
    case([8], [True])
    case([5], [False])
