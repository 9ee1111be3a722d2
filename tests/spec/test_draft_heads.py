"""EAGLE and Medusa draft heads (tandem/model/draft_heads.py, tandem/worker/head_drafter.py).

1. Greedy output is identical with a head's draft trees and without speculation, in float32, with
   n = 2, penalties, logprobs, structured output, preemption, chunked prefill and prefix caching in
   the same run; the trees branch and are verified as trees.
2. Sampling goes through recursive rejection sampling over the trees: with a 4-token vocabulary the
   empirical distribution of 4 generated tokens matches the target's exact one (chi-square, as the
   chain methods' test in test_spec_decode.py), at temperature 1, with top-k and with top-p.
3. The heads trained for the embedded default model (tandem/checkpoints/default-eagle and
   default-medusa, found with no path) are lossless on code prompts and accept enough drafts that
   a broken head fails: a mean acceptance length (tokens per verifying step) over a threshold.
4. `tandem train-draft` writes a head folder that loads, and resumes from its checkpoint.
5. A reduced draft vocabulary (`draft_vocab_size`, the head folder's draft_vocab.json): greedy
   output unchanged, sampling still the target's (chi-square with drafts from 2 of the 4 tokens),
   and the head passes never read the target's whole LM head: only the subset's rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_spec_decode import (
    SETTINGS,
    TARGET,
    build_tiny_vocab_model,
    exact_distribution,
    goodness_of_fit,
    sample,
)
from test_tree_engine import run

import tandem.worker.head_drafter as head_drafter
from tandem import LLM, SamplingParams
from tandem.checkpoints import DEFAULT_MODEL_DIR
from tandem.config import ModelConfig
from tandem.model.draft_heads import HeadConfig, build_head, save_head
from tandem.model.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab, write_draft_vocab
from tandem.model.layers import RotaryEmbedding
from tandem.spec.config import SpeculativeConfig

ALPHA = 1e-3


def make_head(target: Path, method: str, out: Path, seed: int = 0) -> Path:
    """A random head for `target` (float32): its drafts are mostly wrong, never harmful."""
    mc = ModelConfig.from_pretrained(target)
    torch.manual_seed(seed)
    cfg = HeadConfig(method, mc.hidden_size, mc.vocab_size, num_heads=3)
    head = build_head(cfg, mc, None, RotaryEmbedding(mc.head_dim, 8, mc.rope, torch.device("cpu")))
    if method == "medusa":  # zero-initialised blocks are the identity: make them differ
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0.0, 0.3)
    save_head(head, out, method, mc, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def target_dir(model_factory) -> Path:
    return model_factory("llama", **TARGET)


@pytest.fixture
def proposed(monkeypatch) -> list:
    """Every tree a head drafter proposes (each exactly as large as the scheduler reserved)."""
    seen: list = []
    propose = head_drafter.HeadDrafter.propose

    def recording(self, todo):
        trees = propose(self, todo)
        for r, k in todo:
            assert len(trees[r.request_id]) == k  # exactly what the scheduler reserved
            seen.append(trees[r.request_id])
        return trees

    monkeypatch.setattr(head_drafter.HeadDrafter, "propose", recording)
    return seen


def test_config_names_and_checks() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 8, "tree_topk": 2})
    assert cfg is not None and cfg.uses_head and cfg.tree_topk == 2 and cfg.tree_depth == 6
    alone = SpeculativeConfig.from_dict({"method": "eagle"})
    assert alone is not None and alone.num_speculative_tokens == 8 and alone.model is None
    with pytest.raises(ValueError, match="tree_depth"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 4, "tree_depth": 0})


def test_no_head_beside_the_target_says_how_to_train_one(target_dir) -> None:
    with pytest.raises(ValueError, match="train-draft"):
        LLM(
            str(target_dir),
            speculative_config={"method": "eagle", "num_speculative_tokens": 4},
            num_threads=1,
        )


def test_a_head_for_another_target_is_refused(target_dir, tmp_path, model_factory) -> None:
    other = model_factory("llama", hidden_size=48)
    head = make_head(other, "eagle", tmp_path / "head")
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="hidden size"):
        LLM(str(target_dir), speculative_config=spec, num_threads=1)


@pytest.mark.parametrize(
    "method, k, adaptive", [("eagle", 6, False), ("medusa", 5, False), ("eagle", 6, True)]
)
def test_greedy_output_is_unchanged(method, k, adaptive, target_dir, tmp_path, proposed) -> None:
    head = make_head(target_dir, method, tmp_path / method)
    _, base, base_outs = run(target_dir, None)
    spec = {
        "method": method,
        "model": str(head),
        "num_speculative_tokens": k,
        "adaptive": adaptive,
        "tree_topk": 2,
    }
    llm, got, outs = run(target_dir, spec)
    assert got == base
    for g, w in zip(outs[3].outputs[0].logprobs, base_outs[3].outputs[0].logprobs):
        assert g.keys() == w.keys()
    engine = llm.engine
    assert engine.counters.num_preemptions > 0 and engine.counters.prefix_cache_hits > 0
    assert engine.kv.usage == 0.0
    engine.kv.check_invariants()
    if adaptive:  # the controller decides: drafts (of any size it chose) were still verified
        assert len(proposed) >= 1
        return
    assert len(proposed) >= 20
    assert sum(not t.is_chain for t in proposed) >= 10  # trees, verified as trees
    assert max(max(t.depths()) for t in proposed) >= 2
    assert engine.counters.spec_decode_num_draft_tokens_by_method[method] > 0


@pytest.fixture
def head_reads(monkeypatch) -> dict:
    """The drafters built, and the target's full-vocabulary logits computed inside proposals (the
    head passes' read-out through the target's whole LM head)."""
    seen: dict = {"drafters": [], "full_rows": 0}
    propose = head_drafter.HeadDrafter.propose

    def counting(self, todo):
        if self not in seen["drafters"]:
            seen["drafters"].append(self)
            full = self.target.compute_logits

            def compute_logits(h):
                if seen.get("proposing"):
                    seen["full_rows"] += h.shape[0]
                return full(h)

            self.target.compute_logits = compute_logits
        seen["proposing"] = True
        try:
            trees = propose(self, todo)
        finally:
            seen["proposing"] = False
        subset = self.readout.token_ids
        if subset is not None:
            allowed = set(subset.tolist())
            assert all(t in allowed for tree in trees.values() for t in tree.tokens)
        return trees

    monkeypatch.setattr(head_drafter.HeadDrafter, "propose", counting)
    return seen


def write_vocab(head: Path, target: Path, favourites: list[int]) -> None:
    """A draft_vocab.json ranking `favourites` first (as if the target's answers were made of them)."""
    mc = ModelConfig.from_pretrained(target)
    write_draft_vocab(head, mc.vocab_size, [favourites], [], mc.eos_token_ids, "test")


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_reduced_draft_vocabulary_keeps_greedy_output_and_reads_only_its_rows(
    method, target_dir, tmp_path, head_reads
) -> None:
    head = make_head(target_dir, method, tmp_path / method)
    _, base, _ = run(target_dir, None)
    # The subset: the tokens the target emitted (its "answers") first, so drafts can be accepted.
    favourites = [t for outs in base for toks, _ in outs for t in toks]
    write_vocab(head, target_dir, favourites)
    size = 64
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 6, "adaptive": False}
    spec |= {"tree_topk": 2, "draft_vocab_size": size}
    llm, got, _ = run(target_dir, spec)
    assert got == base
    (drafter,) = head_reads["drafters"]
    assert drafter.readout.linear is not None and drafter.readout.linear.out_features == size
    assert drafter.readout.size == size
    assert head_reads["full_rows"] == 0  # no head pass multiplied the whole LM head
    assert drafter.work.passes >= 20
    assert llm.engine.counters.spec_decode_num_accepted_tokens > 0
    # The mechanism check itself: with the whole vocabulary the passes do read the full head.
    head_reads["drafters"].clear()
    run(target_dir, spec | {"draft_vocab_size": 0})
    assert head_reads["drafters"][0].readout.linear is None and head_reads["full_rows"] > 0


def test_head_without_vocab_file_uses_the_whole_vocabulary(target_dir, tmp_path, head_reads, caplog) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="tandem.model")
    head = make_head(target_dir, "eagle", tmp_path / "eagle")
    assert not (head / DRAFT_VOCAB_FILE).exists()
    _, base, _ = run(target_dir, None)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 4, "adaptive": False}
    _, got, _ = run(target_dir, spec | {"draft_vocab_size": 16})
    assert got == base
    assert head_reads["drafters"][0].readout.token_ids is None and head_reads["full_rows"] > 0
    assert len([r for r in caplog.records if DRAFT_VOCAB_FILE in r.getMessage()]) == 1


@pytest.fixture(scope="module")
def tiny_vocab_heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab-heads")
    target = build_tiny_vocab_model(root / "target", seed=0)
    exact = {name: exact_distribution(target, **kw) for name, kw in SETTINGS.items()}
    heads = {m: make_head(target, m, root / m, seed=1) for m in ("eagle", "medusa")}
    return target, heads, exact


@pytest.mark.slow
@pytest.mark.parametrize("method, draft_vocab", [("eagle", 0), ("medusa", 0), ("eagle", 2), ("medusa", 2)])
def test_speculative_sampling_matches_the_exact_distribution(
    method, draft_vocab, tiny_vocab_heads, monkeypatch, proposed
) -> None:
    """`draft_vocab` 2: drafts only ever from the target's two likeliest tokens (zero draft
    probability for the other two); the tokens emitted still follow its whole distribution."""
    from tandem.spec.planner import SpecPlanner

    target, heads, exact = tiny_vocab_heads
    subset: set[int] = set()
    if draft_vocab:
        mass = [0.0] * 4
        for seq, prob in exact["temperature 1"].items():
            for t in seq:
                mass[t] += prob
        subset = set(sorted(range(4), key=lambda t: -mass[t])[:draft_vocab])
        write_draft_vocab(heads[method], 4, [sorted(subset)], [], [], "test")
    lengths: list[int] = []
    observe = SpecPlanner.observe

    def recording(self, req, num_draft, num_accepted):
        lengths.append(num_accepted + 1)
        return observe(self, req, num_draft, num_accepted)

    monkeypatch.setattr(SpecPlanner, "observe", recording)
    spec = {
        "method": method,
        "model": str(heads[method]),
        "num_speculative_tokens": 3,
        "adaptive": False,
        "tree_topk": 2,
        "draft_vocab_size": draft_vocab,
    }
    try:
        llm, samples = sample(target, spec, SETTINGS)
    finally:
        (heads[method] / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    c = llm.engine.counters
    drafted, accepted = c.spec_decode_num_draft_tokens, c.spec_decode_num_accepted_tokens
    assert drafted > 2000
    # Both outcomes are common: acceptance and rejection (with the leftover distribution) matter.
    assert 0.05 * drafted < accepted < 0.9 * drafted
    if draft_vocab:
        # (Renormalized over two tokens, the best child's best child outranks the runner-up: the
        # trees' shapes differ from the whole vocabulary's, checked below.)
        assert {t for tree in proposed for t in tree.tokens} <= subset
    # (Two tokens are drafted at most: one of the 4 was sampled plainly, and the last is the bonus.)
    elif method == "eagle":
        # Unsure heads branch: the root's two best children, verified as a tree (recursive
        # rejection sampling: the second child is tried on what the first one's rejection left).
        assert sum(not t.is_chain for t in proposed) > 1000
    else:
        # Medusa's second head's best beats the first head's runner-up: chains two deep.
        assert lengths.count(3) > 20
    for name in SETTINGS:
        p = goodness_of_fit(samples[name], exact[name])
        assert p > ALPHA, f"{method}, {name}: the samples do not follow the target (p = {p:.2e})"


# -- the heads shipped for the default model ------------------------------------------------------

# Measured (docs/speculative_decoding.md): mean acceptance length of the shipped heads on these
# prompts, greedy, trees of 8 nodes, tree_topk 4: EAGLE 2.46, Medusa 1.49. The thresholds leave
# margin; a head that proposes what the target does not want stays near 1.
MIN_ACCEPTANCE_LENGTH = {"eagle": 2.0, "medusa": 1.3}


def code_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from tandem.loadgen.datasets import code_dataset

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    return [s.prompt_token_ids for s in code_dataset(6, 96, 64, seed=0, tokenizer=tok)]


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_shipped_head_is_lossless_and_accepts(method) -> None:
    prompts = [{"prompt_token_ids": p} for p in code_prompts()]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine = dict(dtype="float32", num_threads=1, max_model_len=256)
    base = LLM(str(DEFAULT_MODEL_DIR), **engine).generate(prompts, sp, use_tqdm=False)
    # No "model": the head beside the default model's folder, shipped in the package.
    spec = {"method": method, "num_speculative_tokens": 8, "adaptive": False}
    llm = LLM(str(DEFAULT_MODEL_DIR), speculative_config=spec, **engine)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    c = llm.engine.counters
    length = 1 + c.spec_decode_num_accepted_tokens / c.spec_decode_num_drafts
    assert length > MIN_ACCEPTANCE_LENGTH[method], f"{method}: mean acceptance length {length:.2f}"


def test_shipped_heads_are_small_and_packaged() -> None:
    import tomllib

    data = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    listed = data["tool"]["setuptools"]["package-data"]["tandem.checkpoints"]
    for method in ("eagle", "medusa"):
        folder = DEFAULT_MODEL_DIR.parent / f"default-{method}"
        assert json.loads((folder / "config.json").read_text())["tandem_draft_head"] == method
        assert (folder / "model.safetensors").stat().st_size < 5_000_000
        for name in ("config.json", "model.safetensors", "training.json", "draft_vocab.json"):
            assert f"default-{method}/{name}" in listed


# -- training -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_train_draft_writes_a_head_that_loads_and_resumes(method, target_dir, tmp_path) -> None:
    from tandem.entrypoints.cli import main

    out = tmp_path / method
    common = [
        "train-draft",
        "--model",
        str(target_dir),
        "--method",
        method,
        "--out",
        str(out),
        "--num-prompts",
        "6",
        "--answer-tokens",
        "12",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--save-every",
        "2",
        "--threads",
        "1",
    ]
    if method == "eagle":  # two depths on the head's own predictions, the LM head on 8 rows
        common += ["--unroll", "2", "--ce-rows", "8"]
    assert main([*common, "--steps", "3"]) == 0
    state = torch.load(out / ".train" / "state.pt")
    assert state["step"] == 3
    vocab = read_draft_vocab(out)  # the answers' tokens, counted
    assert vocab is not None and vocab.vocab_size == ModelConfig.from_pretrained(target_dir).vocab_size
    assert 0 < sum(vocab.answer_counts) <= 6 * 12
    first = (out / "model.safetensors").read_bytes()
    assert main([*common, "--steps", "5", "--resume"]) == 0
    assert torch.load(out / ".train" / "state.pt")["step"] == 5
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "training.json").read_text())["steps"] == 5
    spec = {"method": method, "model": str(out), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(target_dir), speculative_config=spec, num_threads=1)
    out_tokens = llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=6), use_tqdm=False
    )
    assert len(out_tokens[0].outputs[0].token_ids) == 6
    # A resume with nothing to resume from is a usage error (exit status 2, the message on stderr).
    assert main([*common[:6], str(tmp_path / "none"), "--resume"]) == 2


def test_vocab_only_writes_the_draft_vocabulary_of_an_existing_head(target_dir, tmp_path) -> None:
    """`--vocab-only`: draft_vocab.json alone, the head untouched; from the recorded answers (split
    at their prompts' lengths, or, for data recorded before those were kept, at the prompts the
    flags build), else from new answers (greedy: the same ones)."""
    import shutil

    from tandem.entrypoints.cli import main

    out = tmp_path / "eagle"
    common = ["train-draft", "--model", str(target_dir), "--method", "eagle", "--out", str(out)]
    common += ["--num-prompts", "5", "--answer-tokens", "10", "--seq-len", "12", "--threads", "1"]
    assert main([*common, "--batch-size", "2", "--steps", "1"]) == 0
    file = out / DRAFT_VOCAB_FILE
    written = file.read_text()
    weights = (out / "model.safetensors").read_bytes()
    file.unlink()
    assert main([*common, "--vocab-only"]) == 0
    assert file.read_text() == written
    data_file = out / ".train" / "data.pt"
    data = torch.load(data_file)
    del data["prompt_lens"]
    torch.save(data, data_file)
    file.unlink()
    assert main([*common, "--vocab-only"]) == 0
    assert file.read_text() == written
    shutil.rmtree(out / ".train")
    file.unlink()
    assert main([*common, "--vocab-only"]) == 0  # nothing recorded: the target answers anew
    assert file.read_text() == written
    assert (out / "model.safetensors").read_bytes() == weights and not (out / ".train").exists()


def test_train_draft_without_out_writes_where_the_engine_looks(model_factory) -> None:
    """No --out: the head lands beside the target's folder (for a pulled model, in the model
    cache), which is where `{"method": "eagle"}` with no model finds it."""
    from tandem.entrypoints.cli import main

    target = model_factory("llama", seed=11, **TARGET)
    args = ["train-draft", "--model", str(target), "--method", "eagle", "--num-prompts", "4"]
    args += ["--answer-tokens", "8", "--seq-len", "8", "--batch-size", "2", "--steps", "1"]
    assert main([*args, "--threads", "1"]) == 0
    assert (target.with_name(f"{target.name}-eagle") / "config.json").is_file()
    spec = {"method": "eagle", "num_speculative_tokens": 2, "adaptive": False}
    out = LLM(str(target), speculative_config=spec, num_threads=1).generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_unrolled_training_attention_sees_the_context_and_the_ancestors_only() -> None:
    """Depth d of an unrolled EAGLE step (`--unroll`): row p stands for a node d - 1 deep in a
    draft from the context up to p - d + 1, so its output depends on depth 1's rows up to p - d + 1
    (the target's features) and on row p - (d - e) of each depth e in 2..d, nothing else."""
    from tandem.entrypoints.train_draft import _TrainAttention

    heads, kv_heads, dim, n, depth = 2, 1, 4, 7, 3
    attn = _TrainAttention(heads, kv_heads, dim)
    attn.shape = (1, n)
    torch.manual_seed(0)
    ks = [torch.randn(n, kv_heads, dim, requires_grad=True) for _ in range(depth)]
    vs = [torch.randn(n, kv_heads, dim, requires_grad=True) for _ in range(depth)]
    for d in range(depth):
        out = attn.forward(torch.randn(n, heads, dim), ks[d], vs[d], None, None)
    p = 5
    out[p].sum().backward()
    for e in range(depth):
        reached = {j for j in range(n) if vs[e].grad is not None and vs[e].grad[j].abs().sum() > 0}
        expected = set(range(p - depth + 2)) if e == 0 else {p - (depth - 1 - e)}
        assert reached == expected, (e, reached, expected)
    # Depth 1 alone is plain causal attention.
    attn.past = []
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).expand(heads, n, dim),
        v.transpose(0, 1).expand(heads, n, dim),
        is_causal=True,
    )
    assert torch.allclose(attn.forward(q, k, v, None, None), causal.transpose(0, 1), atol=1e-6)


def test_chat_and_code_prompt_set(tokenizer_dir) -> None:
    """`--prompts chat+code`: two thirds the chat set's train split through the chat template, a
    third raw code, mixed; `chat` alone needs a chat template."""
    from transformers import AutoTokenizer

    from tandem.entrypoints.train_draft import TrainConfig, build_prompts
    from tandem.loadgen.chat_prompts import chat_messages

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        build_prompts(TrainConfig(model="m", method="eagle", prompts="chat", num_prompts=3), tok)
    tok.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    cfg = TrainConfig(model="m", method="eagle", prompts="chat+code", num_prompts=12, prompt_tokens=24)
    texts = [tok.decode(p) for p in build_prompts(cfg, tok)]
    chat = [t for t in texts if t.startswith("<<")]
    assert len(texts) == 12 and len(chat) == 8
    assert {t[2:-2] for t in chat} == set(chat_messages(8, 0, "train"))
    assert chat != texts[:8]  # interleaved, so the held-out tail holds both kinds


def test_the_best_nodes_form_a_tree_with_the_likeliest_path_first() -> None:
    """EAGLE-2's rerank: the k best nodes by path log-probability (closed under parents: a child's
    is at most its parent's), laid out depth first with the best child first, so the likeliest path
    is the first branch (its KV needs no copy when it is accepted)."""
    from tandem.worker.head_drafter import _best, _Node, _tree

    nodes = [
        _Node(10, -1, 1, -1.0),  # b
        _Node(11, -1, 1, -0.1),  # a
        _Node(12, 1, 2, -0.3),  # a -> c
        _Node(13, 1, 2, -2.0),  # a -> d
        _Node(14, 2, 3, -1.2),  # a -> c -> e
    ]
    chosen = _best(nodes, 4)
    assert sorted(chosen) == [0, 1, 2, 4]
    tree = _tree(nodes, chosen)
    assert tree.tokens == (11, 12, 14, 10) and tree.parents == (-1, 0, 1, -1)
