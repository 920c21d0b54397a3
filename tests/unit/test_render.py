"""Rendered sbatch scripts: golden files, bash -n, and what every script must contain.

Regenerate the golden files after an intended template change with ``make golden``
(``CK_REGEN_GOLDEN=1 pytest tests/unit/test_render.py``) and review the diff.
"""

import os

import pytest

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.submit.render import render_script, sbatch_quote, shell_quote
from tests.helpers.cli import REPO

GOLDEN = REPO / "tests" / "golden"
RUN_DIR = "/scratch/p163/runs/demo-20260101-000000"
PY = "/opt/venv/bin/python"
NO_USER_TEMPLATES = {"CYCLONE_KIT_TEMPLATES": "/nonexistent"}

CASES = {
    "cyclone_gpu_4nodes": ("cyclone", {"partition": "gpu", "nodes": 4, "account": "p163", "exclusive": True}),
    "cyclone_torchrun_2nodes": ("cyclone", {"partition": "gpu", "nodes": 2, "launcher": "torchrun"}),
    "cyclone_horovod_2nodes": ("cyclone", {"partition": "gpu", "nodes": 2, "launcher": "horovod", "account": "p163"}),
    "local_cpu_2x2": ("local", {"partition": "cpu", "nodes": 2, "ntasks_per_node": 2}),
    "generic_gpus_per_node": ("generic", {"partition": "gpu", "nodes": 1, "gpus_per_node": 2, "mem": "64G"}),
    # issue 31: 2 nodes + 1 spare, may shrink to 1: --nodes=3, --no-kill, the step watcher's restart options
    "local_wide_spare_restart": ("local", {"partition": "wide", "nodes": 2, "ntasks_per_node": 1, "spare_nodes": 1,
                                           "min_nodes": 1}),
}


#: issue 30: containers (Apptainer and Pyxis are checked only here and by bash -n: neither installs on Debian 12).
#: The venv's paths are given (the login side fills them in from its own venv at submission).
CONTAINER_CASES = {
    "cyclone_apptainer_2nodes": ("cyclone", {"partition": "gpu", "nodes": 2, "account": "p163"}, {
        "runtime": "apptainer", "image": "/cluster/images/pytorch 24.sif", "binds": ["/cluster/datasets"],
        "pythonpath": ["/opt/venv/lib/python3.11/site-packages", "/home/u/cyclone_kit"]},
        {"dataset": "cifar10", "data_dir": "/cluster/datasets/cifar10"}),
    "cyclone_pyxis_torchrun_2nodes": ("cyclone", {"partition": "gpu", "nodes": 2, "launcher": "torchrun"}, {
        "runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05-py3", "binds": ["/cluster/datasets:/data"],
        "pythonpath": ["/opt/venv/lib/python3.11/site-packages"]}, None),
}


def render(profile, resources, run_dir=RUN_DIR, name="demo", checkpoint=None, container=None, train=None):
    spec = spec_from_dict({"name": name, "resources": {"profile": profile, **resources},
                           "checkpoint": checkpoint or {}, **({"container": container} if container else {}),
                           **({"train": train} if train else {})})
    return render_script(resolve(spec, load_profile(profile)), run_dir, python=PY, environ=NO_USER_TEMPLATES)


@pytest.mark.parametrize("case", sorted(CASES) + sorted(CONTAINER_CASES))
def test_golden(case):
    if case in CONTAINER_CASES:
        profile, resources, container, train = CONTAINER_CASES[case]
        text = render(profile, resources, container=container, train=train)
    else:
        text = render(*CASES[case])
    path = GOLDEN / f"{case}.sbatch"
    if os.environ.get("CK_REGEN_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}: run `make golden`"
    assert text == path.read_text(), f"{case} differs from its golden file: run `make golden` if intended"


def test_cyclone_4_node_script_has_everything():
    text = render("cyclone", {"partition": "gpu", "nodes": 4})
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=10",
                 "#SBATCH --gres=gpu:4", "#SBATCH --time=01:00:00", "#SBATCH --partition=gpu",
                 "#SBATCH --job-name=demo", f"#SBATCH --output={RUN_DIR}/logs/%x-%j.out",
                 f"#SBATCH --error={RUN_DIR}/logs/%x-%j.err", "#SBATCH --signal=USR2@120", "#SBATCH --requeue",
                 "--cpu-bind=cores --distribution=block:block --gpu-bind=none",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p',
                 "export MASTER_ADDR",
                 "-m cyclone_kit.core.ports 15000 16000", "export MASTER_PORT", "srun --kill-on-bad-exit=1"]:
        assert line in text, line
    assert "--account" not in text.replace("--account=<project>", "").replace("--account to", "")
    assert "module load" not in text  # issue 16: the job runs the submitting env's python with torch's own CUDA


def test_signal_is_configurable_and_no_signal_without_checkpointing():
    text = render("local", {}, checkpoint={"signal": "USR1", "signal_lead_s": 300})
    assert "#SBATCH --signal=USR1@300" in text
    text = render("local", {}, checkpoint={"requeue": False, "resume": False, "every_steps": 0})
    assert "--signal" not in text and "--requeue" not in text


def test_user_template_dir_wins(tmp_path):
    (tmp_path / "srun.sbatch.j2").write_text('{% extends "base.sbatch.j2" %}{% block launch %}echo mine{% endblock %}')
    spec = spec_from_dict({"resources": {"profile": "local"}})
    text = render_script(resolve(spec, load_profile("local")), RUN_DIR, environ={"CYCLONE_KIT_TEMPLATES": str(tmp_path)})
    assert text.rstrip().endswith("echo mine") and "#SBATCH --nodes=1" in text


@pytest.mark.parametrize("payload", ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                     "{{ cycler.__init__.__globals__.os.system('touch /tmp/pwned') }}",
                                     "{{ undefined_variable }}"])
def test_user_templates_are_sandboxed(tmp_path, payload):
    (tmp_path / "srun.sbatch.j2").write_text(payload)
    spec = spec_from_dict({"resources": {"profile": "local"}})
    with pytest.raises(ValidationError, match="HINT"):
        render_script(resolve(spec, load_profile("local")), RUN_DIR, environ={"CYCLONE_KIT_TEMPLATES": str(tmp_path)})


@pytest.mark.parametrize(("value", "expected"), [("abc", "abc"), ("/a b/c", '"/a b/c"'), ("$(x)", '"$(x)"'),
                                                 ("a;b", '"a;b"'), ("p163", "p163")])
def test_sbatch_quote(value, expected):
    assert sbatch_quote(value) == expected


@pytest.mark.parametrize("value", ['a"b', "a\nb", "a\\b", "a\rb"])
def test_sbatch_quote_refuses(value):
    with pytest.raises(ValidationError, match="HINT"):
        sbatch_quote(value)


def test_shell_quote():
    assert shell_quote("it's") == "'it'\"'\"'s'"
