"""The NumPy reference planner, slow and obviously right, and its host helpers (see
``kvplan/planner/README.md``)."""
