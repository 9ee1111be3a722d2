"""Configuration: the model's shape read from config.json, and the engine's arguments.

Pure Python (no torch) so every layer can import it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.core.policy import FCFS, SCHEDULING_POLICIES
from tandem.core.preemption import PREEMPTION_MODES
from tandem.quantization_config import CHECKPOINT_METHODS, METHOD_ALIASES, QuantizationConfig

if TYPE_CHECKING:
    from tandem.spec.config import SpeculativeConfig

# Mixture-of-experts architectures (tandem/model/moe.py); their router settings: MoEConfig.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# At-load quantization of a float checkpoint (tandem/model/quant.py).
QUANTIZATION_METHODS = ("int8",)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
# Where the engine runs (tandem/worker/device.py resolves "auto": CUDA when a GPU is visible, else CPU).
DEVICES = ("auto", "cuda", "cpu")
# Attention backends: "auto" is "torch" on CPU and "triton" on CUDA (tandem/worker/device.py).
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "triton", "flashinfer")
# How the weights are read: "auto" (the folder's safetensors or GGUF file) or "dummy" (vLLM's name:
# random weights of config.json's shape made on the device, no weight file; for benchmarks).
LOAD_FORMATS = ("auto", "dummy")
# How KV blocks move between instances (tandem/kvtransfer/transport.py).
KV_TRANSPORTS = ("zmq", "shm")
# KV cache bytes on a CPU when neither kv_cache_memory nor num_kv_blocks is given.
DEFAULT_KV_CACHE_MEMORY = 2 << 30
# The fraction of a GPU's memory the engine may take (weights, activations, KV cache), as vLLM's
# `--gpu-memory-utilization`; the KV cache gets what the weights and the profiled peak leave.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Preemption by swap (tandem/core/preemption.py; why these values: docs/defaults.md). The swap space
# in GiB where `swap_space` is not given (a CPU's KV cache is in host memory already: none there),
# and the cost model's constants where not given: the host link's bandwidth each way (GB/s) and the
# FLOP rate a prefill reaches (TFLOP/s), on CUDA and on a CPU.
DEFAULT_SWAP_SPACE_GIB_CUDA = 4.0
DEFAULT_SWAP_BANDWIDTH_GBPS_CUDA = 25.0
DEFAULT_SWAP_BANDWIDTH_GBPS_CPU = 10.0
DEFAULT_RECOMPUTE_TFLOPS_CUDA = 400.0
DEFAULT_RECOMPUTE_TFLOPS_CPU = 1.0
# A GGUF file's 4-bit blocks kept packed (tandem/model/gguf_weights.py), vLLM's name for its GGUF kernels.
GGUF_QUANTIZATION = "gguf"
# Every accepted `quantization` value: at load, or naming the checkpoint's own format (checked).
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, *CHECKPOINT_METHODS, *METHOD_ALIASES, GGUF_QUANTIZATION)
# The key of config.json that marks a folder prepared from a GGUF file (tandem/model/gguf_folder.py):
# {"file": absolute path, "size": bytes}; the weights are read from that file.
GGUF_CONFIG_KEY = "tandem_gguf"


@dataclass(frozen=True, slots=True)
class Option:
    """How a config field is set on the command line (vLLM's EngineArgs does the same from its
    fields): `--field-name` (or `flag`) plus `aliases`, this help and these choices; the default is
    the field's own. `parse` turns the flag's text into the value (unset: from the field's type: a
    dict field takes JSON). `group` names the `tandem serve --help` section it is listed in."""

    help: str
    choices: tuple[str, ...] | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    group: str = "engine"
    parse: Callable[[str], Any] | None = None

    def flag_name(self, field_name: str) -> str:
        return self.flag or "--" + field_name.replace("_", "-")


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    group: str = "engine",
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A config field that is also a command-line option (`Option`), with its one default."""
    meta = {"option": Option(help, choices, flag, aliases, metavar, group, parse)}
    return field(default=default, metadata=meta)


def options(cls: type) -> list[tuple[str, Any, str, Option]]:
    """The command-line options of a config dataclass: (field name, default, type as written, Option)."""
    from dataclasses import fields

    return [
        (f.name, f.default, str(f.type), f.metadata["option"]) for f in fields(cls) if "option" in f.metadata
    ]


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (for a copy of a config's knobs elsewhere, such
    as the simulator's InstanceSpec, that must not restate it)."""
    from dataclasses import fields

    (f,) = [f for f in fields(cls) if f.name == name]
    if f.default is MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no plain default")
    return f.default


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


# Token budget of one engine step, shared by prefill chunks and decodes (`max_num_batched_tokens`);
# the measurement behind it: docs/defaults.md.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# Requests the OpenAI server accepts beyond those producing output (`--max-waiting-requests`); past
# it new ones get 503 "overloaded" at once instead of a wait no client would sit through. The
# simulator's front end refuses at the same bound.
DEFAULT_MAX_WAITING_REQUESTS = 512
# Linear layers hold a second form of their weights for the few-row path (AMX tiles beside oneDNN's
# layout for bfloat16; the plain weight beside it for float32) only while all linear weights take
# at most this fraction of the memory available at load: two copies then leave a third or more for
# the KV cache. Past it each layer holds one copy (what that costs: docs/defaults.md).
SECOND_COPY_MAX_MEMORY_FRACTION = 0.33
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters, as transformers' `rope_parameters` (or older `rope_scaling`) give
    them; tandem/model/rope.py turns them into per-position tables."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # The fraction of each head that rotates (the rest passes through).
    partial_rotary_factor: float = 1.0
    # The model's max_position_embeddings: `dynamic` scales past it.
    max_position_embeddings: int = 2048
    # yarn and longrope: the factor cos and sin are multiplied by (None: derived from `factor`).
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope: per-frequency divisors within the original length and past it.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @staticmethod
    def from_hf(
        cfg: dict[str, Any], params: dict[str, Any] | None = None, default_theta: float = 10000.0
    ) -> RopeConfig:
        """`cfg` is config.json; `params` replaces its rope dict where a model keeps several (Gemma 3)."""
        if params is None:
            # transformers 5 writes `rope_parameters` (theta inside); older files write
            # `rope_theta` plus an optional `rope_scaling` dict.
            params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        theta = float(_first(params, "rope_theta", default=_first(cfg, "rope_theta", default=default_theta)))
        rope_type = str(_first(params, "rope_type", "type", default="default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # As transformers: a top-level original_max_position_embeddings wins over the rope dict's.
        original = _first(
            cfg, "original_max_position_embeddings", default=params.get("original_max_position_embeddings")
        )
        if original is None and rope_type in ("llama3", "yarn", "longrope"):
            original = max_pos
        factor = params.get("factor")
        if factor is None:
            # yarn and longrope without a factor stretch the original length to the model's.
            factor = max_pos / original if rope_type in ("yarn", "longrope") and original else 1.0
        partial = _first(
            params, "partial_rotary_factor", default=_first(cfg, "partial_rotary_factor", default=1.0)
        )
        attention_factor = params.get("attention_factor")
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=None if original is None else int(original),
            partial_rotary_factor=float(partial),
            max_position_embeddings=max_pos,
            attention_factor=None if attention_factor is None else float(attention_factor),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=_optional_float(params.get("mscale")),
            mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
            truncate=bool(params.get("truncate", True)),
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        )


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts model's experts and router, as transformers reads them from config.json.

    Each token's router logits go through a float32 softmax over all experts; the `top_k` largest
    probabilities pick its experts and weight their outputs (divided by their sum where
    `norm_topk_prob`). A Qwen2-MoE layer adds a shared expert gated by sigmoid(x . w)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    # Routing weights stay float32 (Mixtral) or are rounded to the activations' dtype (Qwen).
    float32_routing_weights: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # Layer i has experts unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def _moe_config(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    # transformers writes either name for the expert count (an attribute_map alias).
    num_experts = int(_first(cfg, "num_local_experts", "num_experts", default=-1))
    if num_experts < 0:
        raise KeyError("num_experts")
    top_k = int(cfg["num_experts_per_tok"])
    if num_experts and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            float32_routing_weights=True,
        )
    if arch == "Qwen2MoeForCausalLM" and cfg.get("use_sliding_window"):
        # transformers gives every other layer below max_window_layers a window: not one window for all.
        raise ValueError("Qwen2-MoE with use_sliding_window (windows on some layers only) is not supported")
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        float32_routing_weights=False,
        shared_expert_intermediate_size=shared,
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    moe: MoEConfig | None = None  # None for a dense model
    # Gemma 2 / 3 only: what they add (GemmaConfig); None for every other architecture.
    gemma: GemmaConfig | None = None
    # The checkpoint's own quantization (config.json's quantization_config), None for float weights.
    quantization: QuantizationConfig | None = None
    # A folder prepared from a GGUF file: that file, which holds the weights (None: safetensors).
    gguf_file: str | None = None

    @staticmethod
    def from_pretrained(path: str | os.PathLike[str]) -> ModelConfig:
        folder = Path(path)
        if folder.suffix == ".gguf" and folder.is_file():
            raise ValueError(
                f"model path {str(folder)!r} is a GGUF file: LLM(model=...), `tandem serve` and the other "
                "commands take it as it is; ModelConfig reads the folder tandem.checkpoints.resolve prepares"
            )
        if not folder.is_dir():
            raise ValueError(f"model path {str(folder)!r} is not a directory")
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model folder {str(folder)!r} has no config.json")
        try:
            cfg = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r} in {config_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or hidden // num_heads)
            sliding = None
            if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM") or cfg.get(
                "use_sliding_window"
            ):
                sliding = cfg.get("sliding_window")
            return ModelConfig(
                path=str(folder),
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
                attention_bias=bool(
                    _first(cfg, "attention_bias", "qkv_bias", default=arch.startswith("Qwen2"))
                ),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                rope=_rope(arch, cfg),
                sliding_window=int(sliding) if sliding else None,
                eos_token_ids=_eos_ids(folder, cfg),
                bos_token_id=cfg.get("bos_token_id"),
                torch_dtype=str(_first(cfg, "dtype", "torch_dtype", default="float32")),
                moe=_moe_config(arch, cfg),
                gemma=parse_gemma(arch, cfg) if arch in GEMMA_ARCHITECTURES else None,
                quantization=QuantizationConfig.from_hf(cfg.get("quantization_config")),
                gguf_file=_gguf_file(config_file, cfg.get(GGUF_CONFIG_KEY)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and (
                "rope" in str(exc) or "quantization_config" in str(exc) or GGUF_CONFIG_KEY in str(exc)
            ):
                raise
            raise ValueError(f"{config_file} is missing or has a bad field: {exc!r}") from exc


def _gguf_file(config_file: Path, value: Any) -> str | None:
    """The GGUF file a prepared folder's weights live in, checked to be the file it was made from."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("file"), str):
        raise ValueError(f"{config_file}: {GGUF_CONFIG_KEY} must be an object with a 'file' path")
    file = Path(value["file"])
    if not file.is_file():
        raise ValueError(f"{config_file}: {GGUF_CONFIG_KEY}: the GGUF file {str(file)!r} is missing")
    size = value.get("size")
    if size is not None and file.stat().st_size != size:
        raise ValueError(
            f"{config_file}: {GGUF_CONFIG_KEY}: {str(file)!r} has changed since this folder was made "
            "from it (pass the .gguf file itself to prepare it again)"
        )
    return str(file)


def _rope(arch: str, cfg: dict[str, Any]) -> RopeConfig:
    """The rope every layer uses (Gemma 3: its global layers)."""
    if arch == "Gemma3ForCausalLM":
        full, _ = _gemma3_rope_params(cfg)
        return RopeConfig.from_hf(cfg, full, default_theta=1_000_000.0)
    if arch == "Phi3ForCausalLM":
        # Phi-3's config class: "su" and "yarn" mean longrope, and the original length is 4096
        # unless given.
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        if _first(params, "rope_type", "type") in ("su", "yarn"):
            params = {**params, "rope_type": "longrope", "type": "longrope"}
        cfg = {"original_max_position_embeddings": 4096, **cfg}
        return RopeConfig.from_hf(cfg, params)
    return RopeConfig.from_hf(cfg)


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """What Gemma 2 and Gemma 3 add to the decoder: per-layer sliding windows, soft-capping, their
    attention scale and activation; Gemma 3 also q/k norms and a rope of its own for local layers."""

    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # per layer: windowed (local) attention, else full (global)
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    hidden_activation: str
    qk_norm: bool
    local_rope: RopeConfig | None  # Gemma 3's local layers; None: every layer uses ModelConfig.rope


def parse_gemma(arch: str, cfg: dict[str, Any]) -> GemmaConfig:
    gemma3 = arch == "Gemma3ForCausalLM"
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        # Older configs: Gemma 2 alternates (even layers local); Gemma 3 has one global layer in
        # every `sliding_window_pattern`.
        pattern = (
            int(_first(cfg, "sliding_window_pattern", "_sliding_window_pattern", default=6)) if gemma3 else 2
        )
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    window = cfg.get("sliding_window", 4096)
    # Gemma 3's modeling code never soft-caps attention, whatever its config says.
    attn_cap = None if gemma3 else cfg.get("attn_logit_softcapping", 50.0)
    local = None
    if gemma3:
        _, local_params = _gemma3_rope_params(cfg)
        local = RopeConfig.from_hf(cfg, local_params)
    return GemmaConfig(
        sliding_window=None if window is None else int(window),
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
        final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping", None if gemma3 else 30.0)),
        hidden_activation=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        qk_norm=gemma3,
        local_rope=local,
    )


def _gemma3_rope_params(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope dicts of a Gemma 3 config, nested by layer type (transformers 5) or
    the older rope_theta / rope_local_base_freq / rope_scaling (global layers only)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), **params}
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return full, local


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _eos_ids(folder: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    value = cfg.get("eos_token_id")
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
            value = gen.get("eos_token_id", value)
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine arguments, named as vLLM names them."""

    model: str
    tokenizer: str | None = option(
        None,
        "tokenizer folder (unset: the model folder's, or a GGUF file's own from its metadata)",
    )
    dtype: str = option(
        "auto",
        "weights and activations. auto: bfloat16 on CUDA, and where the CPU has AMX-BF16 or AVX512-BF16 "
        "(amx_bf16 or avx512_bf16 in /proc/cpuinfo: Xeons from Cooper Lake and Sapphire Rapids on, "
        "AMD EPYC from Zen 4 on), float32 on other CPUs (AVX2-only, or AVX-512 without BF16); "
        "TANDEM_AUTO_DTYPE=float32|bfloat16 overrides it, and the start-up log says which",
        choices=DTYPES,
    )
    seed: int = option(0, "seed of the engine's sampling generator")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (unset: the model's)")
    max_num_seqs: int = option(256, "sequences running at once")
    max_num_batched_tokens: int = option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "token budget of one step, shared by prefill chunks and decodes",
    )
    block_size: int = option(16, "tokens per KV-cache block")
    # KV cache bytes (None: DEFAULT_KV_CACHE_MEMORY on a CPU; on CUDA what gpu_memory_utilization
    # leaves); num_kv_blocks, where given, overrides both.
    kv_cache_memory: int | None = option(
        None,
        "KV cache size in bytes (unset: 2 GiB on a CPU; on CUDA, from --gpu-memory-utilization)",
    )
    num_kv_blocks: int | None = option(None, "KV cache size in blocks (overrides memory)")
    # "auto": "torch" on CPU, "triton" on CUDA; "flashinfer" where that package is installed (CUDA).
    attention_backend: str = option(
        "auto",
        "auto: torch on a CPU, triton on CUDA; flashinfer where that package is installed (CUDA)",
        choices=ATTENTION_BACKEND_CHOICES,
    )
    # "auto": CUDA when torch sees a GPU, else the CPU; "cuda" without a GPU is a ValueError.
    device: str = option(
        "auto",
        "where the model runs. auto: CUDA when torch sees a GPU, else the CPU; cuda without a GPU "
        "is an error (docs/gpu.md)",
        choices=DEVICES,
    )
    # "auto": the checkpoint's weights; "dummy": random weights of config.json's shape (seeded by
    # `seed`), made on the device: a folder with config.json (and a tokenizer) is enough.
    load_format: str = option(
        "auto",
        "auto: the checkpoint's weights; dummy: random weights of config.json's shape made on the "
        "device (seeded by --seed), no weight file: for benchmarks",
        choices=LOAD_FORMATS,
    )
    # CUDA only: the fraction of the GPU's total memory this engine may use (vLLM's meaning).
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "CUDA: the fraction of the GPU's total memory the engine takes; the KV cache gets what the "
        "weights and the profiled peak leave (unless --kv-cache-memory or --num-kv-blocks is given)",
    )
    # CUDA only: no CUDA graphs (every decode step runs eagerly, as on a CPU).
    enforce_eager: bool = option(False, "CUDA: no CUDA graphs for decode batches (a CPU never uses them)")
    # Overlap scheduling (vLLM's name): plan and launch step N+1 before step N's tokens are read back,
    # so the host's scheduling hides behind the device's forward (docs/gpu.md). None: on for CUDA,
    # off on a CPU (where the forward runs on the same cores that would schedule).
    async_scheduling: bool | None = option(
        None,
        "overlap scheduling: plan and launch step N+1 while step N runs (unset: on for CUDA, off on "
        "a CPU); steps that need their tokens on the host first run synchronously (docs/gpu.md)",
    )
    # Quantization of the linear layers: None (the checkpoint's own, if any), "int8" (a float
    # checkpoint quantized at load, tandem/model/quant.py; on a 4-bit checkpoint, the layers it
    # keeps in float, such as the LM head), or the checkpoint's method named ("awq", "gptq",
    # "compressed-tensors", "fp8"; vLLM's aliases too), checked against it.
    quantization: str | None = option(
        None,
        "int8: quantize a float checkpoint's linear layers at load (on a 4-bit checkpoint, the "
        "layers it keeps in float, such as the LM head); awq, gptq, compressed-tensors, "
        "fp8: the checkpoint's own format (read from config.json when unset; checked when given); "
        "gguf: keep a GGUF file's Q4_0/Q4_1/Q4_K blocks packed for the 4-bit kernels (the default "
        "with --dtype auto; an explicit --dtype without it dequantizes every tensor to that dtype)",
        choices=QUANTIZATION_CHOICES,
        aliases=("-q",),
    )
    # How the KV cache holds K and V: "auto" (the model dtype), or "int8" / "fp8" (= "fp8_e4m3"): one
    # byte per value plus a float32 scale per token and KV head, about half of bfloat16's bytes, so
    # the same kv_cache_memory holds about twice the tokens (tandem/model/kv_quant.py).
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model dtype), or int8 / fp8 (= fp8_e4m3) with a scale per token "
        "and KV head, about twice bfloat16's tokens in the same --kv-cache-memory",
        choices=KV_CACHE_DTYPES,
    )
    # Preemption (tandem/core/preemption.py), vLLM's `preemption_mode`: "auto" swaps or recomputes each
    # victim by which costs less, "swap" swaps whenever the swap space has room, "recompute" never swaps.
    preemption_mode: str = option(
        "auto",
        "auto: swap or recompute each preempted request by which costs less (docs/defaults.md); "
        "swap: whenever the swap space has room; recompute: never swap",
        choices=PREEMPTION_MODES,
    )
    # Host memory for swapped-out requests' KV, in GiB (vLLM's `--swap-space`); 0: no swap, every
    # preemption recomputes. None: DEFAULT_SWAP_SPACE_GIB_CUDA on CUDA, 0 on a CPU.
    swap_space: float | None = option(
        None,
        "GiB of host memory for the KV of requests preempted by swap; 0: every preemption "
        "recomputes (unset: 4 on CUDA, 0 on a CPU)",
    )
    # The cost model's constants (None: the device's default above): the host link's bandwidth each
    # way in GB/s, and the FLOP rate a prefill reaches in TFLOP/s.
    swap_bandwidth_gbps: float | None = option(
        None,
        "the preemption cost model's host link bandwidth each way, GB/s (unset: the device's default)",
    )
    recompute_tflops: float | None = option(
        None,
        "the preemption cost model's prefill FLOP rate, TFLOP/s (unset: the device's default)",
    )
    num_threads: int | None = option(None, "torch CPU threads (unset: torch's default)")
    enable_prefix_caching: bool = option(True, "reuse the KV cache of shared prompt prefixes")
    scheduling_policy: str = option(
        FCFS,
        "which waiting request runs first: arrival order, priority, or longest prefix match",
        choices=SCHEDULING_POLICIES,
    )
    # A waiting request older than this outranks all others (the documented starvation bound).
    starvation_timeout_s: float = option(
        30.0,
        "a request waiting longer than this goes first within its tenant's share",
    )
    # Given as tenant -> {"weight": float, "max_running": int, "max_blocks": int}; held parsed, as
    # tenant -> tandem.core.policy.TenantQuota (a ValueError at construction names what is wrong).
    tenant_quotas: dict[str, Any] | None = option(
        None,
        'JSON: {"tenant": {"weight": 1.0, "max_running": 8, "max_blocks": 1000}}',
    )
    # As vLLM: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b} or {"method": "draft_model", "model": PATH, "num_speculative_tokens": k};
    # plus "adaptive": true, false or a dict of tandem.spec.config.AdaptiveConfig's settings. Held
    # parsed, as a tandem.spec.config.SpeculativeConfig (a ValueError at construction names the key).
    speculative_config: dict[str, Any] | SpeculativeConfig | None = option(
        None,
        'JSON, as vLLM: {"method": "ngram", "num_speculative_tokens": 4, ...}',
    )
    # Moving a request's KV to another instance (tandem/kvtransfer): the transport ("zmq": frames
    # over tcp:// or ipc://; "shm": a shared-memory segment per message, same host only); how long
    # either end waits on the other before giving the transfer up; and the staged copy of a live
    # migration: copy stages while more than `migration_stop_blocks` full blocks are new since
    # the last one, at most `migration_max_stages`, then pause the request and copy the rest.
    kv_transport: str = option(
        "zmq",
        "how KV blocks move between instances: zmq (tcp/ipc frames) or shm (shared memory, one host)",
        choices=KV_TRANSPORTS,
        group="cluster (Ray)",
    )
    kv_transfer_timeout_s: float = 10.0
    migration_max_stages: int = 4
    migration_stop_blocks: int = 2
    # Structured output: how many compiled grammars (one per distinct schema, regex, choice list or
    # grammar) the engine keeps; the least recently used beyond this is compiled again if asked for.
    structured_outputs_cache_size: int = 128
    # ...and at most this many bytes of them, as tandem/structured/config.py charges a grammar (a
    # 60k-value enum takes tens of MB; a count alone let 160 of them take 3 GB).
    structured_outputs_cache_bytes: int = 256 << 20
    # A spec is compiled once in a check process before it is queued (tandem/structured/checker.py);
    # one that takes longer than this there is refused (HTTP 400).
    structured_outputs_check_timeout_s: float = 5.0
    # A file each engine appends one JSON line per step to (start, seconds, planned shape; see
    # tandem/engine/step_trace.py); None: no trace.
    step_trace: str | None = option(
        None,
        "append one JSON line per engine step (start, seconds, planned shape) to FILE",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        # The two structured arguments are parsed once, here: a bad one fails where it is given.
        from tandem.core.policy import parse_tenant_quotas
        from tandem.spec.config import SpeculativeConfig

        if self.tenant_quotas is not None:
            object.__setattr__(self, "tenant_quotas", parse_tenant_quotas(self.tenant_quotas))
        if self.speculative_config is not None:
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config)
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES} or None, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKEND_CHOICES}, got {self.attention_backend!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        gpu = self.gpu_memory_utilization
        if isinstance(gpu, bool) or not isinstance(gpu, (int, float)) or not 0.0 < gpu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a boolean, got {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a boolean or None, got {self.async_scheduling!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "structured_outputs_cache_size",
            "structured_outputs_cache_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s!r}")
        if self.migration_max_stages < 0 or self.migration_stop_blocks < 0:
            raise ValueError("migration_max_stages and migration_stop_blocks must be >= 0")
        if not self.structured_outputs_check_timeout_s > 0:
            raise ValueError(
                "structured_outputs_check_timeout_s must be positive, "
                f"got {self.structured_outputs_check_timeout_s!r}"
            )
        if not self.starvation_timeout_s > 0:
            raise ValueError(f"starvation_timeout_s must be positive, got {self.starvation_timeout_s!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        for name in ("swap_space", "swap_bandwidth_gbps", "recompute_tflops"):
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not ((value >= 0 if name == "swap_space" else value > 0) and value != float("inf"))
            ):
                kind = "a number >= 0" if name == "swap_space" else "a positive number"
                raise ValueError(f"{name} must be {kind} or None, got {value!r}")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
