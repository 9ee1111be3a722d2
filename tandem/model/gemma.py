"""Gemma 2 and Gemma 3 (text): the Llama layout with (1 + weight) RMSNorms, an embedding scaled by
sqrt(hidden_size), a gelu-tanh gated MLP, norms after attention and the MLP as well as before,
attention scaled by query_pre_attn_scalar ** -0.5, and local (sliding-window) layers between
global ones. Gemma 2 soft-caps attention scores and the final logits; Gemma 3 adds q/k norms and
gives its local layers a rope of their own (`rope_local_base_freq`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import GemmaConfig, ModelConfig
from tandem.model.attention import AttentionBackend, LayerAttention
from tandem.model.direct_call import DirectCall
from tandem.model.forward_batch import ForwardBatch
from tandem.model.layers import GatedMLP, RMSNorm, Rope, RotaryEmbedding
from tandem.model.llama import Attention
from tandem.model.llama_checkpoint import LlamaCheckpointMapping


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times (1 + weight), the product taken in float32 before casting back, as Gemma's
    reference does (Llama's casts first, then multiplies)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() <= 3:
            return torch.ops.tandem.rms_norm(x, self.weight, self.eps, 1.0, False)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, 1.0 + self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def _gemma(cfg: ModelConfig) -> GemmaConfig:
    if cfg.gemma is None:
        raise ValueError(f"{cfg.architecture} needs Gemma's config fields (ModelConfig.gemma)")
    return cfg.gemma


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: LayerAttention) -> None:
        super().__init__(cfg, backend, layer)
        if _gemma(cfg).qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        if cfg.attention_bias:
            self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=True)


class GemmaDecoderLayer(DirectCall, nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        g = _gemma(cfg)
        self.local = g.sliding_layers[index]
        spec = LayerAttention(
            sliding_window=g.sliding_window if self.local else None,
            softcap=g.attn_logit_softcapping,
            scale=g.query_pre_attn_scalar**-0.5,
        )
        self.self_attn = GemmaAttention(cfg, backend, backend.layer(spec))
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, g.hidden_activation)
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(
        self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), kv_cache, batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaCheckpointMapping, nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        g = _gemma(cfg)
        self.config = cfg
        self.rotary = rotary  # global layers (every layer, where there is no local rope)
        self.local_rotary = rotary
        if g.local_rope is not None:
            device = rotary.cos.device
            with torch.device(device):  # the tables are real tensors, not the modules' meta ones
                self.local_rotary = RotaryEmbedding(cfg.head_dim, rotary.cos.shape[0], g.local_rope, device)
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.final_softcap = g.final_logit_softcapping

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        # sqrt(hidden_size) rounded to the model's dtype first, as the reference scales.
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(x.dtype)
        rope = self.rotary.lookup(batch.positions)
        local = rope if self.local_rotary is self.rotary else self.local_rotary.lookup(batch.positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(local if layer.local else rope, x, kv_cache, batch)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        logits = F.linear(hidden, self.embed_tokens.weight) if head is None else head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
