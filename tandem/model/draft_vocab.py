"""A reduced draft vocabulary for the draft heads' read-out (the idea of FR-Spec and EAGLE-3's
draft vocabulary).

An EAGLE or Medusa head turns each predicted feature into draft tokens through the target's LM
head: on a large vocabulary that product reads the whole `vocab_size x hidden` matrix on every head
pass. Drafting only needs the tokens the target is likely to emit, so the head's read-out multiplies only those rows (`DraftReadout`): a layer of the same
kind as the target's LM head (int8 with its per-row scales, packed 4-bit groups, fp8, oneDNN /
AMX-packed float, plain float) built from the selected rows at load, never a copy of the whole head.
Head passes compute logits over the subset and map indices back to token ids.

Which tokens: the head folder's `draft_vocab.json`, written by `tandem train-draft` (or `--vocab-only`
for an existing head) from the target's own answers: every token seen, ranked by its count in the
answers, then in the prompts, then by id. The subset is the target's special tokens (EOS and the
like, always in), its single-byte tokens (a byte-level BPE's 256, or `<0xNN>` byte fallbacks: with
them any text can be drafted, and a small model's emoji runs are made of them), then the ranking's
first tokens, then the lowest ids not yet taken (a BPE vocabulary's earliest merges, its commonest
pieces) up to `draft_vocab_size`.

Verification is unchanged: drafts are deterministic proposals (top-k of the subset's logits), so
rejection sampling's q is one-hot at the proposed token, zero outside the subset, and the output
distribution stays the target's (greedy output identical to speculation off).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("tandem.model")

DRAFT_VOCAB_FILE = "draft_vocab.json"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class DraftVocab:
    """What a head folder's draft_vocab.json holds."""

    vocab_size: int
    # Every token seen, best first: by count in the answers, then in the prompts, then by id.
    token_ids: tuple[int, ...]
    answer_counts: tuple[int, ...]
    prompt_counts: tuple[int, ...]
    special_token_ids: tuple[int, ...]
    # The tokenizer's single-byte tokens (empty where it has none or the file predates them).
    byte_token_ids: tuple[int, ...] = ()


def byte_tokens(tokenizer: Any) -> list[int]:
    """Ids of a tokenizer's single-byte tokens: a byte-level BPE's alphabet (GPT-2's printable
    stand-ins for the 256 bytes) or SentencePiece's `<0xNN>` byte fallbacks."""
    # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    # for the characters from U+0100 on, in byte order.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b) for b in printable} | {chr(256 + n) for n in range(len(others))}
    vocab: dict[str, int] = tokenizer.get_vocab()
    # (At most 256 of either kind; a byte-level BPE may lack bytes UTF-8 never uses: SmolLM2 has 235.)
    return sorted(
        i for piece, i in vocab.items() if piece in alphabet or re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece)
    )


def rank_tokens(
    answers: Iterable[Sequence[int]], prompts: Iterable[Sequence[int]]
) -> list[tuple[int, int, int]]:
    """(token id, count in the answers, count in the prompts) for every token seen, best first."""
    in_answers: Counter[int] = Counter()
    in_prompts: Counter[int] = Counter()
    for seq in answers:
        in_answers.update(int(t) for t in seq)
    for seq in prompts:
        in_prompts.update(int(t) for t in seq)
    seen = set(in_answers) | set(in_prompts)
    return sorted(((t, in_answers[t], in_prompts[t]) for t in seen), key=lambda r: (-r[1], -r[2], r[0]))


def write_draft_vocab(
    folder: str | Path,
    vocab_size: int,
    answers: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    special_token_ids: Iterable[int],
    source: str,
    byte_token_ids: Iterable[int] = (),
) -> Path:
    """Count the target's answers (and prompts) and write `folder/draft_vocab.json`."""
    ranked = [r for r in rank_tokens(answers, prompts) if 0 <= r[0] < vocab_size]
    data: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "source": source,
        "answers": len(answers),
        "answer_tokens": sum(len(a) for a in answers),
        "prompt_tokens": sum(len(p) for p in prompts),
        "special_token_ids": sorted({int(t) for t in special_token_ids if 0 <= int(t) < vocab_size}),
        "byte_token_ids": sorted({int(t) for t in byte_token_ids if 0 <= int(t) < vocab_size}),
        "token_ids": [r[0] for r in ranked],
        "answer_counts": [r[1] for r in ranked],
        "prompt_counts": [r[2] for r in ranked],
    }
    out = Path(folder) / DRAFT_VOCAB_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    # One token a line of the lists would be 150k lines on a large vocabulary: compact lists.
    out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return out


def read_draft_vocab(folder: str | Path) -> DraftVocab | None:
    """The folder's draft vocabulary, None when it has none."""
    file = Path(folder) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
        vocab = DraftVocab(
            vocab_size=int(raw["vocab_size"]),
            token_ids=tuple(int(t) for t in raw["token_ids"]),
            answer_counts=tuple(int(c) for c in raw["answer_counts"]),
            prompt_counts=tuple(int(c) for c in raw["prompt_counts"]),
            special_token_ids=tuple(int(t) for t in raw.get("special_token_ids", ())),
            byte_token_ids=tuple(int(t) for t in raw.get("byte_token_ids", ())),
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{file}: not a draft vocabulary ({exc}); `tandem train-draft --vocab-only` writes one"
        ) from exc
    if len(vocab.answer_counts) != len(vocab.token_ids) or len(vocab.prompt_counts) != len(vocab.token_ids):
        raise ValueError(f"{file}: token_ids and the counts differ in length")
    return vocab


def select_tokens(vocab: DraftVocab, vocab_size: int, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` token ids of the draft vocabulary, ascending: the special tokens (`always` and the
    file's), the single-byte tokens, the ranking's first ones, then the lowest ids not yet taken."""
    if vocab.vocab_size != vocab_size:
        raise ValueError(
            f"the draft vocabulary was counted for a vocabulary of {vocab.vocab_size}, the target has {vocab_size}"
        )
    chosen: dict[int, None] = {}
    for t in (*always, *vocab.special_token_ids, *vocab.byte_token_ids, *vocab.token_ids):
        if len(chosen) >= size:
            break
        if 0 <= t < vocab_size:
            chosen.setdefault(t)
    t = 0
    while len(chosen) < size:
        chosen.setdefault(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(
    vocab: DraftVocab, vocab_size: int, size: int, tokens: Iterable[int], always: Iterable[int] = ()
) -> float:
    """The share of `tokens` (e.g. a held-out answer set) inside the first `size` draft tokens."""
    chosen = set(select_tokens(vocab, vocab_size, size, always).tolist())
    toks = list(tokens)
    return sum(t in chosen for t in toks) / max(1, len(toks))


# -- the read-out ----------------------------------------------------------------------------------


def _tile_rows(tiles: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of a bfloat16 weight from AMX tiles (`amx_pack`'s layout, tandem/kernels/amx_ops.cpp:
    [panel, block, tile, row, column x value]), gathered without unpacking the rest."""
    panels, blocks, _, tile_rows, width = tiles.shape
    group = width // tile_rows  # values per 4 bytes: 2 in bfloat16
    view = tiles.view(panels, blocks, 2, tile_rows, tile_rows, group).permute(0, 2, 4, 1, 3, 5)
    panel, rest = rows // 32, rows % 32
    picked = view[panel, rest // 16, rest % 16]  # [rows, blocks, tile rows, group]
    return picked.reshape(len(rows), -1)[:, :k].contiguous()


def sub_linear(model: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A layer computing `rows` of `model`'s LM head, in the form the target's head runs in."""
    from tandem.model.fp8_linear import Fp8Linear
    from tandem.model.int4 import Int4Linear
    from tandem.model.linear import PackedLinear
    from tandem.model.panels import unpack_panels
    from tandem.model.quant import Int8Linear

    head = getattr(model, "lm_head", None)
    ids = rows.cpu()

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.detach()[ids.to(t.device)].contiguous()

    def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else pick(t)

    def dense(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
        out = nn.Linear(
            weight.shape[1], len(ids), bias=bias is not None, device=weight.device, dtype=weight.dtype
        )
        out.weight = nn.Parameter(pick(weight), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(pick(bias), requires_grad=False)
        return out

    if head is None:  # tied and kept as the embedding: F.linear over its rows, as the target does
        embed = model.get_submodule("embed_tokens")
        assert isinstance(embed, nn.Embedding)
        return dense(embed.weight, None)
    if isinstance(head, Int8Linear):
        return Int8Linear.from_int8(pick(head.int8_weight()), pick(head.scale), maybe(head.bias), head.use_kernel)
    if isinstance(head, Int4Linear):
        qweight, scales, zs = head.weight_parts()
        layer = Int4Linear.from_packed(
            pick(qweight),
            pick(scales),
            maybe(zs),
            head.group_size,
            maybe(head.bias),
            use_kernel=None if head.use_kernels else False,
        )
        if head.in_perm is not None:
            layer.in_perm = head.in_perm
            layer.bind_tensors()
        return layer
    if isinstance(head, Fp8Linear):
        scale = head.scale.reshape(-1)
        return Fp8Linear(pick(head.qweight), pick(scale), maybe(head.bias), head._matmul)
    if isinstance(head, PackedLinear):
        if head.plain is not None:
            weight = pick(head.plain)
        elif head.panels is not None:
            weight = pick(unpack_panels(head.panels, head.out_features))
        elif head.tiles is not None:
            weight = _tile_rows(head.tiles, ids, head.in_features)
        else:  # oneDNN's layout alone (memory was short): its dense form, briefly
            weight = head.packed.to_dense()[ids].contiguous()  # type: ignore[union-attr]
        return PackedLinear(weight, maybe(head.bias), head.second_copy)
    if isinstance(head, nn.Linear):
        return dense(head.weight, head.bias)
    raise TypeError(f"no row-subset form of an LM head of type {type(head).__name__}")


class DraftReadout:
    """Logits of the draft tokens: the target's whole LM head (`token_ids` None) or a layer over
    the draft vocabulary's rows, plus the target's final soft-cap where it has one (Gemma)."""

    def __init__(self, model: Any, token_ids: torch.Tensor | None) -> None:
        self.model = model
        self.linear: nn.Module | None = None
        if token_ids is not None:
            try:
                self.linear = sub_linear(model, token_ids)
                token_ids = token_ids.to(next(model.parameters()).device)
            except TypeError as exc:  # an LM head form with no row subset: drafting still works
                logger.warning("draft vocabulary unused, the read-out multiplies the whole LM head: %s", exc)
                token_ids = None
        self.token_ids = token_ids
        self.softcap = getattr(model, "final_softcap", None)

    @property
    def size(self) -> int:
        """Tokens the read-out computes a logit for."""
        if self.token_ids is not None:
            return int(self.token_ids.numel())
        return int(self.model.config.vocab_size)

    def logprobs(self, features: torch.Tensor) -> torch.Tensor:
        """[N, size] float32 log-probabilities over the draft tokens (renormalized over the subset)."""
        if self.linear is None:
            logits = self.model.compute_logits(features)
        else:
            logits = self.linear(features)
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
        return F.log_softmax(logits.float(), dim=-1)

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of read-out columns."""
        return index if self.token_ids is None else self.token_ids[index.to(self.token_ids.device)]


def draft_token_ids(
    head_folder: str | Path, vocab_size: int, size: int, always: Iterable[int] = ()
) -> torch.Tensor | None:
    """The draft vocabulary's token ids for `size` (None: the whole vocabulary, as for 0, a size
    no smaller than the vocabulary, or a head folder without draft_vocab.json, logged: this runs
    once as a drafter loads)."""
    if size <= 0 or size >= vocab_size:
        return None
    vocab = read_draft_vocab(head_folder)
    if vocab is None:
        logger.warning(
            "draft head %s has no %s: its read-out multiplies the whole vocabulary (%d tokens); "
            "`tandem train-draft --vocab-only` writes one",
            head_folder,
            DRAFT_VOCAB_FILE,
            vocab_size,
        )
        return None
    return select_tokens(vocab, vocab_size, size, always)
