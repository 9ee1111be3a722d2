"""The `flashinfer` attention backend (tandem/model/flashinfer_backend.py) without FlashInfer:
its page-table planning against the block tables, its tree mask, the import gate, and the backend
driven through a stand-in `flashinfer` module whose wrappers compute attention the way FlashInfer
documents its arguments (CSR page table, causal aligned to the end of the context, `window_left`
inclusive, flattened custom masks, NHD `(k_cache, v_cache)`), compared with the Triton kernel's
torch reference. The `gpu`-marked tests compare the real FlashInfer with the Triton backend.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import numpy as np
import pytest
import torch

from tandem.model.attention import LayerAttention, get_attention_backend
from tandem.model.flashinfer_backend import FlashInferAttentionBackend
from tandem.model.flashinfer_plan import custom_mask, plan_pages
from tandem.model.forward_batch import ForwardBatch

pytest.importorskip("triton")
from test_triton_attention import make_batch, reference

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _slots_from_plan(plan, b: int, block_size: int) -> list[int]:
    pages = plan.kv_indices[plan.kv_indptr[b] : plan.kv_indptr[b + 1]]
    kv_len = (len(pages) - 1) * block_size + int(plan.kv_last_page_len[b])
    return [int(pages[j // block_size]) * block_size + j % block_size for j in range(kv_len)]


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_page_table_gives_each_request_its_blocks_slots(block_size):
    """Ragged requests, prefixes that end on, before and after block edges, tables padded wider
    than any request needs: every position's slot through FlashInfer's table equals the block
    table's, and nothing more."""
    q_lens = [1, 4, 20, 9, 1]
    ctx_lens = [37, 12, 40, 0, block_size * 3 - 1]  # the last request ends exactly on a block edge
    seq_lens = np.array([q + c for q, c in zip(q_lens, ctx_lens)])
    rng = np.random.default_rng(0)
    width = max(math.ceil(s / block_size) for s in seq_lens) + 2
    tables = np.zeros((len(q_lens), width), dtype=np.int32)
    free = rng.permutation(1000)
    at = 0
    for r, s in enumerate(seq_lens):
        n = math.ceil(s / block_size)
        tables[r, :n] = free[at : at + n]
        at += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    plan = plan_pages(qsl, seq_lens, tables, block_size)
    assert plan.qo_indptr.tolist() == qsl.tolist() and not plan.decode_only
    for arr in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len):
        assert arr.dtype == np.int32
    assert ((plan.kv_last_page_len >= 1) & (plan.kv_last_page_len <= block_size)).all()
    assert plan.kv_last_page_len[-1] == block_size
    for b, s in enumerate(seq_lens):
        want = [int(tables[b, j // block_size]) * block_size + j % block_size for j in range(s)]
        assert _slots_from_plan(plan, b, block_size) == want
    assert plan.kv_indptr[-1] == len(plan.kv_indices) == sum(math.ceil(s / block_size) for s in seq_lens)


def test_a_decode_batch_is_marked_and_bad_layouts_are_refused():
    tables = np.array([[3, 0], [5, 6]], dtype=np.int32)
    plan = plan_pages(np.array([0, 1, 2]), np.array([2, 5]), tables, 4)
    assert plan.decode_only and plan.kv_indices.tolist() == [3, 5, 6]
    assert plan.kv_last_page_len.tolist() == [2, 1]
    with pytest.raises(ValueError, match="blocks"):
        plan_pages(np.array([0, 1]), np.array([13]), np.array([[1, 2, 3]]), 4)
    with pytest.raises(ValueError, match="query token"):
        plan_pages(np.array([0, 3]), np.array([2]), np.array([[1]]), 4)


def test_the_custom_mask_is_each_requests_rows_over_its_context():
    """A decode (outside every tree) and a 5-token tree over a 3-token context, with a window:
    the flattened mask against the mask written out by hand from the tree's ancestors."""
    ancestors = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]
    bits = [sum(1 << i for i in a) for a in ancestors]
    tree = torch.tensor([-1, *bits], dtype=torch.int64)
    mask = custom_mask(np.array([1, 5]), np.array([4, 8]), tree, window=6)
    assert mask.dtype == torch.bool and mask.numel() == 1 * 4 + 5 * 8
    assert mask[:4].tolist() == [True] * 4
    rows = mask[4:].view(5, 8)
    for i, anc in enumerate(ancestors):
        pos = 3 + i
        want = [(k > pos - 6) and (k < 3 or (k - 3) in anc) for k in range(8)]
        assert rows[i].tolist() == want, i


def test_without_flashinfer_the_backend_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails whether installed or not
    with pytest.raises(ValueError, match="flashinfer package"):
        get_attention_backend("flashinfer", 4, 2, 16, None)


class _FakeWrapper:
    """FlashInfer's documented semantics in torch, recording each plan."""

    def __init__(self, log: list, kind: str, workspace: torch.Tensor, layout: str, **kw) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.log, self.kind, self.p = log, kind, None

    def plan(self, *args, **kw):
        if self.kind == "decode":
            kv_indptr, kv_indices, last, heads, kv_heads, dim, page = args
            qo_indptr = torch.arange(len(kv_indptr), dtype=torch.int32)
            mask, causal = None, True
        else:
            qo_indptr, kv_indptr, kv_indices, last, heads, kv_heads, dim, page = args
            mask, causal = kw["custom_mask"], kw["causal"]
            assert causal == (mask is None)
        self.p = dict(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            last=last,
            heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            page=page,
            mask=mask,
            **kw,
        )
        self.log.append((self.kind, self.p))

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self.p
        k_cache, v_cache = kv
        page, kvh, dim = p["page"], p["kv_heads"], p["dim"]
        assert k_cache.shape[1:] == (page, kvh, dim) and q.shape[1:] == (p["heads"], dim)
        assert q.dtype == p["q_data_type"] and k_cache.dtype == p["kv_data_type"]
        scale = dim**-0.5 if p["sm_scale"] is None else p["sm_scale"]
        out = torch.empty_like(q)
        m = 0
        for b in range(len(p["kv_indptr"]) - 1):
            pages = p["kv_indices"][p["kv_indptr"][b] : p["kv_indptr"][b + 1]].long()
            kv_len = (len(pages) - 1) * page + int(p["last"][b])
            k = k_cache[pages].reshape(-1, kvh, dim)[:kv_len].double()
            v = v_cache[pages].reshape(-1, kvh, dim)[:kv_len].double()
            a, z = int(p["qo_indptr"][b]), int(p["qo_indptr"][b + 1])
            ql = z - a
            group = p["heads"] // kvh
            s = torch.einsum("qhd,khd->hqk", q[a:z].double(), k.repeat_interleave(group, 1)) * scale
            if p["logits_soft_cap"]:
                s = p["logits_soft_cap"] * torch.tanh(s / p["logits_soft_cap"])
            qi, kj = torch.arange(ql)[:, None], torch.arange(kv_len)[None, :]
            if p["mask"] is not None:
                allowed = p["mask"][m : m + ql * kv_len].view(ql, kv_len)
                m += ql * kv_len
            else:
                allowed = kj + ql <= kv_len + qi
            if p["window_left"] >= 0:
                allowed = allowed & (kj + ql + p["window_left"] >= kv_len + qi)
            s = s.masked_fill(~allowed[None], float("-inf"))
            out[a:z] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(group, 1)).to(
                q.dtype
            )
        return out


def _fake_flashinfer(log: list) -> types.ModuleType:
    fi = types.ModuleType("flashinfer")
    fi.BatchDecodeWithPagedKVCacheWrapper = lambda ws, layout, **kw: _FakeWrapper(
        log, "decode", ws, layout, **kw
    )
    fi.BatchPrefillWithPagedKVCacheWrapper = lambda ws, layout, **kw: _FakeWrapper(
        log, "prefill", ws, layout, **kw
    )
    return fi


def _forward_batch(q_lens, ctx_lens, block_size=16, heads=(4, 2), head_dim=16, tree=None, seed=0):
    q, kc, vc, tables, seq_lens, qsl = make_batch(
        q_lens, ctx_lens, block_size, *heads, head_dim, torch.float32, seed
    )
    slots = []
    for r, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        pos = torch.arange(c, c + ql)
        slots.append(tables[r, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    kv_cache = torch.stack([kc, vc])
    k_new = kc.reshape(-1, heads[1], head_dim)[slot_mapping].clone()
    v_new = vc.reshape(-1, heads[1], head_dim)[slot_mapping].clone()
    kv_cache[:, :].view(2, -1, heads[1], head_dim)[:, slot_mapping] = 0  # forward must write them
    batch = ForwardBatch(
        input_ids=torch.zeros(len(slot_mapping), dtype=torch.long),
        positions=torch.zeros(len(slot_mapping), dtype=torch.long),
        slot_mapping=slot_mapping,
        logits_indices=torch.zeros(0, dtype=torch.long),
        query_start_loc=qsl.numpy(),
        query_lens=np.array(q_lens),
        seq_lens=seq_lens.numpy(),
        block_tables=tables.numpy(),
        block_size=block_size,
        tree_bits=tree,
    )
    return q, k_new, v_new, kv_cache, batch, (kc, vc, tables, seq_lens, qsl)


CASES = {
    "ragged": dict(q_lens=[1, 4, 20, 9], ctx_lens=[37, 12, 40, 0]),
    "decodes-on-block-edges": dict(q_lens=[1, 1, 1], ctx_lens=[15, 16, 31]),
    "window": dict(q_lens=[1, 6, 12], ctx_lens=[70, 40, 3], window=16),
    "softcap-and-scale": dict(q_lens=[1, 7], ctx_lens=[33, 20], softcap=5.0, scale=0.1),
    "tree": dict(q_lens=[1, 5, 5], ctx_lens=[20, 31, 2], tree=True),
    "tree-and-window": dict(q_lens=[5, 30], ctx_lens=[40, 9], tree=True, window=20),
}


def _tree_words(q_lens: list[int]) -> torch.Tensor:
    ancestors = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]
    bits = [sum(1 << i for i in a) for a in ancestors]
    return torch.tensor([w for n in q_lens for w in (bits if n == 5 else [-1] * n)], dtype=torch.int64)


@pytest.mark.parametrize("case", list(CASES))
def test_the_backend_through_flashinfers_documented_semantics_matches_the_reference(case):
    c = dict(CASES[case])
    q_lens, ctx_lens = c.pop("q_lens"), c.pop("ctx_lens")
    tree = _tree_words(q_lens) if c.pop("tree", False) else None
    window, softcap, scale = c.get("window"), c.get("softcap"), c.get("scale")
    log: list = []
    backend = FlashInferAttentionBackend(4, 2, 16, flashinfer=_fake_flashinfer(log))
    q, k, v, kv_cache, batch, (kc, vc, tables, seq_lens, qsl) = _forward_batch(q_lens, ctx_lens, tree=tree)
    backend.prepare(batch)
    layer = LayerAttention(sliding_window=window, softcap=softcap, scale=scale)
    got = backend.forward(q, k, v, kv_cache, batch, layer)
    assert torch.equal(kv_cache[0], kc) and torch.equal(kv_cache[1], vc)  # the step's K/V written
    want = reference(
        q, kc, vc, tables, seq_lens, qsl, scale or 16**-0.5, window=window, softcap=softcap, tree=tree
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # One plan, by the decode wrapper exactly when every request decodes one token outside a tree,
    # with the page table plan_pages makes.
    assert len(log) == 1
    kind, p = log[0]
    assert kind == ("decode" if tree is None and set(q_lens) == {1} else "prefill")
    plan = plan_pages(batch.query_start_loc, batch.seq_lens, batch.block_tables, 16)
    assert p["kv_indptr"].tolist() == plan.kv_indptr.tolist()
    assert p["kv_indices"].tolist() == plan.kv_indices.tolist()
    assert p["last"].tolist() == plan.kv_last_page_len.tolist()
    if kind == "prefill":
        assert p["qo_indptr"].tolist() == plan.qo_indptr.tolist()


def test_one_plan_per_layer_kind_per_step():
    log: list = []
    backend = FlashInferAttentionBackend(4, 2, 16, flashinfer=_fake_flashinfer(log))
    q, k, v, kv_cache, batch, _ = _forward_batch([1, 3], [10, 4])
    local = LayerAttention(sliding_window=8)
    for _ in range(2):
        backend.prepare(batch)
        for layer in (None, local, None, local):  # Gemma-style alternation
            backend.forward(q, k, v, kv_cache, batch, layer)
    assert [(kind, p["window_left"]) for kind, p in log] == [("prefill", -1), ("prefill", 7)] * 2
    # Wrappers are made once per kind and reused across steps.
    assert len(backend._wrappers) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_flashinfer_matches_the_triton_backend(case):
    from tandem.model.triton_backend import TritonAttentionBackend

    c = dict(CASES[case])
    q_lens, ctx_lens = c.pop("q_lens"), c.pop("ctx_lens")
    tree = _tree_words(q_lens) if c.pop("tree", False) else None
    layer = LayerAttention(sliding_window=c.get("window"), softcap=c.get("softcap"), scale=c.get("scale"))
    q, k, v, kv_cache, batch, _ = _forward_batch(q_lens, ctx_lens, heads=(8, 2), head_dim=128, tree=tree)
    dev = torch.device("cuda")
    q, k, v, kv_cache = (t.to(dev, torch.bfloat16) for t in (q, k, v, kv_cache))
    batch.slot_mapping = batch.slot_mapping.to(dev)
    batch.input_ids = batch.input_ids.to(dev)
    batch.tree_bits = None if tree is None else tree.to(dev)
    outs = []
    for backend in (FlashInferAttentionBackend(8, 2, 128), TritonAttentionBackend(8, 2, 128)):
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, kv_cache.clone(), batch, layer).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
def test_cuda_engine_with_flashinfer_matches_triton(model_factory):
    from tandem import LLM, SamplingParams

    model_dir = model_factory("llama")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    got = {}
    for name in ("flashinfer", "triton"):
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float16",
            attention_backend=name,
            kv_cache_memory=64 << 20,
            enforce_eager=True,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[name] = [o.outputs[0].token_ids for o in outs]
    assert got["flashinfer"] == got["triton"]
