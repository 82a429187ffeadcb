"""What a full disk, a quota or a read-only mount is called, and what a user reads about it."""
from __future__ import annotations

import errno
import sqlite3

from gpu_lab.record import storage


def test_storage_trouble_is_told_from_other_database_errors(tmp_path):
    full = sqlite3.OperationalError("database or disk is full")
    assert storage.trouble(full, tmp_path) == storage.FULL
    assert storage.trouble(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path) == storage.QUOTA
    assert storage.trouble(OSError(errno.EROFS, "Read-only"), tmp_path) == storage.READ_ONLY
    assert storage.trouble(sqlite3.OperationalError("attempt to write a readonly database"),
                           tmp_path) == storage.READ_ONLY
    assert storage.trouble(sqlite3.OperationalError("database is locked"), tmp_path) is None
    assert storage.trouble(ValueError("a bad event"), tmp_path) is None


def test_the_note_names_the_path_the_free_space_and_what_to_do(tmp_path):
    said = storage.says(storage.FULL, tmp_path / "registry.db", 3, 7)
    assert said.startswith(f"the record is paused: the disk holding {tmp_path} is full (")
    assert "3 events waiting, 7 dropped" in said and "GPU_LAB_HOME" in said
    after = storage.says(storage.FULL, tmp_path / "registry.db", 0, 7, paused_s=12.4)
    assert after.startswith(f"the record was paused for 12 s: the disk holding {tmp_path} was "
                            "full; 7 events were not written (")
    assert storage.fmt(1536) == "1.5 KiB" and storage.fmt(12) == "12 B"


def test_a_reserve_takes_real_space_and_gives_it_back(tmp_path):
    r = storage.Reserve(tmp_path, "run-1")
    assert r.make() and r.path.stat().st_size == storage.RESERVE_BYTES
    assert r.path.stat().st_blocks * 512 >= storage.RESERVE_BYTES  # blocks, not a hole
    r.release()
    assert not r.path.exists() and not r.held
