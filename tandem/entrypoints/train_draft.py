"""`tandem train-draft`: an EAGLE head or Medusa heads for a target, trained on the target's own
answers (self-distillation; nothing is downloaded).

1. **Data.** The target answers a prompt set greedily (Tandem's engine, float32): by default code
   prompts cut from the Python standard library's package sources (`lib/*/*.py`; the code benchmark
   cuts its prompts from the top-level modules, `tandem.loadgen.datasets.code_dataset`, which this
   set leaves out), the chat set of tandem/loadgen/chat_prompts.py through the model's chat
   template (`--prompts chat`, or `chat+code` for both), or the lines of `--prompts FILE` (plain
   text, or JSONL with a "prompt" field).
   Then one plain-torch forward of the target over each prompt + answer records its last hidden
   state (after the final norm: what its LM head reads) at every position.
2. **Training.** EAGLE: row p is (feature p, token p + 1); the head predicts feature p + 1, with a
   smooth-L1 loss against the target's and a cross-entropy of its logits (through the target's LM
   head) against the target's distribution there; the input features carry uniform noise, as
   EAGLE's training does, so the head tolerates its own predictions when it drafts deeper; with
   `--unroll D` it also trains D - 1 further depths on its own predicted features. Medusa:
   head k over feature p, cross-entropy against the target's distribution for token p + 1 + k.
   Adam with a linear decay; a tqdm bar shows the loss and the top-1 agreement.
3. **Checkpoints.** Every `--save-every` steps and at the end: the head folder (config.json,
   model.safetensors, training.json) and, under `OUT/.train/`, the recorded data and the optimizer
   state, so `--resume` goes on where a run stopped (or past its end, with a larger `--steps`).
4. **Draft vocabulary.** The answers' tokens, counted, go into the head folder's draft_vocab.json
   (tandem/model/draft_vocab.py: the rows the head's read-out multiplies, `draft_vocab_size`) before
   training starts. `--vocab-only` writes just that file for an existing head: from the answers
   recorded under `OUT/.train/` when they are there, else from new ones (no features, no training).
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch and numpy are imported where used: the CLI builds this command's parser on every start.
STATE_DIR = ".train"
# Built-in prompt sets for --prompts: stdlib code, the chat set of tandem/loadgen/chat_prompts.py
# (through the tokenizer's chat template), or both.
PROMPT_SETS = ("code", "chat", "chat+code")
PROMPT_SOURCES = {
    "code": "python stdlib package sources (lib/*/*.py)",
    "chat": "tandem/loadgen/chat_prompts.py train split, chat template",
    "chat+code": "2/3 tandem/loadgen/chat_prompts.py train split (chat template), 1/3 stdlib code",
}


@dataclass(frozen=True)
class TrainConfig:
    model: str
    method: str
    out: str | None = None  # unset: beside the target, where the engine looks (head_folder)
    prompts: str | None = None
    steps: int = 600
    resume: bool = False
    num_prompts: int = 192
    prompt_tokens: int = 96
    answer_tokens: int = 160
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1e-3
    medusa_heads: int = 4
    noise: float = 0.1
    save_every: int = 100
    seed: int = 0
    threads: int | None = None
    unroll: int = 1  # EAGLE: depths trained on the head's own predictions (1: teacher forcing only)
    ce_rows: int = 0  # EAGLE: rows per step through the LM head's cross-entropy (0: every row)
    answer_dtype: str = "float32"  # the answering engine's dtype ("auto": as served, e.g. packed GGUF)
    vocab_only: bool = False  # write draft_vocab.json only (from recorded answers, else new ones)

    def validate(self) -> None:
        if self.method not in ("eagle", "medusa"):
            raise ValueError(f"--method must be eagle or medusa, got {self.method!r}")
        for name in (
            "steps",
            "num_prompts",
            "prompt_tokens",
            "answer_tokens",
            "batch_size",
            "seq_len",
            "medusa_heads",
            "save_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.seq_len < 3:
            raise ValueError("--seq-len must be at least 3")
        if self.unroll < 1 or self.unroll > self.seq_len - 2:
            raise ValueError(f"--unroll must be in [1, seq_len - 2], got {self.unroll}")
        if self.ce_rows < 0:
            raise ValueError(f"--ce-rows must be at least 0, got {self.ce_rows}")


def code_prompts(tokenizer: Any, n: int, tokens: int, seed: int) -> list[list[int]]:
    """Prompts of about `tokens` tokens cut at seeded offsets from the standard library's package
    sources (not the top-level modules the code benchmark draws from)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in lib.glob("*/*.py")
        if p.is_file() and p.stat().st_size > 4000 and "test" not in p.parent.name and "idlelib" not in str(p)
    )
    if not files:
        raise ValueError(f"no Python sources under {lib} to cut prompts from: pass --prompts FILE")
    import numpy as np

    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    while len(out) < n:
        text = files[int(rng.integers(len(files)))].read_text(errors="ignore")
        start = int(rng.integers(0, max(1, len(text) - tokens * 12)))
        # Start at a line, as a completion would.
        start = text.rfind("\n", 0, start) + 1
        ids = tokenizer.encode(text[start : start + tokens * 12], add_special_tokens=False)[:tokens]
        if len(ids) >= tokens // 2:
            out.append(list(ids))
    return out


def file_prompts(path: str, tokenizer: Any, n: int) -> list[list[int]]:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    texts = []
    for line in lines:
        if line.lstrip().startswith("{"):
            try:
                texts.append(str(json.loads(line)["prompt"]))
                continue
            except (ValueError, KeyError, TypeError):
                pass
        texts.append(line)
    if not texts:
        raise ValueError(f"--prompts {path}: no prompts")
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts[:n]]


def head_folder(model_dir: str, method: str) -> Path:
    """Where the engine finds a head given no folder (engine/core.py's default_head_path): beside
    the target's folder, `<target>-<method>`; for a pulled GGUF model, in the model cache beside
    the folder prepared from its file."""
    folder = Path(model_dir)
    return folder.with_name(f"{folder.name}-{method}")


def build_prompts(cfg: TrainConfig, tokenizer: Any) -> list[list[int]]:
    """The prompt set `--prompts` names: a built-in set (PROMPT_SETS) or a file."""
    source = cfg.prompts or "code"
    if source not in PROMPT_SETS:
        return file_prompts(source, tokenizer, cfg.num_prompts)
    from tandem.loadgen.chat_prompts import chat_messages, chat_prompt_ids

    # "chat+code": two thirds chat (a quarter of it programming requests), a third raw code.
    n_chat = {"code": 0, "chat": cfg.num_prompts, "chat+code": cfg.num_prompts * 2 // 3}[source]
    chat = chat_prompt_ids(tokenizer, chat_messages(n_chat, cfg.seed, "train")) if n_chat else []
    code = code_prompts(tokenizer, cfg.num_prompts - n_chat, cfg.prompt_tokens, cfg.seed)
    # Interleaved, so the held-out tail (the last sequences) holds both kinds.
    mixed = chat + code
    import numpy as np

    order = np.random.default_rng(cfg.seed).permutation(len(mixed))
    return [mixed[int(i)] for i in order]


class _TrainAttention:
    """Attention over [B, L] windows, for training the head's layer (no KV cache).

    The d-th call since `past` was cleared is depth d of an unrolled step: row p of depth d stands
    for a node d - 1 deep in a draft, so it sees what that node sees when drafting: the context's
    rows up to p - d + 1 (depth 1's, computed from the target's features) and its ancestors, row
    p - (d - e) of each depth e in 2..d (itself at e = d). Depth 1 alone is plain causal attention.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.shape = (1, 1)
        self.past: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q, k, v, kv_cache, batch, layer=None):
        import torch
        import torch.nn.functional as F

        b, n = self.shape
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        self.past.append((k, v))
        d = len(self.past)
        if d == 1:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            p = torch.arange(n)[:, None]
            j = torch.arange(n)[None, :]
            mask = torch.cat([j <= p - (d - 1)] + [j == p - (d - e) for e in range(2, d + 1)], dim=1)
            keys = torch.cat([kk for kk, _ in self.past], dim=2)
            values = torch.cat([vv for _, vv in self.past], dim=2)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(b * n, self.num_heads, self.head_dim)


@dataclass
class _Positions:
    positions: torch.Tensor


def _plain_modules(module: torch.nn.Module) -> None:
    """Autograd-friendly paths: no compiled (inference-only) kernels on this instance."""
    from tandem.model.layers import GatedMLP, RMSNorm
    from tandem.model.llama import Attention

    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.fused = False
        elif isinstance(m, Attention):
            m.fused_rope = False
        elif isinstance(m, GatedMLP):
            m.fused = False
            m.gate_up_silu = None


def _answer(cfg: TrainConfig, model_dir: str, log: Any) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and the target's greedy answers to them."""
    from transformers import AutoTokenizer

    from tandem import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = build_prompts(cfg, tok)
    log(f"generating the target's answers to {len(prompts)} prompts ...")
    llm = LLM(model_dir, dtype=cfg.answer_dtype, num_threads=cfg.threads, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=cfg.answer_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return prompts, [list(o.outputs[0].token_ids) for o in outs]


def _recorded_answers(
    data: dict[str, Any], cfg: TrainConfig, model_dir: str
) -> tuple[list[list[int]], list[list[int]]] | None:
    """Prompts and answers of recorded sequences (prompt + answer): split at `prompt_lens`, or, for
    data recorded before it was kept, at the prompts these flags build, when every sequence starts
    with its own; None when they do not."""
    seqs = [t.tolist() for t in data["tokens"]]
    lens = data.get("prompt_lens")
    if lens is None:
        from transformers import AutoTokenizer

        prompts = build_prompts(cfg, AutoTokenizer.from_pretrained(model_dir))
        if len(prompts) != len(seqs) or any(s[: len(p)] != p for s, p in zip(seqs, prompts)):
            return None
        lens = [len(p) for p in prompts]
    return [s[:n] for s, n in zip(seqs, lens)], [s[n:] for s, n in zip(seqs, lens)]


def write_vocab(
    out: Path, model_dir: str, prompts: list[list[int]], answers: list[list[int]], source: str, log: Any
) -> Path:
    """The head folder's draft_vocab.json from the target's answers (and prompts)."""
    from transformers import AutoTokenizer

    from tandem.config import ModelConfig
    from tandem.model.draft_vocab import byte_tokens, write_draft_vocab

    mc = ModelConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    special = {*tok.all_special_ids, *mc.eos_token_ids}
    file = write_draft_vocab(out, mc.vocab_size, answers, prompts, special, source, byte_tokens(tok))
    seen = len({t for a in answers for t in a})
    log(f"wrote {file}: {sum(map(len, answers))} answer tokens, {seen} distinct, of {mc.vocab_size}")
    return file


def _record(cfg: TrainConfig, model_dir: str, log: Any) -> dict[str, Any]:
    """The target's answers to the prompts, and its features over prompt + answer."""
    import torch

    from tandem.config import ModelConfig
    from tandem.core.kv_cache_manager import KVCacheManager
    from tandem.core.request import Request
    from tandem.model.kv_quant import KVCacheFormat
    from tandem.model.loader import load_model
    from tandem.worker.batch import build_batch

    prompts, answers = _answer(cfg, model_dir, log)
    seqs = [p + a for p, a in zip(prompts, answers)]
    mc = ModelConfig.from_pretrained(model_dir)
    longest = max(len(s) for s in seqs)
    plain = load_model(mc, torch.float32, torch.device("cpu"), "torch", longest + 1, cpu_kernels=False)
    bs = 16
    blocks = -(-longest // bs)
    fmt = KVCacheFormat("auto", torch.float32)
    caches = [
        fmt.allocate(blocks, bs, mc.num_kv_heads, mc.head_dim, torch.device("cpu"))
        for _ in range(mc.num_layers)
    ]
    from tqdm import tqdm

    from tandem.sampling_params import SamplingParams as SP

    feats = []
    with torch.inference_mode():
        for s in tqdm(seqs, desc="recording features"):
            req = Request("record", s, SP(), max_tokens=1)
            kv = KVCacheManager(blocks, bs)
            if not kv.allocate_slots(req, len(s), []):
                raise RuntimeError(f"{len(s)} tokens do not fit {blocks} blocks of {bs}")
            batch, _ = build_batch([req], [len(s)], bs, torch.device("cpu"))
            plain.backend.prepare(batch)
            feats.append(plain(batch, caches).to(torch.float16))
    return {
        "tokens": [torch.tensor(s) for s in seqs],
        "features": feats,
        "num_prompts": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
    }


def train(cfg: TrainConfig, log: Any = print) -> dict[str, Any]:
    """Train (or resume) and write the head folder; returns what training.json records."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from tandem.checkpoints.resolve import resolve_model
    from tandem.config import ModelConfig
    from tandem.model.draft_heads import HeadConfig, build_head, save_head
    from tandem.model.layers import RotaryEmbedding
    from tandem.model.loader import load_model

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model).path
    out = Path(cfg.out) if cfg.out else head_folder(model_dir, cfg.method)
    state_dir = out / STATE_DIR
    state_file, data_file = state_dir / "state.pt", state_dir / "data.pt"
    if cfg.resume and not state_file.is_file():
        raise ValueError(f"--resume: no training state in {state_dir}")
    source = PROMPT_SOURCES.get(cfg.prompts or "code", cfg.prompts or "")
    if cfg.vocab_only:
        split = None
        if data_file.is_file():
            split = _recorded_answers(torch.load(data_file), cfg, model_dir)
            if split is None:
                log(f"{data_file}: its prompts are not the ones these flags build; answering anew")
            else:
                log(f"counting the answers recorded in {data_file}")
        prompts, answers = split or _answer(cfg, model_dir, log)
        write_vocab(out, model_dir, prompts, answers, source, log)
        return {}
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if cfg.resume or data_file.is_file():
        data = torch.load(data_file)
        log(f"recorded data from {data_file}: {len(data['tokens'])} sequences")
    else:
        data = _record(cfg, model_dir, log)
        torch.save(data, data_file)
    split = _recorded_answers(data, cfg, model_dir)
    if split is None:
        log(f"{data_file}: its prompts are not the ones these flags build; draft_vocab.json not written")
    else:
        write_vocab(out, model_dir, *split, source, log)
    mc = ModelConfig.from_pretrained(model_dir)
    plain = load_model(mc, torch.float32, torch.device("cpu"), "torch", cfg.seq_len + 1, cpu_kernels=False)
    for p in plain.parameters():  # type: ignore[attr-defined]
        p.requires_grad_(False)
    embed = plain.embed_tokens  # type: ignore[attr-defined]
    hc = HeadConfig(cfg.method, mc.hidden_size, mc.vocab_size, num_heads=cfg.medusa_heads)
    attn = _TrainAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim)
    rotary = RotaryEmbedding(mc.head_dim, cfg.seq_len + 1, mc.rope, torch.device("cpu"))
    head = build_head(hc, mc, attn, rotary)
    _plain_modules(head)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    step = 0
    if cfg.resume:
        saved = torch.load(state_file)
        if saved["method"] != cfg.method:
            raise ValueError(f"--resume: {state_dir} holds a {saved['method']} run, not {cfg.method}")
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
        torch.set_rng_state(saved["rng"])
        log(f"resuming at step {step}")
    tokens, features = data["tokens"], data["features"]
    # The last sequences are held out for the agreement reported at the end.
    held = max(1, len(tokens) // 16)
    lengths = sorted(len(tokens[i]) for i in range(len(tokens) - held))
    # Windows of seq_len tokens, shorter where most answers ended early (at EOS).
    L = max(3, min(cfg.seq_len, lengths[len(lengths) // 4]))
    train_ids = [i for i in range(len(tokens) - held) if len(tokens[i]) >= L]
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    started = time.perf_counter()
    stats: dict[str, Any] = {}

    def batch_of(ids: list[int], offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.stack([tokens[i][o : o + L] for i, o in zip(ids, offsets)])
        feats = torch.stack([features[i][o : o + L] for i, o in zip(ids, offsets)]).float()
        return toks, feats

    def losses(
        toks: torch.Tensor, feats: torch.Tensor, noise: float, ce_rows: int = 0
    ) -> tuple[torch.Tensor, list[float]]:
        """The loss and the top-1 agreement with the target per depth (per head for Medusa)."""
        b = toks.shape[0]
        if cfg.method == "eagle":
            n = L - 1
            attn.shape, attn.past = (b, n), []
            # The cross-entropy through the LM head (a vocabulary-wide product per row, forward and
            # back) costs most of a step on a large vocabulary: with ce_rows it takes that many rows
            # a step, the same rows at every depth; rows too early for the deepest depth are out.
            valid = torch.arange(cfg.unroll - 1, n)
            rows = torch.stack([valid + i * n for i in range(b)]).reshape(-1)
            if ce_rows and ce_rows < len(rows):
                rows = rows[torch.randperm(len(rows), generator=gen)[:ce_rows]]
            target_f = feats[:, 1:].reshape(-1, mc.hidden_size)
            with torch.no_grad():
                target_p = torch.log_softmax(plain.compute_logits(target_f[rows]), dim=-1).exp()
            emb = embed(toks[:, 1:]).reshape(-1, mc.hidden_size)
            pos = _Positions(torch.arange(n).repeat(b))
            x = feats[:, :-1]
            if noise:
                x = x + (torch.rand(x.shape, generator=gen) - 0.5) * 2 * noise * x.abs().mean()
            x = x.reshape(-1, mc.hidden_size)
            total = torch.zeros(())
            agrees = []
            for depth in range(cfg.unroll):
                # Depth d + 1 reads the head's own depth-d predictions (row p: its prediction for
                # feature p), as drafting deeper does: EAGLE-3's training-time test, with the
                # attention of _TrainAttention giving each row the context and its ancestors only.
                g = head(emb, x, pos, None)
                reg = F.smooth_l1_loss(g.view(b, n, -1)[:, depth:], target_f.view(b, n, -1)[:, depth:])
                logp = torch.log_softmax(plain.compute_logits(g[rows]), dim=-1)
                ce = -(target_p * logp).sum(-1).mean()
                total = total + (0.8**depth) * (reg + 0.1 * ce)
                agrees.append((logp.argmax(-1) == target_p.argmax(-1)).float().mean().item())
                x = torch.cat((g.view(b, n, -1)[:, :1], g.view(b, n, -1)[:, :-1]), dim=1).reshape(
                    -1, mc.hidden_size
                )
            return total, agrees
        with torch.no_grad():
            teacher = torch.log_softmax(plain.compute_logits(feats), dim=-1)
        hs = head(feats.reshape(-1, mc.hidden_size)).view(len(head.heads), b, L, -1)  # type: ignore[arg-type]
        total = torch.zeros(())
        agree = 0.0
        for k in range(len(head.heads)):  # type: ignore[arg-type]
            n = L - 1 - k
            logp = torch.log_softmax(plain.compute_logits(hs[k, :, :n]), dim=-1)
            target_p = teacher[:, 1 + k : 1 + k + n]
            total = total + (0.8**k) * -(target_p.exp() * logp).sum(-1).mean()
            if k == 0:
                agree = (logp.argmax(-1) == target_p.argmax(-1)).float().mean().item()
        return total, [agree]

    def save(done: int) -> None:
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": opt.state_dict(),
                "step": done,
                "method": cfg.method,
                "rng": torch.get_rng_state(),
            },
            state_file,
        )
        extra = {"training": {"steps": done, **stats}}
        save_head(head, out, cfg.method, mc, extra=None)
        (out / "training.json").write_text(json.dumps(extra["training"], indent=2) + "\n")

    bar = tqdm(total=cfg.steps, initial=step, desc=f"training {cfg.method} head")
    ema_loss = ema_agree = None
    while step < cfg.steps:
        lr = cfg.learning_rate * min(1.0, (step + 1) / 20) * max(0.05, 1 - step / cfg.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = [train_ids[int(j)] for j in torch.randint(len(train_ids), (cfg.batch_size,), generator=gen)]
        offsets = [int(torch.randint(len(tokens[i]) - L + 1, (), generator=gen)) for i in ids]
        loss, agree_by_depth = losses(*batch_of(ids, offsets), cfg.noise, cfg.ce_rows)
        agree = agree_by_depth[0]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
        ema_agree = agree if ema_agree is None else 0.9 * ema_agree + 0.1 * agree
        bar.set_postfix(loss=f"{ema_loss:.3f}", top1=f"{ema_agree:.3f}")
        bar.update(1)
        if step % cfg.save_every == 0 and step < cfg.steps:
            save(step)
    bar.close()
    # Agreement with the target's argmax on the held-out sequences (first head for Medusa; for
    # EAGLE trained with --unroll, at each depth of its own predictions too).
    held_ids = list(range(len(tokens) - held, len(tokens)))
    with torch.no_grad():
        agrees = [losses(*batch_of([i], [0]), 0.0)[1] for i in held_ids if len(tokens[i]) >= L]
    by_depth = np.mean(agrees, axis=0) if agrees else [math.nan]
    stats.update(
        held_out_top1=round(float(by_depth[0]), 4),
        held_out_top1_by_depth=[round(float(a), 4) for a in by_depth],
        train_top1_ema=round(float(ema_agree or 0.0), 4),
        sequences=len(tokens),
        prompts=int(data["num_prompts"]),
        batch_size=cfg.batch_size,
        seq_len=L,
        prompt_tokens=cfg.prompt_tokens,
        answer_tokens=cfg.answer_tokens,
        learning_rate=cfg.learning_rate,
        unroll=cfg.unroll,
        ce_rows=cfg.ce_rows,
        noise=cfg.noise,
        answer_dtype=cfg.answer_dtype,
        seconds_this_run=round(time.perf_counter() - started, 1),
        prompt_source=PROMPT_SOURCES.get(cfg.prompts or "code", cfg.prompts),
    )
    if cfg.method == "medusa":
        stats["medusa_heads"] = cfg.medusa_heads
    save(step)
    log(f"wrote {out} (held-out top-1 agreement {stats['held_out_top1']})")
    return stats


def add_train_draft_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train-draft",
        help="train an EAGLE head or Medusa heads on the target's own answers (self-distillation)",
    )
    p.add_argument(
        "--model", default=None, help="the target (folder or pulled name; unset: the embedded model)"
    )
    p.add_argument("--method", required=True, choices=["eagle", "medusa"], help="which head to train")
    p.add_argument(
        "--out",
        default=None,
        help="the head folder to write (unset: beside the target's folder, where the engine finds it)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="a built-in set: code (the default), chat (through the chat template), chat+code; "
        "or a file, one prompt a line (or JSONL with 'prompt')",
    )
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimizer steps in all")
    p.add_argument("--resume", action="store_true", help="go on from OUT/.train (data and optimizer state)")
    p.add_argument(
        "--num-prompts", type=int, default=TrainConfig.num_prompts, help="prompts the target answers"
    )
    p.add_argument("--answer-tokens", type=int, default=TrainConfig.answer_tokens, help="tokens per answer")
    p.add_argument(
        "--batch-size", type=int, default=TrainConfig.batch_size, help="windows per optimizer step"
    )
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len, help="tokens per training window")
    p.add_argument(
        "--learning-rate", type=float, default=TrainConfig.learning_rate, help="Adam's, decayed linearly"
    )
    p.add_argument("--medusa-heads", type=int, default=TrainConfig.medusa_heads, help="Medusa: tokens ahead")
    p.add_argument("--save-every", type=int, default=TrainConfig.save_every, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=TrainConfig.seed, help="prompt choice and training order")
    p.add_argument("--threads", type=int, default=None, help="torch threads (unset: torch's default)")
    p.add_argument(
        "--answer-dtype",
        default=TrainConfig.answer_dtype,
        help="dtype of the engine answering the prompts (auto: as served, a GGUF file's 4-bit blocks "
        "packed; faster than float32 on a large model)",
    )
    p.add_argument(
        "--unroll",
        type=int,
        default=TrainConfig.unroll,
        help="EAGLE: depths trained on the head's own predicted features (1: the target's only)",
    )
    p.add_argument(
        "--ce-rows",
        type=int,
        default=TrainConfig.ce_rows,
        help="EAGLE: rows a step through the LM head's cross-entropy (0: all; large vocabularies)",
    )
    p.add_argument(
        "--vocab-only",
        action="store_true",
        help="write only the head folder's draft_vocab.json (the tokens the target emits, counted): "
        "from the answers recorded in OUT/.train when there, else the target answers the prompts anew",
    )
    p.set_defaults(func=_train_draft)


def _train_draft(args: Any) -> int:
    from tandem.entrypoints.llm import default_model_path

    train(
        TrainConfig(
            model=args.model or default_model_path(),
            method=args.method,
            out=args.out,
            prompts=args.prompts,
            steps=args.steps,
            resume=args.resume,
            num_prompts=args.num_prompts,
            answer_tokens=args.answer_tokens,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            learning_rate=args.learning_rate,
            medusa_heads=args.medusa_heads,
            save_every=args.save_every,
            seed=args.seed,
            threads=args.threads,
            unroll=args.unroll,
            ce_rows=args.ce_rows,
            answer_dtype=args.answer_dtype,
            vocab_only=args.vocab_only,
        )
    )
    return 0
