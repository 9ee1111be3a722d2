"""The Llama family: Llama, Mistral, Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.model.attention import AttentionBackend, LayerAttention
from tandem.model.direct_call import DirectCall
from tandem.model.forward_batch import ForwardBatch
from tandem.model.layers import GatedMLP, RMSNorm, Rope, RotaryEmbedding, rotate
from tandem.model.llama_checkpoint import LlamaCheckpointMapping


class Attention(DirectCall, nn.Module):
    # Rotary embedding by the compiled kernel, in place (tandem/model/fused_ops.py switches it on).
    fused_rope = False

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, layer: LayerAttention | None = None
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.backend = backend
        # This layer's own window, scale or soft-cap (declared to the backend); None: its defaults.
        self.layer = layer

    def forward(
        self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:  # both or neither
            # q and k side by side in one rotation: the same elementwise math, half the op count.
            qk = qkv[:, : self.q_size + self.kv_size].view(
                n, self.num_heads + self.num_kv_heads, self.head_dim
            )
            qk = rotate(qk, rope, self.fused_rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = rotate(self.q_norm(q.view(n, self.num_heads, self.head_dim)), rope, self.fused_rope)
            k = rotate(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), rope, self.fused_rope)
        o = self.backend.forward(q, k, v, kv_cache, batch, self.layer)
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderLayer(DirectCall, nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        # The feed-forward block: a gated MLP unless the architecture brings its own (MoE: experts).
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state comes and goes as a pending sum, x + residual (residual None before the
        first layer), so each residual add fuses with the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        a = self.self_attn(rope, h, kv_cache, batch)
        h, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(LlamaCheckpointMapping, nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = rotary
        # The backend every layer's attention shares: the runner prepares it once per pass.
        self.backend = backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        return DecoderLayer(cfg, backend)

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states after the final norm, one row per token of the flat batch."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary.lookup(batch.positions)  # once per pass, not once per layer
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, batch)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)
