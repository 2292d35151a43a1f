"""Where a peer's code comes from on a machine without a package registry.

An adapter whose peer ships pure Python/Triton code inside a large wheel (vLLM, SGLang) declares a
`SOURCE = PeerSource(...)`: the wheel to download by name, the files of it the adapter needs, and small
module stubs that stand in for the engine-only imports of those files (platform detection, logging, env
settings, custom-op handles). `scripts/peers_fetch.py` downloads the wheels on a machine that has a
registry, extracts only those files into the git-ignored `.peers/src/`, and writes the stubs next to them;
`scripts/peers_setup.sh` puts `.peers/src` on PYTHONPATH. Where the real package is installed, the adapter
imports it and the extracted copy is not used. Nothing of the peers is committed: only the list of files
and our stubs are.

A peer whose kernels are CUDA extensions built from source (mamba_ssm, causal-conv1d) declares
`SOURCE = PeerSdist("<pkg>==<version>")`: the fetch script downloads its source archive into `.peers/`
(from the package index's JSON API: `pip download` of an sdist runs its build, which needs CUDA), and
`scripts/gpu.sh` compiles the extensions on the GPU machine (`scripts/build_peer_ext.py`).
"""
from __future__ import annotations

import dataclasses
import os

PEERS_DIR = ".peers"
SRC_DIR = os.path.join(".peers", "src")
WHEEL_DIR = os.path.join(".peers", "wheels")


@dataclasses.dataclass(frozen=True)
class PeerSource:
    """wheel: a pip requirement with an exact version ("vllm==0.33.0"); files: glob patterns of paths inside
    the wheel (relative to its root, e.g. "vllm/model_executor/layers/mamba/ops/*.py"); stubs: path inside
    the source tree -> Python source written there (a stub never overwrites an extracted file: a path
    in both is an error); packages: package directories that get an empty `__init__.py` when the wheel's
    own one is not extracted (so that importing a subpackage does not run the engine's start-up code)."""
    wheel: str
    files: tuple[str, ...]
    stubs: dict = dataclasses.field(default_factory=dict)
    packages: tuple[str, ...] = ()

    def __post_init__(self):
        if "==" not in self.wheel:
            raise ValueError(f"wheel: expected a pinned requirement 'name==version', got {self.wheel!r}")
        clash = [p for p in self.stubs if p in self.files]
        if clash:
            raise ValueError(f"stubs: expected paths that are not extracted files, got {clash}")

    @property
    def name(self) -> str:
        return self.wheel.split("==")[0]

    @property
    def version(self) -> str:
        return self.wheel.split("==")[1]


@dataclasses.dataclass(frozen=True)
class PeerSdist:
    """requirement: a pinned 'name==version' whose source archive goes to .peers/ as it is."""
    requirement: str

    def __post_init__(self):
        if "==" not in self.requirement:
            raise ValueError(f"requirement: expected a pinned 'name==version', got {self.requirement!r}")

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


@dataclasses.dataclass(frozen=True)
class PeerWheels:
    """requirements: pinned pure-Python wheels ('name==version', ...) that go to .peers/ as they are and that
    scripts/peers_setup.sh installs into a private folder on the GPU machine (fla-core and its einops)."""
    requirements: tuple[str, ...]

    def __post_init__(self):
        bad = [r for r in self.requirements if "==" not in r]
        if bad:
            raise ValueError(f"requirements: expected pinned 'name==version' entries, got {bad}")
