"""The offline API as wide as the server's and vLLM's: `LLM(...)` takes the vLLM engine arguments the
server takes as flags (same meaning, or the same "accepted, ignored" note), `LLM.chat()` takes tools,
chat_template_kwargs and continue_final_message, `SamplingParams` takes vLLM's `guided_decoding` and
`detokenize`, integer logit_bias values work, and `--dtype auto` is described as it behaves."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[2]
HERMES_TEMPLATE = (ROOT / "tests/server/hermes_tool_template.jinja").read_text()


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=256, block_size=4, num_threads=1)


def decode(llm: LLM, ids: list[int]) -> str:
    return llm.get_tokenizer().decode(ids, skip_special_tokens=False)


# --- LLM(...) engine arguments -------------------------------------------------------------------


def test_llm_takes_the_vllm_engine_arguments_the_server_takes(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm = LLM(
            str(llama_dir),
            num_kv_blocks=64,
            gpu_memory_utilization=0.9,
            trust_remote_code=True,
            tensor_parallel_size=1,
            enforce_eager=True,
            enable_chunked_prefill=True,
            disable_log_stats=True,
        )
    assert llm.engine.num_blocks == 64  # gpu_memory_utilization sizes the cache on CUDA only
    assert llm.engine.core.runner.graphs is None  # and a CPU never captures graphs
    logged = caplog.text
    # Each ignored argument says so once, with the reason the compatibility page gives.
    for name in ("trust_remote_code", "disable_log_stats"):
        assert f"{name} is accepted and ignored" in logged, logged
    # gpu_memory_utilization and enforce_eager are engine arguments now (docs/gpu.md).
    for name in ("gpu_memory_utilization", "enforce_eager"):
        assert f"{name} is accepted and ignored" not in logged, logged
    # Defaults are no request to ignore: no note.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem"):
        LLM(str(llama_dir), num_kv_blocks=64, trust_remote_code=False, enforce_eager=False)
    assert "ignored" not in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"enable_chunked_prefill": False}, "always chunks long prefills"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb is not applicable in Tandem: weights stay where the model"),
        ({"swap_space": -1}, "swap_space must be a number >= 0"),
        ({"preemption_mode": "sometimes"}, "preemption_mode must be one of"),
        ({"no_such_argument": 1}, "unknown engine argument"),
    ],
)
def test_llm_refuses_what_the_server_refuses_before_loading(kwargs, message):
    # "unused" is no checkpoint: the argument is refused before anything is loaded.
    with pytest.raises(ValueError, match=message):
        LLM("unused", **kwargs)


# --- LLM.chat(): tools, chat_template_kwargs, continue_final_message ----------------------------


def test_chat_renders_tools_and_tool_call_arguments_as_the_server_does(llm):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = llm.chat(
        messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=HERMES_TEMPLATE, tools=tools
    )[0]
    prompt = decode(llm, out.prompt_token_ids)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert "Weather in Paris?" in prompt  # text parts flattened, as the HTTP route does
    # OpenAI sends arguments as JSON text; templates get them as an object (written with tojson).
    assert '"arguments": {"city": "Paris"}' in prompt
    assert '<tool_response id="c1">' in prompt
    with pytest.raises(ValueError, match="tools"):
        llm.chat(messages, tools={"not": "a list"}, use_tqdm=False)


def test_chat_takes_chat_template_kwargs_and_continue_final_message(llm):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}"
    out = llm.chat(
        [{"role": "user", "content": "hello"}],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"suffix": " world"},
    )[0]
    assert decode(llm, out.prompt_token_ids) == "hello world"
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        llm.chat([{"role": "user", "content": "x"}], use_tqdm=False, chat_template_kwargs={"tokenize": True})

    partial = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    out = llm.chat(
        partial,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    # The assistant's turn is left open: no end-of-turn after its text.
    assert decode(llm, out.prompt_token_ids).endswith("one two")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(partial, use_tqdm=False, continue_final_message=True)


# --- SamplingParams: guided_decoding, detokenize, integer logit_bias ---------------------------


@dataclass
class OldGuidedDecodingParams:
    """The fields of vLLM's GuidedDecodingParams (before it became StructuredOutputsParams)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


def test_guided_decoding_is_vllms_older_name_for_structured_outputs():
    from tandem.sampling_params import GuidedDecodingParams

    want = StructuredOutputsParams(choice=["yes", "no"])
    for given in (
        OldGuidedDecodingParams(choice=["yes", "no"], backend="xgrammar"),
        {"choice": ["yes", "no"]},
        GuidedDecodingParams(choice=["yes", "no"]),
    ):
        sp = SamplingParams(guided_decoding=given)
        assert sp.structured_outputs == want
        assert sp.guided_decoding is None  # one spelling kept: clone() and the engine read structured_outputs
        assert sp.clone(max_tokens=3).structured_outputs == want
    assert SamplingParams(guided_decoding={"json": {"type": "object"}}).structured_outputs.kind == "json"
    with pytest.raises(ValueError, match="guided_decoding and structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs=StructuredOutputsParams(regex="b"))
    with pytest.raises(ValueError, match=r"guided_decoding\.whitespace_pattern"):
        SamplingParams(guided_decoding=OldGuidedDecodingParams(json_object=True, whitespace_pattern=" "))
    with pytest.raises(ValueError, match=r"guided_decoding\.no_such"):
        SamplingParams(guided_decoding={"regex": "a", "no_such": 1})
    with pytest.raises(ValueError, match="guided_decoding must be"):
        SamplingParams(guided_decoding="yes|no")


def test_guided_decoding_constrains_the_output(llm):
    out = llm.generate(
        "Is it?",
        SamplingParams(temperature=0.0, max_tokens=8, guided_decoding={"choice": ["yes", "no"]}),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text in ("yes", "no")


def test_detokenize_false_gives_token_ids_and_no_text(llm):
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text_run = llm.generate("The cat", base, use_tqdm=False)[0].outputs[0]
    ids_run = llm.generate("The cat", base.clone(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert text_run.text and ids_run.text == ""
    assert ids_run.token_ids == text_run.token_ids
    with pytest.raises(ValueError, match=r"SamplingParams\.detokenize"):
        SamplingParams(detokenize=0)
    # As vLLM: stop strings are matched in the text, so they need it.
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_integer_logit_bias_values_work_offline(llm):
    sp = SamplingParams(logit_bias={263: 100, 7: -100})
    assert all(type(v) is float for v in sp.logit_bias.values())
    assert all(type(v) is float for v in sp.clone().logit_bias.values())
    out = llm.generate(
        "The cat", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={263: 100}),
        use_tqdm=False,
    )[0]
    assert out.error is None, out.error
    assert out.outputs[0].token_ids == [263] * 4


# --- --dtype auto, described as it behaves -----------------------------------------------------


def test_dtype_auto_is_described_by_cpu_feature():
    from tandem.entrypoints.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (dtype,) = [a for a in serve._actions if "--dtype" in a.option_strings]
    assert "float32 on CPU)" not in dtype.help
    for flag in ("amx_bf16", "avx512_bf16", "TANDEM_AUTO_DTYPE"):
        assert flag in dtype.help, dtype.help
    readme = (ROOT / "README.md").read_text()
    assert "AVX2-only CPUs (such as AMD\nEPYC)" not in readme and "(such as AMD EPYC)" not in readme
    assert "AVX-512 without BF16" in readme


def test_dtype_auto_follows_the_cpu_features_the_help_names(monkeypatch):
    import torch

    from tandem.model import loader

    monkeypatch.delenv(loader.AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(loader, "onednn_available", lambda dtype=None: True)
    cpu = torch.device("cpu")
    for flags, want in [
        ({"avx2", "avx512f"}, "float32"),  # AVX-512 without BF16 (Skylake, Cascade Lake)
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # EPYC Zen 4/5, Cooper Lake
        ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids and later
        ({"avx2"}, "float32"),  # AVX2 only (EPYC before Zen 4)
    ]:
        monkeypatch.setattr(loader, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert loader.auto_dtype(cpu)[0] == want, flags
