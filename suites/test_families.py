"""Mixer families: one module per family on each side (reference/families/, harness/engine/families/), found
through registries; no other source file branches on a family name; the engine's mixers import nothing of
the reference mixers (the oracle must not share code with what it checks)."""
from __future__ import annotations

import ast
import math
import sys
import textwrap
from pathlib import Path

import pytest

from harness.engine import families as engine_families
from reference import families
from reference.loader import detect_config

ROOT = Path(__file__).resolve().parents[1]
FAMILY_DIRS = ("reference/families/", "harness/engine/families/")
# "mamba1" / "mamba2" also name the two state layouts of the selective_state_update op, and "gdn" / "kda"
# the two kinds of the delta-rule ops (ops, impls, op benchmarks, the reference delta rule) and the state
# spec kinds of reference/cache.py: literals there are not model families. Comparisons that involve a
# `family` value are refused everywhere all the same.
LAYOUT_TAG_FILES = ("harness/ops/", "harness/impls/", "harness/bench/", "reference/cache.py",
                    "reference/delta_rule.py", "harness/testing/delta_cases.py")


def _mentions_family(node) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "family" or isinstance(n, ast.Attribute) and n.attr == "family"
               for n in ast.walk(node))


def _family_literals(node, names) -> int:
    return sum(1 for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names)


def family_branches(source: str, names, literals: bool = True) -> list[tuple[int, str]]:
    """(line, what) for every place `source` branches on a family name: a comparison or `match` on a
    `family` value, and (with `literals`) a comparison against a family name, a dict keyed or valued by
    family names, or a tuple / list / set of several family names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left] + node.comparators
            against_none = all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
            if any(_mentions_family(o) for o in operands) and not against_none:
                found.append((node.lineno, "comparison on a family value"))
            elif literals and any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                found.append((node.lineno, "comparison with a family name"))
        elif isinstance(node, ast.Match) and _mentions_family(node.subject):
            found.append((node.lineno, "match on a family value"))
        elif literals and isinstance(node, ast.Dict):
            if sum(_family_literals(k, names) for k in node.keys if k is not None) + \
                    sum(isinstance(v, ast.Constant) and v.value in names for v in node.values) >= 2:
                found.append((node.lineno, "table of family names"))
        elif literals and isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) >= 2:
                found.append((node.lineno, "list of family names"))
    return found


def _sources():
    for top in ("harness", "reference"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(FAMILY_DIRS):
                yield rel, path.read_text()


def test_families_no_branches_outside_family_modules():
    """No source file of harness/ or reference/ outside the family packages branches on a family name
    (generic code asks the registries), so a new family lands as new files only."""
    names = set(families.names())
    bad = []
    for rel, src in _sources():
        literals = not rel.startswith(LAYOUT_TAG_FILES)
        bad += [f"{rel}:{line}: {what}" for line, what in family_branches(src, names, literals)]
    assert not bad, "family branches outside the family modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("snippet, caught", [
    ('if cfg.family == "mamba2":\n    pass', True),
    ("if family in ('mamba1', 'falcon_mamba'):\n    pass", True),
    ("x = 1 if case.family != other else 2", True),
    ('cls = {"mamba1": A, "mamba2": B}[name]', True),
    ('FAMILIES = ("mamba1", "falcon_mamba", "mamba2")', True),
    ('if kind == "mamba2":\n    pass', True),
    ("match cfg.family:\n    case _:\n        pass", True),
    ("if family is None:\n    pass", False),
    ('fam = families.get(cfg.family)', False),
    ('PRESET = dict(family="mamba2", layers=64)', False),
])
def test_families_branch_scan_sees_branches(snippet, caught):
    """The scan itself: it finds comparisons, tables and lists of family names, and lets registry lookups,
    None checks and a single family name as data pass."""
    assert bool(family_branches(snippet, {"mamba1", "falcon_mamba", "mamba2"})) is caught


def test_families_engine_mixers_import_no_reference_mixer():
    """The engine's family modules import nothing of a reference mixer: no reference family module, no
    reference.mixers / reference.models (the registry class of reference.families is all they take)."""
    banned = ("reference.mixers", "reference.models", "reference.families.")
    bad = []
    for path in sorted((ROOT / "harness/engine/families").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
                if node.module == "reference":
                    mods = [f"reference.{a.name}" for a in node.names]
                elif node.module == "reference.families":
                    mods = [f"reference.families.{a.name}" for a in node.names if a.name != "Registry"]
            else:
                continue
            bad += [f"{path.name}:{node.lineno}: {m}" for m in mods
                    if m.startswith(banned) or m in ("reference.mixers", "reference.models")]
    assert not bad, bad


def test_families_registries_agree():
    """Every reference family has an engine mixer and the other way round; each engine family's ops are
    contract ops; the registries' order is stable."""
    from harness.ops import OP_NAMES
    assert families.names() == engine_families.names()
    assert {"mamba1", "falcon_mamba", "mamba2"} <= set(families.names())
    for name in families.names():
        assert families.get(name).name == name == engine_families.get(name).name
        assert set(engine_families.required_ops(name)) <= set(OP_NAMES)
    with pytest.raises(ValueError, match=r"^cfg\.family: expected one of \[.*'mamba2'.*\], got 'nope'"):
        families.get("nope", "cfg.family")
    with pytest.raises(ValueError, match=r"^family: expected one of"):
        engine_families.get("nope")


def test_families_scenario_ops_are_per_family(monkeypatch):
    """A scenario asks an implementation only for its family's ops: with a family registered whose op no
    implementation has (as a new family's would be at first), Mamba scenarios still run; only that
    family's are skipped, and an implementation is skipped outright only where it can run no family."""
    from harness.impls import registry
    from harness.impls.registry import Impl
    from harness.scenarios import engine_ops, lacking_ops, skip_reason
    probe = engine_families.EngineFamily("probe", engine_families.EngineMixer, ("probe_op",), None, None)
    monkeypatch.setitem(engine_families._REGISTRY._items, "probe", ("zz_probe", 99, probe))
    ref = registry.get("reference")
    assert engine_ops("probe") == ("probe_op",) + engine_families.RUNNER_OPS
    assert lacking_ops(ref, "probe") == ["probe_op"]
    for name in families.names():
        assert lacking_ops(ref, name) == [] and skip_reason(ref, "cpu", name) is None
    assert skip_reason(ref, "cpu") is None
    assert "probe_op" in skip_reason(ref, "cpu", "probe")
    nothing = Impl(name="nothing", ops={})
    assert skip_reason(nothing, "cpu") is not None and skip_reason(nothing, "cpu", "mamba1") is not None


def test_families_registry_discovers_new_modules(tmp_path, monkeypatch):
    """A module file dropped into a family package registers itself: the registry imports every module of
    its package (names starting with "_" excepted) on the first lookup."""
    pkg = tmp_path / "fampkg_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from reference.families import Registry\nREG = Registry(__name__, 'probe')\n")
    for mod, name in (("zeta", "z"), ("alpha", "a"), ("_private", "hidden")):
        (pkg / f"{mod}.py").write_text(textwrap.dedent(f"""
            from fampkg_probe import REG
            class F:
                name = {name!r}
            REG.register(F())
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import fampkg_probe
        assert fampkg_probe.REG.names() == ("a", "z")
        with pytest.raises(ValueError, match=r"probe.name: expected a name not registered yet"):
            class G:
                name = "a"
            fampkg_probe.REG.register(G())
    finally:
        for m in [m for m in sys.modules if m.startswith("fampkg_probe")]:
            del sys.modules[m]


@pytest.mark.parametrize("family", families.names())
def test_families_hf_config_round_trip(family):
    """Each family writes an HF config.json that it reads back to the same config, and its tiny test config
    has a state spec whose conv channels are the config's conv_dim."""
    import torch
    fam = families.get(family)
    cfg = fam.build_config(d_model=32, n_layer=3, vocab=96, d_conv=3, chunk_size=256,
                           **({"head_dim": 16, "n_groups": 2} if "head_dim" in fam.build_fields else {}))
    back = detect_config(fam.to_hf(cfg))
    assert back == cfg
    tiny = fam.tiny_config()
    spec = fam.state_spec(tiny, conv_dtype=torch.float32, recurrent_dtype=torch.float32)
    assert spec.conv_shape == (tiny.conv_dim, tiny.d_conv - 1)
    assert set(fam.parameter_shapes(tiny)) <= set(fam.mixer_parameter_names)
    assert all(math.prod(s) > 0 for s in fam.parameter_shapes(tiny).values())


def test_families_config_fields_delegate():
    """ModelConfig reads the family's own fields through attribute access, refuses fields the family does not
    have, and `replace` routes changes to the right place."""
    m1 = families.get("falcon_mamba").tiny_config()
    assert m1.d_inner == m1.mixer.d_inner and m1.conv_dim == m1.d_inner and m1.mixer_rms_eps == 1e-6
    with pytest.raises(AttributeError, match="num_heads"):
        m1.num_heads
    plain = m1.replace(family="mamba1", mixer_rms_eps=None, n_layer=3)
    assert (plain.family, plain.mixer_rms_eps, plain.n_layer, plain.d_inner) == ("mamba1", None, 3, m1.d_inner)
    with pytest.raises(ValueError, match="changes: expected fields of a falcon_mamba ModelConfig"):
        m1.replace(head_dim=4)
    m2 = families.get("mamba2").tiny_config()
    assert m2.conv_dim == m2.d_inner + 2 * m2.n_groups * m2.d_state
    assert m2.as_dict()["num_heads"] == m2.num_heads and "mixer" not in m2.as_dict()
