"""The slot maps of vLLM's sliding-window groups (``kvplan/integrations/vllm/windows.py``): a request's window
blocks map from its full-attention blocks at the same positions, a freed one (vLLM's null block) to 0, and two
requests in flight may not map one full block to two window blocks."""

import torch

from kvplan.integrations.vllm.windows import WindowMaps

BS = 4


def _mapped(maps: WindowMaps, full: int) -> list[int]:
    return maps.maps[0][full * BS : full * BS + BS].tolist()


def test_a_request_maps_the_blocks_of_its_window_only_and_a_freed_one_to_zero():
    maps = WindowMaps((6,), num_blocks=32, block_size=BS, device=torch.device("cpu"))
    for full in range(32):  # (stale values from earlier requests)
        maps.maps[0][full * BS : full * BS + BS] = 99
    # 14 tokens in blocks of 4: the window (5 tokens besides the next: 9..13) lies in positions 2 and 3
    assert maps.claim("a", [5, 9, 2, 7], [[0, 0, 0, 30]], prefix=0, num_tokens=14) is None
    maps.flush()
    assert _mapped(maps, 5) == _mapped(maps, 9) == [99] * BS  # (before the window: not written)
    assert _mapped(maps, 2) == [0] * BS  # (freed inside the window: the planner refuses it, naming the token)
    assert _mapped(maps, 7) == list(range(30 * BS, 31 * BS))


def test_after_a_decode_prefix_the_window_starts_no_earlier_than_the_prefix():
    maps = WindowMaps((100,), num_blocks=32, block_size=BS, device=torch.device("cpu"))
    assert maps.claim("a", [11, 12], [[21, 22]], prefix=8, num_tokens=8) is None  # (blocks of tokens 8..15)
    maps.flush()
    assert _mapped(maps, 11) == list(range(21 * BS, 22 * BS)) and _mapped(maps, 12) == list(range(22 * BS, 23 * BS))


def test_two_requests_in_flight_may_not_map_one_full_block_two_ways_until_the_first_ends():
    maps = WindowMaps((8,), num_blocks=32, block_size=BS, device=torch.device("cpu"))
    assert maps.claim("a", [3, 4], [[10, 11]], prefix=0, num_tokens=8) is None
    why = maps.claim("b", [3, 5], [[12, 13]], prefix=0, num_tokens=8)
    assert "full block 3" in why and "'a'" in why
    assert maps.claim("c", [3, 6], [[10, 14]], prefix=0, num_tokens=8) is None  # (the same mapping: shared)
    maps.release("a")
    maps.release("c")
    assert maps.claim("b", [3, 5], [[12, 13]], prefix=0, num_tokens=8) is None
    maps.flush()
    assert _mapped(maps, 3) == list(range(12 * BS, 13 * BS))


def test_a_released_request_s_unwritten_claims_are_not_written():
    maps = WindowMaps((8,), num_blocks=32, block_size=BS, device=torch.device("cpu"))
    assert maps.claim("a", [3], [[10]], prefix=0, num_tokens=4) is None
    maps.release("a")  # (refused after claiming, before the step's write)
    maps.flush()
    assert _mapped(maps, 3) == [0] * BS


def test_lists_that_do_not_match_the_groups_are_refused_naming_them():
    maps = WindowMaps((8,), num_blocks=32, block_size=BS, device=torch.device("cpu"))
    assert "1 sliding-window groups" in maps.claim("a", [3], [], prefix=0, num_tokens=4)
    assert "has 2 blocks where the full-attention group has 1" in maps.claim("a", [3], [[1, 2]], prefix=0,
                                                                               num_tokens=4)


def test_a_group_of_smaller_blocks_maps_its_window_token_by_token():
    """vLLM pads a sliding-window group of smaller pages to the full group's: its blocks hold fewer tokens."""
    maps = WindowMaps((6,), num_blocks=32, block_size=BS, device=torch.device("cpu"), block_sizes=(2,))
    # 14 tokens: the window (9..13) starts in the window group's block 4 (tokens 8, 9), full block 2 (8..11)
    assert maps.claim("a", [5, 9, 2, 7], [[0, 0, 0, 0, 20, 21, 22]], prefix=0, num_tokens=14) is None
    maps.flush()
    assert _mapped(maps, 2) == [40, 41, 42, 43] and _mapped(maps, 7) == [44, 45, 0, 0]
    assert _mapped(maps, 9) == [0] * BS


def test_a_group_of_larger_blocks_maps_each_full_block_into_its_part_of_a_window_block():
    maps = WindowMaps((6,), num_blocks=32, block_size=BS, device=torch.device("cpu"), block_sizes=(8,))
    assert maps.claim("a", [5, 9, 2, 7], [[0, 30]], prefix=0, num_tokens=14) is None
    maps.flush()
    assert _mapped(maps, 2) == list(range(240, 244)) and _mapped(maps, 7) == list(range(244, 248))
    # another request's window block over full block 2 only from its second half: refused, naming both
    why = maps.claim("b", [1, 2], [[31]], prefix=0, num_tokens=8)
    assert "full block 2" in why and "'a'" in why and "block 30" in why


def test_window_lists_of_other_block_sizes_that_do_not_cover_the_request_or_its_prefix_are_refused():
    maps = WindowMaps((6,), num_blocks=32, block_size=BS, device=torch.device("cpu"), block_sizes=(8,))
    assert "not whole blocks of 8" in maps.claim("a", [3], [[1]], prefix=4, num_tokens=4)
    assert "has 1 blocks of 8 tokens" in maps.claim("a", [3, 4, 5], [[1]], prefix=0, num_tokens=12)
    assert maps.claim("a", [3, 4, 5], [[1, 2]], prefix=0, num_tokens=12) is None
