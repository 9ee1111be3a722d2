"""Draft heads over the target's own features: EAGLE and Medusa.

Both read the target's last hidden state (after its final norm, what its LM head reads) and propose
through the target's own LM head (and, for EAGLE, its embedding): a head folder holds no
vocabulary-sized weights. The drafter multiplies only the rows of the draft vocabulary the folder's
draft_vocab.json ranks first (tandem/model/draft_vocab.py, `draft_vocab_size`).

- **EAGLE** (`EagleHead`): one decoder layer of the target's own class (`tandem.model.llama`'s
  `DecoderLayer`, built with the target's dimensions) over `fc(concat(embed(x[p+1]), f[p]))`, the
  projection of the next token's embedding and the feature at position p; it predicts the feature
  at p + 1, whose logits (through the target's LM head) propose the token after x[p+1]. Its layer
  keeps its own paged KV cache, indexed by the target's block tables.
- **Medusa** (`MedusaHeads`): K residual blocks `h + SiLU(W_k h + b_k)` over the feature at p; head
  k (1-based) proposes token p + 1 + k through the LM head.

A head folder: config.json (`"tandem_draft_head": "eagle" | "medusa"` and the dimensions it was
trained for) and model.safetensors, the layer's weights under EAGLE's (transformers') names
(`fc`, `layers.0.self_attn.q_proj`, ...), Medusa's as `medusa_head.{k}.0.linear`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.model.attention import AttentionBackend
from tandem.model.forward_batch import ForwardBatch
from tandem.model.layers import RotaryEmbedding
from tandem.model.llama import DecoderLayer

HEAD_KEY = "tandem_draft_head"
HEAD_METHODS = ("eagle", "medusa")
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class HeadConfig:
    method: str
    hidden_size: int
    vocab_size: int
    # EAGLE: its layer's MLP width (the target's unless trained otherwise); Medusa: unused.
    intermediate_size: int = 0
    # Medusa: how many tokens ahead it proposes.
    num_heads: int = 0
    path: str = ""

    @staticmethod
    def from_folder(path: str | Path) -> HeadConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"speculative_config.model: {str(folder)!r} has no config.json (a draft head folder)"
            )
        try:
            raw = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
        method = raw.get(HEAD_KEY)
        if method not in HEAD_METHODS:
            raise ValueError(
                f"speculative_config.model: {config_file} is no draft head ({HEAD_KEY!r} is {method!r}, "
                f"expected one of {HEAD_METHODS}); `tandem train-draft` writes one"
            )
        try:
            return HeadConfig(
                method=method,
                hidden_size=int(raw["hidden_size"]),
                vocab_size=int(raw["vocab_size"]),
                intermediate_size=int(raw.get("intermediate_size", 0)),
                num_heads=int(raw.get("medusa_num_heads", 0)),
                path=str(folder),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{config_file}: missing or bad field ({exc})") from exc

    def check_target(self, target: ModelConfig) -> None:
        if (self.hidden_size, self.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(
                f"speculative_config.model: the {self.method} head {self.path!r} was trained for hidden size "
                f"{self.hidden_size} and vocabulary {self.vocab_size}; the target has {target.hidden_size} "
                f"and {target.vocab_size}"
            )
        if self.method == "medusa" and self.num_heads < 1:
            raise ValueError(f"speculative_config.model: {self.path!r} has no medusa_num_heads")


def eagle_layer_config(target: ModelConfig, intermediate_size: int = 0) -> ModelConfig:
    """The target's dimensions, one layer (the EAGLE head's decoder layer)."""
    return replace(
        target,
        num_layers=1,
        intermediate_size=intermediate_size or target.intermediate_size,
        moe=None,
        quantization=None,
        gguf_file=None,
    )


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.backend = backend
        self.rotary = rotary
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(cfg, backend)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Row p: the embedding of token p + 1 and the feature at p -> the predicted feature at p + 1."""
        x = self.fc(torch.cat((embeds, features), dim=-1))
        rope = self.rotary.lookup(batch.positions)
        h, residual = self.layer(rope, x, None, kv_cache, batch)
        return h + residual


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=True)
        # Zero: a new head is the identity, so it starts out proposing what the LM head does.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(ResBlock(hidden) for _ in range(num_heads))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[N, H] features -> [K, N, H]: head k's feature for the token k + 1 past the next one."""
        return torch.stack([head(features) for head in self.heads])


# -- checkpoint layout ----------------------------------------------------------------------------


def _eagle_to_file(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tandem's fused parameters as EAGLE's (transformers') separate tensors."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("layer."):
            rest = name[len("layer.") :]
            if rest.startswith("self_attn.qkv_proj."):
                kind = rest.rsplit(".", 1)[1]
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    out[f"layers.0.self_attn.{part}.{kind}"] = piece
            elif rest == "mlp.gate_up_proj.weight":
                gate, up = t.chunk(2)
                out["layers.0.mlp.gate_proj.weight"] = gate
                out["layers.0.mlp.up_proj.weight"] = up
            else:
                out[f"layers.0.{rest}"] = t
        else:
            out[name] = t
    return out


def _eagle_from_file(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias"):
        parts = [tensors.get(f"layers.0.self_attn.{p}.{kind}") for p in ("q_proj", "k_proj", "v_proj")]
        if all(p is not None for p in parts):
            out[f"layer.self_attn.qkv_proj.{kind}"] = torch.cat(parts)  # type: ignore[arg-type]
    gate, up = tensors.get("layers.0.mlp.gate_proj.weight"), tensors.get("layers.0.mlp.up_proj.weight")
    if gate is not None and up is not None:
        out["layer.mlp.gate_up_proj.weight"] = torch.cat((gate, up))
    for name, t in tensors.items():
        if name.startswith("layers.0."):
            rest = name[len("layers.0.") :]
            if rest.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                continue
            out[f"layer.{rest}"] = t
        else:
            out[name] = t
    return out


def _medusa_name(name: str) -> str:
    # heads.{k}.linear.weight <-> medusa_head.{k}.0.linear.weight
    _, k, rest = name.split(".", 2)
    return f"medusa_head.{k}.0.{rest}"


def save_head(
    module: nn.Module,
    folder: str | Path,
    method: str,
    target: ModelConfig,
    extra: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Write a head folder (float16 weights unless told otherwise)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in module.state_dict().items()}
    config: dict[str, Any] = {
        HEAD_KEY: method,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if method == "eagle":
        assert isinstance(module, EagleHead)
        layer_cfg = module.config
        config.update(
            architectures=["EagleHead"],
            num_attention_heads=layer_cfg.num_heads,
            num_key_value_heads=layer_cfg.num_kv_heads,
            head_dim=layer_cfg.head_dim,
            intermediate_size=layer_cfg.intermediate_size,
            num_hidden_layers=1,
        )
        tensors = _eagle_to_file(state, layer_cfg)
    else:
        assert isinstance(module, MedusaHeads)
        config.update(architectures=["MedusaHeads"], medusa_num_heads=len(module.heads), medusa_num_layers=1)
        tensors = {_medusa_name(k): v for k, v in state.items()}
    if extra:
        config.update(extra)
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _load_state(module: nn.Module, tensors: dict[str, torch.Tensor], path: str) -> None:
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise ValueError(f"draft head {path!r}: missing tensors {missing[:4]}, unexpected {unknown[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if t.shape != p.shape:
                raise ValueError(
                    f"draft head {path!r}: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
                )
            p.copy_(t.to(p.dtype))


def build_head(
    cfg: HeadConfig,
    target: ModelConfig,
    backend: AttentionBackend | Any,
    rotary: RotaryEmbedding | None,
    num_heads: int = 0,
) -> EagleHead | MedusaHeads:
    """A head of `cfg`'s method for `target`, freshly initialised (float32, CPU)."""
    if cfg.method == "eagle":
        assert rotary is not None
        return EagleHead(eagle_layer_config(target, cfg.intermediate_size), backend, rotary)
    return MedusaHeads(target.hidden_size, num_heads or cfg.num_heads)


def load_head(
    cfg: HeadConfig,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend | Any,
    rotary: RotaryEmbedding | None,
    cpu_kernels: bool = False,
) -> EagleHead | MedusaHeads:
    """The head in `cfg.path`, checked against the target it drafts for. `cpu_kernels`: on a CPU,
    run it on the paths the target's layers take (`use_cpu_paths`)."""
    from safetensors.torch import load_file

    cfg.check_target(target)
    file = Path(cfg.path) / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"speculative_config.model: {cfg.path!r} has no {WEIGHTS_FILE}")
    tensors = load_file(str(file))
    module = build_head(cfg, target, backend, rotary)
    if cfg.method == "eagle":
        tensors = _eagle_from_file(tensors)
    else:
        tensors = {
            f"heads.{name.split('.')[1]}.{name.split('.', 3)[3]}": t
            for name, t in tensors.items()
            if name.startswith("medusa_head.") and name.split(".")[2] == "0"
        }
    _load_state(module, tensors, cfg.path)
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if cpu_kernels and device.type == "cpu":
        use_cpu_paths(module, dtype)
    return module


def use_cpu_paths(module: nn.Module, dtype: torch.dtype) -> None:
    """Prepare a loaded head as the loader prepares a target (tandem/model/loader.py): packed
    linear layers (`F.linear` on a bfloat16 weight reorders it for oneDNN on every call: most of a
    head pass's time), the compiled norms, activation and rotary where the dtype allows, and direct
    submodule lookups. A head pass is a few rows, so it runs on the few-row paths."""
    from tandem.model.direct_call import bind_submodules
    from tandem.model.fused_ops import use_fused_ops, wants_fused_ops
    from tandem.model.linear import pack_linears

    pack_linears(module)
    if wants_fused_ops(dtype, quantized=False):
        use_fused_ops(module)
    bind_submodules(module)
