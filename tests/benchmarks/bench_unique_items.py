"""`uniqueItems` on model-written arguments: jsonschema's keyword against qbatch's.

A tool's schema comes from the request and the arguments from the model, so both are a
stranger's. jsonschema's `uniqueItems` sorts the items when it can and otherwise compares
every pair; an array mixing arrays and objects takes the pairwise path, and the whole of
it is one keyword step, out of reach of the step budget (`schemas.json_schema`). This
times both on the same arrays, side by side in one process, and prints the ratio:

    .venv/bin/python -m tests.benchmarks.bench_unique_items --sizes 1000,2000,4000,8000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from jsonschema import Draft202012Validator

from schemas import json_schema

SCHEMA = {"type": "array", "uniqueItems": True}


def mixed(n: int) -> list[Any]:
    """n distinct items, arrays and objects in turn (not sortable together)."""
    return [{"a": i} if i % 2 else [i] for i in range(n)]


def seconds(check: Any, items: list[Any]) -> tuple[float, bool]:
    started = time.perf_counter()
    valid = not check(items)
    return time.perf_counter() - started, valid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,2000,4000,8000")
    args = parser.parse_args()
    reference = Draft202012Validator(SCHEMA)
    budgeted = json_schema.validator(SCHEMA)
    print("| items | jsonschema s | qbatch s | ratio | same verdict |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for n in (int(x) for x in args.sizes.split(",")):
        items = mixed(n)
        theirs, valid_a = seconds(lambda xs: list(reference.iter_errors(xs)), items)
        ours, valid_b = seconds(lambda xs: json_schema.errors(budgeted, xs), items)
        print(
            f"| {n:,} | {theirs:.3f} | {ours:.4f} | {theirs / max(ours, 1e-9):,.0f}x "
            f"| {valid_a == valid_b} |"
        )


if __name__ == "__main__":
    main()
