"""The README's usage runs as printed: its first three snippets (plan a batch; a serving loop's
``Planner``; the decode side's published lists) run here, on the CPU with the kernels interpreted,
and print what the README says. The transport snippets are outlines that name the runnable files
(examples/, tests/) that hold them whole."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_s_planning_snippets_run_as_printed(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    plan_a_batch, serving_loop, decode_side = blocks[0], blocks[1], blocks[2]
    assert "= plan(batch)" in plan_a_batch and "Planner(src, [dst]" in serving_loop, "the snippets moved"
    names: dict = {}
    exec(compile(plan_a_batch, "README.md (plan a batch)", "exec"), names)  # noqa: S102 - our own README
    printed = capsys.readouterr().out
    assert printed.split() == "[[16 3 2] [18 9 2]]".split(), printed  # (s0, d0, len) as its comment says
    exec(compile(serving_loop, "README.md (a serving loop)", "exec"), names)  # noqa: S102
    assert names["descs"].tolist() == names["pending"].descriptors()[0].tolist()
    exec(compile(decode_side, "README.md (the decode side)", "exec"), names)  # noqa: S102
    printed = capsys.readouterr().out
    assert printed.split() == "[ 3 4 9 10]".split() or printed.split() == "[3 4 9 10]".split(), printed
    assert names["pending"].result()[0].lists.pages.tolist() == names["batch"].transfers[0].dst_pages.tolist()


def test_the_readme_s_outlines_name_a_runnable_whole():
    text = README.read_text()
    start = text.index("The two nodes' code, in outline")
    assert "examples/handoff_in_process.py" in text[start:start + 300]
    assert (README.parent / "examples/handoff_in_process.py").exists()
    streaming = (README.parent / "docs/transport.md").read_text()
    start = streaming.index("as in the README's outline")
    assert "tests/transport/test_handoff.py" in streaming[start:start + 300]


def test_the_readme_is_read_in_five_minutes_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(((?:docs|examples|benchmarks|kvplan)/[^)#]+)\)", text):
        assert (README.parent / target).exists(), target


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    """A link is read from its own file's folder (one in docs/ that says ``docs/x.md`` resolves nowhere)."""
    root = README.parent
    pages = [README, root / "CHANGELOG.md", root / "benchmarks" / "RESULTS.md", *sorted((root / "docs").glob("*.md"))]
    dangling = []
    for page in pages:
        text = page.read_text()
        for found in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = found.group(1).split("#")[0]
            if target and not re.match(r"^[a-z]+:", found.group(1)) and not (page.parent / target).exists():
                dangling.append(f"{page.relative_to(root)}:{text[:found.start()].count(chr(10)) + 1}: {found.group(1)}")
    assert dangling == [], dangling
