"""Summarisation jobs: map-reduce over long documents on top of bulk jobs.

`tokens` (the served model's tokenizer, the `docs` extra), `chunking` (token-exact chunks,
streaming), `documents` (text and JSONL readers with per-document errors), `templates`
(prompts the user may override), `plan` (the level planner), `driver` (rounds of bulk
jobs, resumable), `single` (one document through `QBatchClient`). See producer/README.md,
"Summarisation jobs".
"""
