"""The README's usage runs as printed: its first two snippets (plan a batch; a serving loop's
``Planner``) run here, on the CPU with the kernels interpreted, and print what the README says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_s_planning_snippets_run_as_printed(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    plan_a_batch, serving_loop = blocks[0], blocks[1]
    assert "gpu.plan(batch)" in plan_a_batch and "Planner(src, [dst]" in serving_loop, "the snippets moved"
    names: dict = {}
    exec(compile(plan_a_batch, "README.md (plan a batch)", "exec"), names)  # noqa: S102 - our own README
    printed = capsys.readouterr().out
    assert printed.split() == "[[16 3 2] [18 9 2]]".split(), printed  # (s0, d0, len) as its comment says
    exec(compile(serving_loop, "README.md (a serving loop)", "exec"), names)  # noqa: S102
    assert names["descs"].tolist() == names["pending"].descriptors()[0].tolist()
