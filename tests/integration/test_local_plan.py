"""``submit --backend local --dry-run`` prints the local launcher's plan, and that plan is what ran."""

from __future__ import annotations

import json

from cyclone_kit.backends.local import AT_LAUNCH_JOB_ID, AT_LAUNCH_PORT
from cyclone_kit.rundir.layout import RunDir
from tests.helpers.cli import REPO, run_cli, run_dir_of

SMOKE = str(REPO / "jobs" / "smoke.toml")
#: Two ranks of the tiny CNN, one step, no validation: the shortest run that starts every part.
ARGS = ("submit", SMOKE, "--backend", "local",
        "--set", "train.steps=1", "--set", "train.val_samples=0", "--set", "train.log_every=1")


def test_the_dry_run_plan_is_what_the_local_launcher_ran(tmp_path):
    runs = tmp_path / "runs"
    dry = run_cli(*ARGS, "--dry-run", "--runs-dir", str(runs))
    assert dry.returncode == 0, dry.stderr
    assert not runs.exists(), "--dry-run must write nothing"
    plan = json.loads(dry.stdout)
    assert [r["env"]["SLURM_PROCID"] for r in plan["ranks"]] == ["0", "1"]
    assert plan["ranks"][0]["env"]["SLURM_JOB_ID"] == AT_LAUNCH_JOB_ID
    assert "#SBATCH" not in dry.stdout

    real = run_cli(*ARGS, "--runs-dir", str(runs), timeout=300)
    assert real.returncode == 0, real.stderr
    run_dir = run_dir_of(real.stdout)
    launch = RunDir(run_dir).read_launch()
    assert launch is not None
    port = launch["master"].rsplit(":", 1)[1]
    drawn = {launch["job_id"]: AT_LAUNCH_JOB_ID, port: AT_LAUNCH_PORT}
    ran = {
        "launcher": launch["launcher"], "run_dir": str(run_dir), "cwd": launch["cwd"], "nodelist": launch["nodelist"],
        "threads_per_rank": launch["threads_per_rank"], "command": launch["command"],
        "ranks": [{"rank": r["rank"], "host": r["host"], "env": {k: drawn.get(v, v) for k, v in r["env"].items()}}
                  for r in launch["ranks"]],
    }
    shown = json.loads(dry.stdout.replace(plan["run_dir"], str(run_dir)))  # the run directory's name aside
    assert shown == ran
    assert not RunDir(run_dir).script.exists(), "no batch script runs on the local backend: none is written"


def test_run_prepares_its_run_directory_as_submit_backend_local_does(tmp_path):
    runs = tmp_path / "runs"
    real = run_cli("run", SMOKE, "--nproc", "2", "--threads", "1", "--quiet", "--runs-dir", str(runs),
                   *ARGS[4:], timeout=300)
    assert real.returncode == 0, real.stderr
    rd = RunDir(run_dir_of(real.stdout))
    resources = rd.read_spec()["resources"]
    # what ran, and no partition or account: no cluster took part (the spec's profile name is kept)
    assert {k: resources[k] for k in ("nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task", "partition",
                                      "account", "profile")} == {
        "nodes": 1, "ntasks_per_node": 2, "gpus_per_node": 0, "cpus_per_task": 1, "partition": "", "account": "",
        "profile": "local"}
    assert not rd.script.exists() and rd.backend() == "local" and rd.read_launch() is not None
