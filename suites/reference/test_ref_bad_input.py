"""Bad input to every reference op raises ValueError naming the argument ("arg: expected ..., got ...")."""
import re

import pytest
import torch

from reference.conv1d import causal_conv1d, causal_conv1d_update
from reference.norms import gated_rms_norm, rms_norm
from reference.selective_scan import selective_scan, selective_state_update
from reference.ssd import ssd_chunked, ssd_scan, ssd_state_update
from reference.testing import make_conv_inputs, make_mamba1_inputs, make_norm_inputs, make_ssd_inputs

F64, F32 = torch.float64, torch.float32


def conv(**over):
    kw = make_conv_inputs(7, 3, 4, seed=0, cu_seqlens=[0, 3, 7], initial_states=True)
    kw.update(over)
    return lambda: causal_conv1d(**kw)


def conv_update(**over):
    c = make_conv_inputs(2, 3, 4, seed=0, initial_states=False)
    kw = dict(x=c["x"], conv_state=torch.zeros(2, 3, 3, dtype=F64), weight=c["weight"], bias=c["bias"])
    kw.update(over)
    return lambda: causal_conv1d_update(**kw)


def m1(**over):
    kw = make_mamba1_inputs(7, 4, 3, 2, seed=0, cu_seqlens=[0, 3, 7], initial_states=True)
    kw.update(over)
    return lambda: selective_scan(**kw)


def m1_update(**over):
    i = make_mamba1_inputs(2, 4, 3, 2, seed=0, initial_states=False)
    kw = dict(state=torch.zeros(2, 4, 3, dtype=F64), x=i["u"], dt=i["delta"], A=i["A"], B=i["B"], C=i["C"],
              D=i["D"], z=i["z"], dt_bias=i["delta_bias"])
    kw.update(over)
    return lambda: selective_state_update(**kw)


def ssd(fn=ssd_scan, **over):
    kw = make_ssd_inputs(7, 4, 2, 3, 2, seed=0, cu_seqlens=[0, 3, 7], initial_states=True)
    kw.update(over)
    return lambda: fn(**kw)


def ssd_update(**over):
    i = make_ssd_inputs(2, 4, 2, 3, 2, seed=0)
    kw = dict(state=torch.zeros(2, 4, 2, 3, dtype=F64), x=i["x"], dt=i["dt"], A=i["A"], B=i["B"], C=i["C"],
              D=i["D"], z=i["z"], dt_bias=i["dt_bias"])
    kw.update(over)
    return lambda: ssd_state_update(**kw)


def norm(**over):
    kw = make_norm_inputs((3, 8), seed=0, group_size=4)
    kw.update(over)
    return lambda: gated_rms_norm(**kw)


def cu(*v):
    return torch.tensor(v, dtype=torch.int64)


def r(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


CASES = [
    # --- causal_conv1d
    ("conv int x", conv(x=torch.ones(7, 3, dtype=torch.int64)), "x"),
    ("conv x 3-d", conv(x=r(7, 3, 1)), "x"),
    ("conv weight channels", conv(weight=r(4, 4)), "weight"),
    ("conv width 1", conv(weight=r(3, 1), initial_states=None), "weight"),
    ("conv width 9", conv(weight=r(3, 9), initial_states=None), "weight"),
    ("conv bias shape", conv(bias=r(4)), "bias"),
    ("conv activation", conv(activation="relu"), "activation"),
    ("conv cu_seqlens start", conv(cu_seqlens=cu(1, 3, 7)), "cu_seqlens"),
    ("conv cu_seqlens decreasing", conv(cu_seqlens=cu(0, 5, 3, 7)), "cu_seqlens"),
    ("conv cu_seqlens end", conv(cu_seqlens=cu(0, 3, 6)), "cu_seqlens"),
    ("conv cu_seqlens float", conv(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "cu_seqlens"),
    ("conv initial_states count", conv(initial_states=r(3, 3, 3)), "initial_states"),
    ("conv initial_states width", conv(initial_states=r(2, 3, 4)), "initial_states"),
    ("conv mixed dtype weight", conv(weight=r(3, 4, dtype=F32)), "weight"),
    ("conv mixed dtype states", conv(initial_states=r(2, 3, 3, dtype=F32)), "initial_states"),
    ("conv_update state shape", conv_update(conv_state=r(2, 3, 2)), "conv_state"),
    ("conv_update width 9", conv_update(weight=r(3, 9)), "weight"),
    ("conv_update int x", conv_update(x=torch.ones(2, 3, dtype=torch.int32)), "x"),
    ("conv_update mixed dtype", conv_update(bias=r(3, dtype=F32)), "bias"),
    # --- selective_scan (Mamba-1)
    ("m1 int u", m1(u=torch.ones(7, 4, dtype=torch.int64)), "u"),
    ("m1 delta shape", m1(delta=r(7, 5)), "delta"),
    ("m1 A channels", m1(A=r(5, 3)), "A"),
    ("m1 B groups do not divide Dm", m1(B=r(7, 3, 3), C=r(7, 3, 3)), "B"),
    ("m1 B state size", m1(B=r(7, 2, 4)), "B"),
    ("m1 C differs from B", m1(C=r(7, 1, 3)), "C"),
    ("m1 D shape", m1(D=r(3)), "D"),
    ("m1 z shape", m1(z=r(7, 3)), "z"),
    ("m1 delta_bias shape", m1(delta_bias=r(4, 1)), "delta_bias"),
    ("m1 initial_states count", m1(initial_states=r(3, 4, 3)), "initial_states"),
    ("m1 cu_seqlens end", m1(cu_seqlens=cu(0, 3, 8)), "cu_seqlens"),
    ("m1 mixed dtype B", m1(B=r(7, 2, 3, dtype=F32)), "B"),
    ("m1 int A", m1(A=torch.ones(4, 3, dtype=torch.int64)), "A"),
    ("m1_update state 2-d", m1_update(state=r(2, 4)), "state"),
    ("m1_update x batch", m1_update(x=r(3, 4)), "x"),
    ("m1_update B groups", m1_update(B=r(2, 3, 3), C=r(2, 3, 3)), "B"),
    ("m1_update mixed dtype dt", m1_update(dt=r(2, 4, dtype=F32)), "dt"),
    # --- SSD (both formulations share the contract)
    ("ssd x 2-d", ssd(x=r(7, 8)), "x"),
    ("ssd int x", ssd(x=torch.ones(7, 4, 2, dtype=torch.int64)), "x"),
    ("ssd dt shape", ssd(dt=r(7, 3)), "dt"),
    ("ssd A shape", ssd(A=r(4, 2)), "A"),
    ("ssd groups do not divide heads", ssd(B=r(7, 3, 3), C=r(7, 3, 3)), "B"),
    ("ssd C differs from B", ssd(C=r(7, 2, 4)), "C"),
    ("ssd D shape", ssd(D=r(2, 4)), "D"),
    ("ssd z shape", ssd(z=r(7, 4, 3)), "z"),
    ("ssd dt_bias shape", ssd(dt_bias=r(2)), "dt_bias"),
    ("ssd dt_limit order", ssd(dt_limit=(1.0, 0.1)), "dt_limit"),
    ("ssd dt_limit arity", ssd(dt_limit=(0.1,)), "dt_limit"),
    ("ssd initial_states count", ssd(initial_states=r(1, 4, 2, 3)), "initial_states"),
    ("ssd initial_states N", ssd(initial_states=r(2, 4, 2, 4)), "initial_states"),
    ("ssd cu_seqlens start", ssd(cu_seqlens=cu(2, 3, 7)), "cu_seqlens"),
    ("ssd cu_seqlens decreasing", ssd(cu_seqlens=cu(0, 4, 3, 7)), "cu_seqlens"),
    ("ssd mixed dtype A", ssd(A=r(4, dtype=F32)), "A"),
    ("ssd mixed dtype initial_states", ssd(initial_states=r(2, 4, 2, 3, dtype=F32)), "initial_states"),
    ("ssd_chunked groups", ssd(ssd_chunked, B=r(7, 3, 3), C=r(7, 3, 3)), "B"),
    ("ssd_chunked initial_states count", ssd(ssd_chunked, initial_states=r(3, 4, 2, 3)), "initial_states"),
    ("ssd_chunked chunk_size 0", ssd(ssd_chunked, chunk_size=0), "chunk_size"),
    ("ssd_chunked chunk_size float", ssd(ssd_chunked, chunk_size=4.0), "chunk_size"),
    ("ssd_chunked cu_seqlens end", ssd(ssd_chunked, cu_seqlens=cu(0, 3, 9)), "cu_seqlens"),
    ("ssd_update state 3-d", ssd_update(state=r(2, 4, 2)), "state"),
    ("ssd_update B state size", ssd_update(B=r(2, 2, 4), C=r(2, 2, 4)), "B"),
    ("ssd_update groups", ssd_update(B=r(2, 3, 3), C=r(2, 3, 3)), "B"),
    ("ssd_update x shape", ssd_update(x=r(2, 4, 3)), "x"),
    ("ssd_update dt_limit", ssd_update(dt_limit=(0.5, 0.1)), "dt_limit"),
    ("ssd_update mixed dtype z", ssd_update(z=r(2, 4, 2, dtype=F32)), "z"),
    # --- norms
    ("norm group_size does not divide", norm(group_size=3), "group_size"),
    ("norm group_size 0", norm(group_size=0), "group_size"),
    ("norm weight shape", norm(weight=r(4)), "weight"),
    ("norm z shape", norm(z=r(3, 4)), "z"),
    ("norm eps negative", norm(eps=-1.0), "eps"),
    ("norm mixed dtype z", norm(z=r(3, 8, dtype=F32)), "z"),
    ("norm int x", norm(x=torch.ones(3, 8, dtype=torch.int64)), "x"),
    ("rms_norm weight shape", lambda: rms_norm(r(3, 8), r(7)), "weight"),
    ("rms_norm mixed dtype", lambda: rms_norm(r(3, 8), r(8, dtype=F32)), "weight"),
]


@pytest.mark.parametrize("call,arg", [(c, a) for _, c, a in CASES], ids=[n for n, _, _ in CASES])
def test_bad_input_names_the_argument(call, arg):
    """The call raises ValueError whose message starts with the offending argument's name and says what was
    expected and what came ("arg: expected ..., got ...")."""
    with pytest.raises(ValueError, match=rf"^{re.escape(arg)}: expected .+, got .+") as e:
        call()
    assert "\n" not in str(e.value)


def test_good_inputs_of_the_bad_input_table_are_accepted():
    """The unmodified inputs behind the table above are valid (so each bad case fails for its own reason)."""
    for fn in (conv(), conv_update(), m1(), m1_update(), ssd(), ssd(ssd_chunked), ssd_update(), norm()):
        fn()
