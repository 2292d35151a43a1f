"""scripts/peers_fetch.py: what an adapter declares as its peer's source is fetched and extracted exactly
(only the listed files, our stubs beside them, empty package inits where the wheel's are left out), a
pattern that matches nothing is an error, and every adapter's SOURCE is a pinned requirement."""
import importlib.util
import pkgutil
import zipfile
from pathlib import Path

import pytest

from harness.impls import adapters
from harness.impls.adapters._source import PeerSdist, PeerSource, PeerWheels

ROOT = Path(__file__).resolve().parents[1]


def _fetch_module():
    spec = importlib.util.spec_from_file_location("peers_fetch", ROOT / "scripts" / "peers_fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("peer/__init__.py", "import heavy_engine_startup\n")
        z.writestr("peer/ops/kernel.py", "X = 1\n")
        z.writestr("peer/ops/other.py", "Y = 2\n")
        z.writestr("peer/server.py", "raise SystemExit\n")
    return path


def test_extract_takes_only_the_listed_files_and_writes_the_stubs(tmp_path, monkeypatch):
    fetch = _fetch_module()
    monkeypatch.setattr(fetch, "ROOT", str(tmp_path))
    src = PeerSource(wheel="peer==1.0", files=("peer/ops/kernel.py",), stubs={"peer/envs.py": "FLAG = 0\n"},
                     packages=("peer", "peer/ops"))
    root = Path(fetch.extract(src, str(_wheel(tmp_path / "peer-1.0-py3-none-any.whl"))))
    got = sorted(str(p.relative_to(root)) for p in root.rglob("*.py"))
    assert got == ["__init__.py", "envs.py", "ops/__init__.py", "ops/kernel.py"], got
    assert (root / "__init__.py").read_text() == ""  # the wheel's own start-up code is left out
    assert (root / "envs.py").read_text() == "FLAG = 0\n"
    # fetched again: the tree is replaced, not merged
    src2 = PeerSource(wheel="peer==1.0", files=("peer/ops/other.py",), packages=("peer", "peer/ops"))
    root = Path(fetch.extract(src2, str(tmp_path / "peer-1.0-py3-none-any.whl")))
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.py")) == ["__init__.py", "ops/__init__.py",
                                                                            "ops/other.py"]


def test_extract_refuses_a_pattern_that_matches_nothing(tmp_path, monkeypatch):
    fetch = _fetch_module()
    monkeypatch.setattr(fetch, "ROOT", str(tmp_path))
    src = PeerSource(wheel="peer==1.0", files=("peer/ops/kernel.py", "peer/missing/*.py"))
    with pytest.raises(SystemExit, match="peer/missing"):
        fetch.extract(src, str(_wheel(tmp_path / "peer-1.0-py3-none-any.whl")))


def test_sources_are_pinned_and_valid():
    with pytest.raises(ValueError, match="pinned"):
        PeerSource(wheel="peer", files=())
    with pytest.raises(ValueError, match="stubs"):
        PeerSource(wheel="peer==1", files=("a.py",), stubs={"a.py": ""})
    with pytest.raises(ValueError, match="pinned"):
        PeerSdist("peer")
    with pytest.raises(ValueError, match="pinned"):
        PeerWheels(("a==1", "b"))
    found = _fetch_module().sources()
    names = {m.name for m in pkgutil.iter_modules(adapters.__path__) if not m.name.startswith("_")}
    assert set(found) == names, "every adapter says where its peer's code comes from"
