"""A worker side's planning rows (:class:`PlanningRows`): the rows of its planning table free to take, and
the requests that wait for one, in order.

vLLM hands a connector as many requests in a step as its KV blocks allow, not ``max_num_seqs``: a prefill's
finished requests and a decode's loads can outnumber the rows (``max_requests``) at once. Those beyond wait
here, oldest first, each with its deadline, and take rows as earlier requests end; none is dropped for the
bound, and one that waits past its deadline fails, named (the worker says how).

Example::

    rows = PlanningRows(257)                           # rows 1..256 (row 0 stays unused)
    for request_id, (request, deadline) in rows.in_order(step_requests, now, timeout_s):
        row = rows.take()
        if row is None and not rows.wait(request_id, request, deadline, now):
            ...                                       # waited past its deadline: fail it
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["PlanningRows"]


class PlanningRows:
    """Free rows of a planning table (row 0 stays unused, as in SGLang's request pool) and the requests that
    wait for one, by id, oldest first, each with its deadline."""

    def __init__(self, count: int):
        self.free = list(range(count - 1, 0, -1))
        self.waiting: dict[str, tuple[Any, float]] = {}

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def give(self, row: int) -> None:
        self.free.append(row)

    def in_order(self, new: Mapping[str, Any], now: float, timeout_s: float) -> list[tuple[str, tuple[Any, float]]]:
        """The requests that wait, oldest first, then ``new`` (each with its deadline: ``timeout_s`` from
        ``now``). The waiting are taken out: one that still finds no row goes back (:meth:`wait`)."""
        old = list(self.waiting.items())
        self.waiting.clear()
        return old + [(r, (x, now + timeout_s)) for r, x in new.items()]

    def wait(self, request_id: str, request: Any, deadline: float, now: float) -> bool:
        """Let ``request``, which found no free row, wait for one; ``False`` once its deadline has passed."""
        if now > deadline:
            return False
        self.waiting[request_id] = (request, deadline)
        return True
