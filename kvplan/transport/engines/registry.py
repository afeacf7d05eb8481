"""Engines by name. An engine module registers its class with :func:`register_engine`; the CLI and
the demo take their choices from :func:`engine_names`.

Example::

    make_engine("nixl", "prefill-0", memory="VRAM", num_threads=4)
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["engine_names", "engine_settings", "make_engine", "register_engine"]

_ENGINES: dict[str, Callable[..., Any]] = {}


def register_engine(name: str) -> Callable[[type], type]:
    """Class decorator: make the engine class constructible by ``name``."""
    def add(cls: type) -> type:
        _ENGINES[name] = cls
        return cls
    return add


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def engine_settings(kind: str) -> list[str]:
    """The names of engine ``kind``'s own settings (its constructor's, past name, memory and device)."""
    import inspect

    parameters = inspect.signature(_ENGINES[kind]).parameters
    return [p for p in parameters if p not in ("self", "name", "memory", "device_id")]


def make_engine(kind: str, name: str, memory: str = "DRAM", device_id: int = 0, **settings: Any):
    """An engine of kind ``kind`` (see :func:`engine_names`); ``settings`` are the engine's own."""
    try:
        cls = _ENGINES[kind]
    except KeyError:
        raise ValueError(f"unknown engine {kind!r}; choose from {', '.join(engine_names())}") from None
    return cls(name, memory, device_id, **settings)
