"""`harness selftest`: every deliberately broken engine variant (the scenario variants of docs/bug-classes.md)
is caught by the scenario properties, with a minimal hypothesis-shrunk request set that the unbroken engine
passes; every suite variant (a planted component) is caught by the suites' tests it names, which pass
without it; and every class of the docs' table has a variant that is caught.
Runs on the CPU with the float64 `reference` implementation (independent of --impl / --device)."""
import re

import pytest
import torch

from harness.scenarios import RunnerFactory, Scenario, prop_matches_reference
from harness.selftest import (VARIANTS, Variant, documented_classes, format_cases, format_table, main,
                              run_selftest, run_variant)
from harness.selftest_suites import SUITE_VARIANTS, SuiteOutcome, SuiteVariant, run_suite_variant


@pytest.fixture(scope="module")
def outcomes():
    """One run of every variant, both kinds (the scenario searches with a small budget; each suite variant is
    two pytest runs of a few seconds)."""
    return run_selftest("reference", max_examples=25, seconds=3.0, seed=0, echo=None)


def test_selftest_catches_every_variant(outcomes):
    """Each variant is caught (a scenario variant: some property fails on a found case and the control passes
    on it; a suite variant: some selected test fails with the planted component and all pass without it); the
    printed table lists it; afterwards the patches are gone (the unbroken engine passes a chunked, seeded,
    padded scenario)."""
    table = format_table(outcomes)
    print(table)
    assert [o.variant.name for o in outcomes] == [v.name for v in VARIANTS + SUITE_VARIANTS]
    escaped = [(o.variant.name, o.error) for o in outcomes if not o.caught]
    assert not escaped, f"variants escaped: {escaped}\n{table}"
    scen = [o for o in outcomes if not isinstance(o, SuiteOutcome)]
    assert all(o.control_ok and o.case is not None and o.properties for o in scen)
    suite = [o for o in outcomes if isinstance(o, SuiteOutcome)]
    assert all(o.control_ok and o.properties and o.examples >= len(o.properties) for o in suite)
    for o in suite:  # the table names the test that caught it
        row = next(r for r in table.splitlines() if r.startswith(o.variant.name + " "))
        assert o.properties[0][0].split("::")[1] in row and " yes " in row, row
    assert {"1", "2", "3", "4", "5", "9", "10", "11", "16", "19", "22"} <= {o.variant.bug_class for o in scen}
    case = Scenario(family="mamba2", model_seed=0, prompts=((1, 2, 3, 4, 5, 6, 7, 8, 9, 10), (1, 2, 3, 4, 5, 6, 7, 8, 9)),
                    max_new=(3, 2), track=(True, False), waves=((0,), (1,)), token_budget=5, block_size=8,
                    cache_mode="all", chunk_seed=1, num_slots=2, decode_pad=4)
    prop_matches_reference(case, RunnerFactory("reference", dtype=torch.float64))


def test_every_documented_class_has_a_caught_variant(outcomes):
    """Every class of the table in docs/bug-classes.md (read from the file: a class added there without a
    variant fails here) has a variant of either kind that is caught."""
    classes = documented_classes()
    assert len(classes) >= 21 and "1" in classes and "21" in classes, sorted(classes, key=int)
    caught = {o.variant.bug_class for o in outcomes if o.caught}
    missing = sorted(set(classes) - caught, key=int)
    assert not missing, f"documented bug classes without a caught selftest variant: {missing}"


def test_docs_name_each_variant_in_its_class_row():
    """The table's "selftest variant" column names every variant in its class's row, and every variant's
    class is a documented one (no variant of an undocumented class)."""
    classes = documented_classes()
    for v in VARIANTS + SUITE_VARIANTS:
        assert v.bug_class in classes, f"variant {v.name}: class {v.bug_class} is not in docs/bug-classes.md"
        assert v.name in re.findall(r"`([^`]+)`", classes[v.bug_class]), \
            f"docs/bug-classes.md, class {v.bug_class}: the selftest variant column does not name {v.name!r}"
    assert len({v.name for v in VARIANTS + SUITE_VARIANTS}) == len(VARIANTS) + len(SUITE_VARIANTS)


def test_documented_classes_reads_the_table(tmp_path):
    """The table reader: numbered rows only, escaped pipes inside cells kept, the variant column by name; a
    file without the table is a ValueError naming it."""
    doc = tmp_path / "bug-classes.md"
    doc.write_text("text\n\n| # | class | what | selftest variant |\n|---|---|---|---|\n"
                   "| 1 | a | x | `v1` |\n| 2 | b | a large \\|A\\| | – |\n| 3 | c | y | `v3`, `v4` |\n\nafter | 9 |\n")
    assert documented_classes(str(doc)) == {"1": "`v1`", "2": "–", "3": "`v3`, `v4`"}
    doc.write_text("| # | class |\n|---|---|\n| 1 | a |\n")
    with pytest.raises(ValueError, match="selftest variant"):
        documented_classes(str(doc))


def test_suite_variant_escapes_when_nothing_is_broken():
    """A suite variant whose 'broken' component is the unbroken one escapes: no selected test fails; the
    table says NO and the cases name both pytest commands. A variant whose test file is missing escapes
    without running."""
    harmless = SuiteVariant("harmless", "-", "breaks nothing", "suites/test_checks.py", "test_nan_never_passes",
                            impl="torch_grid_ssd", control_impl="torch")
    o = run_suite_variant(harmless)
    assert not o.caught and o.control_ok and o.examples == 1 and not o.properties
    assert "no selected test failed" in o.error
    row = format_table([o]).splitlines()[2]
    assert row.startswith("harmless ") and " NO " in row
    cases = format_cases([o])
    assert "--impl harness.testing.planted:torch_grid_ssd" in cases and "--impl torch" in cases
    gone = SuiteVariant("gone", "-", "no such file", "suites/no_such_file.py", "x", plant="nan_masked_compare")
    o = run_suite_variant(gone)
    assert not o.caught and "not found" in o.error and o.seconds < 1


def test_suite_variant_needs_exactly_one_component():
    with pytest.raises(ValueError, match="exactly one of impl= and plant="):
        SuiteVariant("x", "-", "", "suites/test_checks.py", "x")
    with pytest.raises(ValueError, match="exactly one of impl= and plant="):
        SuiteVariant("x", "-", "", "suites/test_checks.py", "x", impl="torch_grid_ssd", plant="nan_masked_compare")


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
    args = argparse.Namespace(list=False, impl="reference", variant=["nan_masked_compare"], max_examples=5,
                              seconds=2.0)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1/1 variants caught" in out and "test_checks.py::test_nan_never_passes" in out
    monkeypatch.setattr(S, "VARIANTS", [Variant("harmless", "x", "breaks nothing",
                                                 strategy=dict(families=("mamba1",), max_requests=1, max_prompt=3))])
    args = argparse.Namespace(list=False, impl="reference", variant=None, max_examples=2, seconds=1.0,
                              kind="scenario")
    assert main(args) == 1
    assert "ESCAPED" in capsys.readouterr().out


def test_selftest_list_names_both_kinds(capsys):
    """`harness selftest --list` lists every variant with its class and kind; `--kind suite` only the suite
    variants; an unknown --variant is a ValueError naming the known ones."""
    import argparse
    assert main(argparse.Namespace(list=True)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [v.name for v in VARIANTS + SUITE_VARIANTS]
    assert all(ln.split()[3] == ("suite" if i >= len(VARIANTS) else "scenario") for i, ln in enumerate(lines))
    assert main(argparse.Namespace(list=True, kind="suite")) == 0
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()] == [v.name for v in SUITE_VARIANTS]
    with pytest.raises(ValueError, match="nan_masked_compare"):
        main(argparse.Namespace(list=False, impl="reference", variant=["no_such"], max_examples=1, seconds=1.0))


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
