"""Tensor-parallel engine (harness/engine/tp.py): a model sharded over 2 ranks of torch.distributed runs like
the same model on one rank.

Properties, for every family with whole models: Mamba-1, Falcon-Mamba, Mamba-2 (one group replicated on both
ranks, and two groups split), Gated DeltaNet (Qwen3-Next: GDN mixer, gated full attention over one replicated
and over two split key/value heads, a dense and a mixture-of-experts MLP) and KDA (Kimi Linear: KDA mixer,
latent attention, a dense and a mixture-of-experts MLP), with every implementation the suite runs here (on the
CPU: reference and torch, float64, 2 processes over gloo; on CUDA: 2 GPUs over NCCL, ``--device cuda``):

* the greedy tokens of TP = 2 equal those of TP = 1 exactly, on every rank;
* every state each rank holds (final states, the state after every step, prefix-cache snapshots) equals the
  rank's slice of the TP = 1 state (``reference.cache`` specs with ``tp_size``: channels and heads split,
  Mamba-2's single group replicated; the hybrids' paged keys and values: the rank's key/value heads) within
  the checker's tolerance.

The requests mix chunked prefills (a small token budget), decode rows padded with pad requests, and a
shared prefix whose blocks are snapshotted. All sharded runs of a pytest run share ONE spawned group of ranks
(starting processes costs more than running the tiny models); that group also runs GDN with weights cut per
rank before they reach the ranks: cut right (the control) and with in_proj_qkvz cut as [q | k | v | z]
sections, ignoring the checkpoint's per-key-head interleaving (the property must fail). Refusals need no
group: splits the weights do not allow and bad ranks are ValueErrors before anything is built.
"""
from __future__ import annotations

import pytest
import torch

from harness.engine import tp as tp_mod
from harness.engine.runner import EngineRunner, state_spec
from harness.engine.scheduler import Request
from harness.engine.tp import TensorParallel, kv_heads_of_rank, shard_mixer_params, split_heads, state_slice
from harness.loader import ShardRule, take_shard
from harness.scenarios import engine_impl, random_params, skip_reason, tiny_config
from harness.testing.checks import tolerance_for
from harness.testing.plugin import selected_impls
from reference import families
from reference.cache import GDNSpec, KDASpec, Mamba2Spec
from reference.config import MoESpec

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


PLANTED_CASE = "gdn-kv1"


def _qkvz_cuts(cfg) -> dict:
    """{variant: the cut of in_proj_qkvz}: the family's (whole key-head groups of the interleaved checkpoint
    layout) and a wrong one (q, k, v, z sections, as if the rows were not interleaved per key head)."""
    return {"right": tp_mod.shard_rule(cfg, "in_proj_qkvz.weight"),
            "wrong": ShardRule(0, ((cfg.key_dim, True), (cfg.key_dim, True), (cfg.value_dim, True),
                                   (cfg.value_dim, True)))}


def _per_rank_model(cfg, params: dict, qkvz_rule) -> list:
    """[(cfg, rank r's params)]: every layer's in_proj_qkvz cut by `qkvz_rule` before it reaches the ranks (the
    ranks take a weight of the local shape as already cut); the other weights whole, cut by the engine."""
    return [(cfg, {k: take_shard(v, qkvz_rule, r, TP) if k.endswith(".mixer.in_proj_qkvz.weight") else v
                   for k, v in params.items()}) for r in range(TP)]


def _planted_impl(device):
    """The implementation the planted runs use: the first selected one that runs GDN here (None: none)."""
    return next((i for i in selected_impls() if _why_not(i, device, "gdn") is None), None)


_RUNS: dict = {}


def _sharded_runs(device: str) -> dict:
    """{(impl name, case): per-rank plain results} of every case the selected implementations run, and
    {("qkvz cut", variant): ...} of the planted GDN runs, from one spawned group of TP ranks (started on first
    use, once per pytest run)."""
    if device not in _RUNS:
        jobs, keys = [], []
        for impl in selected_impls():
            for case, cfg in CONFIGS.items():
                if _why_not(impl, device, cfg.family) is None:
                    keys.append((impl.name, case))
                    jobs.append(((cfg, random_params(cfg, 5)), impl.name, _requests(),
                                 _runner_kwargs(case, _dtype(engine_impl(impl)))))
        planted = _planted_impl(device)
        if planted is not None:
            cfg = CONFIGS[PLANTED_CASE]
            for variant, rule in _qkvz_cuts(cfg).items():
                keys.append(("qkvz cut", variant))
                jobs.append((_per_rank_model(cfg, random_params(cfg, 5), rule), planted.name, _requests(),
                             _runner_kwargs(PLANTED_CASE, _dtype(engine_impl(planted)))))
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


def test_engine_tp_detects_a_wrong_qkvz_cut(device):
    """Planted bug: GDN whose in_proj_qkvz reaches the ranks cut as [q | k | v | z] sections (ignoring the
    checkpoint's per-key-head interleaving) must fail the property, while the same weights cut as the family
    says and handed over per rank the same way (the control) pass it."""
    impl = _planted_impl(device)
    why = (None if impl else "no selected implementation runs GDN here") or tp_mod.distributed_unavailable(device, TP)
    if why:
        pytest.skip(why)
    cfg = CONFIGS[PLANTED_CASE]
    run = engine_impl(impl)
    dtype = _dtype(run)
    one = EngineRunner((cfg, random_params(cfg, 5)), run, device=tp_mod.rank_device(device, 0),
                       **_runner_kwargs(PLANTED_CASE, dtype))
    single = tp_mod.plain_results(one, one.run(_requests()))
    spec = state_spec(cfg, dtype, torch.float64 if dtype == torch.float64 else torch.float32, tp_size=TP)
    runs = _sharded_runs(device)
    for variant in ("right", "wrong"):
        for rank, part in enumerate(runs[("qkvz cut", variant)]):
            if part.get("declined"):
                pytest.skip(f"declined on rank {rank}: {part['error']}")
    right = tp_mod.compare_ranks(spec, single, runs[("qkvz cut", "right")], tolerance_for(dtype))
    assert not right, "the control (the family's cut, handed over per rank) fails:\n" + "\n".join(right)
    wrong = tp_mod.compare_ranks(spec, single, runs[("qkvz cut", "wrong")], tolerance_for(dtype))
    assert wrong, "a wrong in_proj_qkvz cut passed the tensor-parallel property"
    assert not any("error" in part for part in runs[("qkvz cut", "wrong")]), wrong
    assert any("states" in line or "snapshots" in line for line in wrong), wrong


# ------------------------------------------------------------------------------------------ no group needed

def test_engine_tp_cases():
    """The cases are every family with whole models: Mamba-1, Falcon-Mamba, Mamba-2 with one group
    (replicated) and two groups (split), GDN with one key/value head (replicated) and two (split), KDA; the
    hybrids with a dense and a mixture-of-experts MLP."""
    assert set(CONFIGS) == {"mamba1", "falcon_mamba", "mamba2-g1", "mamba2-g2", "gdn-kv1", "gdn-kv2", "kda"}
    assert {c.family for c in CONFIGS.values()} == {n for n in families.names() if families.get(n).whole_models}
    assert (CONFIGS["mamba2-g1"].n_groups, CONFIGS["mamba2-g2"].n_groups) == (1, 2)
    assert (CONFIGS["gdn-kv1"].attn_kv_heads, CONFIGS["gdn-kv2"].attn_kv_heads) == (1, 2)
    for case in ("gdn-kv1", "gdn-kv2", "kda"):  # every hybrid case: a mixer and an attention layer, MLPs dense
        assert set(families.get(CONFIGS[case].family).layer_kinds(CONFIGS[case])) == {"mixer", "attention"}, case
        assert set(CONFIGS[case].mlp_layer_types) == {"dense", "sparse"}, case  # ... and mixtures of experts
    gdn = CONFIGS["gdn-kv1"]
    assert gdn.num_v_heads == 2 * gdn.num_k_heads == 2 * TP  # the qkvz groups hold two value heads each


@pytest.mark.parametrize("family, cut, message", [
    ("gdn", dict(num_k_heads=3, num_v_heads=6), r"divisor of num_k_heads = 3 \(gdn\), got 2$"),
    ("gdn", dict(attn_heads=3, attn_kv_heads=1), r"divisor of attn_heads = 3 \(gdn\), got 2$"),
    ("gdn", dict(intermediate_size=33), r"divisor of intermediate_size = 33 \(gdn\), got 2$"),
    ("kda", dict(num_heads=3), r"divisor of num_heads = 3 \(kda\), got 2$"),
    ("kda", dict(attn_heads=3), r"divisor of attn_heads = 3 \(kda\), got 2$"),
    ("kda", dict(intermediate_size=33), r"divisor of intermediate_size = 33 \(kda\), got 2$"),
    ("gdn", dict(mlp_layer_types=("sparse", "sparse"), moe=MoESpec(4, 2, 33, shared_inter=4, shared_gate=True)),
     r"divisor of moe.inter = 33 \(gdn\), got 2$"),
    ("kda", dict(mlp_layer_types=("dense", "sparse"), moe=MoESpec(4, 2, 6, router="sigmoid", shared_inter=9)),
     r"divisor of moe.shared_inter = 9 \(kda\), got 2$"),
])
def test_engine_tp_refuses_hybrid_splits_the_weights_do_not_allow(family, cut, message):
    """GDN and KDA refuse a tp_size that does not divide their heads, MLP or experts with a ValueError naming tp_size,
    before any collective or allocation (the runner's and the loader's check alike)."""
    from dataclasses import replace
    from harness.loader import check_tp
    base = tiny_config(family)
    cfg = replace(base, mixer=replace(base.mixer, **cut))
    with pytest.raises(ValueError, match=r"^tp_size: expected a " + message):
        EngineRunner((cfg, random_params(base, 0)), "torch", tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match=r"^tp_size: expected a " + message):
        check_tp(cfg, 2, 0)


def test_engine_tp_refuses_kv_heads_that_neither_split_nor_replicate():
    """GDN's key/value heads split (a multiple of tp_size) or replicate (a divisor of tp_size); 2 of them over
    3 ranks do neither: a ValueError naming tp_size. A model without full-attention layers is not held to it."""
    from dataclasses import replace
    base = tiny_config("gdn")
    cfg = replace(base, mixer=replace(base.mixer, num_k_heads=3, num_v_heads=6, attn_heads=6, attn_kv_heads=2,
                                      intermediate_size=36))
    with pytest.raises(ValueError, match=r"^tp_size: expected a divisor or a multiple of attn_kv_heads = 2 "
                                         r"\(gdn\), got 3$"):
        EngineRunner((cfg, random_params(base, 0)), "torch", tp=TensorParallel(0, 3))
    linear_only = replace(cfg, mixer=replace(cfg.mixer, layer_types=("linear_attention",) * cfg.n_layer))
    from harness.engine import families as engine_families
    assert engine_families.get("gdn").check_tp(linear_only, 3) is None


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
    out = "out_proj.weight" if "out_proj.weight" in params else "o_proj.weight"  # KDA: o_proj
    bad = dict(params, **{out: params[out][:, :3]})
    with pytest.raises(ValueError, match=rf"^params\['{out}'\]: expected shape"):
        shard_mixer_params(cfg, bad, TensorParallel(0, TP))


def test_state_slice_follows_the_spec():
    """state_slice cuts a whole state as the per-rank spec lays it out: Mamba-2 with one group keeps B and C
    whole on every rank and splits x; with two groups each rank takes its group; heads split. GDN and KDA
    split each of their q, k and v conv segments (the spec's conv_dim / tp) and their recurrent heads."""
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
    gdn = GDNSpec(num_k_heads=2, num_v_heads=4, head_k_dim=1, head_v_dim=1, conv_kernel=3, tp_size=2)
    conv3 = torch.arange(gdn.unsharded().conv_dim, dtype=torch.float64)[:, None].expand(-1, 2)  # q 2, k 2, v 4
    assert state_slice(gdn, "conv", conv3, 1)[:, 0].tolist() == [1, 3, 6, 7]
    kda = KDASpec(num_heads=2, head_dim=1, conv_kernel=3, tp_size=2)
    assert state_slice(kda, "conv", conv3[:6], 0)[:, 0].tolist() == [0, 2, 4]
    rec = torch.arange(4, dtype=torch.float64).reshape(4, 1, 1)
    assert state_slice(gdn, "recurrent", rec, 1)[:, 0, 0].tolist() == [2, 3]


def test_kv_slices_follow_the_heads():
    """A rank's keys and values are its share of the key/value heads, or the one head its query heads read
    when there are fewer heads than ranks (rank r of T: head r * H_kv // T); the attention weights are cut to
    the same heads (split_heads), and a count that neither splits nor replicates is a ValueError."""
    spec = GDNSpec(num_k_heads=4, num_v_heads=4, head_k_dim=1, head_v_dim=1, tp_size=4)
    keys = torch.arange(2 * 2 * 3, dtype=torch.float64).reshape(3, 2, 2)  # 3 tokens, 2 heads of 2
    assert [state_slice(spec, "kv", keys, r)[0, :, 0].tolist() for r in range(4)] == [[0], [0], [2], [2]]
    spec2 = GDNSpec(num_k_heads=2, num_v_heads=2, head_k_dim=1, head_v_dim=1, tp_size=2)
    assert state_slice(spec2, "kv", keys, 1).tolist() == keys[:, 1:].tolist()
    assert [kv_heads_of_rank(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    w = torch.arange(8, dtype=torch.float64)[:, None]  # 2 key/value heads of 4 rows
    assert split_heads(w, 2, TensorParallel(3, 4), kv=True)[:, 0].tolist() == [4, 5, 6, 7]
    assert split_heads(w, 4, TensorParallel(1, 2))[:, 0].tolist() == [4, 5, 6, 7]
    assert split_heads(w.t(), 2, TensorParallel(0, 2), dim=1)[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"^tp_size: expected a divisor or a multiple of num_kv_heads = 2, got 3$"):
        kv_heads_of_rank(2, 0, 3)
    with pytest.raises(ValueError, match=r"^full: expected keys or values"):
        state_slice(spec2, "kv", keys[0], 0)


def test_mlp_shard_is_column_then_row_parallel():
    """A rank's MLP shard: gate_proj and up_proj rows, down_proj columns; the ranks' partial outputs sum to
    the whole MLP's output."""
    g = torch.Generator().manual_seed(0)
    whole = {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in
             (("gate_proj.weight", (6, 4)), ("up_proj.weight", (6, 4)), ("down_proj.weight", (4, 6)))}
    h = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mlp = lambda p: (torch.nn.functional.silu(h @ p["gate_proj.weight"].t()) * (h @ p["up_proj.weight"].t())) \
        @ p["down_proj.weight"].t()  # noqa: E731
    parts = [TensorParallel(r, 2).shard_mlp(whole) for r in range(2)]
    assert tuple(parts[1]["gate_proj.weight"].shape) == (3, 4) and tuple(parts[1]["down_proj.weight"].shape) == (4, 3)
    torch.testing.assert_close(mlp(parts[0]) + mlp(parts[1]), mlp(whole), rtol=1e-12, atol=1e-12)
    assert TensorParallel().shard_mlp(whole) is whole and TensorParallel(0, 2).shard_mlp({}) == {}


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_moe_shard_cuts_every_expert(router):
    """A rank's shard of a mixture-of-experts MLP: every expert's and the shared expert's gate_proj and up_proj
    rows, down_proj columns; the router, its bias and the shared-expert gate whole. The ranks' partial outputs
    of the engine's MoE MLP sum to the whole MLP's output (Qwen3-Next's and Kimi Linear's routing alike)."""
    from harness.engine.families._delta import MoEMLP
    moe = (MoESpec(4, 2, 6, shared_inter=4, shared_gate=True) if router == "softmax" else
           MoESpec(4, 2, 6, router="sigmoid", scaling=2.0, n_group=2, topk_group=1, shared_inter=6))
    g = torch.Generator().manual_seed(0)
    whole = {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in moe.shapes(8).items()}
    h = torch.randn(9, 8, generator=g, dtype=torch.float64)
    parts = [TensorParallel(r, 2).shard_mlp(whole) for r in range(2)]
    assert tuple(parts[1]["experts.3.gate_proj.weight"].shape) == (3, 8)
    assert tuple(parts[1]["experts.3.down_proj.weight"].shape) == (8, 3)
    torch.testing.assert_close(parts[1]["experts.3.up_proj.weight"], whole["experts.3.up_proj.weight"][3:])
    assert all(parts[1][n] is whole[n] for n in whole if n.startswith(("router.", "shared_gate.")))
    run = lambda p: MoEMLP(moe, p, dtype=torch.float64, device="cpu")(h)  # noqa: E731
    torch.testing.assert_close(run(parts[0]) + run(parts[1]), run(whole), rtol=1e-12, atol=1e-12)
