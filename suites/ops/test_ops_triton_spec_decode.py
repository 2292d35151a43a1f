"""Kernel suite: the Triton speculative-decode kernels (harness/impls/triton/spec_decode.py, ops
`selective_state_update_spec` in both layouts and `causal_conv1d_update_spec`) on the edges of their layout,
against the float64 oracle.

A program reads its row's start slot once and writes every position's slot after its token (the SSM kernels loop
over the row's tokens, the conv kernel walks all num_spec + 1 positions and masks off those past them). Cases (the
batch of harness.testing.spec_decode_rows): rows of every length from 0 to num_spec + 1 in one batch, every start
position, a row that overwrites its own start slot (and one that starts past its tokens, leaving it untouched), pad
entries inside a live row's slot table, padding rows, a slot table that is a non-contiguous (transposed) view with
int64 ids, strided pools (page-major, and channels-last conv slots), Mamba-1 channel blocks that straddle groups and
Mamba-2 D per head or per (head, P) row, the block sizes the launch configuration may choose (a channel count past
one block). Runs on the device under test (CPU through the Triton interpreter: fp32 / fp64 there; fp32 and bf16 on a
GPU).
"""
import pytest
import torch

from harness.testing import make_pool
from harness.testing.spec_decode_rows import (ROWS, S, T, check_rows, kernel_dtypes, layout_of_rows,
                                              triton_impl)
from reference.testing import gen


def _ssm_kwargs(layout, pool_layout, dtype, device, *, d_per_p=False, G=1, Dm=40, seed=0):
    g = gen(seed)
    pd = torch.float64 if dtype == torch.float64 else torch.float32
    num_slots = len(ROWS) * S + 3
    qsl, tab, acc, table, qs = layout_of_rows(device, num_slots, seed)

    def rn(*shape, dt=dtype, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=g, dtype=torch.float32) * scale + shift).to(device, dt)

    N = 8
    if layout == "mamba2":
        H, P = 4, 5
        slot, chans, xs, Ash = (H, P, N), H, (T, H, P), (H,)
        D = rn(H, P, dt=pd) if d_per_p else rn(H, dt=pd)
    else:
        slot, chans, xs, Ash = (Dm, N), Dm, (T, Dm), (Dm, N)
        D = rn(Dm, dt=pd)
    kw = dict(state=make_pool(num_slots, slot, pd, device, layout=pool_layout, seed=seed), x=rn(*xs),
              dt=rn(*xs[:2], scale=0.5, shift=-2.0), A=-torch.exp(rn(*Ash, dt=pd, scale=0.5)), B=rn(T, G, N),
              C=rn(T, G, N), D=D, z=rn(*xs), dt_bias=rn(chans, dt=pd, scale=0.3), query_start_loc=qsl,
              state_batch_indices=tab, num_accepted_tokens=acc, dt_softplus=True, dt_limit=(1e-3, 0.5))
    return kw, table, qs


@pytest.mark.parametrize("pool_layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("layout", ["mamba1", "mamba2"])
def test_state_update_spec_layout_edges(device, layout, pool_layout):
    impl = triton_impl(device)
    for dtype in kernel_dtypes(device):
        kw, table, qsl = _ssm_kwargs(layout, pool_layout, dtype, device, d_per_p=pool_layout == "page_major")
        check_rows(impl, "selective_state_update_spec", kw, table, qsl, dtype,
                   f"triton selective_state_update_spec {layout} {dtype} {pool_layout}")


@pytest.mark.parametrize("G,Dm", [(4, 40), (2, 300)])
def test_mamba1_channel_blocks_across_groups(device, G, Dm):
    """Channel blocks that straddle groups (B / C gathered per channel), and more channels than one block
    (300 channels: several blocks of the launch configuration on a GPU, 19 of 16 under the interpreter)."""
    impl = triton_impl(device)
    kw, table, qsl = _ssm_kwargs("mamba1", "page_major", torch.float32, device, G=G, Dm=Dm, seed=1)
    check_rows(impl, "selective_state_update_spec", kw, table, qsl, torch.float32,
               f"triton selective_state_update_spec mamba1 G={G} Dm={Dm}")


@pytest.mark.parametrize("pool_layout", ["contiguous", "page_major", "channels_last"])
@pytest.mark.parametrize("K", [2, 4])
def test_conv1d_update_spec_layout_edges(device, K, pool_layout):
    impl = triton_impl(device)
    D = 37  # past one channel block under the interpreter, a partial block everywhere
    for dtype in kernel_dtypes(device):
        g = gen(K)
        num_slots = len(ROWS) * S + 2
        qsl, tab, acc, table, qs = layout_of_rows(device, num_slots, K)

        def rn(*shape, scale=1.0):
            return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(device, dtype)

        pd = torch.float64 if dtype == torch.float64 else torch.float32
        kw = dict(x=rn(T, D), conv_states=make_pool(num_slots, (D, K - 1), pd, device, layout=pool_layout, seed=K),
                  weight=rn(D, K, scale=0.5), bias=rn(D, scale=0.1), query_start_loc=qsl, conv_state_indices=tab,
                  num_accepted_tokens=acc, activation="silu")
        check_rows(impl, "causal_conv1d_update_spec", kw, table, qs, dtype,
                   f"triton causal_conv1d_update_spec K={K} {dtype} {pool_layout}")
