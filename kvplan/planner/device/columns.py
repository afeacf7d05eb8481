"""A batch as the scheduler already holds it: one value per transfer, destination lists flat.

:class:`BatchColumns` is the array-in form the device planner takes. A scheduler keeps these
columns anyway (rows, chunk starts, fill and prompt lengths, decode prefixes, last flags,
destinations, aux ids), and the destination lists it received arrive as one flat array with
offsets. Nothing in it is per-transfer Python: :meth:`kvplan.planner.device.planner.Planner.plan` copies
the columns into its pinned input buffer with one NumPy assignment each.

:meth:`BatchColumns.from_batch` converts the convenience form (:class:`~kvplan.planner.contract.batch.Batch`
of :class:`~kvplan.planner.contract.batch.Transfer`) once.

Example::

    cols = BatchColumns.build(
        requests=["a", "b"], src_row=[1, 2], start=[0, 0], fill_len=[65, 33], prompt_len=[64, 32],
        last=[1, 1], dst_pages=np.array([3, 4, 9, 10, 7, 8]), dst_page_counts=[4, 2])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...errors import InputError
from ..contract.batch import Batch, Transfer

__all__ = ["BatchColumns", "COLUMNS"]

# per-transfer columns, in the order of the planner's input buffer; then (lo, len) of each
# component's destination list in ``dst_flat``
COLUMNS = ("src_row", "start", "fill_len", "prompt_len", "prefix_len", "last", "dest", "aux_src", "aux_dst",
           "num_state", "kv_lo", "kv_len")


def _column(values: Any, what: str, count: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_)):
        raise InputError(None, f"column {what} must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if count is not None and len(arr) != count:
        raise InputError(None, f"column {what} has {len(arr)} values, the batch {count} transfers")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class BatchColumns:
    """The transfers of a batch as int64 columns of length ``T``.

    Attributes:
        table: ``[T, len(COLUMNS) + 2 * C]``: the :data:`COLUMNS`, then ``(lo, len)`` of each state
            component's destination list; ``kv_lo``/``kv_len`` and the component pairs index ``dst_flat``.
        dst_flat: every destination list back to back (int64).
        requests: the request ids, named in errors (``None``: the transfer's index is named).
        transfers: the :class:`Transfer` objects the columns came from, if any (used to word errors
            exactly as the reference does).
    """

    table: np.ndarray
    dst_flat: np.ndarray
    requests: Sequence[Any] | None = None
    transfers: Sequence[Transfer] | None = None
    num_transfers: int = field(init=False, repr=False, compare=False)  # ``len(table)``, read on the hot path

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_transfers", len(self.table))

    @property
    def num_components(self) -> int:
        return (self.table.shape[1] - len(COLUMNS)) // 2

    def request(self, t: int) -> Any:
        return self.requests[t] if self.requests is not None else t

    def column(self, name: str) -> np.ndarray:
        return self.table[:, COLUMNS.index(name)]

    @classmethod
    def build(cls, *, src_row: Any, start: Any, fill_len: Any, prompt_len: Any, last: Any, dst_pages: Any,
              dst_page_counts: Any, prefix_len: Any = None, dest: Any = None, aux_src: Any = None,
              aux_dst: Any = None, dst_state: Sequence[tuple[Any, Any]] = (),
              requests: Sequence[Any] | None = None) -> "BatchColumns":
        """Columns from per-transfer arrays; ``dst_state`` holds ``(flat, counts)`` per component."""
        rows = _column(src_row, "src_row")
        T = len(rows)
        zeros = np.zeros(T, np.int64)
        def col(values, what, default=zeros):  # noqa: E306
            return default if values is None else _column(values, what, T)
        kv_len = col(dst_page_counts, "dst_page_counts")
        parts = [_column(dst_pages, "dst_pages")]
        if int(kv_len.sum()) != len(parts[0]):
            raise InputError(None, f"dst_page_counts sum to {int(kv_len.sum())}, dst_pages has {len(parts[0])}")
        lo = np.cumsum(kv_len) - kv_len
        state_cols = []
        at = len(parts[0])
        for c, (flat, counts) in enumerate(dst_state):
            flat, counts = _column(flat, f"dst_state[{c}]"), col(counts, f"dst_state[{c}] counts")
            if int(counts.sum()) != len(flat):
                raise InputError(None, f"dst_state[{c}] counts sum to {int(counts.sum())}, its list has {len(flat)}")
            state_cols += [at + np.cumsum(counts) - counts, counts]
            parts.append(flat)
            at += len(flat)
        C = len(dst_state)
        table = np.stack([rows, col(start, "start"), col(fill_len, "fill_len"), col(prompt_len, "prompt_len"),
                          col(prefix_len, "prefix_len"), col(last, "last"), col(dest, "dest"),
                          col(aux_src, "aux_src", zeros - 1), col(aux_dst, "aux_dst", zeros - 1),
                          np.full(T, C, np.int64), lo, kv_len, *state_cols], axis=1) if T else \
            np.zeros((0, len(COLUMNS) + 2 * C), np.int64)
        if requests is not None and len(requests) != T:
            raise InputError(None, f"{len(requests)} request ids for {T} transfers")
        return cls(table, np.concatenate(parts), requests)

    @classmethod
    def from_batch(cls, batch: Batch) -> "BatchColumns":
        """The columns of a :class:`Batch` (one pass over its transfers)."""
        transfers = batch.transfers
        C = len(batch.src.state)
        T = len(transfers)
        table = np.zeros((T, len(COLUMNS) + 2 * C), np.int64)
        if T:
            table[:, :10] = [(t.src_row, t.start, t.fill_len, t.prompt_len, t.prefix_len, t.last, t.dest, t.aux_src,
                              t.aux_dst, len(t.dst_state)) for t in transfers]
        lists: list[np.ndarray] = [t.dst_pages for t in transfers]
        kv_len = np.array([len(x) for x in lists], np.int64)
        table[:, COLUMNS.index("kv_len")] = kv_len
        table[:, COLUMNS.index("kv_lo")] = np.cumsum(kv_len) - kv_len
        at = int(kv_len.sum())
        for c in range(C):
            comp = [t.dst_state[c] if c < len(t.dst_state) else lists[0][:0] for t in transfers]
            counts = np.array([len(x) for x in comp], np.int64)
            table[:, len(COLUMNS) + 2 * c] = at + np.cumsum(counts) - counts
            table[:, len(COLUMNS) + 2 * c + 1] = counts
            lists += comp
            at += int(counts.sum())
        flat = np.concatenate(lists) if lists else np.zeros(0, np.int64)
        return cls(table, flat.astype(np.int64, copy=False), [t.request for t in transfers], transfers)

    def transfer(self, t: int) -> Transfer:
        """Transfer ``t`` as a :class:`Transfer` (the original object when the columns came from one)."""
        if self.transfers is not None:
            return self.transfers[t]
        row = self.table[t]
        names = dict(zip(COLUMNS, row.tolist()))
        kv = self.dst_flat[names["kv_lo"] : names["kv_lo"] + names["kv_len"]]
        state = tuple(self.dst_flat[row[len(COLUMNS) + 2 * c] : row[len(COLUMNS) + 2 * c] + row[len(COLUMNS) + 2 * c + 1]]
                      for c in range(self.num_components))
        return Transfer(self.request(t), names["src_row"], names["start"], names["fill_len"], names["prompt_len"],
                        bool(names["last"]), kv, names["prefix_len"], names["aux_src"], names["aux_dst"], state,
                        names["dest"])
