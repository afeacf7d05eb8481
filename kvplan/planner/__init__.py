"""Batches in, plans out, in three rooms, one folder each; a module imports from its own room and
those before it in :data:`ROOMS`, never from one after (``tests/test_import_cycles.py`` checks it by
path). ``README.md`` here gives the reading order.

* ``contract/``: what a batch is and the rules every planner obeys: the sides' memory and the
  batch (``batch``), state kinds and head slices (``state_kinds``, ``tensor_slices``), their checks
  (``rules``, ``block_tables``, ``claims``), how two sides pair (``pairing``), what a plan holds
  (``plan``, ``layer_groups``). It imports only kvplan's errors and the kernels' shape helpers.
* ``reference/``: the NumPy oracle that defines correctness (``oracle``) and what it builds on:
  page mapping across page sizes, chunk lists, descriptor expansion on the host.
* ``device/``: the planner on tensors (``planner``, with its ``tables``, ``buffers`` and
  ``pending`` plans; ``eager`` for one call; ``isolate``), its batch columns and index lists, the
  decode side's destination lists, NIXL's prepared indices. The hot path (``Planner.plan``) stays
  in ``device/planner.py``.

Importing the package registers the state kinds' rules (``contract/state_kinds.py``) with the batch
module, which finds them through ``kind_rules`` without importing back.
"""

from .contract import state_kinds  # noqa: F401  (registers the kinds' rules)

ROOMS: tuple[str, ...] = ("contract", "reference", "device")
