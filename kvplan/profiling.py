"""cProfile of one thread of a kvplan process when ``KVPLAN_PROFILE`` names a folder (off otherwise).

The demo's and ``kvplan load``'s processes profile their own loops; the endpoints' progress threads
(where a batch is planned, posted and settled) profile themselves, each to a file of its own, since
cProfile sees only the thread it was enabled on. From Python 3.12 on a process may run one profiler at a
time: ``KVPLAN_PROFILE_ONLY`` (a name's start, such as ``prefill-progress``) picks which blocks profile,
and a block that finds another profiler running logs so and runs unprofiled.

Example::

    with Profile("decode"):  # KVPLAN_PROFILE=/tmp/prof writes /tmp/prof/decode.txt at the end
        run_loop()
"""

from __future__ import annotations

import logging
import os
from . import env

__all__ = ["Profile"]

log = logging.getLogger(__name__)


class Profile:
    """The functions with the most own time, then the most time under them (waits included), written
    to ``<KVPLAN_PROFILE>/<name>.txt`` when the block ends."""

    def __init__(self, name: str):
        self.folder, self.name = env.get("KVPLAN_PROFILE"), name
        if not name.startswith(env.get("KVPLAN_PROFILE_ONLY")):
            self.folder = None
        self.profiler = None

    def __enter__(self) -> "Profile":
        if self.folder:
            import cProfile

            self.profiler = cProfile.Profile()
            try:
                self.profiler.enable()
            except ValueError as err:  # (3.12+: another block of this process profiles)
                log.warning("%s runs unprofiled: %s", self.name, err)
                self.profiler = None
        return self

    def __exit__(self, *exc) -> None:
        if self.profiler is None:
            return
        import io
        import pstats

        self.profiler.disable()
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(self.profiler, stream=text).sort_stats(order).print_stats(40)
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"{self.name}.txt"), "w") as out:
            out.write(text.getvalue())
