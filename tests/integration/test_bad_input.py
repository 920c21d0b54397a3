"""Bad input, table-driven: every case exits 2 with exactly one error line that has a HINT,
no traceback, and leaves no run directory behind.

Each case is (id, files to write, argv, environment); ``{d}`` in argv or file contents is the
test's temporary directory.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.cli import REPO

SMOKE = str(REPO / "jobs" / "smoke.toml")
SWEEP = f"[sweep]\nname = 's'\nmode = 'strong'\nbase = '{SMOKE}'\n"


def slurm_env(nodelist: str) -> dict[str, str]:
    """A 2-task Slurm step whose node list is ``nodelist`` (every variable the detection reads)."""
    return {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": nodelist,
            "SLURM_STEP_NODELIST": nodelist, "SLURM_NODELIST": nodelist}


RESNET50 = str(REPO / "jobs" / "resnet50_imagenet.toml")
#: network figures doctor measured on the local test cluster's CPU partition.
LOCAL_NETWORK = json.dumps({"kind": "network", "schema": 1, "source": "measured", "cluster": "local", "partition": "cpu",
                            "device": "cpu", "backend": "gloo",
                            "levels": {"inter": {"alpha_s": 6e-4, "busbw_gbps": 0.94, "ranks": 2, "nodes": 2}}})
GOOD_PROFILE = '[partitions.gpu]\nnodes = 2\ncpus_per_node = 8\ngpus_per_node = 4\ndefault = true\n'

CASES: list[tuple[str, dict[str, str], list[str], dict[str, str]]] = [
    # ---- CLI flags
    ("nodes-zero", {}, ["submit", "--nodes", "0", "--dry-run"], {}),
    ("nodes-negative", {}, ["submit", "--nodes", "-3", "--dry-run"], {}),
    ("nodes-not-int", {}, ["submit", "--nodes", "four", "--dry-run"], {}),
    ("nodes-too-many", {}, ["submit", "--nodes", "99", "--dry-run"], {}),
    ("gpus-too-many", {}, ["submit", "--gpus-per-node", "8", "--dry-run"], {}),
    ("tasks-not-gpus", {}, ["submit", "--ntasks-per-node", "3", "--dry-run"], {}),
    ("cpus-too-many", {}, ["submit", "--cpus-per-task", "11", "--dry-run"], {}),
    ("cpus-zero", {}, ["submit", "--cpus-per-task", "0", "--dry-run"], {}),
    ("time-malformed", {}, ["submit", "--time", "1:2:3:4", "--dry-run"], {}),
    ("time-letters", {}, ["submit", "--time", "2h", "--dry-run"], {}),
    ("time-too-long", {}, ["submit", "--time", "2-00:00:00", "--dry-run"], {}),
    ("time-zero", {}, ["submit", "--time", "0", "--dry-run"], {}),
    ("time-bad-minutes", {}, ["submit", "--time", "01:75:00", "--dry-run"], {}),
    ("unknown-partition", {}, ["submit", "--partition", "bigmem", "--dry-run"], {}),
    ("unknown-profile", {}, ["submit", "--profile", "nope", "--dry-run"], {}),
    ("unknown-launcher", {}, ["submit", "--launcher", "mpirun", "--dry-run"], {}),
    ("unknown-flag", {}, ["submit", "--nodez", "2"], {}),
    ("unknown-command", {}, ["frobnicate"], {}),
    ("account-injection", {}, ["submit", "--account", "p1;rm -rf /", "--dry-run"], {}),
    ("account-missing-real-submit", {}, ["submit", "--nodes", "1", "--runs-dir", "{d}/runs"], {}),
    ("name-hostile", {}, ["submit", "--name", "x$(id)", "--dry-run"], {}),
    # ---- empty values (issue 12: an unset shell variable must not mean "the default")
    ("partition-empty", {}, ["submit", "--partition", "", "--dry-run"], {}),
    ("account-blank", {}, ["submit", "--account", " ", "--dry-run"], {}),
    ("profile-empty", {}, ["submit", "--profile", "", "--dry-run"], {}),
    ("time-empty", {}, ["submit", "--time", "", "--dry-run"], {}),
    ("name-empty", {}, ["submit", "--name", "", "--dry-run"], {}),
    ("spec-path-empty", {}, ["submit", "", "--dry-run"], {}),
    ("run-runs-dir-empty", {}, ["run", "--runs-dir", "", "--nproc", "1"], {}),
    ("sweep-partition-empty", {"sw.toml": SWEEP}, ["sweep", "{d}/sw.toml", "--partition", "", "--dry-run"], {}),
    ("set-empty-value", {}, ["submit", "--set", "resources.partition=", "--dry-run"], {}),
    ("set-empty-quoted", {}, ["submit", "--set", 'account=""', "--dry-run"], {}),
    ("spec-empty-string", {"e.toml": '[resources]\npartition = ""\n'}, ["submit", "{d}/e.toml", "--dry-run"], {}),
    ("spec-empty-in-list", {"e.toml": '[resources]\nextra_sbatch = [""]\n'}, ["submit", "{d}/e.toml", "--dry-run"], {}),
    # ---- what sbatch would refuse, or take to mean something else
    ("gpu-partition-zero-gpus", {}, ["submit", "--partition", "gpu", "--gpus-per-node", "0", "--dry-run"], {}),
    ("mem-malformed", {}, ["submit", "--set", "resources.mem=lots", "--dry-run"], {}),
    ("mem-zero", {}, ["submit", "--set", "resources.mem=0", "--dry-run"], {}),
    ("mem-above-node", {}, ["submit", "--set", "resources.mem=4T", "--dry-run"], {}),
    # ---- --set
    ("set-no-equals", {}, ["submit", "--set", "train.lr", "--dry-run"], {}),
    ("set-empty-key", {}, ["submit", "--set", "=3", "--dry-run"], {}),
    ("set-unknown-key", {}, ["submit", "--set", "train.nope=1", "--dry-run"], {}),
    ("set-unknown-section", {}, ["submit", "--set", "optim.lr=1", "--dry-run"], {}),
    ("set-wrong-type", {}, ["submit", "--set", "train.steps=lots", "--dry-run"], {}),
    ("set-bool-for-int", {}, ["submit", "--set", "resources.nodes=true", "--dry-run"], {}),
    ("set-unknown-model", {}, ["submit", "--set", "model=alexnet9", "--dry-run"], {}),
    ("set-unknown-dataset", {}, ["submit", "--set", "dataset=imagenet22k", "--dry-run"], {}),
    ("set-negative-lr", {}, ["submit", "--set", "lr=-0.1", "--dry-run"], {}),
    ("set-bad-signal", {}, ["submit", "--set", "checkpoint.signal=KILL", "--dry-run"], {}),
    ("set-extra-sbatch-newline", {}, ["submit", "--set", 'resources.extra_sbatch=["--qos=a\\nrm"]', "--dry-run"], {}),
    # ---- job spec files
    ("spec-missing", {}, ["submit", "{d}/nope.toml", "--dry-run"], {}),
    ("spec-is-directory", {}, ["submit", "{d}", "--dry-run"], {}),
    ("spec-malformed-toml", {"bad.toml": "[train\nlr = 0.1\n"}, ["submit", "{d}/bad.toml", "--dry-run"], {}),
    ("spec-not-utf8", {"bin.toml": "\udcff"}, ["submit", "{d}/bin.toml", "--dry-run"], {}),
    ("spec-unknown-top-key", {"s.toml": "optimizer = 'sgd'\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-unknown-train-key", {"s.toml": "[train]\nlearning_rate = 0.1\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-wrong-type", {"s.toml": "[train]\nbatch_size = '64'\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-section-not-table", {"s.toml": "train = 3\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-zero-steps", {"s.toml": "[train]\nsteps = 0\nepochs = 0\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-negative-batch", {"s.toml": "[train]\nbatch_size = -1\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-cifar-no-dir", {"s.toml": "[train]\ndataset = 'cifar10'\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-bad-name", {"s.toml": "name = 'my job'\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-name-not-string", {"s.toml": "name = 3\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-huge-signal-lead", {"s.toml": "[checkpoint]\nsignal_lead_s = 100000\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    ("spec-negative-poll", {"s.toml": "[checkpoint]\npoll_s = -1\n"}, ["submit", "{d}/s.toml", "--dry-run"], {}),
    # ---- profiles
    ("profile-missing-file", {}, ["submit", "--profile", "{d}/nope.toml", "--dry-run"], {}),
    ("profile-malformed", {"p.toml": "[partitions.gpu\n"}, ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-no-partitions", {"p.toml": "name = 'x'\n"}, ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-unknown-key", {"p.toml": GOOD_PROFILE + "colour = 'red'\n"},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-unknown-partition-key", {"p.toml": GOOD_PROFILE + "gpus = 4\n"},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-zero-nodes", {"p.toml": "[partitions.gpu]\nnodes = 0\ncpus_per_node = 8\n"},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-bad-max-time", {"p.toml": "[partitions.gpu]\nnodes = 1\ncpus_per_node = 8\nmax_time = 'forever'\n"},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-two-defaults", {"p.toml": GOOD_PROFILE + "[partitions.b]\nnodes = 1\ncpus_per_node = 1\ndefault = true\n"},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-bad-env-name", {"p.toml": "[env]\n'A-B' = '1'\n" + GOOD_PROFILE},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-bad-gpu-request", {"p.toml": "gpu_request = 'gpus'\n" + GOOD_PROFILE},
     ["submit", "--profile", "{d}/p.toml", "--dry-run"], {}),
    ("profile-show-unknown", {}, ["profiles", "nope"], {}),
    # ---- run directories
    ("runs-dir-is-a-file", {"afile": "x"}, ["submit", "--profile", "local", "--runs-dir", "{d}/afile/runs"], {}),
    ("status-missing-run-dir", {}, ["status", "{d}/no-such-run"], {}),
    ("status-not-a-run-dir", {"x/readme": "x"}, ["status", "{d}/x"], {}),
    ("logs-unknown-job", {}, ["logs", "999999", "--runs-dir", "{d}"], {}),
    ("run-resume-not-a-run-dir", {"x/readme": "x"}, ["run", "--resume", "{d}/x"], {}),
    ("run-resume-with-set", {"r/spec.json": "{}"}, ["run", "--resume", "{d}/r", "--set", "lr=1"], {}),
    ("cancel-not-submitted", {"r/spec.json": "{}"}, ["cancel", "{d}/r"], {}),
    # ---- sweep specs (`sweep --dry-run`: plan only, so a pass would not write anything either)
    ("sweep-missing-file", {}, ["sweep", "{d}/nope.toml", "--dry-run"], {}),
    ("sweep-malformed-toml", {"s.toml": "[sweep\nmode = 'strong'\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-no-sweep-table", {"s.toml": "name = 'x'\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-unknown-key", {"s.toml": SWEEP + "world_sizes = [1, 2]\ncolour = 'red'\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-bad-mode", {"s.toml": SWEEP.replace("'strong'", "'sideways'") + "world_sizes = [1, 2]\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-no-points", {"s.toml": SWEEP}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-world-sizes-not-list", {"s.toml": SWEEP + "world_sizes = 4\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-zero-world-size", {"s.toml": SWEEP + "world_sizes = [0, 2]\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-negative-world-size", {"s.toml": SWEEP + "world_sizes = [-1]\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-repeated-size", {"s.toml": SWEEP + "world_sizes = [2, 2]\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-point-zero-nodes", {"s.toml": SWEEP + "points = [{nodes = 0, ntasks_per_node = 2}]\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-point-not-table", {"s.toml": SWEEP + "points = [3]\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-point-unknown-key", {"s.toml": SWEEP + "points = [{nodes = 1, gpus = 2}]\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-repeats-zero", {"s.toml": SWEEP + "world_sizes = [1, 2]\nrepeats = 0\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-batch-indivisible", {"s.toml": SWEEP + "world_sizes = [1, 3]\nglobal_batch_size = 64\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-missing-base", {"s.toml": SWEEP.replace(SMOKE, "gone.toml") + "world_sizes = [1, 2]\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-no-base", {"s.toml": "[sweep]\nname = 's'\nmode = 'strong'\nworld_sizes = [1]\n"},
     ["sweep", "{d}/s.toml", "--dry-run"], {}),
    ("sweep-too-many-nodes", {"s.toml": SWEEP.replace("'strong'", "'weak'") + "points = [{nodes = 9, ntasks_per_node = 2}]\n"},
     ["sweep", "{d}/s.toml", "--profile", "local", "--dry-run"], {}),
    ("sweep-bad-backend", {}, ["sweep", SMOKE, "--backend", "pbs", "--dry-run"], {}),
    # ---- `env` inside a broken Slurm step: malformed hostlists and counts in the environment
    ("env-hostlist-unclosed", {}, ["env"], slurm_env("gpu[01-")),
    ("env-hostlist-reversed-range", {}, ["env"], slurm_env("gpu[09-01]")),
    ("env-hostlist-empty-brackets", {}, ["env"], slurm_env("gpu[]")),
    ("env-hostlist-nested", {}, ["env"], slurm_env("gpu[[1-2]]")),
    ("env-hostlist-huge-range", {}, ["env"], slurm_env("n[0-99999999]")),
    ("env-tasks-per-node-garbage", {}, ["env"], {**slurm_env("c[1-2]"), "SLURM_TASKS_PER_NODE": "2(xx)"}),
    ("env-procid-out-of-range", {}, ["env"], {**slurm_env("c[1-2]"), "SLURM_PROCID": "5"}),
    # ---- `report` on metrics logs that hold no run at all
    ("report-empty-metrics", {"runs/r/spec.json": "{}", "runs/r/metrics.jsonl": ""},
     ["report", "{d}/runs/r", "-o", "{d}/out"], {}),
    ("report-corrupt-only-metrics", {"runs/r/spec.json": "{}", "runs/r/metrics.jsonl": '{not json\n\x00\x01\n{"kind": "st'},
     ["report", "{d}/runs/r", "-o", "{d}/out"], {}),
    # ---- predict (issue 23): unknown model, ranks that do not divide the GPUs, network figures from elsewhere
    ("predict-unknown-model", {"m.toml": "[train]\nmodel = 'resnet152'\n"},
     ["predict", "{d}/m.toml", "--profile", "cyclone", "--partition", "gpu"], {}),
    ("predict-tasks-not-dividing-gpus", {}, ["predict", RESNET50, "--partition", "gpu", "--ntasks-per-node", "3"], {}),
    ("predict-nodes-beyond-partition", {}, ["predict", RESNET50, "--partition", "gpu", "--nodes", "1,32"], {}),
    ("predict-nodes-not-a-list", {}, ["predict", RESNET50, "--partition", "gpu", "--nodes", "1,two"], {}),
    ("predict-network-other-cluster", {"network.json": LOCAL_NETWORK},
     ["predict", RESNET50, "--partition", "gpu", "--network", "{d}/network.json"], {}),
    ("predict-network-other-device", {"network.json": LOCAL_NETWORK},
     ["predict", RESNET50, "--profile", "local", "--partition", "gpu", "--network", "{d}/network.json"], {}),
    ("predict-network-not-one", {"network.json": "{}"},
     ["predict", RESNET50, "--partition", "gpu", "--network", "{d}/network.json"], {}),
    ("predict-no-figures", {}, ["predict", RESNET50, "--profile", "local", "--partition", "cpu"], {}),
    ("predict-missing-target", {}, ["predict", "{d}/nothing-here"], {}),
]


# ---- CLI stumbles (issue 17): each also names the fix; (id, files, argv, env, text the error line must hold)
STUMBLES: list[tuple[str, dict[str, str], list[str], dict[str, str], str]] = [
    ("flag-misspelt-did-you-mean", {}, ["submit", "--nods", "2", "--dry-run"], {}, "did you mean --nodes (not --nods)"),
    ("sweep-flag-misspelt", {"sw.toml": SWEEP}, ["sweep", "{d}/sw.toml", "--baknd", "local", "--dry-run"], {},
     "did you mean --backend"),
    ("status-flag-misspelt", {}, ["status", "--runsdir", "{d}"], {}, "did you mean --runs-dir"),
    ("set-key-misspelt", {}, ["submit", "--set", "train.lrr=0.1", "--dry-run"], {}, "did you mean train.lr (not train.lrr)"),
    ("set-short-key-misspelt", {}, ["submit", "--set", "lrr=0.1", "--dry-run"], {}, "did you mean lr (not lrr)"),
    ("toml-key-misspelt", {"s.toml": "[train]\nlrr = 0.1\n"}, ["submit", "{d}/s.toml", "--dry-run"], {},
     "did you mean lr (not lrr)"),
    ("toml-section-misspelt", {"s.toml": "[trian]\nlr = 0.1\n"}, ["submit", "{d}/s.toml", "--dry-run"], {},
     "did you mean train (not trian)"),
    ("sweep-key-misspelt", {"s.toml": SWEEP + "world_size = [1, 2]\n"}, ["sweep", "{d}/s.toml", "--dry-run"], {},
     "did you mean world_sizes"),
    ("sweep-spec-to-submit", {"s.toml": SWEEP + "world_sizes = [1, 2]\n"}, ["submit", "{d}/s.toml", "--dry-run"], {},
     "`cyclone-kit sweep "),
    ("sweep-spec-to-real-submit", {"s.toml": SWEEP + "world_sizes = [1, 2]\n"},
     ["submit", "{d}/s.toml", "--runs-dir", "{d}/runs"], {}, "`cyclone-kit sweep "),
    ("job-spec-to-sweep", {}, ["sweep", SMOKE, "--dry-run"], {}, "`cyclone-kit submit "),
    ("submit-backend-misspelt-dry-run", {}, ["submit", "--backend", "slrum", "--dry-run"], {}, "did you mean slurm"),
    ("submit-backend-unknown-dry-run", {}, ["submit", "--backend", "pbs", "--dry-run"], {}, "use one of: slurm"),
    ("data-dir-missing", {}, ["submit", "--set", "train.dataset=cifar10", "--set", "train.data_dir={d}/no-data",
                              "--profile", "local", "--runs-dir", "{d}/runs"], {}, "--no-data-check"),
    ("data-dir-missing-dry-run", {}, ["submit", "--set", "train.dataset=imagefolder", "--set",
                                      "train.data_dir={d}/no-data", "--dry-run"], {}, "does not exist on this machine"),
    ("data-dir-is-a-file", {"afile": "x"}, ["submit", "--set", "train.dataset=cifar10", "--set",
                                            "train.data_dir={d}/afile", "--dry-run"], {}, "is not a directory"),
    # ---- in-job restarts (issue 31) on a backend without the step watcher: refused, not ignored
    ("spare-nodes-local-backend", {}, ["submit", SMOKE, "--backend", "local", "--profile", "local", "--partition", "wide",
                                       "--spare-nodes", "1", "--runs-dir", "{d}/runs"], {}, "the local backend would ignore"),
    ("min-nodes-local-backend-dry-run", {}, ["submit", SMOKE, "--backend", "local", "--profile", "local", "--nodes", "2",
                                             "--min-nodes", "1", "--dry-run"], {}, "drop --min-nodes"),
    ("spare-nodes-submitit-backend", {}, ["submit", SMOKE, "--backend", "submitit", "--profile", "local", "--partition",
                                          "wide", "--spare-nodes", "1", "--runs-dir", "{d}/runs"], {},
     "the submitit backend would ignore"),
    ("spec-spare-nodes-submitit-dry-run", {"s.toml": "[resources]\nspare_nodes = 1\nmin_nodes = 1\n"
                                                     "nodes = 2\nprofile = 'local'\npartition = 'wide'\n"},
     ["submit", "{d}/s.toml", "--backend", "submitit", "--dry-run"], {}, "--spare-nodes=1 and --min-nodes=1"),
    ("profile-spare-nodes-local-backend", {"p.toml": "name = 'sp'\nspare_nodes = 1\n[partitions.cpu]\nnodes = 4\n"
                                                     "cpus_per_node = 4\ndefault = true\n"},
     ["submit", SMOKE, "--backend", "local", "--profile", "{d}/p.toml", "--runs-dir", "{d}/runs"], {},
     "pass --spare-nodes 0"),
    ("run-spare-nodes", {}, ["run", SMOKE, "--set", "resources.spare_nodes=1", "--runs-dir", "{d}/runs"], {},
     "`cyclone-kit run` (ranks on this machine) would ignore"),
    ("run-min-nodes", {}, ["run", SMOKE, "--nproc", "2", "--nodes", "2", "--set", "resources.min_nodes=1",
                           "--runs-dir", "{d}/runs"], {}, "drop resources.min_nodes"),
    ("sweep-spare-nodes-local-backend", {"s.toml": SWEEP + "world_sizes = [1, 2]\nglobal_batch_size = 32\n"},
     ["sweep", "{d}/s.toml", "--profile", "local", "--partition", "wide", "--set", "resources.spare_nodes=1",
      "--backend", "local", "--runs-dir", "{d}/runs"], {}, "the local backend would ignore"),
    ("sweep-data-dir-missing", {"s.toml": SWEEP + "world_sizes = [1, 2]\nglobal_batch_size = 32\n"},
     ["sweep", "{d}/s.toml", "--set", "train.dataset=fashion_mnist", "--set", "train.data_dir={d}/no-data",
      "--backend", "local", "--runs-dir", "{d}/runs"], {}, "--no-data-check"),
    # ---- containers (issue 30): a real submit, refused before anything is written or queued
    ("container-image-missing", {}, ["submit", "--profile", "local", "--container", "{d}/no-image", "--set",
     "container.runtime=charliecloud", "--runs-dir", "{d}/runs"], {}, "container image '{d}/no-image' does not exist"),
    ("container-image-not-an-image", {"img.tar": "x"}, ["submit", "--profile", "local", "--container", "{d}/img.tar",
     "--set", "container.runtime=charliecloud", "--runs-dir", "{d}/runs"], {}, "is a file, not an image charliecloud"),
    ("container-sqsh-is-a-folder", {"img/bin/sh": "x"}, ["submit", "--profile", "local", "--container", "{d}/img",
     "--set", "container.runtime=pyxis", "--runs-dir", "{d}/runs"], {}, "a pyxis image is a .sqsh file"),
    ("container-runtime-missing", {"img.sif": "x"}, ["submit", "--profile", "local", "--container", "{d}/img.sif",
     "--set", "container.runtime=apptainer", "--runs-dir", "{d}/runs"], {}, "`srun -N1 -p gpu apptainer --version`"),
    ("container-bind-missing", {"img/tmp/.keep": ""}, ["submit", "--profile", "local", "--container", "{d}/img",
     "--set", "container.runtime=charliecloud", "--set", 'container.binds=["{d}/no-data"]', "--runs-dir", "{d}/runs"],
     {}, "container bind source '{d}/no-data' does not exist"),
    ("container-no-mount-point", {"img/bin/sh": "x"}, ["submit", "--profile", "local", "--container", "{d}/img",
     "--set", "container.runtime=charliecloud", "--runs-dir", "{d}/runs"], {}, "has no folder /"),
    ("container-no-runtime", {"img/bin/sh": "x"}, ["submit", "--profile", "local", "--container", "{d}/img",
     "--runs-dir", "{d}/runs"], {}, "--set container.runtime=NAME"),
    ("container-pyxis-local-backend", {"img.sqsh": "x"}, ["submit", SMOKE, "--profile", "local", "--container",
     "{d}/img.sqsh", "--set", "container.runtime=pyxis", "--backend", "local", "--runs-dir", "{d}/runs"], {},
     "the local backend runs charliecloud and apptainer images"),
    ("container-submitit-backend", {"img/tmp/.keep": ""}, ["submit", SMOKE, "--profile", "local", "--container",
     "{d}/img", "--set", "container.runtime=charliecloud", "--backend", "submitit", "--runs-dir", "{d}/runs"], {},
     "with the submitit backend, which cannot run charliecloud"),
    ("run-container-missing", {}, ["run", SMOKE, "--container", "{d}/no-image", "--set", "container.runtime=charliecloud",
     "--runs-dir", "{d}/runs"], {}, "container image '{d}/no-image' does not exist"),
    ("sweep-container-image-missing", {"sw.toml": SWEEP + "world_sizes = [1, 2]\nglobal_batch_size = 32\n"},
     ["sweep", "{d}/sw.toml", "--profile", "local", "--container", "{d}/no-image", "--set",
      "container.runtime=charliecloud", "--runs-dir", "{d}/runs"], {}, "does not exist"),
]
CASES += [c[:4] for c in STUMBLES]
#: The words of the fix each stumble's error must name (checked with the case's one-line error).
FIX_TEXT = {c[0]: c[4] for c in STUMBLES}


def test_data_check_opt_out_renders_the_job(tmp_path, cli):
    """--no-data-check: a path only the compute nodes see is left to them (the script is rendered, not refused)."""
    result = cli("submit", "--set", "train.dataset=cifar10", "--set", "train.data_dir=/scratch/only-on-nodes",
                 "--no-data-check", "--dry-run", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash") and "#SBATCH --job-name=" in result.stdout


@pytest.mark.parametrize(("name", "files", "argv", "env"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_hint_line(name, files, argv, env, tmp_path, cli):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
    before = {p for p in tmp_path.rglob("*")}
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    result = cli(*argv, cwd=tmp_path, env={k: v.replace("{d}", str(tmp_path)) for k, v in env.items()}, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "HINT" in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    if name in FIX_TEXT:  # a stumble: the error names its fix
        assert FIX_TEXT[name].replace("{d}", str(tmp_path)) in result.stderr, result.stderr
    assert {p for p in tmp_path.rglob("*")} == before, "a failed command must not leave files behind"
    if not any(rel.startswith("runs/") for rel in files):
        assert not (tmp_path / "runs").exists()
    assert not os.path.exists(REPO / "runs" / "never")


def test_case_count():
    assert len(CASES) >= 40
