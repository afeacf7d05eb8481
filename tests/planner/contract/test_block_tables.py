"""Block tables (vLLM's form) as the planner's input: the same plans as the token table they stand
for, on both paths; blocks past int32 refused, never wrapped."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.errors import InputError, PlanError
from kvplan.planner.device import eager
from kvplan.planner.contract.block_tables import token_table_from_blocks
from kvplan.planner.contract.batch import Attention, Batch, Entry, KVLayout, SideMemory, Transfer
from kvplan.planner.reference.oracle import plan_reference


def side(page_size, table, base=0x1000_0000, pages=256):
    kv = KVLayout(Attention.MHA, page_size, tuple(Entry(base + e * (1 << 24), page_size * 8, pages) for e in range(4)))
    return SideMemory(kv, aux=(Entry(base + (1 << 28), 16, 8),), req_to_token=table)


@settings(max_examples=15, deadline=None)
@given(page_size=st.sampled_from([1, 4, 16]), lens=st.lists(st.integers(1, 60), min_size=1, max_size=4),
       seed=st.integers(0, 2**31))
def test_a_block_table_plans_as_its_token_table(device, page_size, lens, seed):
    rng = np.random.default_rng(seed)
    blocks = max(-(-n // page_size) for n in lens)
    block_table = np.zeros((len(lens) + 1, blocks), np.int32)
    free = iter(rng.permutation(np.arange(1, 256)))
    dst_free = iter(rng.permutation(np.arange(1, 256)))
    transfers = []
    for r, n in enumerate(lens, start=1):
        block_table[r, : -(-n // page_size)] = [next(free) for _ in range(-(-n // page_size))]
        dst = np.array([next(dst_free) for _ in range(-(-n // page_size))], np.int64)
        transfers.append(Transfer(f"q{r}", r, 0, n + 1, n, True, dst, aux_src=r, aux_dst=r))
    tokens = (block_table.astype(np.int64)[:, :, None] * page_size + np.arange(page_size)).reshape(len(lens) + 1, -1)
    by_tokens = plan_reference(Batch(side(page_size, tokens.astype(np.int32)), (side(page_size, None, 0x9000_0000),),
                                     tuple(transfers)))
    table = token_table_from_blocks(torch.from_numpy(block_table).to(device), page_size)
    assert table.dtype == torch.int32 and np.array_equal(table.cpu().numpy(), tokens)
    batch = Batch(side(page_size, table), (side(page_size, None, 0x9000_0000),), tuple(transfers))
    plan_reference(batch).assert_equal(by_tokens)
    eager.plan(batch).result().assert_equal(by_tokens)


def test_the_table_is_written_into_a_given_one_in_place(device):
    out = torch.full((3, 12), 7, dtype=torch.int32, device=device)
    token_table_from_blocks(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=device), 4, out=out)
    assert out[:2, :8].cpu().tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]
    assert (out[2] == 7).all() and (out[:, 8:] == 7).all()


def test_a_block_whose_slots_pass_int32_is_refused_not_wrapped():
    table = token_table_from_blocks(torch.tensor([[0], [(1 << 31) // 16]], dtype=torch.int64), 16)
    assert (table[1] == -1).all()
    batch = Batch(side(16, table, pages=1 << 28), (side(16, None, 0x9000_0000),),
                  (Transfer("big", 1, 0, 17, 16, True, np.array([3])),))
    with pytest.raises(PlanError, match="big"):
        plan_reference(batch)


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.int32), torch.zeros((2, 2), dtype=torch.float32)])
def test_a_malformed_block_table_is_refused(bad):
    with pytest.raises(InputError):
        token_table_from_blocks(bad, 4)
