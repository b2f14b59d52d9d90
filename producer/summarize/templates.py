"""Prompt templates: the map prompt (one chunk), the reduce prompt (partial summaries in
order) and the single-pass prompt (a document that fits one chunk). Pure.

Templates are `str.format` strings with four fields only: `{text}`, `{instructions}`,
`{part}`, `{parts}`. Anything else (`{0}`, `{}`, `{text.__class__}`, `{text[0]}`, a
conversion or a format spec) is refused when the template is loaded, so a user template
can neither reach attributes nor blow up memory; document text is substituted as a value
and never parsed as a template. Literal braces are written `{{` and `}}`.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("text", "instructions", "part", "parts")

DEFAULT_INSTRUCTIONS = (
    "Write a concise summary in plain prose that keeps the key facts, names, numbers and "
    "conclusions."
)
DEFAULT_MAP = (
    "This is part {part} of {parts} of a longer document. Summarise this part on its own. "
    "{instructions}\n\n{text}"
)
DEFAULT_REDUCE = (
    "These are summaries of consecutive parts of one document, in order. Combine them "
    "into one summary of the whole. {instructions}\n\n{text}"
)
DEFAULT_SINGLE = "Summarise this document. {instructions}\n\n{text}"
SEPARATOR = "\n\n"
"""Between concatenated partial summaries in a reduce prompt."""


class TemplateError(ValueError):
    """A template uses a field or a feature that is not allowed."""


def check_template(template: str, name: str = "template") -> str:
    """`template` if it uses only the allowed fields, plainly; else TemplateError."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:  # a lone brace
        raise TemplateError(f"{name}: {exc} (write literal braces as {{{{ and }}}})") from None
    for _literal, field, spec, conversion in parsed:
        if field is None:
            continue
        if field not in FIELDS:
            raise TemplateError(
                f"{name}: field {{{field}}} is not allowed; use only "
                + ", ".join(f"{{{f}}}" for f in FIELDS)
            )
        if spec or conversion:
            raise TemplateError(f"{name}: {{{field}}} may not have a conversion or format spec")
    if "{text}" not in template:
        raise TemplateError(f"{name}: has no {{text}} field, so the model would see no text")
    return template


def render(template: str, *, text: str, instructions: str, part: int, parts: int) -> str:
    """Fill a checked template; values are substituted, never parsed."""
    return template.format(text=text, instructions=instructions, part=part, parts=parts)


@dataclass(frozen=True, slots=True)
class Templates:
    map: str = DEFAULT_MAP
    reduce: str = DEFAULT_REDUCE
    single: str = DEFAULT_SINGLE
    instructions: str = DEFAULT_INSTRUCTIONS

    def __post_init__(self) -> None:
        check_template(self.map, "map template")
        check_template(self.reduce, "reduce template")
        check_template(self.single, "single-pass template")

    def fingerprint(self) -> str:
        return "\x00".join((self.map, self.reduce, self.single, self.instructions))


def load_templates(
    *,
    map_file: Path | None = None,
    reduce_file: Path | None = None,
    instructions: str | None = None,
) -> Templates:
    """Defaults, with the user's overrides. A map template also serves single-pass
    documents (as part 1 of 1), so one file changes how every chunk is asked."""
    kwargs: dict[str, str] = {}
    if map_file is not None:
        kwargs["map"] = kwargs["single"] = _read(map_file, "--map-template")
    if reduce_file is not None:
        kwargs["reduce"] = _read(reduce_file, "--reduce-template")
    if instructions is not None:
        kwargs["instructions"] = instructions
    return Templates(**kwargs)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"{what} {path}: {exc}") from None


__all__ = [
    "DEFAULT_INSTRUCTIONS",
    "DEFAULT_MAP",
    "DEFAULT_REDUCE",
    "DEFAULT_SINGLE",
    "FIELDS",
    "SEPARATOR",
    "TemplateError",
    "Templates",
    "check_template",
    "load_templates",
    "render",
]
