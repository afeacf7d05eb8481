"""Batches in, plans out: the model and its rules (``model``, ``rules``, ``state_kinds``), the host
reference (``reference`` and what it builds on), and the device planner (``device``, ``gpu``).

Importing the package registers the state kinds' rules (:mod:`.state_kinds`) with the model, which
finds them through :func:`.model.kind_rules` without importing back.
"""

from . import state_kinds  # noqa: F401  (registers the kinds' rules)
