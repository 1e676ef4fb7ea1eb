"""Compiling the fast backend's static tree step (eval/engine/backends/fast.py) and counting what was compiled:
how many graphs dynamo built and how many steps really ran one, so a check that compile stayed on can fail."""

from __future__ import annotations

import inspect
import logging

import torch

# Graphs one backend's step may compile: one per tree bucket (1, 2, 4, ... 64 nodes: fast.py's _STATIC_PAD_ROOM) and
# aux-layer set. Dynamo's default of 8 recompiles is met by an EAGLE-3 tree search, and with fullgraph=True reaching it
# raises mid-decode instead of falling back.
RECOMPILE_LIMIT = 64
# Where torch.compile has no per-call limit (before 2.13), dynamo's global one, shared by every backend that compiles.
GLOBAL_RECOMPILE_LIMIT = 256

log = logging.getLogger(__name__)


class _CountingCompiler:
    """torch.compile's backend for the static step: the named compiler (inductor with the mode's options, built as
    torch.compile builds it) plus a count of what it did: graphs compiled, and calls that ran one of them. A step
    that dynamo runs eagerly (compilation disabled, a stance forcing eager, a frame it gave up on) never enters a
    compiled graph, so `runs` is what says the step really ran compiled."""

    def __init__(self, name: str, mode: str | None):
        if name == "inductor":
            self._inner = torch._TorchCompileInductorWrapper(mode, None, False)
        else:
            self._inner = torch._dynamo.lookup_backend(name)
        self.compiler_name = name
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        compiled = self._inner(gm, example_inputs)
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run

    def reset(self) -> None:  # torch._dynamo.reset() resets backends (inductor: its CUDA-graph trees)
        if hasattr(self._inner, "reset"):
            self._inner.reset()

    def get_compiler_config(self):
        get = getattr(self._inner, "get_compiler_config", None)
        return get() if get is not None else None


def _compile_step(fn, compiler: _CountingCompiler):
    """torch.compile of the static step, fullgraph, with room for RECOMPILE_LIMIT graphs of this backend's own."""
    kwargs = {}
    params = inspect.signature(torch.compile).parameters
    if "recompile_limit" in params and "isolate_recompiles" in params:
        # per backend: another backend's graphs of the same step function do not count against this one
        kwargs.update(recompile_limit=RECOMPILE_LIMIT, isolate_recompiles=True)
    else:
        for knob in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6
            if hasattr(torch._dynamo.config, knob):
                if getattr(torch._dynamo.config, knob) < GLOBAL_RECOMPILE_LIMIT:
                    log.info("fast backend: torch._dynamo.config.%s raised to %d (one graph per tree bucket "
                             "and aux-layer set)", knob, GLOBAL_RECOMPILE_LIMIT)
                    setattr(torch._dynamo.config, knob, GLOBAL_RECOMPILE_LIMIT)
                break
    return torch.compile(fn, backend=compiler, dynamic=False, fullgraph=True, **kwargs)
