"""Where a profiled process spent its samples: py-spy's raw (collapsed) stacks summed by
thread, by module file and by function (self and inclusive), as text tables.

    py-spy record --gil --threads -r 100 -f raw -o prof.txt -- python3 -m ...
    python3 -m tests.benchmarks.profile_summary prof.txt [--top 25] [--match worker/]

With `--gil` every sample is a stack holding the GIL, so the shares say which threads
and functions the GIL went to (issue 43: the worker's threads against vLLM's output
handling in the same process). Pure apart from reading the file.
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")
_THREAD_ID = re.compile(r"^thread \(\w+\): ")
"""py-spy's `thread (TID): NAME` frame: threads are summed by name."""


@dataclass
class Profile:
    total: int = 0
    by_thread: collections.Counter[str] = field(default_factory=collections.Counter)
    self_by_func: collections.Counter[str] = field(default_factory=collections.Counter)
    incl_by_func: collections.Counter[str] = field(default_factory=collections.Counter)
    self_by_file: collections.Counter[str] = field(default_factory=collections.Counter)


def _short(path: str) -> str:
    """The part of a file path worth reading: from a package root (site-packages/x/...,
    worker/..., producer/...) on."""
    for marker in ("site-packages/", "dist-packages/", "/lib/python3"):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker == "/lib/python3" and "/" in tail else tail
    for root in ("worker/", "producer/", "schemas/", "tests/"):
        if f"/{root}" in path:
            return root + path.split(f"/{root}", 1)[1]
    return path


def parse(lines: Iterable[str]) -> Profile:
    """py-spy raw lines: `frame;frame;...;frame COUNT`, outermost first; with --threads
    the first frame is the thread (`thread (0x7f..)` or its name)."""
    prof = Profile()
    for raw in lines:
        line = raw.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = "(all)"
        if frames and frames[0].startswith(("thread ", "process ")):
            thread = _THREAD_ID.sub("", frames[0]) or frames[0]
            frames = frames[1:]
        prof.total += count
        prof.by_thread[thread] += count
        names = []
        for frame in frames:
            match = _FRAME.match(frame.strip())
            func, file = (match["func"], _short(match["file"])) if match else (frame, "?")
            names.append((f"{func} ({file})", file))
        if names:
            prof.self_by_func[names[-1][0]] += count
            prof.self_by_file[names[-1][1]] += count
        for name in {n for n, _f in names}:
            prof.incl_by_func[name] += count
    return prof


def table(title: str, counts: collections.Counter[str], total: int, top: int) -> str:
    rows = [f"{title}", "| share | samples | name |", "| ---: | ---: | --- |"]
    for name, count in counts.most_common(top):
        rows.append(f"| {100 * count / max(1, total):.1f}% | {count} | {name} |")
    return "\n".join(rows)


def summary(prof: Profile, top: int = 25, match: str | None = None) -> str:
    def keep(counts: collections.Counter[str]) -> collections.Counter[str]:
        if match is None:
            return counts
        return collections.Counter({k: v for k, v in counts.items() if match in k})

    parts = [
        f"samples: {prof.total}",
        table("by thread", prof.by_thread, prof.total, top),
        table("self, by file", keep(prof.self_by_file), prof.total, top),
        table("self, by function", keep(prof.self_by_func), prof.total, top),
        table("inclusive, by function", keep(prof.incl_by_func), prof.total, top),
    ]
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default=None, help="only names containing this")
    args = parser.parse_args()
    with args.path.open(encoding="utf-8", errors="replace") as fh:
        print(summary(parse(fh), args.top, args.match))


if __name__ == "__main__":
    main()
