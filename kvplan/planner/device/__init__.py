"""The planner on tensors: :class:`.planner.Planner` and what it is built from (see
``kvplan/planner/README.md``)."""
