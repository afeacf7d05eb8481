"""What the ``kvplan`` command checks before it starts any process: the environment's ``KVPLAN_*`` variables
and Triton's mode, and the engine settings given on its command line. Each check answers ``None`` or the
one line the command prints before it exits with code 2.

Example::

    why = environment_refusal()
    if why is not None:
        sys.exit(why)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

from .. import env
from ..errors import SettingError
from ..transport.engines.registry import check_settings

__all__ = ["engine_settings_refusal", "environment_refusal", "log_level"]


def environment_refusal() -> str | None:
    """One line for a setting of the environment that would fail after the processes start, else ``None``:
    every ``KVPLAN_*`` variable (:func:`kvplan.env.validate`), and ``TRITON_INTERPRET`` set to anything but
    1 where no GPU is."""
    try:
        env.validate()
    except SettingError as err:
        return f"kvplan: {err}"
    if os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            return (f"kvplan: TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} and no CUDA device: kvplan's "
                    "kernels run on a CPU only in Triton's interpreter; unset TRITON_INTERPRET (the command then "
                    "chooses it) or set it to 1")
    return None


def log_level(verbose: int) -> int:
    """``-v``/``-vv`` where given, else ``KVPLAN_LOG_LEVEL`` (checked by :func:`environment_refusal`), else
    WARNING."""
    if verbose:
        return logging.DEBUG if verbose >= 2 else logging.INFO
    named = env.get("KVPLAN_LOG_LEVEL")
    return logging.getLevelName(named.strip().upper()) if named else logging.WARNING


def engine_settings_refusal(engine: str, settings: Iterable[tuple[str, Any]]) -> str | None:
    """One line for an ``--engine-setting`` the engine does not take (an unknown key, a value of the wrong
    type or outside its choices), else ``None``."""
    try:
        check_settings(engine, dict(settings), where="--engine-setting")
    except SettingError as err:
        return str(err)
    return None
