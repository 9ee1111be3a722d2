"""Weights moved onto transparent huge pages keep their values, sharing and types."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from tandem.model import huge_pages
from tandem.model.huge_pages import HUGE_PAGE_BYTES, huge_empty, move_weights_to_huge_pages, to_huge_pages

BIG = HUGE_PAGE_BYTES // 4 + 1  # float32 elements: just over one huge page


def on_huge_mapping(t: torch.Tensor) -> bool:
    """Starts a 2 MB boundary of a storage larger than the tensor (the padded mapping)."""
    return t.data_ptr() % HUGE_PAGE_BYTES == 0 and t.untyped_storage().nbytes() > t.numel() * t.element_size()


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(BIG // 64, 64)
        self.head = nn.Linear(64, BIG // 64, bias=False)
        self.head.weight = self.embed.weight  # tied, as in small Llamas
        self.register_buffer("table", torch.randn(BIG))
        self.register_buffer("small_table", torch.randn(16))
        self.tiles = torch.randn(BIG)  # a plain attribute, as PackedLinear's tiles
        self.alias = self.tiles
        self.view_of_table = self.table[: BIG // 2]  # a view: not its own storage, stays


def test_huge_empty_is_aligned_and_outlives_its_mapping_name() -> None:
    t = huge_empty((3, BIG), torch.bfloat16)
    gc.collect()
    assert t.shape == (3, BIG) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    t.fill_(2.5)
    assert t.float().sum().item() == pytest.approx(2.5 * 3 * BIG)
    src = torch.randint(-128, 127, (5, 7), dtype=torch.int8)
    assert torch.equal(to_huge_pages(src), src)


def test_move_keeps_values_ties_and_types() -> None:
    torch.manual_seed(0)
    m = Owner()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tiles = m.tiles.clone()
    x = torch.randint(0, BIG // 64, (4,))
    out = m.head(m.embed(x))
    small_ptr = m.small_table.data_ptr()
    moved = move_weights_to_huge_pages(m)
    # embed/head (tied: once), table, tiles (aliased: once); small_table is under the threshold.
    assert moved == 4 * (m.embed.weight.numel() + m.table.numel() + m.tiles.numel())
    assert isinstance(m.embed.weight, nn.Parameter) and m.embed.weight.requires_grad
    assert m.head.weight is m.embed.weight
    assert on_huge_mapping(m.embed.weight) and on_huge_mapping(m.table) and on_huge_mapping(m.tiles)
    assert m.alias.data_ptr() == m.tiles.data_ptr()
    assert m.small_table.data_ptr() == small_ptr
    assert not on_huge_mapping(m.view_of_table)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(m.tiles, tiles)
    assert torch.equal(m.head(m.embed(x)), out)
    assert move_weights_to_huge_pages(m) == 0  # already moved: nothing moves twice


def test_move_does_not_change_a_linear_layers_output() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(512, HUGE_PAGE_BYTES // 1024 + 1).to(torch.bfloat16)
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    expected = lin(x)
    move_weights_to_huge_pages(lin)
    assert on_huge_mapping(lin.weight)
    assert torch.equal(lin(x), expected)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    assert not huge_pages.huge_pages_available()


def test_a_refused_mapping_leaves_the_weights_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(t: torch.Tensor) -> torch.Tensor:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "to_huge_pages", refuse)
    m = Owner()
    before = {k: (v.data_ptr(), v.clone()) for k, v in m.state_dict().items()}
    assert move_weights_to_huge_pages(m) == 0
    for k, v in m.state_dict().items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]), k
