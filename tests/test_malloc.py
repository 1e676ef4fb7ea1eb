"""core/malloc.py: with the setting, a large tensor is served from the heap and its memory stays there once freed
(glibc's mallinfo2 tells), instead of a fresh mmap per allocation that the kernel faults in and zeroes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# glibc's own accounting around one 64 MB tensor: bytes in mmapped blocks while it lives, free bytes kept in the
# heap once it is gone.
PROBE = """
import ctypes, json, sys, torch
sys.path.insert(0, {root!r})
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                               "keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
took = False
if {keep}:
    from core.malloc import keep_freed_memory
    took = keep_freed_memory()
a = torch.ones(16 * 1024 * 1024)
mapped = libc.mallinfo2().hblkhd
del a
print(json.dumps(dict(took=took, mapped=mapped, kept=libc.mallinfo2().fordblks)))
"""


def _probe(keep: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), keep=keep)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_large_tensor_comes_from_the_heap_and_stays_there_when_freed():
    plain, kept = _probe(False), _probe(True)
    big = 64 * 1024 * 1024
    assert plain["mapped"] >= big, f"glibc did not mmap a 64 MB tensor by default ({plain}): the probe shows nothing"
    assert kept["took"], "keep_freed_memory() did not take on glibc"
    assert kept["mapped"] < big, f"with the setting, the 64 MB tensor was still mmapped ({kept})"
    assert kept["kept"] >= big, f"with the setting, its memory was returned to the system when freed ({kept})"
