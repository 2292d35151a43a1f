"""Pieces shared by the multi-token (speculative) decode specs (private to `harness.ops`).

Layout (reference.spec_decode): rows over packed tokens (`query_start_loc`), a slot table of
(Bsz, num_spec + 1) per-position slots, `num_accepted_tokens` picking each row's start slot.

Shape keys of the input builders: `B` rows, `num_spec` draft tokens per row; `lens` (optional) each row's
token count (default: every row carries num_spec + 1 tokens, as an engine's decode-only spec step does);
`accepted` (optional) each row's num_accepted_tokens (default: 1, 2, ..., num_spec + 1, 1, ...).
Row b owns slots 1 + b*(num_spec+1) .. (b+1)*(num_spec+1) of a pool of B*(num_spec+1) + 1 slots (slot 0
stays untouched, as an engine's pad slot would).
"""
from __future__ import annotations

import torch

from harness.ops import _inputs as I
from harness.ops._checks import PAD_SLOT_ID


def _lens(shape) -> list[int]:
    S = shape["num_spec"] + 1
    return list(shape.get("lens", [S] * shape["B"]))


def layout(shape: dict, device) -> dict:
    """T, num_slots, query_start_loc, state_indices, num_accepted_tokens of a builder shape."""
    Bsz, S = shape["B"], shape["num_spec"] + 1
    lens = _lens(shape)
    acc = list(shape.get("accepted", [1 + b % S for b in range(Bsz)]))
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    table = torch.arange(1, Bsz * S + 1, dtype=torch.int32).reshape(Bsz, S)
    return dict(T=qsl[-1], num_slots=Bsz * S + 1,
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                state_indices=table.to(device),
                num_accepted_tokens=torch.tensor(acc, dtype=torch.int32, device=device))


def tokens(shape) -> int:
    return sum(_lens(shape))


def pool_traffic(inp: dict, pool: str, index: str) -> int:
    """Bytes of the slots the step touches: each live row's start slot read, each written position's slot
    written (shape-only inputs: every row live and full)."""
    from reference.spec_decode import spec_rows, written_slots
    p, table = inp[pool], inp[index]
    if table.device.type == "meta":
        return (table.shape[0] + table.numel()) * I.slot_bytes(p)
    pad = inp.get("pad_slot_id", PAD_SLOT_ID)
    T = int(inp["query_start_loc"][-1])
    rows = spec_rows(inp["query_start_loc"], table, inp["num_accepted_tokens"], T, p.shape[0], pad)
    reads = sum(1 for r in rows if r[2] != pad)
    return (reads + len(written_slots(rows, pad))) * I.slot_bytes(p)


def run_on_named_slots(run, pool, query_start_loc, table, num_accepted_tokens, pad_slot_id, cd):
    """Evaluate `run(compact_pool, compact_table) -> (y, compact_pool_after)` (a reference.spec_decode op) on
    the table's live slots only, gathered in `cd`; scatter the slots the step writes back into `pool`.
    Returns y."""
    from reference.spec_decode import spec_rows, written_slots
    ids = table.detach().to("cpu", torch.int64)
    live = sorted({s for s in ids.flatten().tolist() if s != pad_slot_id})
    pos = {s: i for i, s in enumerate(live)}
    compact_table = torch.tensor([[PAD_SLOT_ID if s == pad_slot_id else pos[s] for s in row] for row in ids.tolist()],
                                 dtype=torch.int64).reshape(ids.shape)
    compact = torch.zeros((len(live),) + tuple(pool.shape[1:]), dtype=cd, device=pool.device)
    for i, s in enumerate(live):
        compact[i] = pool[s].to(cd)
    y, after = run(compact, compact_table)
    rows = spec_rows(query_start_loc, compact_table, num_accepted_tokens, y.shape[0], len(live), PAD_SLOT_ID)
    for i in written_slots(rows, PAD_SLOT_ID):
        pool[live[i]] = after[i].to(pool.dtype)
    return y


def bad_inputs(arg: str) -> tuple:
    """Malformed speculative-decode layouts: (what, argument the error must name, mutate(kwargs))."""
    def _set(name, row, col, value):
        return lambda k: k[name].__setitem__((row, col), value if not callable(value) else value(k))
    return (
        ("rows longer than the slot table", "query_start_loc",
         lambda k: k.__setitem__(arg, k[arg][:, :1].clone())),
        (f"{arg} one-dimensional", arg, lambda k: k.__setitem__(arg, k[arg][:, 0].clone())),
        (f"{arg} with a row too few", arg, lambda k: k.__setitem__(arg, k[arg][:-1].clone())),
        ("a slot twice in one row", arg, _set(arg, 0, 1, lambda k: int(k[arg][0, 0]))),
        ("a slot of another row", arg, _set(arg, 1, 0, lambda k: int(k[arg][0, -1]))),
        ("num_accepted_tokens 0", "num_accepted_tokens", lambda k: k["num_accepted_tokens"].__setitem__(0, 0)),
        ("num_accepted_tokens past num_spec + 1", "num_accepted_tokens",
         lambda k: k["num_accepted_tokens"].__setitem__(0, k[arg].shape[1] + 1)),
        ("num_accepted_tokens float", "num_accepted_tokens",
         lambda k: k.__setitem__("num_accepted_tokens", k["num_accepted_tokens"].float())),
        ("num_accepted_tokens of a row too few", "num_accepted_tokens",
         lambda k: k.__setitem__("num_accepted_tokens", k["num_accepted_tokens"][:-1].clone())),
    )
