"""Every process-wide ``KVPLAN_*`` environment variable kvplan reads, with its default and meaning: the one
place they are read (:func:`get`, :func:`enabled`, :func:`number`), rendered into docs/settings.md
(:func:`markdown_table`; a test fails when the two differ). The SGLang adapter's own settings,
``KVPLAN_<NAME>`` for each of its keys, are the table of :mod:`kvplan.integrations.sglang.settings`.

Example::

    from kvplan import env

    if env.enabled("KVPLAN_TRACE"):
        ...
    drain_s = env.number("KVPLAN_DRAIN_S")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["VARIABLES", "Variable", "enabled", "get", "markdown_table", "number"]


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, its default (``None``: unset) and what it does."""

    name: str
    default: str | None
    meaning: str


VARIABLES = (
    Variable("KVPLAN_SECRET", None, "the control plane's shared secret: every pairing proves it, every control "
             "message and engine notification carries a code under it (docs/failures.md)"),
    Variable("KVPLAN_SECRET_FILE", None, "a file holding the secret (read when `KVPLAN_SECRET` is unset)"),
    Variable("KVPLAN_DRAIN_S", "5", "seconds a write that was aborted may take to end before it is reported "
             "`unsafe` (its pages are then never reused)"),
    Variable("KVPLAN_HOT_S", "0.002", "seconds a progress loop keeps yielding after its last event before it "
             "blocks on its sockets"),
    Variable("KVPLAN_COPY_GRAPHS", "1", "`0`: staged gathers are launched as kernels, not replayed from CUDA graphs"),
    Variable("KVPLAN_SCATTER_GRAPHS", "1", "`0`: a decode's staged scatters are launched as kernels, not replayed "
             "from CUDA graphs"),
    Variable("KVPLAN_UPLOAD_GRAPHS", "1", "`0`: a decode uploads scatter tables without CUDA graphs"),
    Variable("KVPLAN_TRACE", None, "non-empty (not `0`): staged runs, streamed sends and the decode log each "
             "step's clock (a trace, for benchmarks)"),
    Variable("KVPLAN_PROFILE", None, "a folder: the progress threads and `kvplan load`'s processes write a "
             "profile of their functions there"),
    Variable("KVPLAN_PROFILE_ONLY", "", "profile only the threads whose names start with this"),
    Variable("KVPLAN_LOG_LEVEL", None, "the log level `kvplan`'s command passes to the processes it starts"),
    Variable("KVPLAN_SGLANG", None, "`1`: the SGLang plugin switches kvplan's adapter on (docs/sglang.md)"),
    Variable("KVPLAN_CONFIG", None, "a JSON file of the SGLang adapter's settings (docs/sglang.md)"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str) -> str | None:
    """The variable's value in the environment, else its default. A name not in :data:`VARIABLES` raises
    ``KeyError``: a variable read must be registered (and so documented)."""
    return os.environ.get(name, _BY_NAME[name].default)


def enabled(name: str) -> bool:
    """Whether the variable is on: set (or defaulted) to anything but empty or ``0``."""
    return get(name) not in (None, "", "0")


def number(name: str) -> float:
    """The variable as a number (``ValueError`` naming it when it is not one)."""
    value = get(name)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number") from None


def markdown_table() -> str:
    """:data:`VARIABLES` as the table docs/settings.md shows."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for v in VARIABLES:
        rows.append(f"| `{v.name}` | {'unset' if v.default is None else f'`{v.default}`'} | {v.meaning} |")
    return "\n".join(rows)
