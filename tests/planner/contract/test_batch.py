"""The data model refuses what it cannot describe unambiguously."""

import pytest
import torch

from kvplan.errors import LayoutError
from kvplan.planner.contract.batch import Entry


def test_a_token_indexed_buffer_becomes_pages_of_page_size_rows():
    k_buffer = torch.zeros(64, 8, 128, dtype=torch.bfloat16)  # SGLang's [tokens, heads, dim]
    entry = Entry.from_tensor(k_buffer, tokens_per_item=16)
    assert (entry.item_len, entry.num_items) == (16 * 8 * 128 * 2, 4)
    assert entry.base_ptr == k_buffer.data_ptr()


def test_a_page_indexed_buffer_keeps_its_rows():
    pages = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    assert Entry.from_tensor(pages, tokens_per_item=1).item_len == 16 * 8 * 128 * 2


def test_the_layout_must_be_said_and_must_divide():
    buffer = torch.zeros(60, 8, dtype=torch.float16)
    with pytest.raises(TypeError):
        Entry.from_tensor(buffer)  # which layout it is cannot be guessed
    with pytest.raises(LayoutError, match="whole items of 16 rows"):
        Entry.from_tensor(buffer, tokens_per_item=16)
    with pytest.raises(LayoutError, match="contiguous"):
        Entry.from_tensor(buffer.t(), tokens_per_item=1)
