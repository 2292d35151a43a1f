"""`harness selftest`: every deliberately broken engine variant (bug classes 1-5, 7-11, 16, 19, 22 of
docs/bug-classes.md) is caught by the scenario properties, with a minimal hypothesis-shrunk request set that the
unbroken engine passes.
Runs on the CPU with the float64 `reference` implementation (independent of --impl / --device)."""
import torch

from harness.scenarios import RunnerFactory, Scenario, prop_matches_reference
from harness.selftest import VARIANTS, Variant, format_table, main, run_selftest, run_variant


def test_selftest_catches_every_variant():
    """Each variant is caught (some property fails on a found case and the control passes on it); the
    printed table lists it; afterwards the patches are gone (the unbroken engine passes a chunked,
    seeded, padded scenario)."""
    outcomes = run_selftest("reference", max_examples=25, seconds=3.0, seed=0, echo=None)
    table = format_table(outcomes)
    print(table)
    assert {o.variant.name for o in outcomes} == {v.name for v in VARIANTS}
    escaped = [(o.variant.name, o.error) for o in outcomes if not o.caught]
    assert not escaped, f"variants escaped: {escaped}\n{table}"
    assert all(o.control_ok and o.case is not None and o.properties for o in outcomes)
    assert {"1", "2", "3", "4", "5", "9", "10", "11", "16", "19", "22"} <= {o.variant.bug_class for o in outcomes}
    case = Scenario(family="mamba2", model_seed=0, prompts=((1, 2, 3, 4, 5, 6, 7, 8, 9, 10), (1, 2, 3, 4, 5, 6, 7, 8, 9)),
                    max_new=(3, 2), track=(True, False), waves=((0,), (1,)), token_budget=5, block_size=8,
                    cache_mode="all", chunk_seed=1, num_slots=2, decode_pad=4)
    prop_matches_reference(case, RunnerFactory("reference", dtype=torch.float64))


def test_selftest_reports_an_escape():
    """A 'variant' that breaks nothing escapes (no failing case exists), and the CLI exits 1 then."""
    harmless = Variant("harmless", "-", "breaks nothing", strategy=dict(families=("mamba1",), max_requests=1,
                                                                          max_prompt=4))
    o = run_variant(harmless, RunnerFactory("reference").impl, max_examples=3, seconds=2.0)
    assert not o.caught and o.case is None


def test_selftest_cli_exit_codes(monkeypatch, capsys):
    """`harness selftest` exits 0 when every chosen variant is caught, 1 when one escapes."""
    import argparse
    import harness.selftest as S
    args = argparse.Namespace(list=False, impl="reference", variant=["2"], max_examples=5, seconds=2.0)
    assert main(args) == 0
    assert "two_return_values" in capsys.readouterr().out
    monkeypatch.setattr(S, "VARIANTS", [Variant("harmless", "x", "breaks nothing",
                                                 strategy=dict(families=("mamba1",), max_requests=1, max_prompt=3))])
    args = argparse.Namespace(list=False, impl="reference", variant=None, max_examples=2, seconds=1.0)
    assert main(args) == 1
    assert "ESCAPED" in capsys.readouterr().out


def test_seeding_gate_caught_on_its_textbook_symptom():
    """Bug class 1 on exactly its public symptom: every step of the tracked request ends on a block
    boundary (so the broken AND changes nothing there), and the only affected request is one seeded from
    the prefix cache that is NOT tracked; the seeding property catches it, the unbroken engine passes."""
    import pytest
    from harness.selftest import reproduce
    base = tuple(range(3, 19))
    case = Scenario(family="mamba1", model_seed=0, prompts=(base, base + (50, 51)), max_new=(1, 2),
                    track=(True, False), waves=((0,), (1,)), token_budget=64, block_size=8, cache_mode="all")
    reproduce("seeding_gate", case, "seeding", broken=False)
    with pytest.raises(AssertionError, match=r"request 1"):
        reproduce("seeding_gate", case, "seeding")


def test_unwritten_pad_rows_escape_every_result_and_are_caught_by_the_pad_row_check():
    """Bug class 22 at engine level: ops that leave their pad rows unwritten (NaN) give every request its
    oracle tokens, logits and states -- no request reads a pad row back -- so the properties pass with the
    engine's pad-row check off (the variant escaped them before the check); with it on (the default) the
    property fails naming the op, the pad row and its NaN. Mamba-2 and GDN engines, conv slots of both
    layouts, two and three decode rows padded to four."""
    import pytest
    from harness.impls import registry
    from harness.scenarios import engine_impl
    from harness.selftest import unwritten_pad_rows
    broken = unwritten_pad_rows(engine_impl(registry.get("reference")))
    for family, conv_layout, prompts in (("mamba2", "row_major", ((1, 2, 3), (4, 5))),
                                         ("gdn", "channels_last", ((1, 2), (3,), (4, 5, 6)))):
        case = Scenario(family=family, model_seed=0, prompts=prompts, max_new=(2,) * len(prompts),
                        track=(False,) * len(prompts), waves=(tuple(range(len(prompts))),), token_budget=16,
                        cache_mode="none", num_slots=len(prompts), decode_pad=4, conv_layout=conv_layout)
        prop_matches_reference(case, RunnerFactory(broken, check_pad_rows=False))
        with pytest.raises(AssertionError, match=r"pad rows of y must be zero: row \d+ has nan"):
            prop_matches_reference(case, RunnerFactory(broken))
