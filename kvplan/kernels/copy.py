"""Executing descriptors inside one process: direct copies, gathers into and scatters out of a staging buffer.

Shape contract
--------------
* ``descs``: int64 ``[n, 3]`` ``(src_addr, dst_addr, nbytes)`` (uint64 bit patterns); addresses
  are raw device (or, in the interpreter, host) addresses.
* ``offsets``: int64 ``[n]``: byte offset of each descriptor inside the staging buffer (exclusive
  scan of ``nbytes``); used by ``GATHER`` (destination ``staging + offsets[i]``) and ``SCATTER``
  (source ``staging + offsets[i]``); ignored by ``DIRECT``.
* ``WORD``: bytes moved per lane (1, 4, 8 or 16); every address, offset and size must be a
  multiple of it (the launcher checks what it can: the caller passes the alignment of the layout).
* Grid, large descriptors: ``(n, SPLIT)``; program ``(i, p)`` copies words ``p*BLOCK,
  p*BLOCK + SPLIT*BLOCK, ...`` of descriptor ``i``. Small descriptors (head slices): ``cdiv(n, DPP)``
  programs of ``DPP`` descriptors each, as ``[DPP, W]`` word tiles. Either kernel copies any size;
  ``typical_bytes`` only picks the faster one. Descriptors must not overlap on the destination
  (a plan guarantees it).
* ``window`` (``GATHER`` and ``SCATTER``): bytes ``[win_lo, win_hi)`` of the stream the offsets
  index. Each descriptor is cut to its part inside the window (nothing when it lies outside), so one
  wave of a staged run is gathered or scattered with the whole run's descriptors; ``win_lo``,
  ``win_hi`` must be multiples of ``WORD``.
* ``rows``: int64 ``[1]`` on the device: only descriptors ``i < rows[0]`` are copied, the rest of
  ``descs`` is not read. A plan's descriptor count lives on the device until the host waits for it;
  with ``rows`` a copy can be queued behind the plan before that (a gather ahead of the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DIRECT, GATHER, SCATTER = 0, 1, 2
SMALL_WORDS = 128  # descriptors of up to this many words (typically) go through the tile kernel
TILE_WORDS = 2048
MAX_SPLIT = 64  # programs per large descriptor


@triton.jit
def _endpoints(desc_ptr, offsets_ptr, rows_ptr, staging_addr, i, live, win_lo, win_hi, MODE: tl.constexpr,
               WORD: tl.constexpr, WINDOW: tl.constexpr, COUNTED: tl.constexpr):
    """Source and destination word pointers and the size in words of descriptors ``i``."""
    if COUNTED:
        live = live & (i < tl.load(rows_ptr))
    src = tl.load(desc_ptr + i * 3, mask=live, other=0)
    dst = tl.load(desc_ptr + i * 3 + 1, mask=live, other=0)
    nbytes = tl.load(desc_ptr + i * 3 + 2, mask=live, other=0)
    if MODE != 0:
        offset = tl.load(offsets_ptr + i, mask=live, other=0)
        if WINDOW:  # the descriptor's part inside the window
            lo = tl.maximum(offset, win_lo)
            nbytes = tl.maximum(tl.minimum(offset + nbytes, win_hi) - lo, 0)
            if MODE == 1:
                src = src + (lo - offset)
            else:
                dst = dst + (lo - offset)
            offset = lo
        if MODE == 1:
            dst = staging_addr + offset
        else:
            src = staging_addr + offset
    words = nbytes // WORD
    if WORD == 8:
        return src.to(tl.pointer_type(tl.int64)), dst.to(tl.pointer_type(tl.int64)), words
    elif WORD == 4:
        return src.to(tl.pointer_type(tl.int32)), dst.to(tl.pointer_type(tl.int32)), words
    else:
        return src.to(tl.pointer_type(tl.uint8)), dst.to(tl.pointer_type(tl.uint8)), words


# the addresses, counts and windows that change from call to call are not specialised on (Triton would compile
# a variant per value that is 1 or a multiple of 16): one compiled kernel per launch shape, which a warm-up can
# compile ahead (kvplan.transport.local.warm_up)
_VARYING = ["staging_addr", "n", "win_lo", "win_hi"]


@triton.jit(do_not_specialize=_VARYING[:1] + _VARYING[2:])
def _copy_kernel(desc_ptr, offsets_ptr, rows_ptr, staging_addr, win_lo, win_hi, MODE: tl.constexpr,
                 WORD: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
                 COUNTED: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    sp, dp, words = _endpoints(desc_ptr, offsets_ptr, rows_ptr, staging_addr, i, i >= 0, win_lo, win_hi, MODE, WORD,
                               WINDOW, COUNTED)
    for start in range(part * BLOCK, words, SPLIT * BLOCK):
        o = start + tl.arange(0, BLOCK).to(tl.int64)
        m = o < words
        tl.store(dp + o, tl.load(sp + o, mask=m), mask=m)


@triton.jit(do_not_specialize=_VARYING)
def _copy_tile_kernel(desc_ptr, offsets_ptr, rows_ptr, staging_addr, n, win_lo, win_hi, MODE: tl.constexpr,
                      WORD: tl.constexpr, DPP: tl.constexpr, W: tl.constexpr, WINDOW: tl.constexpr,
                      COUNTED: tl.constexpr):
    """Small descriptors: ``DPP`` descriptors per program as a ``[DPP, W]`` tile of words, repeated
    over ``W``-word columns up to the largest descriptor of the tile."""
    i = tl.program_id(0).to(tl.int64) * DPP + tl.arange(0, DPP).to(tl.int64)
    live = i < n
    sp, dp, words = _endpoints(desc_ptr, offsets_ptr, rows_ptr, staging_addr, i, live, win_lo, win_hi, MODE, WORD,
                               WINDOW, COUNTED)
    most = tl.max(words, axis=0)
    for start in range(0, most, W):
        o = start + tl.arange(0, W).to(tl.int64)
        m = live[:, None] & (o[None, :] < words[:, None])
        tl.store(dp[:, None] + o[None, :], tl.load(sp[:, None] + o[None, :], mask=m), mask=m)


def word_size(alignment: int) -> int:
    """The widest lane (8, 4 or 1 bytes) that divides ``alignment``."""
    return 8 if alignment % 8 == 0 else 4 if alignment % 4 == 0 else 1


def copy_descriptors(descs: torch.Tensor, mode: int = DIRECT, offsets: torch.Tensor | None = None,
                     staging_addr: int = 0, alignment: int = 1, typical_bytes: int = 4096,
                     window: tuple[int, int] | None = None, rows: torch.Tensor | None = None) -> None:
    """Launch the copy of every descriptor, or of the first ``rows[0]`` (see the module's shape contract)."""
    n = descs.shape[0]
    if n == 0:
        return
    if window is not None and mode == DIRECT:
        raise ValueError("a byte window applies to gathers and scatters only")
    win_lo, win_hi = window if window is not None else (0, 0)
    word, tile, width, per_program = launch_shape(typical_bytes, alignment)
    offsets = offsets if offsets is not None else descs
    counted = rows if rows is not None else descs  # (not read unless COUNTED)
    if tile:  # many small descriptors: several per program
        _copy_tile_kernel[(triton.cdiv(n, per_program),)](descs, offsets, counted, staging_addr, n, win_lo, win_hi,
                                                          MODE=mode, WORD=word, DPP=per_program, W=width,
                                                          WINDOW=window is not None, COUNTED=rows is not None)
        return
    _copy_kernel[(n, per_program)](descs, offsets, counted, staging_addr, win_lo, win_hi, MODE=mode, WORD=word,
                                   BLOCK=width, SPLIT=per_program, WINDOW=window is not None, COUNTED=rows is not None)


def launch_shape(typical_bytes: int, alignment: int) -> tuple[int, bool, int, int]:
    """``(word, tile, width, split)``: how :func:`copy_descriptors` copies descriptors of about
    ``typical_bytes``. With ``tile``, ``split`` descriptors of ``width`` words per program; else
    ``split`` programs of ``width``-word blocks per descriptor (a power of two). Two calls of the same shape, kind,
    window and counting launch the same kernel for the same grid over the same rows."""
    word = word_size(alignment)
    words = max(1, typical_bytes // word)
    if words <= SMALL_WORDS:
        width = max(16, triton.next_power_of_2(words))
        return word, True, width, max(1, TILE_WORDS // width)
    block = min(2048, max(64, triton.next_power_of_2(words)))
    # about one block per program, rounded up to a power of two: few shapes, so that typical sizes that vary
    # from batch to batch do not compile a kernel each mid-serving, and a warm-up can compile them all
    return word, False, block, max(1, min(MAX_SPLIT, triton.next_power_of_2(triton.cdiv(words, block))))


_GATHER_SCATTER = ((DIRECT, False, False), (GATHER, False, False), (SCATTER, False, False), (SCATTER, True, False),
                   (GATHER, True, True), (SCATTER, False, True))  # (mode, window, counted): what the transport launches
COMPILE_SPECS = [
    (_copy_kernel,
     {"desc_ptr": "*i64", "offsets_ptr": "*i64", "rows_ptr": "*i64", "staging_addr": "i64", "win_lo": "i64",
      "win_hi": "i64", "MODE": "constexpr", "WORD": "constexpr", "BLOCK": "constexpr", "SPLIT": "constexpr",
      "WINDOW": "constexpr", "COUNTED": "constexpr"},
     {"MODE": mode, "WORD": word, "BLOCK": 1024, "SPLIT": 4, "WINDOW": window, "COUNTED": counted})
    for mode, window, counted in _GATHER_SCATTER for word in (1, 8)
] + [
    (_copy_tile_kernel,
     {"desc_ptr": "*i64", "offsets_ptr": "*i64", "rows_ptr": "*i64", "staging_addr": "i64", "n": "i64",
      "win_lo": "i64", "win_hi": "i64", "MODE": "constexpr", "WORD": "constexpr", "DPP": "constexpr",
      "W": "constexpr", "WINDOW": "constexpr", "COUNTED": "constexpr"},
     {"MODE": mode, "WORD": 8, "DPP": 64, "W": 32, "WINDOW": window, "COUNTED": counted})
    for mode, window, counted in _GATHER_SCATTER
]
