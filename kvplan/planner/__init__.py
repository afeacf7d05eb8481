"""Batches in, plans out, in three rooms; a module imports from its own room and those above it in
this list, never from one below (``tests/test_import_cycles.py`` checks it):

* **model**: what a batch is and the rules every planner obeys: the sides' memory and state kinds
  (``model``, ``state_kinds``, ``tensor_slices``), their checks (``rules``, ``block_tables``,
  ``claims``), how two sides pair (``pairing``), what a plan holds (``plan``, ``layer_groups``).
  It imports only kvplan's errors and kernels' shape helpers.
* **host**: the NumPy reference that defines correctness (``reference``) and what it builds on: page
  mapping across page sizes, chunk lists, descriptor expansion on the host. It may import the model.
* **device**: the planner on tensors (``device``, ``gpu``, ``isolate``), its batch columns and index
  lists, the decode side's destination lists, NIXL's prepared indices. It may import both rooms above;
  the hot path (``Planner.plan``) stays in ``device``.

Importing the package registers the state kinds' rules (:mod:`.state_kinds`) with the model, which
finds them through :func:`.model.kind_rules` without importing back.
"""

from . import state_kinds  # noqa: F401  (registers the kinds' rules)

ROOMS: dict[str, tuple[str, ...]] = {
    "model": ("model", "rules", "state_kinds", "tensor_slices", "block_tables", "claims", "pairing", "plan",
              "layer_groups"),
    "host": ("reference", "host_expand", "page_mapping", "chunk_lists", "transfer_lists"),
    "device": ("device", "gpu", "isolate", "columns", "lists", "destinations", "prepared"),
}
