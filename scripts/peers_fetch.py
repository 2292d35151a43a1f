"""Fetch the peers' pure-Python/Triton sources that the adapters need, for a GPU machine without a registry.

    python scripts/peers_fetch.py [PEER ...]      # default: every adapter that declares a SOURCE

Runs where pip can reach a package index. For each adapter module of harness/impls/adapters with a
`SOURCE = PeerSdist(...)`: downloads its source archive into .peers/ (built on the GPU machine by gpu.sh); with
`SOURCE = PeerWheels(...)`: downloads those pure-Python wheels into .peers/; with a
`SOURCE = PeerSource(...)`: downloads the pinned wheel (no dependencies) into .peers/wheels/, extracts only
the files it lists into .peers/src/, adds empty package `__init__.py` files where the wheel's own are left
out, and writes the adapter's stubs. The result is small enough to carry to the GPU machine with the
working tree (`.peers` is git-ignored); `source scripts/peers_setup.sh` puts .peers/src on PYTHONPATH.
A run that dies half way leaves the previous .peers/src/<package> in place: the new tree is built beside
it and swapped in at the end.
"""
from __future__ import annotations

import fnmatch
import glob
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.impls import adapters  # noqa: E402
from harness.impls.adapters._source import PEERS_DIR, SRC_DIR, WHEEL_DIR, PeerSdist, PeerSource, PeerWheels  # noqa: E402


def sources() -> dict[str, PeerSource | PeerSdist | PeerWheels]:
    out = {}
    for m in pkgutil.iter_modules(adapters.__path__):
        if m.name.startswith("_"):
            continue
        src = getattr(importlib.import_module(f"harness.impls.adapters.{m.name}"), "SOURCE", None)
        if isinstance(src, (PeerSource, PeerSdist, PeerWheels)):
            out[m.name] = src
    return out


def wheel_path(src: PeerSource) -> str:
    wheels = os.path.join(ROOT, WHEEL_DIR)
    os.makedirs(wheels, exist_ok=True)
    dist = src.name.replace("-", "_")
    pattern = os.path.join(wheels, f"{dist}-{src.version}-*.whl")
    found = glob.glob(pattern)
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        "-d", wheels, src.wheel], check=True)
        found = glob.glob(pattern)
    if not found:
        raise SystemExit(f"peers_fetch: expected a wheel matching {pattern} after pip download, got none")
    return sorted(found)[0]


def extract(src: PeerSource, wheel: str) -> str:
    """Build the source tree of one peer in a fresh folder and swap it in; returns the package root."""
    top = src.name.replace("-", "_")
    dest = os.path.join(ROOT, SRC_DIR)
    tmp = os.path.join(dest, f".{top}.new")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if any(fnmatch.fnmatch(n, p) for p in src.files)]
        missing = [p for p in src.files if not any(fnmatch.fnmatch(n, p) for n in names)]
        if missing:
            raise SystemExit(f"peers_fetch: {src.wheel}: expected files matching {missing}, got none")
        for n in names:
            z.extract(n, tmp)
    for pkg in src.packages:
        init = os.path.join(tmp, pkg, "__init__.py")
        os.makedirs(os.path.dirname(init), exist_ok=True)
        if not os.path.exists(init):
            open(init, "w").close()
    for path, text in src.stubs.items():
        full = os.path.join(tmp, path)
        if os.path.exists(full):
            raise SystemExit(f"peers_fetch: {src.wheel}: stub {path} would overwrite an extracted file")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    roots = {n.split("/")[0] for n in os.listdir(tmp)}
    for r in roots:
        old = os.path.join(dest, r)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(os.path.join(tmp, r), old)
    shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(dest, top)


def fetch_sdist(src: PeerSdist) -> str:
    """The source archive of `src` in .peers/ (downloaded once), from the package index's JSON API."""
    import json
    import urllib.request
    with urllib.request.urlopen(f"https://pypi.org/pypi/{src.name}/json", timeout=60) as r:
        meta = json.load(r)
    files = [u for u in meta.get("releases", {}).get(src.version, []) if u.get("packagetype") == "sdist"]
    if not files:
        raise SystemExit(f"peers_fetch: {src.requirement}: expected a source archive on the index, got none")
    dest = os.path.join(ROOT, PEERS_DIR, files[0]["filename"])
    if not os.path.exists(dest):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with urllib.request.urlopen(files[0]["url"], timeout=300) as r, open(dest + ".part", "wb") as f:
            shutil.copyfileobj(r, f)
        os.replace(dest + ".part", dest)
    return dest


def main(argv: list[str]) -> int:
    found = sources()
    want = argv or sorted(found)
    unknown = [w for w in want if w not in found]
    if unknown:
        print(f"peers_fetch: PEER: expected some of {sorted(found)}, got {unknown}", file=sys.stderr)
        return 4
    for name in want:
        src = found[name]
        if isinstance(src, PeerWheels):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", os.path.join(ROOT, PEERS_DIR), *src.requirements], check=True)
            print(f"{name}: {', '.join(src.requirements)} -> {PEERS_DIR}/")
            continue
        if isinstance(src, PeerSdist):
            path = fetch_sdist(src)
            print(f"{name}: {src.requirement} -> {os.path.relpath(path, ROOT)} ({os.path.getsize(path) / 1e6:.2f} MB)")
            continue
        root = extract(src, wheel_path(src))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        print(f"{name}: {src.wheel} -> {os.path.relpath(root, ROOT)} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
