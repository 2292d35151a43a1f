"""Model-level throughput (`harness bench throughput`, harness/bench/throughput.py) on the CPU with tiny shapes:
it runs the engine's backend path and transformers' model, and writes well-formed timing records."""
import pytest

from harness.bench.throughput import PRESETS, main, model_config
from harness.records import read_records


@pytest.mark.parametrize("family,hf", [("falcon_mamba", False), ("mamba2", True)])
def test_throughput_cpu_tiny(tmp_path, family, hf):
    """Tiny CPU run: an env record, then timing records for the engine's prefill (batch 1) and decode
    (batch 4), and (mamba2; transformers' FalconMamba is slow on CPU) transformers' prefill and decode,
    each with positive ms and tok_s = tokens / time."""
    out = tmp_path / "t.jsonl"
    rc = main(["--device", "cpu", "--family", family, "--layers", "2", "--d-model", "32", "--vocab", "128",
               "--d-state", "8", "--head-dim", "16", "--n-groups", "2", "--chunk-size", "8", "--prefill", "16",
               "--decode-batch", "4", "--dtype", "float32", "--impl", "reference", "--reps", "2", "--warmup", "1",
               "--hf-new-tokens", "6", "--out", str(out)] + ([] if hf else ["--no-hf"]))
    assert rc == 0
    recs = read_records(str(out))
    assert recs[0]["kind"] == "env"
    timings = [r for r in recs if r["kind"] == "timing"]
    got = {(r["source"], r["op"]) for r in timings}
    want = {("engine", "model_prefill"), ("engine", "model_decode")}
    if hf:
        want |= {("transformers", "model_prefill"), ("transformers", "model_decode")}
    assert got == want, timings
    for r in timings:
        assert "error" not in r, r
        assert r["ms_p50"] > 0 and r["tok_s"] == pytest.approx(r["tokens"] / (r["ms_p50"] / 1e3))
        assert r["cuda_graph"] is False
        assert r["shape"]["family"] == family and r["shape"]["layers"] == 2 and r["dtype"] == "float32"


def test_throughput_bad_input(capsys):
    """Non-positive sizes exit 2 with a message naming the argument; an unknown implementation is a usage
    error (exit 4) listing the registered ones, through `harness bench throughput` as well."""
    from harness.cli import main as harness_main
    assert main(["--device", "cpu", "--layers", "0", "--no-hf"]) == 2
    assert "--layers: expected a positive int" in capsys.readouterr().err
    assert main(["--device", "cpu", "--layers", "1", "--d-model", "16", "--impl", "nope", "--no-hf"]) == 4
    err = capsys.readouterr().err
    assert "--impl" in err and "nope" in err and "reference" in err and "triton" in err
    assert harness_main(["bench", "throughput", "--device", "cpu", "--impl", "nope", "--no-hf"]) == 4


def test_throughput_presets_have_the_published_shapes():
    """falcon-mamba-7b: d_inner 8192, N 16, dt_rank 256, vocab 65024, 64 layers; Mamba-Codestral-7B: H 128,
    P 64, G 8, N 128, vocab 32768, 64 layers."""
    f = dict(PRESETS["falcon-mamba-7b"])
    cfg = model_config(f.pop("family"), f.pop("layers"), f.pop("d_model"), **f)
    assert (cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.vocab_size, cfg.n_layer) == (8192, 16, 256, 65024, 64)
    m = dict(PRESETS["mamba-codestral-7b"])
    cfg = model_config(m.pop("family"), m.pop("layers"), m.pop("d_model"), **m)
    assert (cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.d_state, cfg.vocab_size, cfg.n_layer) == \
        (128, 64, 8, 128, 32768, 64)
