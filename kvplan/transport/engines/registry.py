"""Engines by name. An engine module registers its class with :func:`register_engine`, with the
check that its library imports and the extras that install it; the CLI and the demo take their
choices from :func:`engine_names` and refuse an engine that is not installed (:func:`missing_engine`).

Example::

    make_engine("nixl", "prefill-0", memory="VRAM", num_threads=4)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from ...errors import SettingError

__all__ = ["check_settings", "engine_names", "engine_settings", "make_engine", "missing_engine", "register_engine"]

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


def _settings(kind: str) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(_ENGINES[kind]).parameters
    return {n: p for n, p in parameters.items() if n not in ("self", "name", "memory", "device_id")}


def engine_settings(kind: str) -> list[str]:
    """The names of engine ``kind``'s own settings (its constructor's, past name, memory and device)."""
    return list(_settings(kind))


def check_settings(kind: str, settings: Mapping[str, Any], where: str = "engine settings") -> None:
    """Raise :class:`~kvplan.errors.SettingError`, naming the setting and ``where`` it came from, for the
    first of ``settings`` engine ``kind`` does not take: an unknown engine or key, a value of the wrong
    type (a switch, a count >= 0, a name), or one outside the engine's ``SETTING_CHOICES``. The CLI and
    both integrations call it before an engine is made, so a typo fails at start, not half-way through a
    run.

    Example::

        check_settings("mooncake", {"protocol": "rdma", "device_name": "mlx5_0"})
    """
    if kind not in _ENGINES:
        raise SettingError("engine", f"{where}: unknown engine {kind!r}; choose from {', '.join(engine_names())}")
    known = _settings(kind)
    choices = getattr(_ENGINES[kind], "SETTING_CHOICES", {})
    for key, value in settings.items():
        if key not in known:
            raise SettingError(key, f"{where}: {kind} has no setting {key!r}; its settings: {', '.join(known) or 'none'}")
        annotation, default = str(known[key].annotation), known[key].default
        if isinstance(default, bool) or annotation == "bool":
            ok, takes = isinstance(value, bool) or value in (0, 1), "true or false"
        elif "int" in annotation:
            ok, takes = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a count >= 0"
        elif "str" in annotation:
            ok, takes = isinstance(value, str), "text"
        else:
            ok, takes = True, ""
        if ok and key in choices and value not in choices[key]:
            ok, takes = False, f"one of {', '.join(map(str, choices[key]))}"
        if not ok:
            raise SettingError(key, f"{where}: {kind}'s {key}={value!r}; it takes {takes}")


def make_engine(kind: str, name: str, memory: str = "DRAM", device_id: int = 0, **settings: Any):
    """An engine of kind ``kind`` (see :func:`engine_names`); ``settings`` are the engine's own, checked
    first (:func:`check_settings`)."""
    try:
        cls = _ENGINES[kind]
    except KeyError:
        raise ValueError(f"unknown engine {kind!r}; choose from {', '.join(engine_names())}") from None
    check_settings(kind, settings)
    return cls(name, memory, device_id, **settings)
