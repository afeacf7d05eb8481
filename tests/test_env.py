"""The registry of kvplan's environment variables (kvplan/env.py): the docs' table is its rendering, every
``KVPLAN_*`` name in the package is registered (or is one of the SGLang adapter's settings), and only the
registry reads them from the environment."""

from __future__ import annotations

import pathlib
import re

import pytest

from kvplan import env
from kvplan.errors import SettingError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvplan"
SGLANG_SETTINGS = PACKAGE / "integrations" / "sglang" / "settings.py"


def test_the_docs_table_is_the_registry_s():
    text = (ROOT / "docs" / "settings.md").read_text()
    table = text.split("<!-- variables: rendered from kvplan/env.py -->\n", 1)[1].split("\n<!-- end of variables -->", 1)[0]
    assert table == env.markdown_table(), "docs/settings.md's table differs from kvplan/env.py: render it again"


def _sglang_variables() -> set[str]:
    """``KVPLAN_<NAME>`` of each key of the SGLang adapter's settings table (its module docstring)."""
    return set(re.findall(r"``(KVPLAN_[A-Z_]+)``", SGLANG_SETTINGS.read_text()))


def test_every_variable_the_package_names_is_registered():
    registered = {v.name for v in env.VARIABLES} | _sglang_variables()
    named = {}
    for path in PACKAGE.rglob("*.py"):
        for name in re.findall(r"\b(KVPLAN_[A-Z][A-Z_]*[A-Z])\b", path.read_text()):
            named.setdefault(name, path.relative_to(ROOT))
    missing = {name: str(where) for name, where in named.items() if name not in registered}
    assert missing == {}, f"read or named but not registered in kvplan/env.py: {missing}"


def test_only_the_registry_reads_them():
    # a read: environ.get("KVPLAN_..."), getenv("KVPLAN_..."), environ["KVPLAN_..."] not assigned to
    reads = re.compile(r"""(environ\.get\(|getenv\()\s*["']KVPLAN_|environ\[\s*["']KVPLAN_[A-Z_]+["']\s*\](?!\s*=[^=])""")
    readers = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                     if p not in (PACKAGE / "env.py", SGLANG_SETTINGS) and reads.search(p.read_text()))
    assert readers == [], f"read KVPLAN_* outside kvplan/env.py: {readers}"


def test_values_defaults_and_switches(monkeypatch):
    monkeypatch.delenv("KVPLAN_DRAIN_S", raising=False)
    assert env.number("KVPLAN_DRAIN_S") == 5.0
    monkeypatch.setenv("KVPLAN_DRAIN_S", "soon")
    with pytest.raises(SettingError, match="KVPLAN_DRAIN_S='soon': not a number"):
        env.number("KVPLAN_DRAIN_S")
    monkeypatch.setenv("KVPLAN_DRAIN_S", "-0.5")
    with pytest.raises(SettingError, match="KVPLAN_DRAIN_S='-0.5': below 0"):
        env.number("KVPLAN_DRAIN_S")
    for value, on in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("KVPLAN_TRACE", value)
        assert env.enabled("KVPLAN_TRACE") is on
    monkeypatch.delenv("KVPLAN_TRACE")
    assert not env.enabled("KVPLAN_TRACE") and env.enabled("KVPLAN_COPY_GRAPHS")  # (defaults: off, on)
    with pytest.raises(KeyError):
        env.get("KVPLAN_NOT_A_SETTING")
    for value in ("maybe", "2", "enabled"):
        monkeypatch.setenv("KVPLAN_TRACE", value)
        with pytest.raises(SettingError, match="not a switch"):
            env.enabled("KVPLAN_TRACE")


def test_validate_checks_every_variable_set_and_names_each_bad_one(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)  # (a secret's file is its owner's alone)
    good = {"KVPLAN_DRAIN_S": "2.5", "KVPLAN_COPY_GRAPHS": "off", "KVPLAN_TRACE": "",
            "KVPLAN_SECRET_FILE": str(secret), "KVPLAN_LOG_LEVEL": "info", "KVPLAN_PROFILE_ONLY": "x", "PATH": "/bin"}
    env.validate(good)
    bad = dict(good, KVPLAN_DRAIN_S="fast", KVPLAN_SECRET_FILE=str(tmp_path / "none"))
    with pytest.raises(SettingError) as raised:
        env.validate(bad)
    lines = str(raised.value).splitlines()
    assert len(lines) == 2 and {line.split("=")[0] for line in lines} == {"KVPLAN_SECRET_FILE", "KVPLAN_DRAIN_S"}
    assert any(line.startswith("KVPLAN_DRAIN_S='fast'") for line in lines)


def test_an_endpoint_checks_the_environment_when_it_is_made(monkeypatch):
    from kvplan.transport.endpoints import DecodeEndpoint, PrefillEndpoint

    monkeypatch.setenv("KVPLAN_DRAIN_S", "abc")
    for endpoint in (PrefillEndpoint, DecodeEndpoint):
        with pytest.raises(SettingError, match="KVPLAN_DRAIN_S='abc'"):
            endpoint(None, None, [])

