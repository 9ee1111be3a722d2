"""Rotary tables against transformers' own rotary embeddings (ROPE_INIT_FUNCTIONS and the models'
RotaryEmbedding modules, which add the attention factor and the length-dependent switches), read
from the config.json transformers writes; and the clear error for a rope type Tandem lacks."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import transformers

from tandem import LLM
from tandem.config import ModelConfig, RopeConfig
from tandem.model.layers import RotaryEmbedding
from tandem.model.rope import attention_scaling, rope_angles, rope_inv_freq

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
HEAD_DIM = 16


def _llama(max_positions: int = 1024, **rope) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**SHAPE, max_position_embeddings=max_positions, rope_parameters=rope)


def _ours(config: transformers.PretrainedConfig) -> RopeConfig:
    """Parsed from the dict transformers writes to config.json."""
    return RopeConfig.from_hf(json.loads(config.to_json_string()))


def _phi3_config(folder, config: dict) -> ModelConfig:
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Phi3ForCausalLM"]}))
    return ModelConfig.from_pretrained(folder)


def _hf_table(module: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = module(torch.zeros(1), positions[None])
    return cos[0], sin[0]


YARN = {
    "plain": dict(factor=4.0, original_max_position_embeddings=64),
    "mscale": dict(factor=8.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707),
    "mscale-ratio": dict(factor=8.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5),
    "attention-factor": dict(factor=4.0, original_max_position_embeddings=64, attention_factor=1.5),
    "betas-untruncated": dict(
        factor=4.0, original_max_position_embeddings=128, beta_fast=16.0, beta_slow=2.0, truncate=False
    ),
    "implicit-factor": dict(original_max_position_embeddings=256),
}


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_matches_transformers(name: str) -> None:
    params = dict(YARN[name])
    if "factor" not in params:
        params["factor"] = None  # derived from max_position_embeddings / original
    config = _llama(rope_type="yarn", rope_theta=10000.0, **params)
    rope = _ours(config)
    inv_hf, factor_hf = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(rope_inv_freq(rope, HEAD_DIM), inv_hf)
    assert attention_scaling(rope) == pytest.approx(factor_hf, rel=1e-12)
    if name == "plain":
        assert attention_scaling(rope) == pytest.approx(1 + 0.1 * math.log(4.0))
    positions = torch.arange(300)
    cos_hf, sin_hf = _hf_table(transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config), positions)
    ours = RotaryEmbedding(HEAD_DIM, 300, rope, torch.device("cpu"))
    assert torch.equal(ours.cos, cos_hf)
    half = HEAD_DIM // 2
    assert torch.equal(ours.sin_signed[:, half:], sin_hf[:, half:])


@pytest.mark.parametrize(
    ("rope_type", "extra"),
    [
        ("default", {}),
        ("linear", dict(factor=3.0)),
        ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
    ],
)
def test_static_types_match_transformers(rope_type: str, extra: dict) -> None:
    config = _llama(rope_type=rope_type, rope_theta=500000.0, **extra)
    module = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    cos_hf, _ = _hf_table(module, torch.arange(200))
    assert torch.equal(RotaryEmbedding(HEAD_DIM, 200, _ours(config), torch.device("cpu")).cos, cos_hf)


def test_dynamic_matches_transformers_per_position() -> None:
    """Within max_position_embeddings the default frequencies; past it, position p gets the base
    transformers computes for a pass ending at p (a sequence of p + 1 tokens)."""
    max_pos = 64
    config = _llama(max_positions=max_pos, rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    rope = _ours(config)
    ours = RotaryEmbedding(HEAD_DIM, 200, rope, torch.device("cpu"))
    module = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    cos_hf, _ = _hf_table(module, torch.arange(max_pos))
    assert torch.equal(ours.cos[:max_pos], cos_hf)
    for p in [64, 65, 100, 199]:  # one-token passes, as decoding runs them
        cos_p, _ = _hf_table(module, torch.tensor([p]))
        torch.testing.assert_close(ours.cos[p], cos_p[0], rtol=0, atol=1e-6)
    # The rows past the length do change: the base grows with the position.
    default = RotaryEmbedding(HEAD_DIM, 200, RopeConfig(theta=10000.0), torch.device("cpu"))
    assert torch.equal(ours.cos[:max_pos], default.cos[:max_pos])
    assert (ours.cos[150] - default.cos[150]).abs().max() > 0.1


def _phi3(**extra) -> transformers.Phi3Config:
    rot = int(HEAD_DIM * extra.get("partial_rotary_factor", 1.0)) // 2
    return transformers.Phi3Config(
        **SHAPE,
        pad_token_id=0,
        eos_token_id=2,
        max_position_embeddings=1024,
        original_max_position_embeddings=48,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.3 * i for i in range(rot)],
            "long_factor": [1.5 + 2.0 * i for i in range(rot)],
        },
        **extra,
    )


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_short_and_long_sets_match_transformers(partial: float, tmp_path) -> None:
    """An engine whose sequences stay within the original length uses the short factors, one that
    goes past it the long ones at every position: transformers' tables for a sequence within the
    original length and for one past it (Phi-3's generate recomputes the cache at the switch)."""
    config = _phi3(partial_rotary_factor=partial)
    rope = _phi3_config(tmp_path, json.loads(config.to_json_string())).rope
    assert rope.rope_type == "longrope" and rope.partial_rotary_factor == partial
    module = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    rot = int(HEAD_DIM * partial)
    short = RotaryEmbedding(HEAD_DIM, 48, rope, torch.device("cpu"))
    assert short.cos.shape == (48, rot)
    cos_hf, _ = _hf_table(module, torch.arange(48))
    assert torch.equal(short.cos, cos_hf)
    long = RotaryEmbedding(HEAD_DIM, 100, rope, torch.device("cpu"))
    cos_hf, _ = _hf_table(module, torch.arange(100))
    assert torch.equal(long.cos, cos_hf)
    assert not torch.equal(long.cos[:48], short.cos)
    # sqrt(1 + ln(1024 / 48) / ln(48)): the factor every position's cos and sin carry.
    assert attention_scaling(rope) == pytest.approx(module.attention_scaling)
    assert attention_scaling(rope) > 1.3


def test_phi3_legacy_su_type_is_longrope(tmp_path) -> None:
    """Phi-3's first releases wrote `rope_scaling` with type "su" and no original length."""
    mc = json.loads(_phi3().to_json_string())
    scaling = {k: v for k, v in mc.pop("rope_parameters").items() if k in ("short_factor", "long_factor")}
    mc["rope_scaling"] = {**scaling, "type": "su"}
    mc.pop("original_max_position_embeddings")
    rope = _phi3_config(tmp_path, mc).rope
    assert rope.rope_type == "longrope"
    assert rope.original_max_position_embeddings == 4096  # Phi-3's default when the file omits it
    assert rope.factor == 1024 / 4096


def test_longrope_factor_count_is_checked() -> None:
    rope = RopeConfig(rope_type="longrope", short_factor=(1.0,) * 3, long_factor=(1.0,) * 8)
    with pytest.raises(ValueError, match=r"short_factor has 3 entries, expected 8"):
        rope_angles(rope, HEAD_DIM, 16)


@pytest.mark.parametrize("rope_type", ["proportional", "mrope", "su"])
def test_unsupported_rope_type_is_a_clear_error(rope_type: str) -> None:
    with pytest.raises(ValueError, match=rf"rope scaling type '{rope_type}' is not supported \(supported: default"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": rope_type, "factor": 2.0}})


def test_unsupported_rope_type_from_llm(llama_dir, tmp_path) -> None:
    folder = shutil.copytree(llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope scaling type 'proportional' is not supported"):
        LLM(str(folder))
