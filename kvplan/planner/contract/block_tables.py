"""Block tables (vLLM's form of a request's pages) as the planner's token table.

vLLM keeps, per request, the ids of its KV blocks (``block_table[row, i]`` is the block of tokens
``[i * ps, (i + 1) * ps)``); SGLang's scheduler keeps token slots (``req_to_token``), and SGLang's
sender is handed page ids. The planner reads token slots (planning.md §2), so a block table becomes
one: slot ``block_table[row, pos // ps] * ps + pos % ps``. A slot that does not fit int32 becomes
-1, which the planner refuses as outside the pool. The expansion is one elementwise op on
the table's device, in stream order: no host work per token and no synchronisation.

Example::

    block_table = torch.tensor([[0, 0], [7, 3]], dtype=torch.int32, device="cuda")
    side = SideMemory(kv, req_to_token=token_table_from_blocks(block_table, page_size=16))
"""

from __future__ import annotations

import torch

from ...errors import InputError

__all__ = ["token_table_from_blocks"]


def token_table_from_blocks(block_table: torch.Tensor, page_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The token table ``[rows, blocks * page_size]`` (int32) of a block table ``[rows, blocks]``.

    ``out``: a table to write into (its first ``blocks * page_size`` columns), e.g. the one a
    planner was built over, so that its captured graph sees the new rows.

    >>> token_table_from_blocks(torch.tensor([[2, 5]]), 4).tolist()
    [[8, 9, 10, 11, 20, 21, 22, 23]]
    """
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise InputError(None, f"a block table is int32 or int64 [rows, blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if page_size < 1:
        raise InputError(None, f"page_size must be >= 1, got {page_size}")
    rows, blocks = block_table.shape
    offsets = torch.arange(page_size, dtype=torch.int64, device=block_table.device)
    slots = (block_table.to(torch.int64)[:, :, None] * page_size + offsets).reshape(rows, blocks * page_size)
    # a slot past int32 becomes -1, which the planner's bounds checks refuse naming the request
    # (checking here would need the values on the host: a sync)
    slots = torch.where(slots < (1 << 31), slots, -1).to(torch.int32)
    if out is None:
        return slots
    if out.dtype != torch.int32 or out.device != block_table.device or out.shape[0] < rows \
            or out.shape[1] < blocks * page_size:
        raise InputError(None, f"out must be int32 on {block_table.device} with at least {rows} rows and "
                         f"{blocks * page_size} columns, got {out.dtype} {tuple(out.shape)} on {out.device}")
    out[:rows, : blocks * page_size].copy_(slots)
    return out
