"""What kvplan's vLLM connector tests hand vLLM's code: configurations, requests and KV caches shaped
as vLLM 0.33 makes them (a real ``VllmConfig`` needs a model), for the tests and for the prefill and
decode processes of :mod:`tests.integrations.vllm_node`. Needs vLLM installed (``make setup-vllm``)."""

import importlib.util
import json
import os
import sys
import types
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _without_vllm_kernels() -> None:
    """vLLM's CUDA platform imports its kernel library when imported (``vllm._C_stable_libtorch``), and the
    chain to ``allocate_kv_cache`` its flash attention (``vllm.vllm_flash_attn``, which raises unless its
    extensions load); the wheel's are built for torch 2.14 and are not carried to the cards
    (``benchmarks/vllm_site.py``). Nothing here runs a vLLM kernel: where vLLM is there without them, a
    stand-in module takes each name (flash attention's names raise if called)."""
    spec = importlib.util.find_spec("vllm")  # (finds the package without importing it)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if folders and not any(name.startswith("_C_stable_libtorch") for folder in folders for name in os.listdir(folder)):
        sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    if not folders or os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return  # (vLLM's CPU platform never imports flash attention)
    try:
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError:
        sys.modules["vllm.vllm_flash_attn"] = _flash_attention_stand_in()
    import torch

    try:
        import vllm._C  # noqa: F401  (registers vLLM's kernels as torch.ops._C)
    except ImportError:  # (their import-time capability checks answer "not supported"; any other op raises)
        torch.ops._C = _KernelsStandIn()


class _KernelsStandIn:
    """``torch.ops._C`` where vLLM's kernel library is not loaded: a ``*supported*`` / ``*supports*`` query
    answers False (what vLLM's modules ask at import); any other op is missing, as without the library."""

    def __getattr__(self, name: str):
        if "support" in name:
            return lambda *args, **kwargs: False
        raise AttributeError(f"vLLM's kernel {name} is not loaded here (tests/integrations/vllm_fakes.py)")


def _flash_attention_stand_in() -> types.ModuleType:
    """``vllm.vllm_flash_attn`` as its importers name it, with no kernel behind it."""
    module = types.ModuleType("vllm.vllm_flash_attn")

    def absent(*args, **kwargs):
        raise RuntimeError("vLLM's flash attention is a stand-in here (tests/integrations/vllm_fakes.py): no "
                           "vLLM kernel runs in kvplan's vLLM harness")

    for name in ("compile_flash_attn_varlen_func_from_specs", "flash_attn_varlen_func", "get_scheduler_metadata"):
        setattr(module, name, absent)
    module.FA2_AVAILABLE = module.FA3_AVAILABLE = False
    module.is_fa_version_supported = lambda *args, **kwargs: False
    module.fa_version_unsupported_reason = lambda *args, **kwargs: "a stand-in: vLLM's flash attention is not loaded"
    return module


_without_vllm_kernels()

import torch  # noqa: E402
from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,  # noqa: E402
                                        MambaSpec, SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

BLOCK = 16
ENGINE = "prefill-engine-0"


def full_attention(*groups_of_layers, num_blocks=64, heads=8, head_size=128, dtype=torch.bfloat16,
                   layout=None, block_size=BLOCK) -> KVCacheConfig:
    """A KV cache config of full-attention groups; with ``layout``, one backing allocation of one group
    placed as that layout places it (what vLLM's ``allocate_kv_cache`` reads)."""
    groups = [KVCacheGroupSpec(list(layers), FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                                                head_size=head_size, dtype=dtype))
              for layers in groups_of_layers]
    tensors = []
    if layout is not None:
        layers, page = groups[0].layer_names, groups[0].kv_cache_spec.page_size_bytes
        compact = layout.is_layer_compact
        tensors = [KVCacheTensor(size=page * num_blocks * len(layers), layers=list(layers),
                                 layer_stride=page * num_blocks if compact else page,
                                 block_stride=page if compact else page * len(layers))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def hybrid_attention(full_layers, window_layers, window: int, num_blocks=64, heads=8, head_size=128,
                     dtype=torch.bfloat16, layout=KVCacheLayout.LBHNC, block_size=BLOCK,
                     window_block_size=0) -> KVCacheConfig:
    """A full-attention group and a sliding-window group of ``window`` tokens, overlaid in one backing
    allocation from byte 0 as vLLM 0.33's ``get_kv_cache_config_from_groups`` places layer-outermost groups
    (a block belongs to one group at a time). With a smaller ``window_block_size`` the sliding-window group's
    blocks hold fewer tokens, each padded to the full group's page (vLLM's ``page_size_padded``)."""
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    window_block_size = window_block_size or block_size
    assert window_block_size <= block_size, "the fake pads the sliding-window group's pages, never the full group's"
    sliding = SlidingWindowSpec(block_size=window_block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
                                sliding_window=window,
                                page_size_padded=full.page_size_bytes if window_block_size < block_size else None)
    groups = [KVCacheGroupSpec(list(full_layers), full), KVCacheGroupSpec(list(window_layers), sliding)]
    page = full.page_size_bytes
    size = page * num_blocks * max(len(full_layers), len(window_layers))
    tensors = [KVCacheTensor(size=size, layers=list(g.layer_names), layer_stride=page * num_blocks, block_stride=page)
               for g in groups]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


# a Mamba2 layer of the model: a conv state of 3 rows over 16 + 8 + 8 channels (x | B | C), as (state_len, dim),
# vLLM's default layout, and a temporal (SSM) state of 4 heads of 4 x 8; each TP rank holds 1/tp of both
MAMBA_CONV, MAMBA_GROUPS, MAMBA_HEADS, MAMBA_DTYPES = (3, 32), (16, 8, 8), (4, 4, 8), (torch.bfloat16, torch.float32)


def mamba_shapes(tp_size: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A TP rank's shapes of :data:`MAMBA_CONV` and :data:`MAMBA_HEADS` (``MambaSpec.shapes``)."""
    return (MAMBA_CONV[0], MAMBA_CONV[1] // tp_size), (MAMBA_HEADS[0] // tp_size, *MAMBA_HEADS[1:])


def mamba_hybrid(full_layers, mamba_layers, num_blocks=64, heads=8, head_size=128, dtype=torch.bfloat16,
                 layout=KVCacheLayout.LBHNC, block_size=BLOCK, scratch_blocks=0, tp_size=1,
                 mamba_type=None) -> KVCacheConfig:
    """A full-attention group and a Mamba group, overlaid in one backing allocation from byte 0 as vLLM 0.33
    places layer-outermost groups: the Mamba state (a rank's of TP ``tp_size``) padded to the attention page
    (a block belongs to one group at a time), ``scratch_blocks`` speculative blocks after each request's state
    block; ``mamba_type``: vLLM's backend of the kind (Mamba2 by default)."""
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    page = full.page_size_bytes
    kind = {} if mamba_type is None else {"mamba_type": mamba_type}
    mamba = MambaSpec(block_size=block_size, shapes=mamba_shapes(tp_size), dtypes=MAMBA_DTYPES, page_size_padded=page,
                      num_speculative_blocks=scratch_blocks, **kind)
    assert mamba.state_content_size_bytes < page, "the fake's Mamba state must fit one attention page"
    groups = [KVCacheGroupSpec(list(full_layers), full), KVCacheGroupSpec(list(mamba_layers), mamba)]
    size = page * num_blocks * max(len(full_layers), len(mamba_layers))
    tensors = [KVCacheTensor(size=size, layers=list(g.layer_names), layer_stride=page * num_blocks, block_stride=page)
               for g in groups]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def kv_caches(kv_cache_config: KVCacheConfig, layout: KVCacheLayout, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The per-layer KV views vLLM's model runner registers with the connector (on the CPU by default)."""
    return allocate_kv_cache(kv_cache_config, torch.device(device), layout)


def vllm_config(extra=None, role="kv_both", lookahead=1, engine_id=ENGINE, max_model_len=4096,
                block_size=BLOCK, tp_size=1) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the factory, both schedulers and the worker read."""
    transfer = KVTransferConfig(kv_connector="KvplanConnector", kv_connector_module_path="kvplan.integrations.vllm",
                                kv_role=role, engine_id=engine_id,
                                kv_connector_extra_config={"host": "127.0.0.1", "port": 17500} if extra is None
                                else extra)
    return SimpleNamespace(
        kv_transfer_config=transfer, num_prefill_lookahead_tokens=lookahead,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False, max_num_seqs=32),
        cache_config=SimpleNamespace(block_size=block_size), model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, decode_context_parallel_size=1, data_parallel_index=0,
                                        pipeline_parallel_size=1))


def nixl_vllm_config(role: str, engine_id: str, model_dir: str, block_size: int = 32, dtype: str = "bfloat16",
                     device: str = "cpu") -> VllmConfig:
    """A real ``VllmConfig`` for vLLM's own ``NixlConnector`` (the baseline the benchmarks compare kvplan's
    connector with): it reads far more of the configuration than kvplan's does. ``model_dir`` holds the
    model's ``config.json`` (both sides must name the same path: it enters the connector's compatibility
    hash). On a CPU vLLM's attention backend wants blocks of a multiple of 32. ``device``: where the KV is
    (NIXL registers it there)."""
    from tests.integrations.vllm_suite.kvplan_vllm_plugin import OPT_125M

    config = os.path.join(model_dir, "config.json")
    if not os.path.exists(config):  # (both sides may write it: the same bytes, each replaced whole)
        os.makedirs(model_dir, exist_ok=True)
        with open(f"{config}.{os.getpid()}", "w") as f:
            json.dump(OPT_125M, f)
        os.replace(f"{config}.{os.getpid()}", config)
    model = ModelConfig(model=model_dir, dtype=dtype, seed=42)
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=model.max_model_len,
                                is_encoder_decoder=False)
    cache = CacheConfig(block_size=block_size, cache_dtype="auto")
    cache.kv_cache_layout = "LBNHC"  # (vLLM resolves the layout before it builds connectors)
    transfer = KVTransferConfig(kv_connector="NixlConnector", engine_id=engine_id, kv_buffer_device=device,
                                kv_role="kv_producer" if role == "prefill" else "kv_consumer")
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache, kv_transfer_config=transfer,
                      device_config=DeviceConfig(device),
                      # (on a card, Triton's attention backend: the others' kernels are vLLM's compiled ones)
                      attention_config=AttentionConfig(backend="TRITON_ATTN" if device == "cuda" else None))


def nixl_as_vllm_imports_it() -> None:
    """vLLM imports NIXL as ``nixl._api`` (the ``nixl`` meta-package's name); the wheels this project installs
    name it ``nixl_cu12`` (here) or ``nixl_cu13`` (the cards). Alias it, as vLLM itself aliases ROCm's build
    (``alias_nixl_for_ray``)."""
    from kvplan.transport.engines.nixl import NIXL_PACKAGES

    build = next((p for p in NIXL_PACKAGES if importlib.util.find_spec(p) is not None), None)
    if build in (None, "nixl"):
        return  # (vLLM finds it itself, or says NIXL is not available)
    for name in ("", "._api", "._bindings"):
        sys.modules.setdefault(f"nixl{name}", importlib.import_module(build + name))


def kv_blocks(*groups: list[int]) -> KVCacheBlocks:
    """vLLM's own ``KVCacheBlocks`` of these block ids, group by group (none cached: all unhashed); block 0 is
    vLLM's null block (``is_null``), as its block pool hands it out where a sliding window needs no block."""
    def block(block_id: int) -> KVCacheBlock:
        made = KVCacheBlock(block_id)
        made.is_null = block_id == 0
        return made

    return KVCacheBlocks(tuple([block(b) for b in group] for group in groups))


def request(request_id, prompt_len, params, computed=0, status=RequestStatus.RUNNING) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(range(prompt_len)), num_prompt_tokens=prompt_len,
                           _all_token_ids=list(range(prompt_len)), max_tokens=16, prompt_embeds=None,
                           get_skip_reading_prefix_cache=lambda: False,
                           num_computed_tokens=computed, status=status,
                           kv_transfer_params=None if params is None else dict(params))


class Blocks:
    """What ``update_state_after_alloc`` reads of vLLM's ``KVCacheBlocks``."""

    def __init__(self, *groups):
        self.groups = tuple(list(g) for g in groups)

    def get_unhashed_block_ids_all_groups(self):
        return self.groups
