"""Tensor-parallel engine (harness/engine/tp.py): a model sharded over 2 ranks of torch.distributed runs like
the same model on one rank.

Properties, for Mamba-1, Falcon-Mamba and Mamba-2 (one group replicated on both ranks, and two groups
split), with every implementation the suite runs here (on the CPU: reference and torch, float64, 2 processes
over gloo; on CUDA: 2 GPUs over NCCL, ``--device cuda``):

* the greedy tokens of TP = 2 equal those of TP = 1 exactly, on every rank;
* every state each rank holds (final states, the state after every step, prefix-cache snapshots) equals the
  rank's slice of the TP = 1 state (``reference.cache`` specs with ``tp_size``: channels and heads split,
  Mamba-2's single group replicated) within the checker's tolerance.

The requests mix chunked prefills (a small token budget), decode rows padded with pad requests, and a
shared prefix whose blocks are snapshotted. All sharded runs of a pytest run share ONE spawned group of ranks
(starting processes costs more than running the tiny models). Refusals need no group: families that cannot
be split (GDN, KDA), splits the weights do not allow, and bad ranks are ValueErrors before anything is built.
"""
from __future__ import annotations

import pytest
import torch

from harness.engine import tp as tp_mod
from harness.engine.runner import EngineRunner, state_spec
from harness.engine.scheduler import Request
from harness.engine.tp import TensorParallel, shard_mixer_params, state_slice
from harness.scenarios import engine_impl, random_params, skip_reason, tiny_config
from harness.testing.checks import tolerance_for
from harness.testing.plugin import selected_impls
from reference import families
from reference.cache import Mamba2Spec

TP = 2
CPU_IMPLS = ("reference", "torch")  # the others' kernels run under Triton's interpreter on the CPU: too slow here
CONFIGS = tp_mod.tp_configs(TP)
PREFIX = [7, 3, 11, 42, 5, 9, 30, 2, 18, 27]  # shared by two requests: a block of 8 is snapshotted


def _requests():
    return [Request("shared-a", PREFIX + [1, 4, 8], 3, True), Request("one", [13], 4),
            Request("shared-b", PREFIX + [22], 3, True), Request("mid", [40, 41, 2, 6, 19], 2)]


def _runner_kwargs(case: str, dtype) -> dict:
    return dict(num_slots=4, token_budget=7, cache_mode="all", block_size=8, dtype=dtype, record_states=True,
                decode_pad_multiple=4, layout="page_major" if case.endswith("g2") else "layer_major")


def _dtype(impl):
    return torch.float64 if torch.float64 in impl.dtypes else torch.float32


def _why_not(impl, device, family) -> str | None:
    why = skip_reason(impl, device, family)
    if why:
        return why
    if device.startswith("cpu") and impl.name not in CPU_IMPLS:
        return (f"the CPU run of the TP suite covers {list(CPU_IMPLS)}; {impl.name!r} runs its kernels under "
                f"Triton's interpreter, too slow for 2 processes on a small machine (the suite runs it on GPUs)")
    return None


_RUNS: dict = {}


def _sharded_runs(device: str) -> dict:
    """{(impl name, case): per-rank plain results} of every case the selected implementations run, from one
    spawned group of TP ranks (started on first use, once per pytest run)."""
    if device not in _RUNS:
        jobs, keys = [], []
        for impl in selected_impls():
            for case, cfg in CONFIGS.items():
                if _why_not(impl, device, cfg.family) is None:
                    keys.append((impl.name, case))
                    jobs.append(((cfg, random_params(cfg, 5)), impl.name, _requests(),
                                 _runner_kwargs(case, _dtype(engine_impl(impl)))))
        _RUNS[device] = dict(zip(keys, tp_mod.run_engines(jobs, TP, device=device))) if jobs else {}
    return _RUNS[device]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_engine_tp2_equals_tp1(case, impl, device, check):
    """Property: TP = 2 (gloo on the CPU, NCCL on CUDA) gives TP = 1's greedy tokens exactly on both ranks,
    and each rank's states (final, after every step, prefix-cache snapshots) are the matching slices of
    TP = 1's within the checker's tolerance."""
    cfg = CONFIGS[case]
    why = _why_not(impl, device, cfg.family) or tp_mod.distributed_unavailable(device, TP)
    if why:
        pytest.skip(why)
    run = engine_impl(impl)
    dtype = _dtype(run)
    one = EngineRunner((cfg, random_params(cfg, 5)), run, device=tp_mod.rank_device(device, 0),
                       **_runner_kwargs(case, dtype))
    results = one.run(_requests())
    single = tp_mod.plain_results(one, results)
    assert single["snapshots"], "the case must take prefix-cache snapshots"
    assert any(sum(not s[3] for s in r.steps) > 1 for r in results.values()), "the case must chunk a prefill"
    ranks = _sharded_runs(device)[(impl.name, case)]
    assert len(ranks) == TP
    for rank, part in enumerate(ranks):
        if part.get("declined"):
            pytest.skip(f"declined on rank {rank}: {part['error']}")
        assert "error" not in part, f"{case} [{impl.name}] rank {rank} of {TP}: {part['error']}"
    spec = state_spec(cfg, dtype, torch.float64 if dtype == torch.float64 else torch.float32, tp_size=TP)
    for rank, part in enumerate(ranks):
        for rid, res in single["results"].items():
            got = part["results"][rid]["tokens"]
            assert got == res["tokens"], (f"{case} [{impl.name}, {dtype}] request {rid!r}: rank {rank} of {TP} "
                                          f"generated {got}, TP = 1 {res['tokens']}")
        bad, pairs = tp_mod.paired_states(spec, single, part, rank)
        assert not bad, "\n".join(bad)
        assert {w for w, _, _ in pairs} == {"final states", "states after every step", "prefix-cache snapshots"}
        for what, actual, expected in pairs:
            check.close(f"{case}: {what}, rank {rank} of {TP} vs the slice of TP = 1", actual, expected,
                        op="engine_tp", impl=run.name, dtype=dtype, tol=tolerance_for(dtype),
                        shapes={"states": [actual.numel()]},
                        context=f"{cfg.family} {families.get(cfg.family).summary(cfg)}")


# ------------------------------------------------------------------------------------------ no group needed

def test_engine_tp_cases():
    """The cases are Mamba-1, Falcon-Mamba and Mamba-2 with one group (replicated) and two groups (split);
    the hybrid families (GDN, KDA) are left out because they refuse tp_size 2."""
    assert set(CONFIGS) == {"mamba1", "falcon_mamba", "mamba2-g1", "mamba2-g2"}
    assert (CONFIGS["mamba2-g1"].n_groups, CONFIGS["mamba2-g2"].n_groups) == (1, 2)


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_engine_tp_refuses_families_that_cannot_be_split(family):
    """GDN and KDA (hybrid families) refuse tp_size 2 with a ValueError naming tp_size, before any
    collective or allocation."""
    cfg = tiny_config(family)
    with pytest.raises(ValueError, match=r"^tp_size: expected 1 \(tensor parallelism is not supported"):
        EngineRunner((cfg, random_params(cfg, 0)), "torch", tp=TensorParallel(0, 2))


def test_engine_tp_refuses_bad_splits_and_ranks():
    """A split the weights do not allow (Mamba-2 heads or groups, Mamba-1 channels), a rank outside the
    group and a `tp` that is no TensorParallel are ValueErrors naming the argument."""
    m2 = families.get("mamba2").build_config(d_model=16, n_layer=1, vocab=60, chunk_size=8, d_state=8, head_dim=8,
                                             n_groups=2)  # 4 heads, 2 groups
    with pytest.raises(ValueError, match=r"^tp_size: expected a divisor of num_heads = 4, got 3$"):
        EngineRunner((m2, random_params(m2, 0)), "torch", tp=TensorParallel(0, 3))
    with pytest.raises(ValueError, match=r"^tp_size: expected a divisor of n_groups = 2 \(or n_groups == 1\), got 4$"):
        EngineRunner((m2, random_params(m2, 0)), "torch", tp=TensorParallel(0, 4))
    m1 = tiny_config("mamba1")
    with pytest.raises(ValueError, match=rf"^tp_size: expected a divisor of d_inner = {m1.d_inner}, got 3$"):
        EngineRunner((m1, random_params(m1, 0)), "torch", tp=TensorParallel(1, 3))
    with pytest.raises(ValueError, match=r"^tp_rank: expected an int in 0\.\.1, got 2$"):
        TensorParallel(2, 2)
    with pytest.raises(ValueError, match=r"^tp_size: expected an int >= 1, got 0$"):
        TensorParallel(0, 0)
    with pytest.raises(ValueError, match=r"^tp: expected None or a harness.engine.tp.TensorParallel, got tuple$"):
        EngineRunner((m1, random_params(m1, 0)), "torch", tp=(0, 2))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_engine_tp_weight_cuts(case):
    """Each rank's mixer weights are the same whether they come whole (cut by the engine) or already cut
    (as the fast loader reads them); the cuts of all ranks put back together (harness.loader.assemble_shards)
    are the whole weights; a weight of any other shape is a ValueError naming it."""
    from harness.loader import assemble_shards
    cfg = CONFIGS[case]
    params = {k.split(".mixer.", 1)[1]: v for k, v in random_params(cfg, 1).items() if k.startswith("layers.0.mixer.")}
    cuts = []
    for rank in range(TP):
        tp = TensorParallel(rank, TP)
        local, shapes = shard_mixer_params(cfg, params, tp)
        assert {k: tuple(v.shape) for k, v in local.items()} == shapes
        again, _ = shard_mixer_params(cfg, local, tp)
        assert all(torch.equal(again[k], local[k]) for k in local)
        cuts.append(local)
    for name, whole in params.items():
        assert torch.equal(assemble_shards([c[name] for c in cuts], tp_mod.shard_rule(cfg, name)), whole), name
    bad = dict(params, **{"out_proj.weight": params["out_proj.weight"][:, :3]})
    with pytest.raises(ValueError, match=r"^params\['out_proj.weight'\]: expected shape"):
        shard_mixer_params(cfg, bad, TensorParallel(0, TP))


def test_state_slice_follows_the_spec():
    """state_slice cuts a whole state as the per-rank spec lays it out: Mamba-2 with one group keeps B and C
    whole on every rank and splits x; with two groups each rank takes its group; heads split."""
    N, Pd = 2, 1
    whole = Mamba2Spec(num_heads=4, head_dim=Pd, state_size=N, n_groups=1, conv_kernel=3, tp_size=1)
    conv = torch.arange(whole.conv_dim, dtype=torch.float64)[:, None].expand(-1, 2)
    x, b, c = list(range(4)), [4, 5], [6, 7]
    spec1 = Mamba2Spec(num_heads=4, head_dim=Pd, state_size=N, n_groups=1, conv_kernel=3, tp_size=2)
    assert state_slice(spec1, "conv", conv, 1)[:, 0].tolist() == x[2:] + b + c
    whole2 = Mamba2Spec(num_heads=4, head_dim=Pd, state_size=N, n_groups=2, conv_kernel=3, tp_size=1)
    conv2 = torch.arange(whole2.conv_dim, dtype=torch.float64)[:, None].expand(-1, 2)
    spec2 = Mamba2Spec(num_heads=4, head_dim=Pd, state_size=N, n_groups=2, conv_kernel=3, tp_size=2)
    assert state_slice(spec2, "conv", conv2, 0)[:, 0].tolist() == [0, 1, 4, 5, 8, 9]
    assert state_slice(spec2, "conv", conv2, 1)[:, 0].tolist() == [2, 3, 6, 7, 10, 11]
    rec = torch.arange(4, dtype=torch.float64).reshape(4, 1, 1).expand(4, Pd, N)
    assert state_slice(spec2, "recurrent", rec, 1)[:, 0, 0].tolist() == [2, 3]
    with pytest.raises(ValueError, match=r"^full: expected a whole conv state of 12 channels"):
        state_slice(spec2, "conv", conv2[:10], 0)
