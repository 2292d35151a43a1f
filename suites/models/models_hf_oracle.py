"""Helpers for the models suites: tiny random transformers checkpoints (the oracle), their raw
state-spaces twins, and tie-aware greedy agreement.

Nothing is downloaded: configs are built here, weights are random (seeded), transformers saves them
itself. Imported by the test modules of suites/models (it is not a test module).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

# transformers' CPU path calls many tiny ops (depthwise conv1d on a few tokens); with the default
# OpenMP pool they spin-wait against the other xdist worker on a 2-core box and take 100x longer
# (0.1 s per conv1d call measured). One intra-op thread per worker process is the right setting for
# these tiny models; it is set when this module is imported, i.e. only in processes running the
# models suites.
torch.set_num_threads(1)

FAMILIES = ("mamba1", "falcon_mamba", "mamba2")

HF_MODELING = ("transformers.models.mamba.modeling_mamba", "transformers.models.falcon_mamba.modeling_falcon_mamba",
               "transformers.models.mamba2.modeling_mamba2",
               # the delta-rule oracles: Qwen3NextGatedDeltaNet and KimiLinearDeltaAttention, which bind
               # causal-conv1d's and flash-linear-attention's kernels the same way when those import
               "transformers.models.qwen3_next.modeling_qwen3_next",
               "transformers.models.kimi_linear.modeling_kimi_linear")


def _hf_module_functions():
    """(module, attribute, callable) for every module-level function of the transformers modules of HF_MODELING,
    and every module-level object that runs a function in their place (`_runs_function`)."""
    import importlib
    import inspect
    for name in HF_MODELING:
        mod = importlib.import_module(name)
        for attr, f in list(vars(mod).items()):
            if inspect.isfunction(f) or _runs_function(f) is not None:
                yield mod, attr, f


def _runs_function(obj):
    """The function a module-level object calls in place of a function, or None: with the `kernels` package
    installed (a dependency of transformers from 5.25), `use_kernel_func_from_hub_with_fallback` turns the
    decorated function into an instance of a torch.nn.Module class whose forward calls the wrapper of the
    function (the class is built around it: the wrapper is the function its forward closes over)."""
    import inspect
    forward = getattr(type(obj), "forward", None) if isinstance(obj, torch.nn.Module) else None
    for cell in getattr(forward, "__closure__", None) or ():
        if inspect.isfunction(cell.cell_contents):
            return cell.cell_contents
    return None


def _torch_function(f):
    """The function the module-level callable f ends in: the innermost of its `__wrapped__` chain, through the
    function a `kernels` module object runs (`_runs_function`)."""
    import inspect
    return inspect.unwrap(_runs_function(f) or f)


def hf_torch_path_only() -> list[str]:
    """Make transformers' HF_MODELING modules (Mamba, the delta-rule mixers) use their own torch code; return
    the functions that were swapped.

    transformers 5.x binds mamba_ssm's, causal-conv1d's and flash-linear-attention's kernels in place of its
    torch functions at import time when those packages import (`use_kernel_func_from_hub_with_fallback`); from
    5.25, with the `kernels` package installed, the module attribute is then an nn.Module object that calls the
    wrapper. On the GPU box, where the peers are importable for their adapters, the CPU oracle then called CUDA
    kernels on CPU tensors ("Expected x.is_cuda() to be true") in every mixer and model oracle test. The oracle
    must be transformers' torch code, so each such module-level wrapper is replaced by the torch function it
    wraps (the forwards call these functions by their module-level names)."""
    import inspect
    swapped = []
    for mod, attr, f in _hf_module_functions():
        inner = _torch_function(f)
        if inner is not f and inspect.isfunction(inner) and inner.__module__ == mod.__name__:
            setattr(mod, attr, inner)
            swapped.append(f"{mod.__name__.rsplit('.', 1)[-1]}.{attr}")
    return swapped


def hf_foreign_functions() -> list[str]:
    """Module-level callables of transformers' HF_MODELING modules that stand for a function of theirs but run
    other code: a kernel wrapper left in place, as a function or as a `kernels` module object (it may call a
    peer's kernel). Empty once `hf_torch_path_only` ran."""
    out = []
    for mod, attr, f in _hf_module_functions():
        code = getattr(f, "__code__", None)
        if code is None:  # an object that runs a function
            out.append(f"{mod.__name__.rsplit('.', 1)[-1]}.{attr} ({type(f).__qualname__} object)")
        elif f.__module__ == mod.__name__ and code.co_filename != mod.__file__:
            out.append(f"{mod.__name__.rsplit('.', 1)[-1]}.{attr} (code in {code.co_filename})")
    return out


hf_torch_path_only()

HF_UNGROUPED_NORM = ("this transformers normalizes Mamba-2's gated RMSNorm over the whole inner dimension "
                     "instead of per group (MambaRMSNormGated without group_size, e.g. 5.17; later releases fix "
                     "it): it cannot be the oracle for n_groups > 1")


def hf_mamba2_norm_is_grouped() -> bool:
    """True when transformers' Mamba-2 gated RMSNorm normalizes per group of n_groups, as mamba_ssm does
    (and as the checkpoints were trained); older transformers releases normalize over all channels."""
    import inspect
    return "group_size" in inspect.signature(hf_mamba2_gated_norm().__init__).parameters


def hf_mamba2_gated_norm():
    """transformers' Mamba-2 gated RMSNorm class: MambaRMSNormGated up to 5.24, Mamba2RMSNormGated from 5.25."""
    from transformers.models.mamba2 import modeling_mamba2 as m
    return getattr(m, "MambaRMSNormGated", None) or m.Mamba2RMSNormGated


def mamba2_group_choices(heads: int, choices=(1, 2, 4)) -> list:
    """n_groups values an oracle test may draw: all that divide `heads`, or only 1 when this transformers'
    gated norm is ungrouped (test_models_hf_mamba2_norm_is_grouped then skips, giving the reason)."""
    ok = [g for g in choices if heads % g == 0]
    return ok if hf_mamba2_norm_is_grouped() else [1]


def quiet_transformers():
    import logging
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Dims:
    """A tiny model's shape, drawn by the tests."""
    family: str
    d_model: int = 16
    n_layer: int = 2
    vocab: int = 64
    d_state: int = 4
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 4          # mamba2
    n_groups: int = 1          # mamba2
    chunk_size: int = 8        # mamba2
    tie: bool = True
    bias: bool = False
    conv_bias: bool = True
    mixer_rms_eps: float = 1e-6  # falcon
    dt_rank: int | None = None   # mamba1: None = auto
    time_step_limit: tuple = (0.0, math.inf)


def hf_config(d: Dims):
    """The transformers config object for `d` (eos/pad/bos ids put out of the way of generation)."""
    quiet_transformers()
    from transformers import FalconMambaConfig, Mamba2Config, MambaConfig
    common = dict(vocab_size=d.vocab, hidden_size=d.d_model, state_size=d.d_state, num_hidden_layers=d.n_layer,
                  conv_kernel=d.d_conv, expand=d.expand, use_bias=d.bias, use_conv_bias=d.conv_bias,
                  tie_word_embeddings=d.tie, residual_in_fp32=True, layer_norm_epsilon=1e-5,
                  bos_token_id=0, eos_token_id=None, pad_token_id=0)
    if d.family == "mamba1":
        return MambaConfig(time_step_rank=d.dt_rank or "auto", **common)
    if d.family == "falcon_mamba":
        return FalconMambaConfig(time_step_rank=d.dt_rank or "auto", mixer_rms_eps=d.mixer_rms_eps, **common)
    heads = d.expand * d.d_model // d.head_dim
    return Mamba2Config(num_heads=heads, head_dim=d.head_dim, n_groups=d.n_groups, chunk_size=d.chunk_size,
                        time_step_limit=tuple(d.time_step_limit), **common)


def randomize_(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Perturb every parameter so that no structure (ones, zeros, equal rows) hides a bug.

    Norm weights stay near 1, A_log near its init, dt biases near their init; projections get
    unit-scale-preserving noise.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g, dtype=torch.float64) * 4 + 0.5).to(p.dtype))
            elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
                p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64) * 3 - 3).to(p.dtype))
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".D"):
                p.copy_(1 + 0.5 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() >= 2:
                fan_in = p.shape[-1] if p.dim() == 2 else p[0].numel()
                # out_proj larger: the mixers, not the (tied) embedding, must decide the next token
                gain = 4.0 if name.endswith("out_proj.weight") else 1.0
                p.copy_(noise * (gain * scale * 3 / math.sqrt(fan_in)))
            else:
                p.copy_(scale * noise)


def hf_mixer(d: Dims, seed: int, dtype=torch.float32):
    """A transformers mixer (layer 0) for `d` with random weights, and its config."""
    hc = hf_config(d)
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
    from transformers.models.mamba.modeling_mamba import MambaMixer
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    cls = {"mamba1": MambaMixer, "falcon_mamba": FalconMambaMixer, "mamba2": Mamba2Mixer}[d.family]
    torch.manual_seed(seed)
    mixer = cls(hc, 0, initialize_mixer_weights=False)
    randomize_(mixer, seed)
    return mixer.to(dtype).eval(), hc


def hf_mixer_call(mixer, hidden, cache):
    """Run a transformers mixer with `cache`. The keyword is `cache` from 5.2x on (`cache_params`, still
    accepted there, is deprecated) and `cache_params` before (5.17 swallows an unknown `cache=` into
    **kwargs and leaves the cache empty)."""
    import inspect
    name = "cache" if "cache" in inspect.signature(mixer.forward).parameters else "cache_params"
    return mixer(hidden, **{name: cache})


def hf_model(d: Dims, seed: int):
    """A transformers causal LM for `d` with random weights (float32, eval)."""
    hc = hf_config(d)
    from transformers import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM
    cls = {"mamba1": MambaForCausalLM, "falcon_mamba": FalconMambaForCausalLM, "mamba2": Mamba2ForCausalLM}[d.family]
    torch.manual_seed(seed)
    model = cls(hc)
    randomize_(model, seed)
    if d.tie:
        model.tie_weights()
    return model.eval()


def kda_checkpoint_names(sd: dict) -> dict:
    """A KimiLinearDeltaAttention module's state dict under the checkpoints' names (ours): its fused
    `conv1d.weight` split into q_conv1d / k_conv1d / v_conv1d, `forget_gate.*` beside the other weights (what
    transformers' save_pretrained writes for Kimi Linear)."""
    out = {}
    for k, v in sd.items():
        if k == "conv1d.weight":
            for name, part in zip("qkv", v.chunk(3, dim=0)):
                out[f"{name}_conv1d.weight"] = part.clone()
        else:
            out[k[len("forget_gate."):] if k.startswith("forget_gate.") else k] = v
    return out


def our_config_dict(hc) -> dict:
    return json.loads(hc.to_json_string())


def state_spaces_config(d: Dims, vocab_size: int, pad_multiple: int) -> dict:
    """The raw state-spaces (mamba_ssm MambaConfig) config.json for `d`."""
    if d.family == "mamba2":
        ssm = {"layer": "Mamba2", "d_state": d.d_state, "d_conv": d.d_conv, "expand": d.expand,
               "headdim": d.head_dim, "ngroups": d.n_groups, "chunk_size": d.chunk_size,
               "conv_bias": d.conv_bias, "bias": d.bias}
        if tuple(d.time_step_limit) != (0.0, math.inf):
            ssm["dt_limit"] = list(d.time_step_limit)
    elif d.family == "mamba1":
        ssm = {"d_state": d.d_state, "d_conv": d.d_conv, "expand": d.expand, "conv_bias": d.conv_bias,
               "bias": d.bias}
        if d.dt_rank:
            ssm["dt_rank"] = d.dt_rank
    else:
        raise ValueError("state-spaces has no Falcon-Mamba format")
    return {"d_model": d.d_model, "d_intermediate": 0, "n_layer": d.n_layer, "vocab_size": vocab_size,
            "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
            "fused_add_norm": True, "pad_vocab_size_multiple": pad_multiple, "tie_embeddings": d.tie}


def write_state_spaces(model, d: Dims, folder: Path, fmt: str = "bin", pad_in_file: bool = True,
                       pad_multiple: int = 8, prefix: str = "backbone.") -> Path:
    """Write `model`'s weights as a raw state-spaces checkpoint (names `backbone.embedding.weight`, ...).

    The config says vocab_size = the model's vocabulary and pad_vocab_size_multiple = `pad_multiple`.
    state-spaces stores the embedding padded to the multiple (`pad_in_file`, zero rows) and saves
    `lm_head.weight` even when tied (it is in its state dict); without `pad_in_file` the loader must
    pad the rows itself.
    """
    from reference.loader import pad_rows, pad_vocab
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("backbone."):
            k = k[len("backbone."):]
            if k.startswith("embeddings."):
                k = "embedding." + k[len("embeddings."):]
            k = prefix + k
        sd[k] = v.detach().clone().contiguous()
    emb = prefix + "embedding.weight"
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd[emb].clone()
    if pad_in_file:
        rows = pad_vocab(d.vocab, pad_multiple)
        sd[emb] = pad_rows(sd[emb], rows)
        sd["lm_head.weight"] = pad_rows(sd["lm_head.weight"], rows)
    (folder / "config.json").write_text(json.dumps(state_spaces_config(d, d.vocab, pad_multiple)))
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file(sd, str(folder / "model.safetensors"))
    return folder


def hf_greedy(model, prompt: list[int], n: int):
    """transformers' own greedy generation: (new tokens, per-step logits (n, V) float32)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, num_beams=1, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0, use_cache=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([lg[0] for lg in out.logits]).float()
    return tokens, logits


# The oracle's spread is one sample of what fp32 rounding does at the compared steps; our fp32 is a third
# evaluation order, judged within SPREAD_K of that sample (a nightly case: transformers' two orders 2.3e-2 apart
# at one step, our fp32 1.1e-1 from our fp64 there, our fp64 1.5e-3 from transformers' generate).
SPREAD_K = 8.0


def spread(a: torch.Tensor, b: torch.Tensor, k: float = 1.0):
    """k times the distance of two values the oracle gives for one quantity, as a widening of a tolerance: atol
    by the largest difference, ratio by the difference's norm relative to `b`'s (rtol 0)."""
    from harness.testing.checks import Tolerance
    diff = a.double() - b.double()
    return Tolerance(k * float(diff.abs().max()), 0.0, k * float(diff.norm() / b.double().norm().clamp_min(1e-300)))


def widened(tol, s):
    """`tol` widened by a `spread`."""
    return type(tol)(tol.atol + s.atol, tol.rtol, tol.ratio + s.ratio)


def one_forward(model, prompt: list[int], tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    """transformers' step logits for `tokens` after `prompt` from one forward of the whole sequence (the
    steps and vocabulary of `logits`, which generate gave)."""
    ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long)
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1:, :logits.shape[-1]]


def oracle_spread(model, prompt: list[int], tokens: list[int], logits: torch.Tensor, full=None):
    """How far transformers' fp32 step logits (`logits`, from generate: one token at a time through its caches)
    move when the same tokens go through one forward of the whole sequence instead (`full`: `one_forward`'s,
    if already computed): their `spread`, SPREAD_K times. That is the oracle's own rounding at these steps:
    ~1e-6 where they are well conditioned, 1e-2 at ill-conditioned ones (a gated norm over a nearly zero head
    output, say)."""
    full = one_forward(model, prompt, tokens, logits) if full is None else full
    return spread(full, logits, SPREAD_K)


def oracle_tie_margins(model, prompt: list[int], tokens: list[int], logits: torch.Tensor, margin: float,
                       full=None) -> list[float]:
    """Per step, the top-2 margin (`top2_margin`'s units) below which transformers' own choice is a tie: at least
    `margin`, and at least SPREAD_K times what the step's two best logits can move between its two evaluation
    orders (generate against one forward: each logit by the step's largest difference d, their gap by 2 d),
    relative to max(1, |top logit|). Where the oracle is well conditioned (d ~ 1e-6) that is `margin`; at a step
    whose orders differ by 2e-2 a choice made by less than about 0.3 is the oracle's rounding, not a token.
    `full`: `one_forward`'s logits, if already computed."""
    full = one_forward(model, prompt, tokens, logits) if full is None else full
    d = (full.double() - logits.double()).abs().amax(-1)
    top = logits.double().amax(-1).abs().clamp_min(1.0)
    return [max(margin, float(x)) for x in SPREAD_K * 2 * d / top]


def top2_margin(logits: torch.Tensor) -> float:
    """Relative gap between the best and second-best logit: (l1 - l2) / max(1, |l1|)."""
    top = torch.topk(logits.double(), 2).values
    return float((top[0] - top[1]) / max(1.0, abs(float(top[0]))))


def first_clear_mismatch(ours: list[int], oracle: list[int], oracle_logits: torch.Tensor, margin=1e-3):
    """Tie-aware greedy agreement.

    Walks the two token streams; a mismatch where the oracle's top-2 margin is <= `margin` (one number, or one
    per step: `oracle_tie_margins`) is a tie: the streams may legitimately diverge there, and nothing after it is
    compared. Returns None when they agree, else (step, our token, oracle token, margin) of the first clear
    mismatch.
    """
    for i, (a, b) in enumerate(zip(ours, oracle)):
        if a == b:
            continue
        m = top2_margin(oracle_logits[i])
        if m <= (margin if isinstance(margin, (int, float)) else margin[i]):
            return None
        return i, a, b, m
    if len(ours) != len(oracle):
        return len(min(ours, oracle, key=len)), None, None, float("inf")
    return None


def check_engine_greedy(check, family: str, factory, prompts, oracle, results, *, seed: int, context: str,
                        margin: float = 1e-3, show_cached: bool = False, model=None) -> None:
    """The engine's requests ``r{i}`` (`results` of a runner built by `factory`) against transformers'
    greedy generation of each prompt (`oracle`: hf_greedy's (tokens, logits) per prompt): the tokens agree
    tie-aware (first_clear_mismatch with `margin`), and the logits of the steps where both chose the same
    tokens (after a tie the inputs differ) are within tolerance. transformers runs in fp32: the comparison
    cannot be tighter than fp32's policy (x2 for depth). With the transformers `model`, each prompt's tolerance
    is widened by the oracle's own spread at its steps (`oracle_spread`), and a step's tie margin by it
    (`oracle_tie_margins`). `show_cached`: a token mismatch's
    message also says how many tokens the request took from the prefix cache."""
    from harness.testing.checks import tolerance_for
    tol = factory.tol if factory.dtype != torch.float64 else tolerance_for(torch.float32, 2.0)
    for i, (p, (toks, logits)) in enumerate(zip(prompts, oracle)):
        r = results[f"r{i}"]
        full = one_forward(model, p, toks, logits) if model is not None else None
        ties = oracle_tie_margins(model, p, toks, logits, margin, full) if model is not None else margin
        bad = first_clear_mismatch(list(r.tokens), toks, logits, ties)
        cached = f", {r.num_cached} tokens from the prefix cache" if show_cached else ""
        assert bad is None, (f"{family} engine[{factory.impl.name}, {factory.dtype}] request {i} (prompt {p}{cached}): "
                             f"greedy token differs from transformers at step {bad[0]}: ours {bad[1]}, "
                             f"transformers {bad[2]} (margin {bad[3]:.3e})\nours {list(r.tokens)}\nhf   {toks}")
        agree = next((k for k, (a, b) in enumerate(zip(r.tokens, toks)) if a != b), len(toks))
        wide, why = tol, context
        if model is not None:
            s = oracle_spread(model, p, toks, logits, full)
            wide = widened(tol, s)
            why = (f"{context}; widened by {SPREAD_K:g}x the oracle's spread (atol + {s.atol:.2e}, "
                   f"ratio + {s.ratio:.2e})")
        check.close(f"{family} request {i}: step logits vs transformers", r.step_logits[:agree, :logits.shape[-1]],
                    logits[:agree].double(), op="engine_generate", impl=factory.impl, dtype=factory.dtype,
                    tol=wide, seed=seed, shapes={"prompt": [len(p)], "steps": [agree]}, context=why)
