"""The check that a `fast` backend's tree steps really ran through torch.compile's graphs (tests/test_cuda.py on
the GPU, tests/test_fast_compile.py on the CPU)."""

from __future__ import annotations


def assert_ran_compiled(backend) -> None:
    """Compile is on, dynamo compiled graphs for this backend's step, steps ran them and none ran eagerly (counted
    by eval/engine/backends/fast.py from inside the compiled code, not from the compile flag)."""
    report = backend.compile_report()
    assert report["ran_compiled"] and report["graphs"] > 0, f"tree steps did not run a compiled graph: {report}"
