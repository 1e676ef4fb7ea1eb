"""The fast backend's compile report (eval/engine/backends/fast.py: compile_report), on the CPU with dynamo's cheap
"eager" compiler: it tells tree steps that ran a compiled graph from steps that ran eagerly, and one backend
compiles a graph per tree bucket and aux-layer set past dynamo's default limit of 8 recompiles."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled import assert_ran_compiled
from helpers.trees import random_tree

from eval.engine.backends.fast import FastBackend


def _decode(backend: FastBackend, sizes, max_len: int = 64) -> None:
    """A prefill, then one tree step of each size (keeping the root)."""
    gen = torch.Generator().manual_seed(0)
    backend.reset(max_len)
    backend.prefill(torch.randint(3, 100, (5,), generator=gen))
    for n in sizes:
        _, depths, mask = random_tree(n, gen)
        backend.forward_tree(torch.randint(3, 100, (n,), generator=gen), depths, mask)
        backend.commit(torch.tensor([0]))


def test_a_compiled_backend_passes_the_check(model):
    backend = FastBackend(model, max_len=64, compile=True, compile_backend="eager")
    _decode(backend, (3, 1, 4, 2))  # buckets 4, 1, 4, 2
    assert_ran_compiled(backend)
    report = backend.compile_report()
    assert report["graphs"] == 3 and report["compiled_steps"] == 4 and report["eager_steps"] == 0


def test_a_backend_that_does_not_compile_fails_the_check(model):
    backend = FastBackend(model, max_len=64, compile=False, static=True)  # the same padded steps, no compile
    _decode(backend, (3, 1, 4, 2))
    with pytest.raises(AssertionError, match="did not run a compiled graph"):
        assert_ran_compiled(backend)
    assert backend.compiled_graphs == 0 and backend.compiled_steps == 0


def test_steps_dynamo_runs_eagerly_fail_the_check(model):
    """Compile is set, but dynamo runs the step eagerly (here: the force_eager stance; elsewhere a frame it gives
    up on): no step counts as compiled, each counts as eager."""
    backend = FastBackend(model, max_len=64, compile=True, compile_backend="eager")
    with torch.compiler.set_stance("force_eager"):
        _decode(backend, (3, 1, 4))
    report = backend.compile_report()
    assert report["compile"] and report["graphs"] == 0
    assert report["compiled_steps"] == 0 and report["eager_steps"] == 3
    with pytest.raises(AssertionError, match="did not run a compiled graph"):
        assert_ran_compiled(backend)


def test_one_backend_compiles_more_graphs_than_dynamos_default_limit(model):
    """7 buckets (1 ... 64 nodes) x 2 aux-layer sets = 14 graphs of one step function; dynamo's default limit is 8,
    and with fullgraph=True reaching it raises. The backend sets its own limit (fast_compile.py: RECOMPILE_LIMIT)."""
    backend = FastBackend(model, max_len=160, compile=True, compile_backend="eager")
    sizes = (1, 2, 3, 5, 9, 17, 33)
    for aux in ([], [0]):
        backend.set_aux_layers(aux)
        _decode(backend, sizes, max_len=160)
    assert_ran_compiled(backend)
    assert backend.compiled_graphs == 14 and backend.compiled_steps == 14
