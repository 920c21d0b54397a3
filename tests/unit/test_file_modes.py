"""Every run-directory file is written with the one group-readable mode (issue 17: job_id was 0600)."""

from __future__ import annotations

import os
import stat

from cyclone_kit.rundir.fileio import FILE_MODE, write_atomic, write_new
from cyclone_kit.rundir.layout import RunDir


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_and_first_writer_files_are_group_readable(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", "{}\n")
        assert write_new(tmp_path / "b.json", "{}\n")
    finally:
        os.umask(old)
    assert FILE_MODE == 0o644
    assert _mode(tmp_path / "a.json") == FILE_MODE
    assert _mode(tmp_path / "b.json") == FILE_MODE


def test_run_dir_files_share_one_mode(tmp_path):
    rd = RunDir.create(tmp_path, "modes", "{}\n")
    rd.write_submission("123", "slurm")
    rd.write_script("#!/bin/bash\n")
    for path in (rd.spec, rd.job_id_file, rd.backend_file):
        assert _mode(path) == FILE_MODE, path
        assert _mode(path) & stat.S_IRGRP
    assert _mode(rd.script) == 0o755
