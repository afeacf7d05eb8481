"""SGLang's bootstrap server (0.5.23), spoken by kvplan: how prefill ranks are found.

An SGLang prefill node runs an HTTP bootstrap server (``CommonKVBootstrapServer``). Each prefill
rank registers its control socket there (``PUT /route``, ``CommonKVManager.register_to_bootstrap``),
and a decode rank looks up first the prefill's parallel layout, then the rank that holds its part
(``GET /route``, ``try_ensure_parallel_info`` and ``_get_bootstrap_info_from_server``). With
:func:`register_rank` a kvplan prefill rank is found by SGLang's decode like its own;
:func:`prefill_layout` and :func:`prefill_rank` find an SGLang (or kvplan) prefill rank the way
SGLang's decode does. Answers are read strictly: a missing or malformed field is a
:class:`~kvplan.errors.PeerError` naming it. Every call has a timeout.

Example::

    register_rank("127.0.0.1", 8998, RankRoute(rank_ip="127.0.0.1", rank_port=17000, page_size=64,
                                                kv_cache_dtype="bfloat16", attn_tp_size=2, attn_tp_rank=0))
    layout = prefill_layout("127.0.0.1", 8998)              # PrefillLayout(attn_tp_size=2, ...)
    prefill_rank("127.0.0.1", 8998, tp_rank=1)              # ("127.0.0.1", 17001)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import PeerError

__all__ = ["BootstrapNotReady", "PrefillLayout", "RankRoute", "prefill_layout", "prefill_rank", "register_rank"]


class BootstrapNotReady(PeerError):
    """The bootstrap server answered that not every prefill rank has registered yet (HTTP 503)."""


@dataclass(frozen=True)
class RankRoute:
    """What a prefill rank registers: its place in the prefill's parallel layout, its control socket
    (``rank_ip``, ``rank_port``) and the layout facts a decode checks (page size, KV dtype)."""

    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    system_dp_size: int = 1
    system_dp_rank: int = 0
    kv_layout: str | None = None
    load_balance_method: str = "follow_bootstrap_room"
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    prefill_http_port: int | None = None
    decode_allocation_policy: str = "early"


@dataclass(frozen=True)
class PrefillLayout:
    """The prefill's parallel layout as its bootstrap server reports it (SGLang's ``PrefillServerInfo``)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    kv_layout: str | None = None
    prefill_http_port: int | None = None
    decode_allocation_policy: str = "early"


_KINDS = {int: "an integer", str: "a string", bool: "true or false"}
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _url(host: str, port: int, query: str = "") -> str:
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{int(port)}/route" + (f"?{query}" if query else "")


def _call(request: urllib.request.Request, timeout: float) -> Any:
    """The JSON (or text) of the server's answer; raises :class:`BootstrapNotReady` on 503 and
    :class:`PeerError` on any other failure, with the server's own text."""
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            body = answer.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as err:
        text = err.read().decode("utf-8", errors="replace")[:200]
        kind = BootstrapNotReady if err.code == 503 else PeerError
        raise kind(f"the bootstrap server at {request.full_url} answered {err.code}: {text}") from None
    except (urllib.error.URLError, OSError) as err:
        raise PeerError(f"the bootstrap server at {request.full_url} cannot be reached: {err}") from None
    try:
        return json.loads(body)
    except ValueError:
        return body


def register_rank(host: str, port: int, route: RankRoute, timeout: float = 5.0) -> None:
    """Register a prefill rank with the bootstrap server at ``host:port`` (``PUT /route``, the
    payload of ``register_to_bootstrap``). Raises :class:`PeerError` if the server refuses it."""
    payload = asdict(route)
    if payload["kv_layout"] is None:
        del payload["kv_layout"]
    if payload["prefill_http_port"] is None:
        del payload["prefill_http_port"]
    payload["dsv41_spec_layout"] = None
    request = urllib.request.Request(_url(host, port), data=json.dumps(payload).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    _call(request, timeout)


def _field(answer: Any, name: str, kind: type, what: str, optional: bool = False) -> Any:
    if not isinstance(answer, dict):
        raise PeerError(f"{what}: the bootstrap server answered {str(answer)[:80]!r}, not a JSON object")
    if name not in answer or answer[name] is None:
        if optional:
            return None
        raise PeerError(f"{what}: the bootstrap server's answer has no {name!r}")
    value = answer[name]
    if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # (SGLang's server passes some numbers through as they were registered)
    if not isinstance(value, kind) or kind is int and isinstance(value, bool):
        raise PeerError(f"{what}: {name!r} is not {_KINDS[kind]}: {value!r}")
    return value


def prefill_layout(host: str, port: int, timeout: float = 5.0) -> PrefillLayout:
    """The prefill's parallel layout, once every prefill rank has registered (else
    :class:`BootstrapNotReady`), as SGLang's decode asks for it (all ranks ``-1``)."""
    what = "the prefill's parallel layout"
    answer = _call(urllib.request.Request(_url(host, port, "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                                                            "&target_pp_rank=-1")), timeout)
    layout = PrefillLayout(
        attn_tp_size=_field(answer, "attn_tp_size", int, what), attn_cp_size=_field(answer, "attn_cp_size", int, what),
        dp_size=_field(answer, "dp_size", int, what), pp_size=_field(answer, "pp_size", int, what),
        page_size=_field(answer, "page_size", int, what, optional=True),
        kv_cache_dtype=_field(answer, "kv_cache_dtype", str, what, optional=True),
        follow_bootstrap_room=_field(answer, "follow_bootstrap_room", bool, what),
        enable_dsa_cache_layer_split=bool(_field(answer, "enable_dsa_cache_layer_split", bool, what, optional=True)),
        enable_kv_cache_sharding=bool(_field(answer, "enable_kv_cache_sharding", bool, what, optional=True)),
        kv_layout=_field(answer, "kv_layout", str, what, optional=True),
        prefill_http_port=_field(answer, "prefill_http_port", int, what, optional=True),
        decode_allocation_policy=_field(answer, "decode_allocation_policy", str, what, optional=True) or "early")
    for name in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size"):
        if getattr(layout, name) < 1:
            raise PeerError(f"{what}: {name} is {getattr(layout, name)}")
    return layout


def prefill_rank(host: str, port: int, tp_rank: int, dp_rank: int = 0, cp_rank: int = 0, pp_rank: int = 0,
                 timeout: float = 5.0) -> tuple[str, int]:
    """``(rank_ip, rank_port)``: the control socket of the prefill rank at that place, as registered."""
    what = f"prefill rank dp{dp_rank} cp{cp_rank} tp{tp_rank} pp{pp_rank}"
    query = f"prefill_dp_rank={int(dp_rank)}&prefill_cp_rank={int(cp_rank)}&target_tp_rank={int(tp_rank)}" \
            f"&target_pp_rank={int(pp_rank)}"
    answer = _call(urllib.request.Request(_url(host, port, query)), timeout)
    rank_port = _field(answer, "rank_port", int, what)
    if not 0 < rank_port < 65536:
        raise PeerError(f"{what}: rank_port {rank_port} is no TCP port")
    return _field(answer, "rank_ip", str, what), rank_port
