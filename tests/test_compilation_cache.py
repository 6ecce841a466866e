"""The suite's XLA compilation cache lives where no other user of the machine can write (issue 40, item 10)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.conftest import private_cache_dir


def test_the_suites_compilation_cache_is_private_to_its_user():
    path = Path(private_cache_dir()).resolve()
    for directory in (path, *path.parents):  # nobody else can create, replace or fill it
        info = directory.stat()
        assert info.st_uid in (os.getuid(), 0), f"{directory} belongs to uid {info.st_uid}"
        assert not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH), f"{directory} is writable by other users"
    assert not path.stat().st_mode & 0o077, oct(path.stat().st_mode)
