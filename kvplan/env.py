"""Every process-wide ``KVPLAN_*`` environment variable kvplan reads, with its default, its kind and its
meaning: the one place they are read and checked (:func:`get`, :func:`enabled`, :func:`number`,
:func:`validate`), rendered into docs/settings.md (:func:`markdown_table`; a test fails when the two
differ). A value that does not parse or lies out of range raises :class:`~kvplan.errors.SettingError`
naming the variable, where it is read and in :func:`validate`, which the endpoints call once at start. The
SGLang adapter's own settings, ``KVPLAN_<NAME>`` for each of its keys, are the table of
:mod:`kvplan.integrations.sglang.settings`.

Example::

    from kvplan import env

    env.validate()                       # every KVPLAN_* variable set here, checked at once
    if env.enabled("KVPLAN_TRACE"):
        ...
    drain_s = env.number("KVPLAN_DRAIN_S")
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import SettingError

__all__ = ["VARIABLES", "Variable", "check", "enabled", "flag", "get", "markdown_table", "number", "validate"]


FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("", "0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, its default (``None``: unset), what it does and what it takes.

    ``kind`` is ``"text"`` (anything), ``"flag"`` (``1``/``0``, ``true``/``false``, ``yes``/``no``,
    ``on``/``off``, any case; empty is off), ``"number"`` (a finite number, at least ``minimum``),
    ``"file"`` (a readable file), ``"private"`` (a readable file no one but its owner, this user, may read or
    write: a secret's), ``"level"`` (a logging level's name) or ``"secret"`` (non-empty)."""

    name: str
    default: str | None
    meaning: str
    kind: str = "text"
    minimum: float | None = None

    def takes(self) -> str:
        """What the variable accepts, as the docs' table and the errors say it."""
        if self.kind == "number":
            return "a number" if self.minimum is None else f"a number >= {self.minimum:g}"
        return {"flag": "`1` or `0`", "file": "a readable file",
                "private": "a file of this user's that no one else may read or write (mode 600 or 400)", "level": " ".join(f"`{x}`" for x in LOG_LEVELS),
                "secret": "non-empty text"}.get(self.kind, "text")


VARIABLES = (
    Variable("KVPLAN_SECRET", None, "the control plane's shared secret (off loopback, needed unless `KVPLAN_INSECURE`): every pairing proves it, every control "
             "message and engine notification carries a code under it (docs/failures.md)", "secret"),
    Variable("KVPLAN_SECRET_FILE", None, "a file holding the secret (read when `KVPLAN_SECRET` is unset)", "private"),
    Variable("KVPLAN_INSECURE", None, "on: control channels without a secret run open (anyone who reaches the port "
             "can pair), logged and counted; off: without a secret they prove the loopback secret on loopback and "
             "do not start elsewhere (docs/failures.md §10)", "flag"),
    Variable("KVPLAN_LOOPBACK_SECRET_FILE", None, "where this user's per-host secret for loopback channels lives "
             "(created, mode 600, by the first process that needs it; default `~/.cache/kvplan/loopback-secret`)"),
    Variable("KVPLAN_DRAIN_S", "5", "seconds a write that was aborted may take to end before it is reported "
             "`unsafe` (its pages are then never reused)", "number", 0.0),
    Variable("KVPLAN_COPY_GRAPHS", "1", "`0`: staged gathers are launched as kernels, not replayed from CUDA graphs",
             "flag"),
    Variable("KVPLAN_SCATTER_GRAPHS", "1", "`0`: a decode's staged scatters are launched as kernels, not replayed "
             "from CUDA graphs", "flag"),
    Variable("KVPLAN_UPLOAD_GRAPHS", "1", "`0`: a decode uploads scatter tables without CUDA graphs", "flag"),
    Variable("KVPLAN_TRACE", None, "on: staged runs, streamed sends and the decode log each step's clock, and a "
             "prefill's progress thread its batches' phases (a trace, for benchmarks)", "flag"),
    Variable("KVPLAN_PROFILE", None, "a folder: the progress threads and `kvplan load`'s processes write a "
             "profile of their functions there"),
    Variable("KVPLAN_PROFILE_ONLY", "", "profile only the threads whose names start with this"),
    Variable("KVPLAN_LOG_LEVEL", None, "the log level of `kvplan`'s command and the processes it starts (its "
             "`--log-level` wins)", "level"),
    Variable("KVPLAN_SGLANG", None, "on: the SGLang plugin switches kvplan's adapter on (docs/sglang.md)", "flag"),
    Variable("KVPLAN_CONFIG", None, "a JSON file of the SGLang adapter's settings (docs/sglang.md)", "file"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def get(name: str) -> str | None:
    """The variable's value in the environment, else its default. A name not in :data:`VARIABLES` raises
    ``KeyError``: a variable read must be registered (and so documented)."""
    return os.environ.get(name, _BY_NAME[name].default)


def _refuse(variable: Variable, value: str, why: str) -> SettingError:
    return SettingError(variable.name, f"{variable.name}={value!r}: {why}; it takes {variable.takes()} "
                        "(docs/settings.md)")


def flag(name: str, value: str | None) -> bool:
    """``value`` of the flag variable ``name`` as a bool (unset and empty are off); anything but the
    flag words raises :class:`SettingError`."""
    if value is None or value.strip().lower() in FLAG_OFF:
        return False
    if value.strip().lower() in FLAG_ON:
        return True
    raise _refuse(_BY_NAME[name], value, "not a switch")


def enabled(name: str) -> bool:
    """Whether the flag variable is on (:func:`flag` of its value or default)."""
    return flag(name, get(name))


def number(name: str) -> float:
    """The variable as a number, checked against its minimum (:class:`SettingError` naming it when it is
    not a finite number in range)."""
    return _number(_BY_NAME[name], get(name))


def _number(variable: Variable, value: str | None) -> float:
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise _refuse(variable, str(value), "not a number") from None
    if not math.isfinite(result):
        raise _refuse(variable, str(value), "not a finite number")
    if variable.minimum is not None and result < variable.minimum:
        raise _refuse(variable, str(value), f"below {variable.minimum:g}")
    return result


def not_private(path: str) -> str | None:
    """Why the file at ``path`` cannot hold a secret (another user owns it, or others may read or write it),
    or ``None``. A secret others can read is theirs too."""
    info = os.stat(path)
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"owned by user {info.st_uid}, not by this process's user {os.geteuid()}"
    if info.st_mode & 0o077:
        return (f"its mode {info.st_mode & 0o777:o} lets others than its owner read or write it: `chmod 600 {path}`")
    return None


def check(variable: Variable, value: str) -> None:
    """Raise :class:`SettingError` when ``value`` is not one ``variable`` takes."""
    if variable.kind == "flag":
        flag(variable.name, value)
    elif variable.kind == "number":
        _number(variable, value)
    elif variable.kind in ("file", "private"):
        if not os.path.isfile(value) or not os.access(value, os.R_OK):
            raise _refuse(variable, value, "no readable file there")
        if variable.kind == "private" and (why := not_private(value)):
            raise _refuse(variable, value, why)
    elif variable.kind == "level":
        if value.strip().upper() not in LOG_LEVELS:
            raise _refuse(variable, value, "not a log level")
    elif variable.kind == "secret":
        if not value.strip():
            raise _refuse(variable, value, "empty: an empty secret authenticates anyone")


def validate(environ: Mapping[str, str] | None = None) -> None:
    """Check every registered variable set in ``environ`` (the process's by default) at once: one
    :class:`SettingError` whose message has a line per bad variable, or nothing."""
    environ = os.environ if environ is None else environ
    problems = []
    for variable in VARIABLES:
        if variable.name in environ:
            try:
                check(variable, environ[variable.name])
            except SettingError as err:
                problems.append(err)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise SettingError(problems[0].setting, "\n".join(str(p) for p in problems))


def markdown_table() -> str:
    """:data:`VARIABLES` as the table docs/settings.md shows."""
    rows = ["| variable | default | takes | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        rows.append(f"| `{v.name}` | {'unset' if v.default is None else f'`{v.default}`'} | {v.takes()} | {v.meaning} |")
    return "\n".join(rows)
