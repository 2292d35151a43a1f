"""Launch configurations as data: harness/impls/triton/configs/<device>/<module>.json, read through
`launch_config` (the device's file, then the HARNESS_TRITON_CONFIG override), malformed files refused."""
from __future__ import annotations

import json
import os

import pytest

from harness.impls.triton import _common
from harness.impls.triton._common import CONFIG_DIR, device_folder, launch_config, read_config_file


@pytest.fixture
def config_env(tmp_path, monkeypatch):
    """A config folder with one device file ("dev/mod.json"), selected through HARNESS_TRITON_DEVICE."""
    monkeypatch.setattr(_common, "CONFIG_DIR", str(tmp_path / "configs"))
    monkeypatch.setenv("HARNESS_TRITON_DEVICE", "dev")
    monkeypatch.delenv("HARNESS_TRITON_CONFIG", raising=False)
    d = tmp_path / "configs" / "dev"
    d.mkdir(parents=True)
    (d / "mod.json").write_text(json.dumps({"default": {"a": 5, "nested": {"x": 1}}, "wide": {"b": 9}}))
    return tmp_path


def test_h200_files_equal_the_module_defaults():
    """The H200 files hold exactly the defaults written in the kernel modules, for every module and shape
    class that reads one, and no file names a module or class that no kernel reads."""
    _common.kernel_modules()
    seen = {}
    for (module, cls), defaults in _common.DEFAULTS.items():
        seen.setdefault(module, {})[cls] = defaults
    files = sorted(f[:-5] for f in os.listdir(os.path.join(CONFIG_DIR, "h200")) if f.endswith(".json"))
    assert files == sorted(seen), "configs/h200/*.json vs the modules that read a launch config"
    for module, classes in seen.items():
        data = read_config_file(os.path.join(CONFIG_DIR, "h200", f"{module}.json"))
        assert data == classes, module


def test_launch_config_reads_the_device_file(config_env):
    """The device's file updates the defaults for its shape class; object parameters merge one level; a
    class the file lacks, another device or no device keep the defaults."""
    defaults = {"a": 1, "b": 2, "nested": {"x": 0, "y": 3}}
    assert launch_config("mod", defaults) == {"a": 5, "b": 2, "nested": {"x": 1, "y": 3}}
    assert launch_config("mod", defaults, "wide") == {"a": 1, "b": 9, "nested": {"x": 0, "y": 3}}
    assert launch_config("mod", defaults, "other") == defaults
    assert launch_config("absent", defaults) == defaults
    os.environ["HARNESS_TRITON_DEVICE"] = "another"
    assert launch_config("mod", defaults) == defaults
    assert defaults == {"a": 1, "b": 2, "nested": {"x": 0, "y": 3}}  # not modified in place


def test_override_file_wins(config_env, monkeypatch):
    """HARNESS_TRITON_CONFIG ({module: {class: params}}) is applied after the device's file."""
    over = config_env / "over.json"
    over.write_text(json.dumps({"mod": {"default": {"a": 7}}, "unrelated": {"default": {"q": 1}}}))
    monkeypatch.setenv("HARNESS_TRITON_CONFIG", str(over))
    assert launch_config("mod", {"a": 1, "b": 2, "nested": {}}) == {"a": 7, "b": 2, "nested": {"x": 1}}
    assert launch_config("mod", {"b": 2}, "wide") == {"b": 9}


@pytest.mark.parametrize("text,match", [
    ("{not json", "unreadable JSON"),
    ("[1, 2]", "a JSON object"),
    ('{"default": 3}', "a JSON object"),
    ('{"default": {"zz": 1}}', "'zz'.*unknown name"),
    ('{"default": {"a": [1]}}', "a number, a boolean"),
])
def test_malformed_device_file_is_a_clear_error(config_env, text, match):
    """A device file that is not {class: {parameter: value}} or names an unknown parameter raises
    ValueError naming the file."""
    (config_env / "configs" / "dev" / "mod.json").write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        launch_config("mod", {"a": 1, "nested": {}})
    assert "mod.json" in str(e.value)


def test_malformed_override_is_a_clear_error(config_env, monkeypatch):
    """A missing override file, or one without the module level, raises ValueError naming it."""
    monkeypatch.setenv("HARNESS_TRITON_CONFIG", str(config_env / "missing.json"))
    with pytest.raises(ValueError, match="HARNESS_TRITON_CONFIG.*missing.json.*no such file"):
        launch_config("mod", {"a": 1, "nested": {}})
    flat = config_env / "flat.json"
    flat.write_text(json.dumps({"mod": {"a": 2}}))
    monkeypatch.setenv("HARNESS_TRITON_CONFIG", str(flat))
    with pytest.raises(ValueError, match=r"HARNESS_TRITON_CONFIG.*flat.json.*\{module: \{shape class"):
        launch_config("mod", {"a": 1, "nested": {}})


def test_device_folder_names():
    """Model names map to the folder names the baselines use."""
    assert device_folder("NVIDIA H200") == "h200"
    assert device_folder("NVIDIA H100 80GB HBM3") == "h100"
    assert device_folder("NVIDIA GeForce RTX 4090") == "rtx"


def test_gdn_output_launch_runs_one_stage_only():
    """The GDN prefill's parallel output launch at two pipeline stages is compiled by Triton 3.6 for sm_90
    into programs whose outputs differ from run to run (docs/findings.md): neither the module's default, nor
    any device file, nor any sweep candidate sets out_stages above 1."""
    from harness.bench.sweep import SWEEPS
    from harness.impls.triton import delta_rule_chunk as M
    assert _common.DEFAULTS[("delta_rule_chunk", "default")]["out_stages"] == 1
    for dev in sorted(os.listdir(CONFIG_DIR)):
        path = os.path.join(CONFIG_DIR, dev, "delta_rule_chunk.json")
        if os.path.exists(path):
            for cls, cfg in read_config_file(path).items():
                assert cfg.get("out_stages", 1) == 1, (dev, cls)
    for group in SWEEPS["gated_delta_rule_varlen"]:
        for cand in group.candidates:
            assert cand.get("out_stages", 1) == 1, (group.name, cand)
    assert M.CONFIG["out_stages"] == 1 or os.environ.get("HARNESS_TRITON_CONFIG"), M.CONFIG
