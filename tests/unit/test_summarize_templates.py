"""Prompt templates: only {text} {instructions} {part} {parts}, plainly; values are never
parsed as templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from producer.summarize.templates import (
    DEFAULT_INSTRUCTIONS,
    TemplateError,
    Templates,
    check_template,
    load_templates,
    render,
)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{text.__class__}", "not allowed"),
        ("{text.__init__.__globals__}", "not allowed"),
        ("{text[0]}", "not allowed"),
        ("{0} {text}", "not allowed"),
        ("{} {text}", "not allowed"),
        ("{secret} {text}", "not allowed"),
        ("{text!r}", "conversion or format spec"),
        ("{text:>99999999}", "conversion or format spec"),
        ("{text:{part}}", "conversion or format spec"),
        ("no text field {instructions}", "no {text}"),
        ("a lone { brace {text}", "literal braces"),
        ("a lone } brace {text}", "literal braces"),
    ],
)
def test_hostile_templates_are_refused(template: str, why: str) -> None:
    with pytest.raises(TemplateError, match=why):
        check_template(template, "map template")


def test_values_are_substituted_not_parsed() -> None:
    template = check_template("[{part}/{parts}] {instructions} {{literal}}\n{text}")
    hostile = "{text.__class__} {0} {instructions} }{"
    out = render(template, text=hostile, instructions="Be brief.", part=2, parts=5)
    assert out == "[2/5] Be brief. {literal}\n" + hostile


def test_load_templates_overrides(tmp_path: Path) -> None:
    (tmp_path / "map.txt").write_text("MAP {part}/{parts}: {text}", encoding="utf-8")
    (tmp_path / "reduce.txt").write_text("REDUCE: {text}", encoding="utf-8")
    t = load_templates(
        map_file=tmp_path / "map.txt", reduce_file=tmp_path / "reduce.txt", instructions="X"
    )
    assert (t.map, t.single, t.reduce, t.instructions) == (
        "MAP {part}/{parts}: {text}",
        "MAP {part}/{parts}: {text}",
        "REDUCE: {text}",
        "X",
    )
    assert load_templates().instructions == DEFAULT_INSTRUCTIONS
    (tmp_path / "bad.txt").write_text("{text.__class__}", encoding="utf-8")
    with pytest.raises(TemplateError, match="map template"):
        load_templates(map_file=tmp_path / "bad.txt")
    with pytest.raises(TemplateError, match="--reduce-template"):
        load_templates(reduce_file=tmp_path / "missing.txt")
    with pytest.raises(TemplateError, match="reduce template"):
        Templates(reduce="{parts}")
