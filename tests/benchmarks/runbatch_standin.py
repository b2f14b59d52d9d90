"""A CPU STAND-IN for `python -m vllm.entrypoints.openai.run_batch`, for bench_runbatch's
dry run only: no vLLM, no model, its figures mean nothing.

What it keeps of vLLM 0.24's run_batch.py, so the harness's plumbing is exercised as on the
GPU: the command line (`-i`, `-o`, the engine flags ignored), the progress bar (tqdm,
`desc="Running batch"`, the same `bar_format`, first line when the requests start, last at
100%), the output line shape, and the refusal of lines with `tools` unless started with
`--enable-auto-tool-choice` (vLLM answers them 400). Each answer is an echo of `max_tokens`
tokens after `--delay-ms` (all lines concurrently, as run-batch gathers them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

from tqdm import tqdm

# vLLM 0.24 run_batch.py's _BAR_FORMAT, verbatim
BAR_FORMAT = "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]\n"


def answer(line: dict[str, Any], auto_tools: bool) -> dict[str, Any]:
    body = line["body"]
    out_id = f"vllm-{uuid.uuid4().hex}"
    if body.get("tools") and not auto_tools:
        return {
            "id": out_id,
            "custom_id": line["custom_id"],
            "response": {"status_code": 400, "request_id": f"vllm-batch-{uuid.uuid4().hex}"},
            "error": {
                "message": '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "type": "BadRequestError",
                "code": 400,
            },
        }
    prompt = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    completion = int(body["max_tokens"])
    return {
        "id": out_id,
        "custom_id": line["custom_id"],
        "response": {
            "status_code": 200,
            "request_id": f"vllm-batch-{uuid.uuid4().hex}",
            "body": {
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "echo"},
                        "finish_reason": "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            },
        },
        "error": None,
    }


async def run(args: argparse.Namespace) -> None:
    with open(args.input_file, encoding="utf-8") as fh:
        lines = [json.loads(x) for x in fh.read().strip().split("\n") if x.strip()]
    pbar = tqdm(total=len(lines), unit="req", desc="Running batch", mininterval=5,
                bar_format=BAR_FORMAT)  # fmt: skip

    async def one(line: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(args.delay_ms / 1000)
        pbar.update()
        return answer(line, args.enable_auto_tool_choice)

    with pbar:
        outputs = await asyncio.gather(*(one(x) for x in lines))
    with open(args.output_file, "w", encoding="utf-8") as fh:
        for out in outputs:
            fh.write(json.dumps(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--input-file", required=True)
    parser.add_argument("-o", "--output-file", required=True)
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--tool-call-parser")
    parser.add_argument("--delay-ms", type=float, default=500)
    args, _engine_flags = parser.parse_known_args()
    print("runbatch_standin: a CPU stand-in for vLLM run-batch (no vLLM; figures meaningless)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
