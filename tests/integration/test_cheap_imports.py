"""The CLI and ``import cyclone_kit`` stay cheap: each check runs a fresh interpreter and looks at sys.modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.cli import REPO
from tests.helpers.slurm_env import SLURM_BATCH, SLURM_TASK3


def test_import_cyclone_kit_stays_cheap_and_the_api_loads_on_first_use() -> None:
    code = ("import sys, cyclone_kit as ck; before = sorted(m for m in ('torch', 'cyclone_kit.api') if m in sys.modules);"
            " ck.init; print(before, 'cyclone_kit.api' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[] True"


def test_the_cli_never_imports_torch() -> None:
    code = ("import sys; from cyclone_kit.cli.app import main; import cyclone_kit.doctor.checks, cyclone_kit.doctor.job, "
            "cyclone_kit.slurm.query; rc = main(['doctor', '--help']); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('clean', rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "clean 0" in out.stdout


def _cli(args: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "SUBMITIT_"))
            and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    return subprocess.run([sys.executable, "-m", "cyclone_kit", *args], env={**base, **environ}, text=True,
                          capture_output=True, timeout=60, check=False)


def test_env_command_json_and_no_torch_import() -> None:
    out = _cli(["env", "--json"], SLURM_TASK3)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["rank"], data["world_size"], data["master_addr"], data["hostnames"]) == (3, 4, "c1", ["c1", "c2"])
    assert data["device"] == "cpu" and data["backend"] == "gloo"
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, argparse; from cyclone_kit.cli import env; "
         "env.run(argparse.Namespace(json=True)); assert 'torch' not in sys.modules, 'torch imported'"],
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}, text=True, capture_output=True,
        timeout=60, check=False)
    assert probe.returncode == 0, probe.stderr


def test_env_command_exits_2_with_one_line_on_a_forgotten_srun() -> None:
    out = _cli(["env"], SLURM_BATCH)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "HINT:" in lines[0]


def test_importing_the_command_does_not_import_pandas_or_matplotlib() -> None:
    code = ("import sys, cyclone_kit.cli.report; "
            "print(sorted({'pandas', 'matplotlib', 'torch'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
