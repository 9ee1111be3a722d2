"""config.json of the Gemma and Phi-3 families as the hub has them (older layouts without
`layer_types` or `rope_parameters` included) read into ModelConfig; what Tandem cannot run is a
clear ValueError."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem import LLM
from tandem.config import ModelConfig

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=1024,
)


def _config(tmp_path, **cfg) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **cfg}))
    return ModelConfig.from_pretrained(tmp_path)


def test_gemma2_without_layer_types_alternates_local_and_global(tmp_path) -> None:
    """Gemma 2 as first published: no layer_types (even layers local), no tie flag (tied), and
    transformers' defaults for the caps and the attention scale."""
    mc = _config(tmp_path, architectures=["Gemma2ForCausalLM"], num_hidden_layers=5, sliding_window=4096)
    g = mc.gemma
    assert g is not None
    assert g.sliding_layers == (True, False, True, False, True)
    assert g.sliding_window == 4096 and mc.sliding_window is None
    assert (g.attn_logit_softcapping, g.final_logit_softcapping) == (50.0, 30.0)
    assert g.query_pre_attn_scalar == 256 and g.hidden_activation == "gelu_pytorch_tanh"
    assert mc.tie_word_embeddings and not g.qk_norm and g.local_rope is None


def test_gemma3_older_layout(tmp_path) -> None:
    """gemma-3-1b's config.json: sliding_window_pattern, rope_theta / rope_local_base_freq and
    rope_scaling (global layers only); Gemma 3 never soft-caps attention."""
    mc = _config(
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=7,
        sliding_window=512,
        sliding_window_pattern=3,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        attn_logit_softcapping=50.0,
        final_logit_softcapping=None,
    )
    g = mc.gemma
    assert g is not None
    assert g.sliding_layers == (True, True, False, True, True, False, True)
    assert (mc.rope.rope_type, mc.rope.factor, mc.rope.theta) == ("linear", 8.0, 1000000.0)
    assert g.local_rope is not None
    assert (g.local_rope.rope_type, g.local_rope.theta) == ("default", 10000.0)
    assert g.attn_logit_softcapping is None and g.final_logit_softcapping is None
    assert g.qk_norm


def test_gemma3_nested_rope_parameters(tmp_path) -> None:
    mc = _config(
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 2e6, "original_max_position_embeddings": 256},
        },
    )
    assert mc.gemma is not None and mc.gemma.local_rope is not None
    assert mc.gemma.local_rope.theta == 5000.0
    assert (mc.rope.rope_type, mc.rope.theta, mc.rope.original_max_position_embeddings) == ("yarn", 2e6, 256)


def test_phi3_sliding_window_applies_to_every_layer(tmp_path) -> None:
    mc = _config(tmp_path, architectures=["Phi3ForCausalLM"], num_hidden_layers=2, sliding_window=2047)
    assert mc.sliding_window == 2047 and mc.gemma is None and not mc.tie_word_embeddings


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (dict(architectures=["Gemma3ForConditionalGeneration"]), "unsupported architecture"),
        (dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(architectures=["Gemma2ForCausalLM"], layer_types=["full_attention"]), "layer_types has 1 entries for 2"),
    ],
)
def test_what_tandem_cannot_run_is_refused(tmp_path, cfg, message) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, num_hidden_layers=2, **cfg)


def test_unknown_activation_is_refused_at_load(model_factory, tmp_path) -> None:
    folder = shutil.copytree(model_factory("gemma2", head_dim=16), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_activation"] = "relu2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"activation 'relu2' is not supported"):
        LLM(str(folder))
