"""Engines by name. An engine module registers its class with :func:`register_engine`, with the
check that its library imports and the extras that install it; the CLI and the demo take their
choices from :func:`engine_names` and refuse an engine that is not installed (:func:`missing_engine`).

Example::

    make_engine("nixl", "prefill-0", memory="VRAM", num_threads=4)
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["engine_names", "engine_settings", "make_engine", "missing_engine", "register_engine"]

_ENGINES: dict[str, Callable[..., Any]] = {}
_PROBES: dict[str, tuple[Callable[[], Any], str]] = {}  # name -> (imports the engine's library, install hint)


def register_engine(name: str, probe: Callable[[], Any] | None = None, install: str = "") -> Callable[[type], type]:
    """Class decorator: make the engine class constructible by ``name``. ``probe`` imports the engine's
    library (raising ``ImportError`` or ``OSError`` where it cannot); ``install`` says what installs it."""
    def add(cls: type) -> type:
        _ENGINES[name] = cls
        if probe is not None:
            _PROBES[name] = (probe, install)
        return cls
    return add


def missing_engine(kind: str) -> str | None:
    """``None`` when engine ``kind``'s library imports here, else a sentence that says why not and which
    extra installs it (the engines import their libraries only when one is made: this asks up front)."""
    probe, install = _PROBES.get(kind, (None, ""))
    if probe is None:
        return None
    try:
        probe()
    except (ImportError, OSError) as err:  # OSError: a shared library the wheel needs (libibverbs for Mooncake)
        return f"{kind} is not installed here ({err}); {install}"
    return None


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
