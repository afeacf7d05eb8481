"""vLLM's KV cache groups as kvplan's connector moves them.

vLLM gives each KV cache group its own block table; a request holds a list of blocks per group. kvplan
covers one full-attention group, its KV (``FullAttentionSpec``, or ``MLAAttentionSpec`` without a sliding
window), any number of sliding-window attention groups (``SlidingWindowSpec``), each a SWA state
component: only the blocks of the window the decode's next token attends to move (planning.md §6), found
through a map from the full group's slots to the group's own (:mod:`.windows`), and any number of Mamba
groups (``MambaSpec``), each a Mamba state component: a request's state block (the one its running state
is in; vLLM's speculative scratch blocks after it stay) moves to the decode's, found through a map by
planning row. Each attention group keeps its own block size (vLLM gives layers of smaller pages larger or
padded blocks): a sliding-window group's map is made token by token, so its blocks need not be the full
group's. Every other kind (chunked local attention, cross attention, encoder-only, ...) and a model without
one full-attention group are refused, naming them.

Example::

    groups = transfer_groups(kv_cache_config)     # e.g. (KVGroup(full layers), KVGroup(swa layers, window=128))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import KvplanError
from ...planner.contract.batch import TensorShard
from .mamba_shards import conv_dim_first, mamba_shards

__all__ = ["KVGroup", "MAMBA_KIND", "UnsupportedConfig", "WINDOW_KIND", "transfer_groups"]

_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOW_SPECS = ("SlidingWindowSpec",)
_STATE_SPECS = ("MambaSpec",)
WINDOW_KIND = "swa"  # the kvplan state kind a sliding-window group moves as (planning.md §6)
MAMBA_KIND = "mamba"  # ... and a Mamba group


class UnsupportedConfig(KvplanError, ValueError):
    """A vLLM configuration this connector does not cover; names what and why."""


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its layers, its sliding window in tokens (0: full attention), whether
    it holds Mamba state, then how many speculative scratch blocks follow a request's state block, its
    block size in tokens (0: the engine's ``--block-size``) and, for a Mamba group, how each tensor of its
    page is sharded across TP ranks (empty: unknown; it then moves between equal TP sizes only)."""

    layers: tuple[str, ...]
    window: int = 0
    mamba: bool = False
    scratch_blocks: int = 0
    block_size: int = 0
    shards: tuple[TensorShard, ...] = ()  # a Mamba group's tensors in a page (:mod:`.mamba_shards`), if known

    def state_block(self, blocks: list[int]) -> list[int]:
        """A Mamba group's block list cut to the block that holds the request's running state: the last one
        before the speculative scratch blocks (at least one block stays); another group's as it is."""
        if not self.mamba or not blocks:
            return blocks
        scratch = min(self.scratch_blocks, len(blocks) - 1)
        return list(blocks[: len(blocks) - scratch][-1:])


def _named(group: Any) -> str:
    names = list(group.layer_names)
    return f"{type(group.kv_cache_spec).__name__} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"


def transfer_groups(kv_cache_config: Any, tp_size: int = 1) -> tuple[KVGroup, ...]:
    """The groups of ``kv_cache_config`` that transfer, in vLLM's order (its ``transfer_groups`` where it
    names them), for a rank of TP size ``tp_size``, or :class:`UnsupportedConfig` naming what is not
    covered."""
    groups = list(getattr(kv_cache_config, "transfer_groups", None) or kv_cache_config.kv_cache_groups)
    out, uncovered = [], []
    for group in groups:
        spec, kind = group.kv_cache_spec, type(group.kv_cache_spec).__name__
        # (the tokens a sliding window keeps readable, its own included: vLLM's num_retained_tokens + 1)
        window = int(getattr(spec, "sliding_window", None) or 0) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        block_size = int(getattr(spec, "block_size", 0) or 0)
        if kind in _FULL_SPECS and not window:
            out.append(KVGroup(tuple(group.layer_names), block_size=block_size))
        elif kind in _WINDOW_SPECS and window > 1:
            out.append(KVGroup(tuple(group.layer_names), window, block_size=block_size))
        elif kind in _STATE_SPECS:
            out.append(KVGroup(tuple(group.layer_names), mamba=True,
                               scratch_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
                               shards=mamba_shards(spec, tp_size, conv_dim_first())))
        else:
            uncovered.append(_named(group))
    if uncovered:
        raise UnsupportedConfig(f"kvplan's vLLM connector moves full-attention, sliding-window attention and Mamba KV "
                                f"cache groups; not {'; '.join(uncovered)} (docs/vllm.md: what is covered)")
    full = [g for g in out if not g.window and not g.mamba]
    if len(full) != 1:
        raise UnsupportedConfig(f"{len(full)} full-attention KV cache groups: kvplan's vLLM connector moves one "
                                "(its KV), with any sliding-window and Mamba groups as state (docs/vllm.md)")
    return tuple(out)
