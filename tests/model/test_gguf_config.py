"""A GGUF file's metadata as Tandem's model configuration: the keys llama.cpp writes, what it leaves
implicit (Gemma's attention scale, the end-of-generation tokens), the folder prepared once per file,
and the errors a user meets (an architecture Tandem does not run, a split file, no tokenizer)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf_checkpoints import write_gguf

from tandem.checkpoints.resolve import resolve_engine_config, resolve_model
from tandem.config import EngineConfig, ModelConfig
from tandem.model.gguf_config import gguf_config, open_reader
from tandem.model.gguf_folder import prepared_folder


def _metadata_only(path: Path, arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, **keys) -> Path:
    """A GGUF file with hyperparameters and a token embedding only (enough for its config)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key.format(arch=arch), value)
        elif isinstance(value, float):
            w.add_float32(key.format(arch=arch), value)
        else:
            w.add_uint32(key.format(arch=arch), value)
    w.add_tensor("token_embd.weight", np.zeros((32, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama_file_reads_as_its_checkpoint_config(model_factory, tmp_path):
    src = model_factory("llama", tie_word_embeddings=False)
    folder = prepared_folder(write_gguf(src, tmp_path / "m.gguf", "Q8_0"), tmp_path / "cache")
    ours, theirs = ModelConfig.from_pretrained(folder), ModelConfig.from_pretrained(src)
    assert ours.gguf_file == str((tmp_path / "m.gguf").resolve())
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings", "attention_bias", "eos_token_ids", "bos_token_id"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope.theta == theirs.rope.theta
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    # The tokenizer and its chat template came from the metadata.
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok.get("eos_token")
    assert (folder / "chat_template.jinja").is_file() or tok.get("chat_template")


def test_the_folder_is_made_once_per_file(model_factory, tmp_path):
    gguf_file = write_gguf(model_factory("llama"), tmp_path / "m.gguf", "F16")
    cache = tmp_path / "cache"
    first = prepared_folder(gguf_file, cache)
    mtime = (first / "config.json").stat().st_mtime_ns
    assert prepared_folder(gguf_file, cache) == first
    assert (first / "config.json").stat().st_mtime_ns == mtime
    # A changed file is another folder, and the old one refuses to stand for it.
    with gguf_file.open("ab") as f:
        f.write(b"\0" * 64)
    os.utime(gguf_file, ns=(mtime + 10**9, mtime + 10**9))
    assert prepared_folder(gguf_file, cache) != first
    with pytest.raises(ValueError, match="has changed since this folder was made"):
        ModelConfig.from_pretrained(first)


def test_gemma_attention_scale_and_windows_follow_llama_cpp(tmp_path):
    g2 = gguf_config(open_reader(_metadata_only(tmp_path / "g2.gguf", "gemma2", layers=46, hidden=64, heads=8,
                                                **{"{arch}.attention.key_length": 16})))  # fmt: skip
    assert g2.config["query_pre_attn_scalar"] == 64 / 8  # the 27B model: hidden / heads
    assert g2.config["sliding_window"] == 4096  # llama.cpp's default
    assert g2.config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    g3 = gguf_config(open_reader(_metadata_only(
        tmp_path / "g3.gguf", "gemma3", layers=8, heads=2,
        **{"{arch}.attention.key_length": 256, "{arch}.attention.sliding_window": 512,
           "{arch}.attention.sliding_window_pattern": 4, "{arch}.rope.freq_base_swa": 20000.0},
    )))  # fmt: skip
    assert g3.config["query_pre_attn_scalar"] == 256  # head_dim elsewhere
    assert g3.config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] + \
        ["sliding_attention"] * 3 + ["full_attention"]  # fmt: skip
    assert g3.config["rope_local_base_freq"] == 20000.0


def test_sampling_defaults_and_end_of_turn_tokens(tmp_path):
    import gguf

    path = tmp_path / "chat.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_float32("general.sampling.temp", 0.6)
    w.add_uint32("general.sampling.top_k", 20)
    w.add_token_list(["<unk>", "a", "<|im_end|>", "<|endoftext|>", "b"])
    w.add_eos_token_id(3)
    w.add_tensor("token_embd.weight", np.zeros((5, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = gguf_config(open_reader(path))
    assert info.config["eos_token_id"] == [3, 2]  # the file's EOS first, then <|im_end|>
    assert info.generation_config["temperature"] == pytest.approx(0.6)
    assert info.generation_config["top_k"] == 20
    assert info.config["attention_bias"] is False and info.config["tie_word_embeddings"] is True


def test_unsupported_and_split_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama"):
        gguf_config(open_reader(_metadata_only(tmp_path / "a.gguf", "gpt2")))
    split = _metadata_only(tmp_path / "s.gguf", "llama", **{"split.count": 3})
    with pytest.raises(ValueError, match="split GGUF"):
        open_reader(split)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read"):
        open_reader(bad)
    with pytest.raises(ValueError, match="is a GGUF file"):
        ModelConfig.from_pretrained(split)


def test_a_file_without_tokenizer_needs_one(model_factory, tokenizer_dir, tmp_path):
    gguf_file = write_gguf(model_factory("llama"), tmp_path / "m.gguf", "F16", tokenizer=False)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        resolve_engine_config(EngineConfig(model=str(gguf_file)))
    cfg = resolve_engine_config(EngineConfig(model=str(gguf_file), tokenizer=str(tokenizer_dir)))
    assert cfg.tokenizer == str(tokenizer_dir) and cfg.quantization == "gguf"


def test_resolution(model_factory, tmp_path):
    src = model_factory("llama")
    (tmp_path / "one").mkdir()
    gguf_file = write_gguf(src, tmp_path / "one" / "m.gguf", "Q4_0")
    # A folder holding one GGUF file and no config.json stands for that file.
    assert resolve_model(str(tmp_path / "one")).gguf_file == str(gguf_file.resolve())
    assert resolve_model(str(gguf_file)).name == "m.gguf"
    # A checkpoint folder is itself; a prepared folder says where it came from.
    assert resolve_model(str(src)) == resolve_model(str(src))
    assert resolve_model(str(src)).path == str(src) and resolve_model(str(src)).gguf_file is None
    folder = resolve_model(str(gguf_file)).path
    assert resolve_model(folder).gguf_file == str(gguf_file.resolve())
    # dtype auto keeps the 4-bit blocks packed; an explicit dtype dequantizes; int8 stays int8.
    assert resolve_engine_config(EngineConfig(model=str(gguf_file))).quantization == "gguf"
    assert resolve_engine_config(EngineConfig(model=str(gguf_file), dtype="float32")).quantization is None
    assert (
        resolve_engine_config(EngineConfig(model=str(gguf_file), quantization="int8")).quantization == "int8"
    )
    plain = EngineConfig(model=str(src))
    assert resolve_engine_config(plain) is plain
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(gguf_file.read_bytes())
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model(str(tmp_path / "two"))


def test_gguf_quantization_needs_a_gguf_file(model_factory):
    from tandem import LLM

    with pytest.raises(ValueError, match="needs a GGUF file"):
        LLM(str(model_factory("llama")), quantization="gguf", num_kv_blocks=8)
