"""kvplan.compat.sglang against SGLang 0.5.23's own helpers, on random values over each format's
whole range. Differences by design are named and asserted:

* a value outside its format: SGLang raises ``struct.error``, kvplan ``InputError``;
* a malformed packed message: SGLang returns truncated lists or raises ``struct.error``, kvplan
  raises ``InputError`` naming what is wrong;
* ``"l"`` and ``"L"``: SGLang packs them in the standard 4 bytes (``"<L"``) but unpacks with the
  native item size (``struct.calcsize("L")``, 8 on 64-bit Linux), so its own round trip fails;
  kvplan unpacks what was packed.
"""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.compat import sglang as ours
from kvplan.errors import InputError
from tests.sglang_real import sglang_module

pytestmark = pytest.mark.sglang

RANGES = {"b": (-2**7, 2**7 - 1), "B": (0, 2**8 - 1), "h": (-2**15, 2**15 - 1), "H": (0, 2**16 - 1),
          "i": (-2**31, 2**31 - 1), "I": (0, 2**32 - 1), "l": (-2**31, 2**31 - 1), "L": (0, 2**32 - 1),
          "q": (-2**63, 2**63 - 1), "Q": (0, 2**64 - 1)}


@pytest.fixture(scope="module")
def theirs():
    return sglang_module("srt.disaggregation.common.utils")


@pytest.fixture(scope="module")
def their_pages():
    return sglang_module("srt.mem_cache.common")  # 0.5.23 keeps the page helpers here


def int_lists(fmt):
    lo, hi = RANGES[fmt]
    edge = st.sampled_from([lo, hi, 0 if lo <= 0 else lo, lo + 1, hi - 1, (lo + hi) // 2])
    return st.lists(st.lists(st.one_of(st.integers(lo, hi), edge), max_size=8), max_size=5)


@pytest.mark.parametrize("fmt", sorted(RANGES))
def test_int_lists_pack_and_unpack_as_sglang_s(theirs, fmt):
    @settings(max_examples=40, deadline=None)
    @given(lists=int_lists(fmt))
    def check(lists):
        packed = theirs.pack_int_lists(lists, fmt)
        assert ours.pack_int_lists(lists, fmt) == packed
        assert ours.pack_int_lists([np.array(x, dtype=ours._dtype(fmt)) for x in lists], fmt) == packed
        got = ours.unpack_int_lists(packed, fmt)
        assert got == lists
        assert all(type(v) is int for inner in got for v in inner)
        if fmt not in NATIVE_SIZE_DIFFERS:
            assert theirs.unpack_int_lists(packed, fmt) == lists

    check()


NATIVE_SIZE_DIFFERS = {f for f in RANGES if struct.calcsize(f) != struct.calcsize("<" + f)}


@pytest.mark.parametrize("fmt", sorted(NATIVE_SIZE_DIFFERS))
def test_sglang_unpacks_l_formats_with_the_native_size_and_kvplan_does_not(theirs, fmt):
    packed = theirs.pack_int_lists([[1, 2, 3]], fmt)
    with pytest.raises(struct.error):  # SGLang's own round trip breaks: 12 bytes read as 8-byte items
        theirs.unpack_int_lists(packed, fmt)
    assert ours.unpack_int_lists(packed, fmt) == [[1, 2, 3]]


@pytest.mark.parametrize("fmt", sorted(RANGES))
def test_a_value_outside_the_format_raises_on_both_sides(theirs, fmt):
    lo, hi = RANGES[fmt]
    for bad in (lo - 1, hi + 1):
        with pytest.raises(struct.error):
            theirs.pack_int_lists([[bad]], fmt)
        with pytest.raises(InputError):  # by design: our own error type
            ours.pack_int_lists([[bad]], fmt)


@settings(max_examples=60, deadline=None)
@given(buffers=st.lists(st.binary(max_size=40), max_size=6))
def test_buffer_lists_pack_and_unpack_as_sglang_s(theirs, buffers):
    packed = theirs.pack_list_of_buffers(buffers)
    assert ours.pack_list_of_buffers(buffers) == packed
    assert ours.unpack_list_of_buffers(packed) == theirs.unpack_list_of_buffers(packed) == buffers


def test_a_truncated_message_is_an_error_here_and_silently_short_in_sglang(theirs):
    packed = theirs.pack_list_of_buffers([b"abcd", b"efgh"])[:-3]
    assert theirs.unpack_list_of_buffers(packed) == [b"abcd", b"e"]  # SGLang: short, no error
    with pytest.raises(InputError):
        ours.unpack_list_of_buffers(packed)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 40), breaks=st.lists(st.integers(0, 40), max_size=6), seed=st.integers(0, 2**31))
def test_group_concurrent_contiguous_as_sglang_s(theirs, n, breaks, seed):
    rng = np.random.default_rng(seed)
    src = np.cumsum(np.where(np.isin(np.arange(n), breaks), rng.integers(2, 9, n), 1)).astype(np.int32)
    dst = np.cumsum(np.where(rng.random(n) < 0.2, rng.integers(-5, 9, n), 1)).astype(np.int32)
    assert ours.group_concurrent_contiguous(src, dst) == theirs.group_concurrent_contiguous(src, dst)


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(st.integers(0, 1000), max_size=20), page_size=st.sampled_from([1, 2, 16, 64]),
       cut=st.integers(0, 63))
def test_page_helpers_as_sglang_s(their_pages, pages, page_size, cut):
    """SGLang's ``kv_to_page_indices`` takes a torch tensor (and copies it to the host); ours NumPy."""
    import torch

    slots = (np.array(pages, np.int64)[:, None] * page_size + np.arange(page_size)).reshape(-1)
    slots = slots[: max(0, len(slots) - cut)]
    want = their_pages.kv_to_page_indices(torch.from_numpy(slots), page_size)
    assert ours.kv_to_page_indices(slots, page_size).tolist() == want.tolist()
    assert ours.kv_to_page_num(len(slots), page_size) == their_pages.kv_to_page_num(len(slots), page_size)
