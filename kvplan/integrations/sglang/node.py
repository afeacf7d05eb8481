"""Where an SGLang rank is: its attention TP place, its parallel layout and its addresses, as SGLang knows them.

Inside SGLang's scheduler the runtime context (``sglang.srt.runtime_context``) is published, and it
is what SGLang's own managers read: attention TP under DP attention (``tp_size / dp_size``), DP and
PP ranks, the serving host and ``--dist-init-addr``. Where it is not published (a manager built by
hand, a test) the server args are read instead. Nothing here picks loopback: the node's address is
the one SGLang advertises for its own ranks (``get_local_ip_auto``, which honours ``SGLANG_HOST_IP``).

Example::

    size, rank = attention_tp(server_args, kv_args)        # (4, 1) on TP 8 with DP attention 2
    node_address(server_args)                              # "10.1.2.3": what this rank advertises
    bootstrap_host(server_args)                            # where SGLang's bootstrap server listens
"""

from __future__ import annotations

from typing import Any

__all__ = ["attention_tp", "bootstrap_host", "context_parallel", "node_address", "parallel_place", "server_arg"]

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # a wildcard bind is reached on its family's loopback


def _context(getter: str, name: str) -> Any:
    """A field of SGLang's published runtime context, or None where nothing is published."""
    try:
        from sglang.srt import runtime_context

        return getattr(getattr(runtime_context, getter)(), name)
    except Exception:  # noqa: BLE001 - not inside SGLang's scheduler: the server args are read instead
        return None


def _arg(server_args: Any, name: str) -> Any:
    return getattr(server_args, name, None) if server_args is not None else None


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


# which of SGLang's published config namespaces holds a server arg (SGLang's own managers read them there:
# inside its scheduler the ServerArgs object's attributes keep their defaults)
_NAMESPACES = {"host": "get_serving", "port": "get_serving", "max_running_requests": "get_schedule",
               "context_length": "get_model"}


def server_arg(server_args: Any, name: str, default: Any = None) -> Any:
    """SGLang's server arg ``name``: from its published runtime context where there is one (its
    scheduler), else the server args' attribute, else ``default``."""
    getter = "get_disagg" if name.startswith("disaggregation_") else _NAMESPACES.get(name)
    return _first(_context(getter, name) if getter else None, _arg(server_args, name), default)


def attention_tp(server_args: Any, kv_args: Any) -> tuple[int, int]:
    """``(attn_tp_size, attn_tp_rank)``: SGLang's published values, else the server args'
    ``attn_tp_size``, else ``tp_size / dp_size`` with DP attention, else ``tp_size``; the rank is the
    context's, else ``engine_rank`` within the attention group."""
    size = _first(_context("get_parallel", "attn_tp_size"), _arg(server_args, "attn_tp_size"))
    if size is None:
        tp = int(_arg(server_args, "tp_size") or 1)
        dp = int(_arg(server_args, "dp_size") or 1) if _arg(server_args, "enable_dp_attention") else 1
        size = max(1, tp // max(1, dp))
    size = int(size)
    rank = _context("get_parallel", "attn_tp_rank")
    rank = int(rank) if rank is not None else int(getattr(kv_args, "engine_rank", 0)) % size
    return size, rank


def context_parallel(server_args: Any) -> int:
    """The attention context-parallel size (1 without it): SGLang's published value, else the server args'."""
    return int(_first(_context("get_parallel", "attn_cp_size"), _arg(server_args, "attn_cp_size"), 1))


def parallel_place(server_args: Any, kv_args: Any) -> dict[str, int]:
    """The rest of a prefill rank's place, as SGLang registers it: DP attention, PP, system DP."""
    def get(name: str, fallback: Any, default: int) -> int:
        return int(_first(_context("get_parallel", name), fallback, default))

    return {
        "attn_dp_size": get("attn_dp_size", None, 1),
        "attn_dp_rank": get("attn_dp_rank", None, 0),
        "pp_size": get("pp_size", _arg(server_args, "pp_size"), 1),
        "pp_rank": int(getattr(kv_args, "pp_rank", 0) or 0),
        "system_dp_size": get("dp_size", _arg(server_args, "dp_size"), 1),
        "system_dp_rank": int(getattr(kv_args, "system_dp_rank", 0) or 0),
    }


def node_address(server_args: Any) -> str:
    """The address this rank binds and advertises: SGLang's own choice for its ranks
    (``get_local_ip_auto``: ``SGLANG_HOST_IP``, then the node's interfaces), else the server args'
    ``host`` (a wildcard read as its family's loopback)."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto

        return str(get_local_ip_auto())
    except Exception:  # noqa: BLE001 - SGLang absent or no address found: the configured host
        host = server_arg(server_args, "host")
        if host is None:
            raise ValueError("no address for this node: set KVPLAN_HOST (or SGLANG_HOST_IP)") from None
        return _WILDCARDS.get(str(host), str(host))


def bootstrap_host(server_args: Any) -> str:
    """Where SGLang's bootstrap server listens, as SGLang's prefill ranks find it: the host of
    ``--dist-init-addr`` on several nodes, else the serving ``--host`` (a wildcard as its loopback)."""
    dist = _first(_context("get_parallel", "dist_init_addr"), _arg(server_args, "dist_init_addr"))
    if dist:
        host = str(dist).rsplit(":", 1)[0] if str(dist).count(":") == 1 or str(dist).startswith("[") else str(dist)
        return host.strip("[]")
    host = server_arg(server_args, "host")
    return _WILDCARDS.get(str(host), str(host)) if host is not None else node_address(server_args)
