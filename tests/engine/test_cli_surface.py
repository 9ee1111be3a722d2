"""The parts of vLLM's surface that need no server: every CLI flag documented with its default, vLLM
flags refused or noted, `tandem models path`, --generation-config's reading, FIM prompts, cache
salts under tenants, the bench plot's point labels."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.entrypoints.cli import build_parser, engine_kwargs
from tandem.entrypoints.openai.fim import fim_prompt
from tandem.entrypoints.openai.generation_config import sampling_defaults
from tandem.entrypoints.openai.serving import request_salt
from tandem.entrypoints.openai.tenants import Tenant
from tandem.loadgen.plot import run_label


def parsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def serve_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def test_every_config_option_is_one_flag_with_the_fields_default():
    """The engine flags come from EngineConfig's fields (tandem/config.py `option`), and the cluster
    flags from ClusterConfig's: each field with an Option is one flag of `serve` (and of `generate`
    where it is an engine one) whose default, choices and help are the field's, and `serve --help`
    lists it once."""
    from dataclasses import fields

    from tandem.cluster.config import ClusterConfig
    from tandem.config import EngineConfig, options

    declared = options(EngineConfig)
    assert len(declared) >= 28
    assert {f.name for f in fields(EngineConfig)} - {name for name, *_ in declared} <= {
        "model",  # the positional MODEL or --model, resolved to the embedded model when unset
        "kv_transfer_timeout_s",
        "migration_max_stages",
        "migration_stop_blocks",
        "structured_outputs_cache_size",
        "structured_outputs_cache_bytes",
        "structured_outputs_check_timeout_s",
    }
    srv = serve_parser()
    by_dest = {a.dest: a for a in srv._actions}
    help_text = srv.format_help()
    defaults = vars(srv.parse_args([]))
    cluster = options(ClusterConfig)
    assert {name for name, *_ in cluster} >= {"num_instances", "dispatch_policy", "prefill_instances"}
    for name, default, _, opt in declared + cluster:
        action = by_dest[name]
        flag = opt.flag_name(name)
        assert flag in action.option_strings, name
        assert defaults[name] == default, name
        assert action.help == opt.help, name
        assert (list(action.choices) if action.choices else None) == (
            list(opt.choices) if opt.choices else None
        )
        # An option's own line is indented by two spaces (a wrapped help line by more).
        own = [
            line
            for line in help_text.splitlines()
            if re.match(rf"  {re.escape(flag)}[ ,]|  {re.escape(flag)}$", line)
        ]
        assert len(own) == 1, (flag, own)
    # The parsed defaults build the config as the dataclass alone would.
    args = srv.parse_args(["--dtype", "float32", "-q", "int8", "--no-enable-prefix-caching"])
    config = EngineConfig(model="m", **engine_kwargs(args))
    assert (config.dtype, config.quantization, config.enable_prefix_caching) == ("float32", "int8", False)
    untouched = EngineConfig(model="m", **engine_kwargs(srv.parse_args([])))
    assert untouched == EngineConfig(model="m")


def test_structured_arguments_are_parsed_when_the_config_is_made():
    """speculative_config and tenant_quotas are held typed; bad input is a ValueError naming the field."""
    from tandem.config import EngineConfig
    from tandem.core.policy import TenantQuota
    from tandem.sim.instance import InstanceSpec
    from tandem.spec.config import SpeculativeConfig

    config = EngineConfig(
        model="m",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        tenant_quotas={"a": {"weight": 2, "max_running": 4}},
    )
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.num_speculative_tokens == 3
    assert config.tenant_quotas == {"a": TenantQuota(weight=2, max_running=4)}
    for bad, field in (
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 99}}, "speculative_config"),
        ({"speculative_config": {"method": "ngram", "k": 3}}, "speculative_config"),
        ({"tenant_quotas": {"a": {"weight": 0}}}, "tenant_quotas"),
        ({"tenant_quotas": {"a": {"burst": 1}}}, "tenant_quotas"),
        ({"tenant_quotas": ["a"]}, "tenant_quotas"),
    ):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **bad)
    # The simulator's instance takes the knobs it shares with the engine from EngineConfig.
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert getattr(InstanceSpec(), name) == getattr(EngineConfig(model="m"), name)


def test_every_flag_has_help_and_every_parser_shows_defaults():
    for path, p in parsers(build_parser()):
        assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter, path
        for action in p._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                assert action.help, (path, action.option_strings or action.dest)
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default: 256)" in text and "(default: auto)" in text


def test_every_engine_argument_is_a_flag():
    from tandem.config import EngineConfig

    args = build_parser().parse_args(
        [
            "serve",
            "--starvation-timeout-s",
            "5",
            "--tenant-quotas",
            '{"a": {"weight": 2}}',
            "--no-enable-prefix-caching",
        ]
    )
    kw = engine_kwargs(args)
    assert kw["starvation_timeout_s"] == 5.0 and kw["tenant_quotas"] == {"a": {"weight": 2}}
    assert kw["enable_prefix_caching"] is False
    EngineConfig(model="x", **kw)  # every name is an engine argument


def test_served_model_name_takes_several():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size must be 1"),
        (["--no-enable-chunked-prefill"], "always chunks long prefills"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-logprobs", "50"], "--max-logprobs must be in [0, 20]"),
    ],
)
def test_vllm_flags_tandem_cannot_honour_are_refused_before_loading(flags, message):
    proc = run_cli("serve", *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_models_path_prints_the_embedded_model_folder():
    proc = run_cli("models", "path")
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip())
    assert (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()
    draft = Path(run_cli("models", "path", "--draft").stdout.strip())
    assert (draft / "config.json").is_file() and draft != folder


def test_generation_config_reads_the_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 99, "do_sample": True})
    )
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 99}
    assert sampling_defaults("auto", str(tmp_path)) == want
    assert sampling_defaults(str(tmp_path), "/nonexistent") == want
    assert sampling_defaults("vllm", str(tmp_path)) == {}
    assert sampling_defaults("auto", str(tmp_path / "none")) == {}
    with pytest.raises(ValueError, match="neither auto, vllm nor a folder"):
        sampling_defaults(str(tmp_path / "missing"), str(tmp_path))


def test_fim_prompt_in_each_spelling():
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    for names in (
        ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
        ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ):
        vocab = {n: 1000 + i for i, n in enumerate(names)}
        assert fim_prompt(vocab.get, encode, "ab", "c") == [1000, 97, 98, 1001, 99, 1002]
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        fim_prompt({"<fim_prefix>": 1}.get, encode, "a", "b")


def test_cache_salt_stays_within_the_tenant():
    a = Tenant(name="a", cache_salt="salt-a")
    b = Tenant(name="b", cache_salt="salt-b")
    assert request_salt(None, None) is None and request_salt(None, "x") == "x"
    assert request_salt(a, None) == "salt-a"
    # Whatever salt a request sends, it cannot land in another tenant's (or the untenanted) cache.
    assert request_salt(a, "x") != request_salt(b, "x")
    assert request_salt(a, "salt-b") != request_salt(b, None)
    assert request_salt(a, "x") != "x"


def test_plot_labels_name_the_load():
    assert run_label({"request_rate": None, "max_concurrency": 8}) == "concurrency 8"
    assert run_label({"request_rate": 2.0, "max_concurrency": None}) == "2 req/s"
    assert run_label({"request_rate": 2.0, "max_concurrency": 4}, short=True) == "2 req/s, c=4"
    assert "None" not in run_label({"request_rate": None, "max_concurrency": None})


def test_cluster_flags_become_the_cluster_config():
    from tandem.cluster.config import ClusterConfig
    from tandem.entrypoints.cli import build_parser, cluster_kwargs

    args = build_parser().parse_args(
        ["serve", "--num-instances", "2", "--migration-triggers", "imbalance, priority", "--instance-timeout", "5"]
    )
    cfg = ClusterConfig(**cluster_kwargs(args, num_threads=3))
    assert cfg.migration_triggers == ("imbalance", "priority")
    assert cfg.instance_timeout_s == 5.0
    assert cfg.cpus == 3.0  # the engine's threads when --cpus-per-instance is not given
    args = build_parser().parse_args(["serve", "--cpus-per-instance", "1.5", "--migration-triggers", "sideways"])
    with pytest.raises(ValueError, match="sideways"):
        ClusterConfig(**cluster_kwargs(args, num_threads=3))
    assert ClusterConfig(**cluster_kwargs(build_parser().parse_args(["serve", "--cpus-per-instance", "1.5"]), 3)).cpus == 1.5
