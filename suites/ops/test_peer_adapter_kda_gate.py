"""The fla lineage's chunked KDA declines log-decays below its safe-gate bound (harness.impls.adapters:
`require_kda_gate_floor`, docs/findings.md): a call with g < -5 anywhere raises NotImplementedError naming
the limit before the peer is reached; g at the bound passes; inside `no_index_checks()` nothing is read on
the host. No peer package is needed (the peer's import raises if it is reached)."""
import pytest
import torch

from harness.impls import adapters as A
from harness.impls.adapters import fla as fla_adapter
from harness.impls.adapters import vllm as vllm_adapter
from harness.ops import no_index_checks


def _kda_call(g_min: float):
    T, H, K, V = 5, 2, 3, 4
    q, k = torch.randn(T, H, K), torch.randn(T, H, K)
    v = torch.randn(T, H, V)
    g = torch.full((T, H, K), -0.5)
    g[3, 1, 2] = g_min
    beta = torch.rand(T, H)
    pool = torch.zeros(3, H, V, K)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return [q, k, v, g, beta, pool, i32(0, 2, T), i32(0, 2), torch.tensor([True, False])]


def test_floor_helper_declines_below_and_passes_at_the_bound():
    g = torch.tensor([-0.1, -5.0, -1.0])
    A.require_kda_gate_floor(g, "peer")  # at the bound: runs
    with pytest.raises(NotImplementedError, match=r"peer: per-token log-decays g >= -5 only .* got min g = -5\.5"):
        A.require_kda_gate_floor(torch.tensor([-0.1, -5.5]), "peer")
    with no_index_checks():
        A.require_kda_gate_floor(torch.tensor([-30.0]), "peer")  # no host read there: not checked
    A.require_kda_gate_floor(torch.zeros(0), "peer")


@pytest.mark.parametrize("adapter, who", [(fla_adapter, "fla chunk_kda"), (vllm_adapter, "vllm chunk_kda")])
def test_kda_varlen_declines_strong_decays_before_the_peer(monkeypatch, adapter, who):
    def unreachable(name):
        raise AssertionError(f"the peer ({name}) was reached")
    monkeypatch.setattr(adapter, "import_peer", unreachable)
    args = _kda_call(-12.0)
    before = args[5].clone()
    with pytest.raises(NotImplementedError, match=who + r": per-token log-decays g >= -5 only"):
        adapter.kda_varlen(*args)
    assert torch.equal(args[5], before)
    with pytest.raises(ValueError, match="g"):  # bad input is still the contract's error, first
        adapter.kda_varlen(*(args[:3] + [args[3][:, :, :2]] + args[4:]))
