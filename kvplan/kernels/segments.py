"""Shared device helpers: the segment table's fields, error bits, and segment search.

A *segment* is one list of one transfer: its KV chunk, one state component, or its aux row.
Transfer ``t`` owns segments ``t * K .. t * K + K - 1`` (``K = 2 + C``: KV, each component, aux),
whether or not they hold anything, so every offset is a prefix sum and nothing is compacted.

Segment table: int64 ``[S, SEG_FIELDS]``, the columns named below. The constants are
``tl.constexpr`` so that kernels can read them; they index NumPy arrays as they are.
"""

from __future__ import annotations

import triton
import triton.language as tl

# list kinds (how element k of a segment is computed); see kvplan.kernels.index_lists
TOKEN_PAGES, MAPPED_PAGES, RING, ROW_MAP, CONST = (tl.constexpr(v) for v in range(5))

# segment table columns
(F_KIND, F_ROW, F_A, F_STEP, F_DIV, F_RING, F_N, F_DST_LO, F_DST_CONST, F_LO, F_HI, F_DLO, F_DHI, F_MAP, F_MAP_LEN,
 F_MERGE, F_ENTRY_OFF, F_ENTRIES, F_SLICED, F_DEST, F_CHK_A, F_CHK_PS, F_CHK_FLAGS, F_KEEP, F_START,
 F_CHK_START, F_CHK_N, F_RATIO, F_SKIP) = (tl.constexpr(v) for v in range(29))
# F_RATIO: destination ids per destination-list entry. 1, except for KV between sides of different
# page sizes (docs/page_sizes.md), whose elements are units of gcd(ps_s, ps_d) tokens: element k's
# destination id is dst_flat[F_DST_LO + kk // F_RATIO] * F_RATIO + kk % F_RATIO with kk = k + F_SKIP
# (F_SKIP: units of the destination list before the segment's first position, for SWA windows that
# start later on the source than on the destination).
# F_SLICED: 0 for direct descriptors; for head-sliced KV the tokens one element holds (the page
# size, or the unit between sides of different page sizes): one descriptor per entry and token.
SEG_FIELDS = tl.constexpr(32)

# check flags of a segment's token range
CHK_INVARIANT, CHK_MAPPED, CHK_PAGE_BOUNDS = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)

# per-segment error bits (atomically or-ed by the kernels; judged by the summary kernel)
# ERR_OVERLAP: an element of the segment claimed a destination item already claimed (planning.md §6.1)
ERR_FATAL, ERR_WARN, ERR_INVARIANT, ERR_UNMAPPED, ERR_OVERLAP = (tl.constexpr(1 << v) for v in range(5))



@triton.jit
def find_segment(ends_ptr, count, x, LOG: tl.constexpr):
    """Per lane, the first ``s`` in ``[0, count)`` with ``ends[s] > x`` (``ends`` non-decreasing)."""
    lo = tl.zeros_like(x)
    hi = lo + count
    for _ in tl.static_range(LOG):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(ends_ptr + mid, mask=active, other=0)
        right = active & (v <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


def log2_ceil(n: int) -> int:
    """Iterations of :func:`find_segment` over ``n`` segments."""
    return max(1, int(n).bit_length())
