"""Configuration: the model's shape read from config.json, and the engine's arguments.

Pure Python (no torch) so every layer can import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.core.policy import FCFS, SCHEDULING_POLICIES

# Mixture-of-experts architectures (tandem/model/moe.py); their router settings: MoEConfig.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8",)


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers 5 writes `rope_parameters` (theta inside); older files write
        # `rope_theta` plus an optional `rope_scaling` dict.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = float(_first(merged, "rope_theta", default=_first(cfg, "rope_theta", default=10000.0)))
        rope_type = str(_first(merged, "rope_type", "type", default="default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
            )
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=merged.get("original_max_position_embeddings"),
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

    @staticmethod
    def from_pretrained(path: str | os.PathLike[str]) -> ModelConfig:
        folder = Path(path)
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
            if arch in ("MistralForCausalLM", "MixtralForCausalLM") or cfg.get("use_sliding_window"):
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
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(
                    _first(cfg, "attention_bias", "qkv_bias", default=arch.startswith("Qwen2"))
                ),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                rope=RopeConfig.from_hf(cfg),
                sliding_window=int(sliding) if sliding else None,
                eos_token_ids=_eos_ids(folder, cfg),
                bos_token_id=cfg.get("bos_token_id"),
                torch_dtype=str(_first(cfg, "dtype", "torch_dtype", default="float32")),
                moe=_moe_config(arch, cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and "rope" in str(exc):
                raise
            raise ValueError(f"{config_file} is missing or has a bad field: {exc!r}") from exc

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


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
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int = 2 << 30
    num_kv_blocks: int | None = None
    attention_backend: str = "torch"
    # Quantization of the linear layers: None or "int8" (see tandem/model/quant.py).
    quantization: str | None = None
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = FCFS
    # A waiting request older than this outranks all others (the documented starvation bound).
    starvation_timeout_s: float = 30.0
    # tenant -> {"weight": float, "max_running": int, "max_blocks": int}
    tenant_quotas: dict[str, dict[str, Any]] | None = None
    # As vLLM: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b} or {"method": "draft_model", "model": PATH, "num_speculative_tokens": k};
    # plus "adaptive": true, false or a dict of tandem.spec.config.AdaptiveConfig's settings.
    speculative_config: dict[str, Any] | None = None
    # Moving a request's KV to another instance (tandem/kvtransfer): the transport ("zmq": frames
    # over tcp:// or ipc://; "shm": a shared-memory segment per message, same host only); how long
    # either end waits on the other before giving the transfer up; and the staged copy of a live
    # migration: copy stages while more than `migration_stop_blocks` full blocks are new since
    # the last one, at most `migration_max_stages`, then pause the request and copy the rest.
    kv_transport: str = "zmq"
    kv_transfer_timeout_s: float = 10.0
    migration_max_stages: int = 4
    migration_stop_blocks: int = 2
    # Structured output: how many compiled grammars (one per distinct schema, regex, choice list or
    # grammar) the engine keeps; the least recently used beyond this is compiled again if asked for.
    structured_outputs_cache_size: int = 128

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS} or None, got {self.quantization!r}"
            )
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_memory",
            "structured_outputs_cache_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.kv_transport not in ("zmq", "shm"):
            raise ValueError(f"kv_transport must be 'zmq' or 'shm', got {self.kv_transport!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s!r}")
        if self.migration_max_stages < 0 or self.migration_stop_blocks < 0:
            raise ValueError("migration_max_stages and migration_stop_blocks must be >= 0")
        if not self.starvation_timeout_s > 0:
            raise ValueError(f"starvation_timeout_s must be positive, got {self.starvation_timeout_s!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
