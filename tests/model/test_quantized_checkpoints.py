"""Quantized checkpoints (AWQ, GPTQ, compressed-tensors int4 and FP8, fp8) against their dequantized
reference.

Each tiny random Llama is written in the format by tandem/checkpoints/quantize.py, which also writes
the same weights dequantized from its own integers and scales (no reader code involved) as a float
checkpoint. transformers runs that reference; Tandem runs the quantized folder. Prompt positions go
through the dequantize-then-GEMM path (exact up to float32 rounding); decode positions through the
4-bit kernel where the host has it, which also quantizes activations to int8 blocks of 32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tandem import LLM, SamplingParams, kernels
from tandem.checkpoints.quantize import Scheme, write_quantized
from tandem.config import EngineConfig, ModelConfig
from tandem.model.int4 import Int4Linear
from tandem.model.linear import PackedLinear
from tandem.model.linear_report import linear_report
from tandem.model.loader import load_model
from tandem.model.quant import Int8Linear

SCHEMES = {
    "awq-g32": Scheme("awq", 32),
    "awq-channel": Scheme("awq", -1),
    "gptq-g64-sym": Scheme("gptq", 64, sym=True),
    "gptq-g32-asym": Scheme("gptq", 32),
    "gptq-v2-channel": Scheme("gptq", -1, gptq_format="gptq_v2"),
    "gptq-g32-actorder": Scheme("gptq", 32, desc_act=True),
    "ct-int4-g32-sym": Scheme("ct-int4", 32, sym=True),
    "ct-int4-g64-asym": Scheme("ct-int4", 64, scale_dtype=torch.bfloat16),
    "ct-int4-g32-actorder": Scheme("ct-int4", 32, sym=True, desc_act=True),
    "ct-fp8-channel": Scheme("ct-fp8", fp8_block=None),
    "fp8-block": Scheme("fp8", fp8_block=(32, 48)),  # ragged blocks: 48 divides neither 64 nor 128
    "fp8-tensor": Scheme("fp8", fp8_block=None),
}
INT4 = ("awq", "gptq", "ct-int4")
# Max |logprob difference| to the reference. Prompt positions: float32 rounding only (measured
# 3e-6). Generated positions with the int4 kernel: its int8 activation blocks cost up to 0.10 on
# these random models (sharp distributions: initializer_range 0.2); without it, rounding only.
PROMPT_TOL = 2e-4
DECODE_TOL = {True: 0.25, False: 2e-4}
# Prompts longer than the kernel's rows (16), so their pass is the dequantize-then-GEMM one (where the
# panel kernel, which takes every row count, is not the 4-bit path).
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n        print(name)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def source(model_factory) -> Path:
    return model_factory("llama", seed=3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def written(source, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    out = {}
    for name, scheme in SCHEMES.items():
        root = tmp_path_factory.mktemp(name)
        write_quantized(source, root / "q", scheme, reference=root / "ref")
        out[name] = (root / "q", root / "ref")
    return out


def _hf_logprobs(folder: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0].double(), -1) for s in sequences]


# End to end (a few seconds each): one case per format family; every scheme's weights are checked
# exactly by test_every_scheme_loads_the_reference_weights.
GENERATE = ["awq-g32", "gptq-g64-sym", "gptq-g32-actorder", "ct-int4-g64-asym", "ct-fp8-channel", "fp8-block"]
CASES = [(name, True) for name in GENERATE] + [("awq-g32", False)]


@pytest.mark.parametrize(("name", "use_kernels"), CASES, ids=[f"{n}{'' if k else '-nokernels'}" for n, k in CASES])
def test_quantized_checkpoint_matches_dequantized_reference(name, use_kernels, written, monkeypatch):
    if not use_kernels:
        monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    qdir, ref = written[name]
    scheme = SCHEMES[name]
    llm = LLM(str(qdir), num_kv_blocks=64)
    inner = llm.engine.core.runner.model
    kinds, _ = linear_report(inner)
    int4 = scheme.method in INT4
    assert ("int4" in kinds["down_proj"].path) == int4
    assert kinds["lm_head"].path.startswith("packed oneDNN") or kinds["lm_head"].path.startswith("F.linear")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    hf = _hf_logprobs(ref, seqs)
    kernel = int4 and kernels.has("gemm_int4")
    worst_prompt = worst_decode = 0.0
    for o, lp, seq in zip(outs, hf, seqs):
        n = len(o.prompt_token_ids)
        assert n > 16
        for i in range(1, n):  # prompt token i given the tokens before it
            got = o.prompt_logprobs[i][seq[i]].logprob
            worst_prompt = max(worst_prompt, abs(got - float(lp[i - 1, seq[i]])))
        for j, tok in enumerate(o.outputs[0].token_ids):
            got = o.outputs[0].logprobs[j][tok].logprob
            worst_decode = max(worst_decode, abs(got - float(lp[n - 1 + j, tok])))
    # Without AMX the 4-bit panel kernel takes every row count, prompts too (int8 activations).
    panels = any(isinstance(m, Int4Linear) and m.panels is not None for m in inner.modules())
    assert worst_prompt < (DECODE_TOL[True] if panels else PROMPT_TOL), worst_prompt
    assert worst_decode < DECODE_TOL[kernel or panels], worst_decode
    for o, lp in zip(outs, hf):
        last = lp[len(o.prompt_token_ids) - 1]
        first = o.outputs[0].token_ids[0]
        if panels:  # the first token's reference log-probability within the tolerance of the best
            assert float(last.max() - last[first]) < DECODE_TOL[True]
        else:  # from the prompt pass (exact), so the reference's argmax
            assert first == int(last.argmax())


def _fused_reference(ref: Path, layer: int) -> dict[str, torch.Tensor]:
    t = load_file(str(ref / "model.safetensors"))
    p = f"model.layers.{layer}."
    return {
        "qkv_proj": torch.cat([t[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]),
        "o_proj": t[f"{p}self_attn.o_proj.weight"],
        "gate_up_proj": torch.cat([t[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]),
        "down_proj": t[f"{p}mlp.down_proj.weight"],
    }


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_loads_the_reference_weights(name, written):
    """Each layer's product with the identity (rows beyond the kernel's: the dequantized weight
    itself) equals the reference checkpoint's weight, every format and variant."""
    qdir, ref = written[name]
    cfg = ModelConfig.from_pretrained(qdir)
    model = load_model(cfg, torch.float32, torch.device("cpu"), "torch", 64)
    for i, layer in enumerate(model.layers):
        expected = _fused_reference(ref, i)
        for leaf, lin in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            assert isinstance(lin, Int4Linear) == (SCHEMES[name].method in INT4)
            w = expected[leaf]
            eye = torch.eye(w.shape[1])
            torch.testing.assert_close(lin(eye).T, w, rtol=1e-6, atol=1e-6, msg=f"{name} layer {i} {leaf}")


def test_int4_weights_take_a_quarter_of_bfloat16(written):
    qdir, _ = written["gptq-g64-sym"]
    cfg = ModelConfig.from_pretrained(qdir)
    model = load_model(cfg, torch.float32, torch.device("cpu"), "torch", 64)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * cfg.num_layers  # q/k/v fused, o, gate/up fused, down
    for m in layers:
        weights = m.out_features * m.in_features
        groups = weights // m.group_size
        # Row layout, or column panels (padded to 16 columns) where those replace it.
        qweight, scales, zs = (m.qweight, m.scales, m.zs) if m.panels is None else (m.panels, m.panel_scales, m.panel_zs)
        padded = -(-m.out_features // 16) * 16 * m.in_features
        assert qweight.numel() * qweight.element_size() in (weights // 2, padded // 2)
        assert scales.numel() in (groups, padded // m.group_size)
        assert zs is None  # symmetric: every zero point 8, none stored
    # One dequantization buffer for the model's 4-bit layers: not one per layer (the float model's
    # memory again), nor one per process (shared with other models).
    assert len({id(m.scratch) for m in layers}) == 1
    other = load_model(cfg, torch.float32, torch.device("cpu"), "torch", 64)
    assert next(m for m in other.modules() if isinstance(m, Int4Linear)).scratch is not layers[0].scratch


def test_transformers_reference_is_its_own_float_model(written, source):
    """The reference differs from the float source by the quantization only, not a format slip."""
    _, ref = written["awq-g32"]
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(source / "model.safetensors"))
    w, w0 = a["model.layers.0.mlp.down_proj.weight"], b["model.layers.0.mlp.down_proj.weight"].float()
    # 4 bits over each group's range: every weight within half a step of its own value.
    step = (w0.view(w0.shape[0], -1, 32).amax(-1) - w0.view(w0.shape[0], -1, 32).amin(-1).clamp(max=0)) / 15
    assert bool(((w - w0).abs().view(w0.shape[0], -1, 32) <= step[..., None] * 0.51 + 1e-6).all())
    assert not torch.equal(w, w0)


def _edit(src: Path, dst: Path, config=None, drop: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        t = load_file(str(dst / "model.safetensors"))
        del t[drop]
        save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("gptq-g64-sym", lambda q: q.update(bits=8), "bits=8 is not supported"),
        ("gptq-g64-sym", lambda q: q.update(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
        ("gptq-g64-sym", lambda q: q.update(dynamic={"-:.*": {}}), "dynamic"),
        ("awq-g32", lambda q: q.update(version="gemv"), "awq version 'gemv'"),
        ("awq-g32", lambda q: q.update(zero_point=False), "zero_point: false"),
        ("awq-g32", lambda q: q.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
        ("ct-int4-g32-sym", lambda q: q.update(format="marlin-24"), "format 'marlin-24'"),
        ("ct-int4-g32-sym", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8),
         "bits=8 is not supported"),
        ("fp8-block", lambda q: q.update(weight_block_size=[128]), "weight_block_size"),
        ("fp8-block", lambda q: q.update(fmt="e5m2"), "fmt 'e5m2'"),
    ],
)
def test_unsupported_configs_are_value_errors(name, change, message, written, tmp_path):
    folder = _edit(written[name][0], tmp_path / "m", config=change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(folder)


def test_bad_tensors_are_value_errors(written, tmp_path):
    awq = written["awq-g32"][0]
    missing = _edit(awq, tmp_path / "a", drop="model.layers.1.self_attn.k_proj.qzeros")
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.qzeros'"):
        load_model(ModelConfig.from_pretrained(missing), torch.float32, torch.device("cpu"), "torch", 64)
    # A g_idx whose groups are not all group_size inputs long is refused by name.
    gptq = _edit(written["gptq-g32-asym"][0], tmp_path / "g")
    t = load_file(str(gptq / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.g_idx"
    t[key] = torch.zeros_like(t[key])
    save_file(t, str(gptq / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.g_idx does not give each of the 4 groups 32 inputs"):
        load_model(ModelConfig.from_pretrained(gptq), torch.float32, torch.device("cpu"), "torch", 64)
    # Act-order parts fused into one layer (q/k/v) must share their input order.
    order = _edit(written["gptq-g32-actorder"][0], tmp_path / "o")
    t = load_file(str(order / "model.safetensors"))
    key = "model.layers.0.self_attn.k_proj.g_idx"
    t[key] = (torch.arange(t[key].numel()) // 32).to(torch.int32)
    save_file(t, str(order / "model.safetensors"))
    with pytest.raises(ValueError, match="share their act-order input permutation"):
        load_model(ModelConfig.from_pretrained(order), torch.float32, torch.device("cpu"), "torch", 64)


def test_quantization_argument_must_agree_with_the_checkpoint(written, source):
    qdir, _ = written["gptq-g32-asym"]
    with pytest.raises(ValueError, match=r"already quantized with 'gptq'.*or 'int8' for its float layers"):
        LLM(str(qdir), quantization="awq", num_kv_blocks=16)
    with pytest.raises(ValueError, match="already quantized with 'fp8'"):
        LLM(str(written["fp8-tensor"][0]), quantization="int8", num_kv_blocks=16)
    with pytest.raises(ValueError, match="needs a checkpoint quantized that way"):
        LLM(str(source), quantization="fp8", num_kv_blocks=16)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model=str(source), quantization="nf4")
    # Naming the checkpoint's own method (or vLLM's kernel alias for it) is accepted.
    llm = LLM(str(qdir), quantization="gptq_marlin", num_kv_blocks=16)
    assert llm.generate("x", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_int8_on_a_4bit_checkpoint_quantizes_its_float_layers(written):
    """quantization="int8" on a GPTQ checkpoint: the 4-bit layers stay, the float LM head goes to
    int8 (within int8's error of the float head), and the model still generates."""
    qdir, _ = written["gptq-g64-sym"]
    plain = LLM(str(qdir), num_kv_blocks=16).engine.core.runner.model
    both = LLM(str(qdir), quantization="int8", num_kv_blocks=16)
    model = both.engine.core.runner.model
    assert isinstance(model.lm_head, Int8Linear) and not isinstance(plain.lm_head, Int8Linear)
    kinds = {type(m) for m in model.modules()}
    assert Int4Linear in kinds and nn.Linear not in kinds and PackedLinear not in kinds
    h = torch.randn(3, plain.lm_head.in_features)
    ref = plain.lm_head(h)
    assert float((model.lm_head(h) - ref).norm() / ref.norm()) < 0.02
    out = both.generate("hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_biases_of_4bit_layers_load(model_factory, tmp_path):
    """Qwen2's q/k/v biases stay float next to 4-bit weights, fused in the same rows."""
    src = model_factory("qwen2", seed=4)
    qdir = write_quantized(src, tmp_path / "q", Scheme("gptq", 32), reference=tmp_path / "ref")
    model = load_model(ModelConfig.from_pretrained(qdir), torch.float32, torch.device("cpu"), "torch", 64)
    ref = load_file(str(tmp_path / "ref" / "model.safetensors"))
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.bias is not None
    p = "model.layers.1.self_attn."
    bias = torch.cat([ref[f"{p}{x}_proj.bias"] for x in "qkv"])
    weight = torch.cat([ref[f"{p}{x}_proj.weight"] for x in "qkv"])
    eye = torch.eye(weight.shape[1])
    torch.testing.assert_close(qkv(torch.zeros(17, weight.shape[1]))[0], bias, rtol=0, atol=1e-6)
    torch.testing.assert_close(qkv(eye).T - bias[:, None], weight, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_moe"])
def test_other_architectures_load_4bit_layers(arch, model_factory, tmp_path):
    """The 4-bit layers go in through each architecture's own weight mapping (Gemma 2; Qwen3-MoE,
    whose attention is 4-bit here and experts float): each equals the reference model's layer."""
    src = model_factory(arch, seed=2)
    qdir = write_quantized(src, tmp_path / "q", Scheme("gptq", 32, sym=True), reference=tmp_path / "ref")
    load = lambda d: load_model(ModelConfig.from_pretrained(d), torch.float32, torch.device("cpu"), "torch", 64)
    model, ref = load(qdir), dict(load(tmp_path / "ref").named_modules())
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) >= 2 * model.config.num_layers
    for name, lin in layers.items():
        eye = torch.eye(lin.in_features)
        torch.testing.assert_close(lin(eye), ref[name](eye), rtol=1e-5, atol=1e-5, msg=name)
