"""tests/benchmarks/profile_summary.py sums py-spy's raw stacks by thread name, file and
function (self and inclusive)."""

from __future__ import annotations

from tests.benchmarks.profile_summary import parse, summary

RAW = """\
thread (11): qbatch-writer;run (/x/worker/writer.py:10);dumps (/usr/lib/python3.11/json/__init__.py:231) 3
thread (12): qbatch-writer;run (/x/worker/writer.py:10) 1
thread (13): MainThread;loop (/y/site-packages/vllm/v1/engine/async_llm.py:500);step (/y/site-packages/vllm/v1/engine/output_processor.py:90) 6
not a stack line
"""


def test_samples_are_summed_by_thread_file_and_function() -> None:
    prof = parse(RAW.splitlines())
    assert prof.total == 10
    assert prof.by_thread == {"qbatch-writer": 4, "MainThread": 6}
    assert prof.self_by_file["vllm/v1/engine/output_processor.py"] == 6
    assert prof.self_by_file["json/__init__.py"] == 3
    assert prof.self_by_func["run (worker/writer.py)"] == 1
    assert prof.incl_by_func["run (worker/writer.py)"] == 4
    text = summary(prof, top=3, match="worker/")
    assert "| 40.0% | 4 | run (worker/writer.py) |" in text
    assert "output_processor" not in text.split("by thread")[1].split("self, by file")[1]
