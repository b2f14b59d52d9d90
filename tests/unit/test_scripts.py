"""The Lua scripts of the Redis contract: one home, names from the enums."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from schemas.keys import JobField, JobStatus, StreamField
from schemas.result import Status
from schemas.scripts import SCRIPT_NAMES, function, lua, placeholders

LUA_DIR = resources.files("schemas").joinpath("lua")


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_loads_with_every_placeholder_known(name: str) -> None:
    text = lua(name)
    assert "${" not in text and "$" not in text.replace("$ref", "")


def test_every_lua_file_is_a_script_or_a_shared_function() -> None:
    files = {p.name.removesuffix(".lua") for p in LUA_DIR.iterdir() if p.name.endswith(".lua")}
    assert files == set(SCRIPT_NAMES) | {"finalize", "keytypes", "result_head"}
    assert function("finalize").startswith("-- finalize(job)")


def test_no_contract_name_is_hard_coded_in_lua() -> None:
    """Quoted words that are job fields, job or result states, or stream fields must be
    `${...}` placeholders, so renaming an enum member cannot leave a script behind."""
    names = {m.value for enum in (JobField, JobStatus, Status, StreamField) for m in enum}
    # Lua/Redis words that happen to equal a contract name are not contract names.
    allowed = {"ok"}
    for path in LUA_DIR.iterdir():
        if not path.name.endswith(".lua"):
            continue
        quoted = set(re.findall(r"'([A-Za-z_]+)'", path.read_text()))
        assert not (quoted & names) - allowed, f"{path.name} hard-codes {quoted & names}"


def test_placeholders_cover_the_enums() -> None:
    values = placeholders()
    assert values["F_total"] == JobField.total
    assert values["S_completed_with_errors"] == JobStatus.completed_with_errors
    assert values["X_result"] == StreamField.result and values["R_failed"] == Status.failed
