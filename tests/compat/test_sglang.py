"""Golden vectors of planning.md §7-8 for the SGLang-compatible helpers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.compat.sglang import (
    group_concurrent_contiguous,
    kv_to_page_indices,
    kv_to_page_num,
    pack_int_lists,
    pack_list_of_buffers,
    unpack_int_lists,
    unpack_list_of_buffers,
)
from kvplan.errors import InputError


def h(s: str) -> bytes:
    return bytes.fromhex(s.replace(" ", ""))


def test_kv_to_page_indices_golden():
    assert kv_to_page_indices(np.array([8, 9, 10, 11, 20, 21, 22, 23, 40, 41]), 4).tolist() == [2, 5, 10]
    assert kv_to_page_indices(np.array([8, 9, 3]), 1).tolist() == [8, 9, 3]


def test_kv_to_page_num_golden():
    assert (kv_to_page_num(10, 4), kv_to_page_num(8, 4), kv_to_page_num(0, 4)) == (3, 2, 0)


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ([10, 11, 12], [5, 6, 7], ([[10, 11, 12]], [[5, 6, 7]])),
        ([10, 11, 20], [5, 6, 7], ([[10, 11], [20]], [[5, 6], [7]])),
        ([3, 4, 5, 6], [9, 10, 20, 21], ([[3, 4], [5, 6]], [[9, 10], [20, 21]])),
        ([5, 4, 3], [1, 2, 3], ([[5], [4], [3]], [[1], [2], [3]])),
        ([1, 1], [2, 3], ([[1], [1]], [[2], [3]])),
        ([], [1, 2], ([], [])),
        ([1, 2], [], ([], [])),
    ],
)
def test_group_concurrent_contiguous_golden(src, dst, expected):
    assert group_concurrent_contiguous(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)) == expected


def test_group_concurrent_contiguous_unequal_lengths_raise():
    with pytest.raises(ValueError):
        group_concurrent_contiguous(np.array([1, 2, 3]), np.array([1, 2]))


@pytest.mark.parametrize(
    "lists, fmt, packed",
    [
        ([[1, 2, 3], [4]], "i", "02000000 0c000000 04000000 01000000 02000000 03000000 04000000"),
        ([[]], "I", "01000000 00000000"),
        ([], "Q", ""),
        ([[0x1000], [0x2000, 0x3000]], "Q",
         "02000000 08000000 10000000 0010000000000000 0020000000000000 0030000000000000"),
    ],
)
def test_pack_int_lists_golden(lists, fmt, packed):
    assert pack_int_lists(lists, fmt) == h(packed)
    assert unpack_int_lists(h(packed), fmt) == lists


def test_pack_list_of_buffers_empty_is_empty_bytes():
    assert pack_list_of_buffers([]) == b""
    assert unpack_list_of_buffers(b"") == []


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=6))
def test_buffers_round_trip(buffers):
    assert unpack_list_of_buffers(pack_list_of_buffers(buffers)) == buffers


@pytest.mark.parametrize("bad", [b"\x01\x00", h("02000000 04000000"), h("01000000 04000000 0102030405")])
def test_unpack_rejects_malformed_messages(bad):
    with pytest.raises(InputError):
        unpack_list_of_buffers(bad)


def test_pack_int_lists_rejects_values_that_do_not_fit():
    with pytest.raises(InputError):
        pack_int_lists([[2**31]], "i")
    with pytest.raises(InputError):
        pack_int_lists([[-1]], "Q")


def test_unpack_int_lists_gives_lists_of_python_ints_as_sglang_does():
    lists = unpack_int_lists(pack_int_lists([[1, 2], [3]], "i"), "i")
    assert lists == [[1, 2], [3]]
    assert lists[0] + [9] == [1, 2, 9]  # list concatenation, not element-wise addition
    assert all(type(v) is int for inner in lists for v in inner)
    assert not unpack_int_lists(pack_int_lists([[]], "i"), "i")[0]  # an empty list is falsy


@pytest.mark.parametrize("values", [[2**62 + 1, 2**63 + 3], [2**64 - 1, 0, 2**53 + 1]])
def test_q_values_at_and_above_2_63_round_trip_exactly(values):
    assert unpack_int_lists(pack_int_lists([values], "Q"), "Q") == [values]
    assert unpack_int_lists(pack_int_lists([np.array(values, np.uint64)], "Q"), "Q") == [values]


@pytest.mark.parametrize("fmt, lo, hi", [("b", -128, 127), ("B", 0, 255), ("h", -2**15, 2**15 - 1),
                                         ("H", 0, 2**16 - 1), ("l", -2**31, 2**31 - 1), ("L", 0, 2**32 - 1),
                                         ("q", -2**63, 2**63 - 1)])
def test_every_struct_integer_format_packs_its_whole_range(fmt, lo, hi):
    assert unpack_int_lists(pack_int_lists([[lo, hi]], fmt), fmt) == [[lo, hi]]
    for bad in (lo - 1, hi + 1):
        with pytest.raises(InputError):
            pack_int_lists([[bad]], fmt)
        if -2**63 <= bad < 2**64:  # as an array too, where NumPy can hold it
            with pytest.raises(InputError):
                pack_int_lists([np.array([bad], np.int64 if bad < 2**63 else np.uint64)], fmt)
