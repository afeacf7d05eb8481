"""Executing a plan inside one process: direct copies, or through a staging buffer.

Direct mode copies every descriptor with one Triton launch. Staged mode gathers the bytes of the
descriptors into a contiguous staging buffer (what an engine then moves as one region per
transfer) and scatters them into the destination pool with the same descriptors; byte for byte
the result is the same.

Example::

    pending = plan(batch)
    descs = pending.device_descriptors()         # raises PlanError before any byte moves
    align = plan_alignment(batch)
    run_direct(descs, align)                     # or: offsets = staging_offsets(descs)
                                                 #     gather(descs, offsets, staging, align)
                                                 #     scatter(descs, offsets, staging, align)
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import InputError
from ..kernels import copy as kc
from ..planner.contract.batch import Batch, SideMemory
from ..planner.reference.page_mapping import unit_tables
from ..planner.contract.pairing import pair_sides

__all__ = ["gather", "plan_alignment", "run_direct", "scatter", "staging_offsets", "typical_sizes", "warm_up"]


def plan_alignment(batch: Batch) -> int:
    """The largest power of two dividing every address and size the batch's descriptors can hold."""
    values = [16]
    for dst in batch.dsts:
        p = pair_sides(batch.src, dst)
        kv = (p.kv_src, p.kv_dst)
        if dst.kv.page_size != batch.src.kv.page_size:  # KV moves in units of gcd tokens (docs/page_sizes.md)
            kv = unit_tables(p, batch.src.kv.page_size, dst.kv.page_size)
        moved = [b for b in p.state_bytes if b is not None]  # sliced entries' bytes per item
        for table in (*kv, p.aux_src, p.aux_dst, *p.state_src, *p.state_dst, *moved):
            values += [int(v) for v in table.reshape(-1)]
        for h in (p.heads, *p.state_heads):
            if h is not None:
                values += [h.src_token_bytes, h.dst_token_bytes, h.bytes_per_head, h.nbytes]
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return g & -g if g else 1


def run_direct(descs: torch.Tensor, alignment: int, typical_bytes: int = 4096) -> None:
    """Copy every descriptor ``[n, 3]`` (int64 on the device whose memory they address)."""
    kc.copy_descriptors(descs, kc.DIRECT, alignment=alignment, typical_bytes=typical_bytes)


def staging_offsets(descs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each descriptor's byte offset in the staging buffer, and the running ends (device tensors)."""
    ends = torch.cumsum(descs[:, 2], 0)
    return ends - descs[:, 2], ends


def _check_staging(staging: torch.Tensor, descs: torch.Tensor, offsets: torch.Tensor, need: int | None,
                   shift: int = 0) -> None:
    if staging.dtype != torch.uint8 or not staging.is_contiguous():
        raise InputError(None, "the staging buffer must be a contiguous uint8 tensor")
    if shift and need is None:
        raise InputError(None, "a shifted staging copy needs the staging bytes it reaches (need)")
    if need is None:  # one read of the end from the device; callers that know it pass `need`
        need = int(offsets[-1] + descs[-1, 2]) if descs.shape[0] else 0
    if need > staging.numel():
        raise InputError(None, f"the staging buffer holds {staging.numel()} bytes; the transfer needs {need}")


def _check_window(alignment: int, need: int | None, window: tuple[int, int] | None) -> None:
    if window is not None and (need is None or window[0] % kc.word_size(alignment) or window[1] % kc.word_size(alignment)):
        raise InputError(None, "a staging window needs `need` and bounds aligned to the copy word")


def gather(descs: torch.Tensor, offsets: torch.Tensor, staging: torch.Tensor, alignment: int,
           typical_bytes: int = 4096, need: int | None = None, shift: int = 0,
           window: tuple[int, int] | None = None, rows: torch.Tensor | None = None) -> None:
    """Copy each descriptor's source bytes to ``staging[offsets[i] + shift:]`` (the source side of staged mode).

    ``need``: the staging bytes the copy reaches, when the caller knows it (else read from the device;
    a caller that passes ``shift`` must pass ``need``). ``shift`` lets a slice of a whole batch's
    offsets land in one slot of the buffer without a new offsets tensor. ``window``: only the bytes
    ``[lo, hi)`` of the offsets' stream (pass ``need``). ``rows``: a device int64 ``[1]``: only the
    first ``rows[0]`` descriptors are read (a gather queued behind a plan the host has not seen yet;
    pass ``window`` and ``need``, which bound what it writes)."""
    _check_window(alignment, need, window)
    if rows is not None and window is None:
        raise InputError(None, "a gather of a device-counted prefix needs a window (what bounds its bytes)")
    _check_staging(staging, descs, offsets, need, shift)
    kc.copy_descriptors(descs, kc.GATHER, offsets, staging.data_ptr() + shift, alignment, typical_bytes, window, rows)


def scatter(descs: torch.Tensor, offsets: torch.Tensor, staging: torch.Tensor, alignment: int,
            typical_bytes: int = 4096, need: int | None = None, shift: int = 0,
            window: tuple[int, int] | None = None, rows: torch.Tensor | None = None) -> None:
    """Copy ``staging[offsets[i] + shift:]`` to each descriptor's destination (the receiving side of staged mode).

    ``window``: only the bytes ``[lo, hi)`` of the offsets' stream (one wave of a run; pass ``need``);
    each descriptor is cut to its part inside it. ``rows``: a device int64 ``[1]``: only the first
    ``rows[0]`` descriptors are read (a plan's buffers at full capacity, counted by the plan: pass
    ``need``, the staging bytes the counted rows reach)."""
    _check_window(alignment, need, window)
    if rows is not None and need is None:
        raise InputError(None, "a scatter of a device-counted prefix needs `need` (the staging bytes it reads)")
    _check_staging(staging, descs, offsets, need, shift)
    kc.copy_descriptors(descs, kc.SCATTER, offsets, staging.data_ptr() + shift, alignment, typical_bytes, window,
                        rows)


def warm_up(staging: torch.Tensor, alignment: int = 16, typical_sizes: Sequence[int] = (4096,),
            kinds: Sequence[int] = (kc.GATHER, kc.SCATTER)) -> int:
    """Compile now the gather and scatter kernels a staged transfer launches (a first transfer should
    not pay for it): for each descriptor size of ``typical_sizes`` (one per launch shape is enough,
    :func:`~kvplan.kernels.copy.launch_shape`) and each of ``kinds``, every form the transport uses
    (plain, a byte window, counted rows). Each copies the staging buffer's first 16 bytes onto
    themselves. Returns how many launch shapes were compiled."""
    if staging.numel() < 16:
        return 0
    addr = staging.data_ptr()
    descs = torch.tensor([[addr, addr, 16]] * 2, dtype=torch.int64).to(staging.device)
    offsets = torch.zeros(2, dtype=torch.int64, device=staging.device)
    one = torch.ones(1, dtype=torch.int64, device=staging.device)
    forms = {kc.GATHER: ((None, None), ((0, 16), None), ((0, 16), one)),  # a wave's; a gather ahead of the host
             kc.SCATTER: ((None, None), ((0, 16), None), (None, one))}  # a table run's; a counted one (.copy_graphs)
    # a wave's rows are a slice of its run's: Triton compiles apart for tensors that start 16-byte aligned or not
    # (rows of 24 bytes, offsets of 8); a counted copy reads whole plan buffers (aligned)
    starts = {False: ((0, 0), (0, 1), (1, 0), (1, 1)), True: ((0, 0),)}
    shapes = {kc.launch_shape(size, alignment): size for size in typical_sizes}
    for size in shapes.values():
        for kind in kinds:
            for window, rows in forms[kind]:
                for d, o in starts[rows is not None]:
                    kc.copy_descriptors(descs[d : d + 1], kind, offsets[o : o + 1], addr, alignment, size,
                                        window=window, rows=rows)
    if staging.is_cuda:
        torch.cuda.current_stream(staging.device).synchronize()
    return len(shapes)


def typical_sizes(side: SideMemory, largest: int = 256 << 10) -> list[int]:
    """One descriptor size per launch shape a staged transfer of ``side``'s pools can take: powers of
    two from its smallest item (a head slice or a page of one layer) up to ``largest`` (``auto``
    stages batches of at most 256 KiB per descriptor on average)."""
    items = [e.item_len for e in side.kv.entries] + [e.item_len for c in side.state for e in c.entries]
    heads = max(1, side.kv.num_kv_heads or 1)
    size = 16
    while size * 2 <= max(16, min(items, default=4096) // heads):
        size *= 2
    sizes = []
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes
