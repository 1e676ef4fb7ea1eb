"""core/atomic.py: a write that fails or is killed leaves the old file (or nothing), never half a file."""

from __future__ import annotations

import pytest

from core.atomic import atomic_open, atomic_path, write_dir_atomic, write_json_atomic, write_text_atomic


def test_text_and_json_writes_replace_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_json_atomic(path, {"x": 1})
    assert path.read_text() == '{\n "x": 1\n}\n'
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]  # no temp file left behind
    assert oct(path.stat().st_mode & 0o777) != "0o600"  # readable like a plain open() (mkstemp's files are private)


def test_a_failing_writer_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "b.npz") as tmp:
        assert tmp.suffix == ".npz" and tmp.parent == tmp_path
        raise RuntimeError
    assert not (tmp_path / "b.npz").exists() and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_a_directory_is_swapped_in_whole(tmp_path):
    out = tmp_path / "export"
    write_dir_atomic(out, {"a": lambda p: p.write_text("1"), "b": lambda p: p.write_text("2")})
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]

    def broken(p):
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_dir_atomic(out, {"a": lambda p: p.write_text("new"), "c": broken})
    assert (out / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
