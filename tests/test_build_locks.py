"""A torch extension build lock left by a killed run is removed before DeepSpeed starts (core/build_locks.py), so a
later `specdraft train` does not wait for it forever; a lock a build may still hold is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from core.build_locks import clear_stale_build_locks, extensions_root


def _lock(root, name, age_s):
    d = root / name
    d.mkdir(parents=True)
    lock = d / "lock"
    lock.touch()
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_an_old_lock_with_no_build_running_is_removed(tmp_path, caplog):
    stale = _lock(tmp_path, "deepspeed_shm_comm", age_s=3600)
    assert clear_stale_build_locks(tmp_path) == [stale] and not stale.exists()
    assert "no build running" in caplog.text


def test_a_fresh_lock_is_kept(tmp_path):
    fresh = _lock(tmp_path, "op", age_s=5)
    assert clear_stale_build_locks(tmp_path) == [] and fresh.exists()


def test_a_lock_whose_directory_a_build_works_in_is_kept(tmp_path):
    held = _lock(tmp_path, "op", age_s=3600)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=held.parent)
    try:
        time.sleep(0.2)
        assert clear_stale_build_locks(tmp_path) == [] and held.exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_build_locks(tmp_path) == [held]


def test_the_root_is_torchs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import _get_build_directory

    want = os.path.dirname(_get_build_directory("specdraft_probe_name", False))
    os.rmdir(os.path.join(want, "specdraft_probe_name"))
    assert str(extensions_root()) == want
