"""scripts/local-slurm.sh from nothing, in every CI run (issue 12).

The shared test cluster may have been started on a machine that already had a slurm.conf, a
munge key and a state root from earlier runs, which is how a broken set-up step once hid behind
a passing CI. Here a second cluster starts beside it from an empty configuration directory and
an empty state root (its own munge key, socket and ports), all four nodes must come up and run a
two-node job, and stop must leave nothing of it running, also of the daemons whose pid files were
lost. The failure paths must say what failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cli import REPO

SCRIPT = REPO / "scripts" / "local-slurm.sh"
NODES = ("c1", "c2", "g1", "g2")
#: a port offset no other cluster of this script uses (the shared one runs at offset 0)
OFFSET = "100"
#: hang guards only: every wait below is for an event, these bound a broken machine
HANG_S = 600

pytestmark = pytest.mark.slurm


def _require_root_and_packages() -> None:
    reasons = []
    if os.geteuid() != 0:
        reasons.append("not root")
    if not shutil.which("apt-get") and not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "tini")):
        reasons.append("Slurm packages missing and no apt-get")
    if reasons:
        message = f"cannot start a Slurm cluster here: {', '.join(reasons)}"
        if os.environ.get("CK_REQUIRE_SLURM") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def _script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=HANG_S)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args.strip())
    return found


def test_cluster_starts_from_an_empty_config_dir_and_state_root(tmp_path: Path) -> None:
    _require_root_and_packages()
    conf_dir, root = tmp_path / "etc-slurm", tmp_path / "state-root"
    assert not conf_dir.exists() and not root.exists()
    env = {"CK_SLURM_CONF_DIR": str(conf_dir), "CK_SLURM_ROOT": str(root), "CK_SLURM_PORT_OFFSET": OFFSET,
           "CK_SLURM_TIMEOUT": str(HANG_S)}
    client = {**os.environ, "SLURM_CONF": str(conf_dir / "slurm.conf")}
    try:
        started = _script("start", env=env)
        assert started.returncode == 0, f"start failed:\n{started.stdout}\n{started.stderr}"
        assert f"creating {root}/munge/munge.key" in started.stdout  # no key anywhere before
        assert (conf_dir / "slurm.conf").is_file() and (conf_dir / "gres.conf").is_file()

        sinfo = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], env=client, capture_output=True,
                               text=True, timeout=HANG_S)
        states = dict(line.split() for line in sinfo.stdout.splitlines() if line.strip())
        assert states == dict.fromkeys(NODES, "idle"), sinfo.stdout + sinfo.stderr

        job = subprocess.run(["srun", "--nodes=2", "--ntasks=2", "--time=1", "hostname"], env=client,
                             capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
        assert job.returncode == 0, job.stderr
        assert sorted(job.stdout.split()) in (["c1", "c2"], [os.uname().nodename] * 2)  # UTS fallback
        # Pid files lost while the daemons run (a state root cleaned by hand): stop still finds them.
        for name in ("slurmctld.pid", "tini-c1.pid", "slurmd-c1.pid", "munged.pid"):
            (root / "run" / name).unlink()
    finally:
        stopped = _script("stop", env=env)
    assert stopped.returncode == 0 and "local-slurm: error" not in stopped.stderr, stopped.stderr
    assert _processes_mentioning(str(conf_dir)) == [] and _processes_mentioning(str(root)) == []


def test_a_failure_names_the_command_and_line(tmp_path: Path) -> None:
    _require_root_and_packages()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    env = {"CK_SLURM_CONF_DIR": str(blocker / "slurm"), "CK_SLURM_ROOT": str(tmp_path / "root"),
           "CK_SLURM_PORT_OFFSET": OFFSET}
    failed = _script("start", env=env)
    assert failed.returncode != 0
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith("local-slurm: error: line ") and "install -d" in line and "HINT:" in line, failed.stderr
    assert _processes_mentioning(str(tmp_path)) == []


def test_bad_settings_are_refused_before_anything_starts(tmp_path: Path) -> None:
    _require_root_and_packages()
    failed = _script("start", env={"CK_SLURM_PORT_OFFSET": "ten", "CK_SLURM_ROOT": str(tmp_path / "r")})
    assert failed.returncode != 0
    assert "CK_SLURM_PORT_OFFSET=ten is not a whole number HINT" in failed.stderr
    assert not (tmp_path / "r").exists()
