"""The draft heads' reduced vocabulary (tandem/model/draft_vocab.py).

1. draft_vocab.json: the target's answers counted, ranked (answers, then prompts, then id), read
   back; the subset holds the special tokens, the ranking's first tokens, then the lowest ids.
2. The read-out over the subset (`sub_linear`) computes exactly the selected columns of the
   target's LM head in each form it takes (float, oneDNN / AMX packed, int8 with per-row scales,
   packed 4-bit groups, fp8, a tied head), holding only those rows.
3. A head folder without the file falls back to the whole vocabulary, logged.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tandem.model import draft_vocab as dv
from tandem.model.draft_vocab import (
    DRAFT_VOCAB_FILE,
    DraftReadout,
    draft_token_ids,
    read_draft_vocab,
    select_tokens,
    sub_linear,
    write_draft_vocab,
)
from tandem.spec.config import DEFAULT_DRAFT_VOCAB_SIZE, SpeculativeConfig


def test_config_field_defaults_and_checks() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "eagle"})
    assert cfg is not None and cfg.draft_vocab_size == DEFAULT_DRAFT_VOCAB_SIZE
    medusa = SpeculativeConfig.from_dict({"method": "medusa", "draft_vocab_size": 0})
    assert medusa is not None and medusa.draft_vocab_size == 0
    for bad in (-1, 1.5, "8192", True, None):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            SpeculativeConfig.from_dict({"method": "eagle", "draft_vocab_size": bad})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 64})


def test_vocab_file_ranks_answers_then_prompts_then_ids(tmp_path) -> None:
    answers = [[5, 5, 7, 9], [7, 5, 30]]
    prompts = [[9, 9, 9, 11, 12], [12]]
    file = write_draft_vocab(tmp_path, 40, answers, prompts, [2, 99], "test")
    assert file == tmp_path / DRAFT_VOCAB_FILE
    vocab = read_draft_vocab(tmp_path)
    assert vocab is not None and vocab.vocab_size == 40
    # 5 (3 in answers), 7 (2), 9 (1 + 3 in prompts), 30 (1), then prompt-only 12 (2), 11 (1)
    assert vocab.token_ids == (5, 7, 9, 30, 12, 11)
    assert vocab.answer_counts == (3, 2, 1, 1, 0, 0)
    assert vocab.prompt_counts == (0, 0, 3, 0, 2, 1)
    assert vocab.special_token_ids == (2,)  # 99 is outside the vocabulary
    # Special tokens first (the file's and the caller's), then the ranking, then the lowest free ids.
    assert select_tokens(vocab, 40, 4, always=[3]).tolist() == [2, 3, 5, 7]
    assert select_tokens(vocab, 40, 10).tolist() == [0, 1, 2, 3, 5, 7, 9, 11, 12, 30]
    with pytest.raises(ValueError, match="vocabulary of 40"):
        select_tokens(vocab, 41, 4)
    assert dv.coverage(vocab, 40, 3, [5, 7, 9, 2]) == 0.75  # {2, 5, 7}


def test_missing_vocab_file_falls_back_to_the_whole_vocabulary_logged(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.model")
    assert draft_token_ids(tmp_path, 100, 0) is None  # 0: the whole vocabulary, nothing read
    assert draft_token_ids(tmp_path, 100, 100) is None  # no smaller than the vocabulary
    assert not caplog.records
    assert draft_token_ids(tmp_path, 100, 16) is None
    assert len([r for r in caplog.records if DRAFT_VOCAB_FILE in r.getMessage()]) == 1
    write_draft_vocab(tmp_path, 100, [[50, 51]], [], [], "test")
    ids = draft_token_ids(tmp_path, 100, 16, always=[99])
    assert ids is not None and len(ids) == 16 and {50, 51, 99} <= set(ids.tolist())
    (tmp_path / DRAFT_VOCAB_FILE).write_text("{")
    with pytest.raises(ValueError, match="vocab-only"):
        draft_token_ids(tmp_path, 100, 16)


class _Target(nn.Module):
    """What `sub_linear` reads of a model: `lm_head` (None: tied to `embed_tokens`)."""

    def __init__(self, head: nn.Module | None, vocab: int = 300, hidden: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = head
        self.config = SimpleNamespace(vocab_size=vocab)
        self.final_softcap: float | None = None  # Gemma's, where set

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return nn.functional.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)


def _heads() -> dict[str, nn.Module | None]:
    from tandem.model.int4 import Int4Linear
    from tandem.model.linear import PackedLinear, onednn_available
    from tandem.model.quant import Int8Linear

    torch.manual_seed(1)
    w = torch.randn(300, 64) * 0.1
    b = torch.randn(300) * 0.1
    heads: dict[str, nn.Module | None] = {"tied": None}
    lin = nn.Linear(64, 300)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    heads["float"] = lin
    heads["int8"] = Int8Linear(w, b)
    heads["int8 reference"] = Int8Linear(w, None, use_kernel=False)
    q = torch.randint(0, 16, (300, 64))
    heads["int4"] = Int4Linear(
        q, torch.rand(300, 2) * 0.1, torch.full((300, 2), 7.5), 32, b, use_kernel=False
    )
    heads["int4 kernels"] = Int4Linear(q, torch.rand(300, 2) * 0.1, torch.full((300, 2), 7.5), 32, None)
    if onednn_available():
        heads["packed float32"] = PackedLinear(w, b)
        heads["packed float32, one copy"] = PackedLinear(w, None, second_copy=False)
    if onednn_available(torch.bfloat16):
        heads["packed bfloat16"] = PackedLinear(w.bfloat16(), None)
        heads["packed bfloat16, one copy"] = PackedLinear(w.bfloat16(), None, second_copy=False)
    return heads


@pytest.mark.parametrize("kind", list(_heads()))
def test_sub_linear_computes_the_selected_columns_holding_only_their_rows(kind) -> None:
    head = _heads()[kind]
    model = _Target(head)
    rows = torch.tensor([0, 3, 17, 31, 32, 33, 47, 100, 255, 299])
    sub = sub_linear(model, rows)
    assert type(sub) is (nn.Linear if head is None else type(head))
    assert sub.out_features == len(rows)
    dtype = torch.bfloat16 if "bfloat16" in kind else torch.float32
    for n in (1, 3, 20):  # the few-row kernels' and the library's row counts
        x = torch.randn(n, 64, dtype=dtype)
        full = model.compute_logits(x)[:, rows]
        got = sub(x)
        assert got.shape == (n, len(rows))
        # int8 activations are quantized per row over the same values: the same result.
        torch.testing.assert_close(
            got.float(), full.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4
        )
    readout = DraftReadout(model, rows)
    assert readout.size == len(rows)
    assert readout.tokens(torch.tensor([2, 0])).tolist() == [17, 0]


def test_tile_rows_undo_the_amx_layout() -> None:
    """`_tile_rows` reads rows out of `amx_pack`'s layout (built here with the kernel's own
    permutation, so it runs without AMX too)."""
    n, k = 70, 96
    w = torch.randn(n, k).bfloat16()
    np_, kp = 96, 96
    padded = torch.zeros(np_, kp, dtype=torch.bfloat16)
    padded[:n, :k] = w
    tiles = padded.view(np_ // 32, 2, 16, kp // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    tiles = tiles.view(np_ // 32, kp // 32, 2, 16, 32)
    rows = torch.tensor([0, 15, 16, 31, 32, 69])
    assert torch.equal(dv._tile_rows(tiles, rows, k), w[rows])


def test_fp8_and_gemma_softcap_read_outs() -> None:
    from tandem.model.fp8_linear import Fp8Linear

    torch.manual_seed(2)
    q = (torch.randn(40, 16) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(40) + 0.5

    def matmul(a, b, scale_a, scale_b, out_dtype):  # torch._scaled_mm's contract, in float
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    model = _Target(Fp8Linear(q, scale, None, matmul), vocab=40, hidden=16)
    model.final_softcap = 3.0
    rows = torch.tensor([1, 5, 39])
    readout = DraftReadout(model, rows)
    assert isinstance(readout.linear, Fp8Linear) and readout.linear.out_features == 3
    x = torch.randn(2, 16)
    full = torch.tanh(model.compute_logits(x) / 3.0) * 3.0
    want = torch.log_softmax(full[:, rows], dim=-1)
    torch.testing.assert_close(readout.logprobs(x), want)


def test_an_lm_head_form_without_a_row_subset_reads_the_whole_head(caplog) -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ torch.ones(x.shape[1], 300)

    caplog.set_level(logging.WARNING, logger="tandem.model")
    readout = DraftReadout(_Target(Odd()), torch.tensor([1, 2]))
    assert readout.linear is None and readout.token_ids is None and readout.size == 300
    assert readout.logprobs(torch.randn(2, 64)).shape == (2, 300)
    assert "whole LM head" in caplog.text


def test_byte_tokens_of_a_byte_level_bpe() -> None:
    from transformers import AutoTokenizer

    from tandem.checkpoints import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    ids = dv.byte_tokens(tok)
    assert len(ids) == 256 and len(set(ids)) == 256
    assert tok.convert_tokens_to_ids("a") in ids and tok.convert_tokens_to_ids("\u0120") in ids  # "a", " "
