"""What a batch is and the rules every planner obeys (see ``kvplan/planner/README.md``)."""
