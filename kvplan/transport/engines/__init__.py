"""Transfer engines: the interface (:mod:`.base`), the registry (:mod:`.registry`) and one module
per engine (:mod:`.nixl`, :mod:`.mooncake`, :mod:`.ipc`). Importing this package registers every engine; an
engine's own library is imported only when one is made."""

from . import ipc, mooncake, nixl  # noqa: F401  (registers the engines)
from .base import Capabilities, Engine, Handle, TransferError, Waiting, is_unsafe, wait_all, write
from .registry import check_settings, engine_names, make_engine, missing_engine, register_engine

__all__ = ["Capabilities", "Engine", "Handle", "TransferError", "Waiting", "is_unsafe", "check_settings", "engine_names", "make_engine",
           "missing_engine", "register_engine", "wait_all", "write"]
