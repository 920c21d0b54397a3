"""Containers (issue 30): the runtimes' words, the binds a job needs, the [container] table and its checks."""

from __future__ import annotations

import getpass
import json
import shlex
from pathlib import Path

import pytest

from cyclone_kit.config.container import ContainerConfig, container_paths, container_problems, host_paths, merged
from cyclone_kit.config.job import spec_from_dict, spec_to_dict
from cyclone_kit.config.profile import load_profile, profile_from_dict
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.doctor import checks as doctor
from cyclone_kit.doctor.checks import HostVersions, SmokeResult
from cyclone_kit.doctor.job import doctor_request
from cyclone_kit.launchers import SRUN, Wrapped
from cyclone_kit.launchers.containers import (
    Apptainer,
    Bind,
    Charliecloud,
    Pyxis,
    charliecloud_mount_points,
    image_form_error,
    job_binds,
    make_runtime,
    missing_runtime_error,
    outermost,
    parse_bind,
)
from cyclone_kit.submit.render import render_script
from tests.helpers.cli import REPO

PY = "/opt/venv/bin/python"
NO_USER_TEMPLATES = {"CYCLONE_KIT_TEMPLATES": "/nonexistent"}


# ------------------------------------------------------------------ the runtimes' words
def test_charliecloud_binds_sets_env_and_separates_the_command():
    ch = Charliecloud("/img", (Bind("/tmp", "/tmp"), Bind("/data", "/mnt/data")), (("PYTHONPATH", "/v/site"),),
                      cwd="/tmp/proj")
    assert ch.wrap(["python3", "-m", "x"]) == ["ch-run", "-b", "/tmp", "-b", "/data:/mnt/data",
                                                "--set-env=PYTHONPATH=/v/site", "--cd=/tmp/proj", "/img", "--",
                                                "python3", "-m", "x"]
    assert ch.srun_options() == ()


def test_apptainer_adds_nv_only_on_gpu_nodes():
    cpu = Apptainer("/i.sif", (Bind("/r", "/r"),), (("A", "1"),))
    gpu = Apptainer("/i.sif", (Bind("/r", "/r"),), (("A", "1"),), gpus=True, binary="singularity")
    assert cpu.wrap(["p"]) == ["apptainer", "exec", "--bind", "/r", "--env", "A=1", "/i.sif", "p"]
    assert gpu.wrap(["p"])[:3] == ["singularity", "exec", "--nv"]


def test_pyxis_leaves_the_command_and_gives_srun_the_container():
    px = Pyxis("nvcr.io#nvidia/pytorch:24.05-py3", (Bind("/r", "/r"), Bind("/d", "/data")), (("A", "1"),))
    assert px.wrap(["python3", "x"]) == ["python3", "x"]
    assert px.srun_options() == ("--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
                                 "--container-mounts=/r:/r,/d:/data", "--no-container-mount-home", "--export=ALL,A=1")
    with pytest.raises(ValidationError, match="srun --export"):
        Pyxis("x#y", (), (("A", "1,2"),))


def test_wrapped_launcher_runs_its_command_inside_and_keeps_its_rules():
    wrapped = Wrapped(SRUN, Charliecloud("/img"))
    assert wrapped.rank_command(["python3", "t.py"]) == ["ch-run", "/img", "--", "python3", "t.py"]
    assert wrapped.name == "srun" and wrapped.tasks_per_node(None, 4) == SRUN.tasks_per_node(None, 4)


@pytest.mark.parametrize(("runtime", "path"), [("pyxis", "/a,b"), ("apptainer", "/a,b"), ("charliecloud", "/a:b")])
def test_a_path_a_bind_list_cannot_carry_is_refused(runtime, path):
    with pytest.raises(ValidationError, match="HINT"):
        make_runtime(runtime, "/img", [Bind(path, path)])


def test_unknown_runtime_is_refused():
    with pytest.raises(ValidationError, match="use one of"):
        make_runtime("docker", "/img", [])


# ------------------------------------------------------------------ binds
def test_charliecloud_binds_each_path_by_its_top_folder():
    assert charliecloud_mount_points(["/tmp/x/run", "/work/main/.venv/lib/site", "/work/main", "/tmp/y"]) == \
        ("/tmp", "/work")


@pytest.mark.parametrize("path", ["/usr/share/datasets/mnist", "/etc/x", "/"])
def test_charliecloud_never_covers_the_images_system(path):
    with pytest.raises(ValidationError, match="would cover the image's own"):
        charliecloud_mount_points([path])


def test_other_runtimes_bind_the_outermost_paths_and_extra_binds_cover_theirs():
    assert outermost(["/a/b", "/a", "/c/", "/c", "/a/b/c"]) == ("/a", "/c")
    binds = job_binds("apptainer", ["/r/run", "/data/cifar", "/v/site"], [Bind("/data", "/data"), Bind("/x", "/y")])
    assert binds == (Bind("/r/run", "/r/run"), Bind("/v/site", "/v/site"), Bind("/data", "/data"), Bind("/x", "/y"))
    assert job_binds("charliecloud", ["/tmp/r", "/work/v"], [Bind("/scratch", "/scratch")]) == (
        Bind("/tmp", "/tmp"), Bind("/work", "/work"), Bind("/scratch", "/scratch"))


@pytest.mark.parametrize("text", ["data", "/a:/b:/c", "/a:", ":/b", "/a:rel"])
def test_parse_bind_refuses(text):
    with pytest.raises(ValidationError, match="SRC:DST"):
        parse_bind(text)


def test_parse_bind():
    assert parse_bind("/d") == Bind("/d", "/d") and parse_bind("/d:/data").spec == "/d:/data"


# ------------------------------------------------------------------ images and runtimes on the login node
@pytest.mark.parametrize(("runtime", "image", "is_dir", "is_file", "words"), [
    ("charliecloud", "/img", True, False, None),
    ("charliecloud", "/img.sqfs", False, True, None),
    ("charliecloud", "/img.tar.gz", False, True, "is a file, not an image charliecloud runs"),
    ("charliecloud", "/nope", False, False, "does not exist"),
    ("apptainer", "/i.sif", False, True, None),
    ("apptainer", "/sandbox", True, False, None),
    ("apptainer", "/i.sqsh", False, True, "apptainer build"),
    ("apptainer", "docker://pytorch/pytorch", False, False, None),
    ("pyxis", "/i.sqsh", False, True, None),
    ("pyxis", "/folder", True, False, "is a folder, not an image pyxis runs"),
    ("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3", False, False, None),
    ("pyxis", "/nope.sqsh", False, False, "does not exist"),
])
def test_image_form(runtime, image, is_dir, is_file, words):
    error = image_form_error(runtime, image, is_dir=is_dir, is_file=is_file)
    if words is None:
        assert error is None
    else:
        assert error is not None and words in str(error) and error.hint


def test_a_missing_runtime_says_how_to_check_the_compute_nodes():
    text = str(missing_runtime_error("charliecloud", "gpu"))
    assert "'ch-run' is not on this login node's PATH" in text and "srun -N1 -p gpu which ch-run" in text


def test_container_problems(tmp_path):
    image = tmp_path / "img"
    (image / "tmp").mkdir(parents=True)
    box = ContainerConfig(runtime="charliecloud", image=str(image))
    found = lambda name: f"/usr/bin/{name}"  # noqa: E731
    container_problems(box, ["/tmp/runs/r"], "cpu", which=found)
    with pytest.raises(ValidationError, match=r"has no folder /work .* HINT: mkdir"):
        container_problems(box, ["/tmp/runs/r", "/work/venv"], "cpu", which=found)
    with pytest.raises(ValidationError, match="'ch-run' is not on this login node's PATH"):
        container_problems(box, ["/tmp/runs/r"], "cpu", which=lambda name: None)
    with pytest.raises(ValidationError, match="bind source"):
        container_problems(ContainerConfig(runtime="charliecloud", image=str(image), binds=(str(tmp_path / "no"),)),
                           [], "cpu", which=found)
    with pytest.raises(ValidationError, match="not an absolute path"):
        container_problems(ContainerConfig(runtime="charliecloud", image="img"), [], "cpu", which=found)


# ------------------------------------------------------------------ the [container] table
def test_container_table_values_are_checked():
    with pytest.raises(ValidationError, match=r"unknown container\.runtime 'docker'"):
        ContainerConfig(runtime="docker")
    with pytest.raises(ValidationError, match="not one command"):
        ContainerConfig(python="python3 -u")
    with pytest.raises(ValidationError, match="SRC:DST"):
        ContainerConfig(binds=("rel",))


def test_job_container_over_the_profiles():
    prof = ContainerConfig(runtime="apptainer", binds=("/scratch",), python="python3.11")
    job = ContainerConfig(image="/i.sif", binds=("/data",))
    out = merged(job, prof)
    assert out is not None and (out.runtime, out.image, out.binds, out.python) == \
        ("apptainer", "/i.sif", ("/scratch", "/data"), "python3.11")
    assert merged(None, prof) is None  # a runtime alone puts no job in a container
    assert merged(None, ContainerConfig(runtime="pyxis", image="x#y")) is not None  # a profile's default image does
    with pytest.raises(ValidationError, match="no container runtime"):
        merged(job, None)
    with pytest.raises(ValidationError, match="names no image"):
        merged(ContainerConfig(runtime="pyxis"), None)


def test_spec_round_trip_and_profile_table():
    spec = spec_from_dict({"container": {"runtime": "charliecloud", "image": "/img", "binds": ["/d"]}})
    assert spec.container == ContainerConfig(runtime="charliecloud", image="/img", binds=("/d",))
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert "container" not in spec_to_dict(spec_from_dict({}))
    prof = profile_from_dict({"partitions": {"cpu": {"nodes": 1, "cpus_per_node": 2}},
                              "container": {"runtime": "pyxis"}}, "p")
    assert prof.container == ContainerConfig(runtime="pyxis")
    with pytest.raises(ValidationError, match="unknown key"):
        spec_from_dict({"container": {"imgae": "/x"}})


def test_host_paths_add_the_project_only_outside_the_venv():
    assert host_paths("/v", "/v/lib/python3.11/site-packages")[0] == "/v/lib/python3.11/site-packages"
    assert all(p.startswith("/") for p in host_paths())


def test_container_paths_of_a_script_job():
    spec = spec_from_dict({"script": {"path": "/home/u/proj/train.py", "chdir": "/home/u/proj", "live": True},
                           "container": {"runtime": "apptainer", "image": "/i.sif", "pythonpath": ["/v/site"]}})
    assert container_paths(spec, "/scratch/runs/r") == ["/scratch/runs/r", "/home/u/proj", "/home/u/proj", "/v/site"]


# ------------------------------------------------------------------ rendered: pure, quoted
def test_hostile_run_dir_is_one_word_in_the_containers_command():
    run_dir = "/tmp/we ird/'quote'; rm -rf ~/runs/r"
    spec = spec_from_dict({"name": "c", "resources": {"profile": "local", "partition": "cpu", "nodes": 2},
                           "container": {"runtime": "charliecloud", "image": "/img dir/x", "pythonpath": ["/w/site"]}})
    text = render_script(resolve(spec, load_profile("local")), run_dir, python=PY, environ=NO_USER_TEMPLATES)
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("ch-run"))
    words = shlex.split(line)
    assert words[:10] == ["ch-run", "-b", "/tmp", "-b", "/w", "--set-env=CYCLONE_REQUEUE_BY=stepwatch",
                          "--set-env=CYCLONE_CONTAINER=charliecloud",
                          f"--cd={run_dir}", "/img dir/x", "--"]
    assert words[10:] == ["python3", "-m", "cyclone_kit.runtime", "--run-dir", run_dir]
    assert 'export USER="${USER:-$(id -un)}"' in text
    assert 'export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}"/w/site' in text  # after the job's own, as site-packages


# ------------------------------------------------------------------ requeue from a container: through the step watcher
def test_a_rank_in_a_container_asks_the_step_watcher_to_requeue(tmp_path, capsys):
    from cyclone_kit.rundir.layout import RunDir
    from cyclone_kit.runtime.signals import requeue

    environ = {"SLURM_JOB_ID": "42", "CYCLONE_RUN_DIR": str(tmp_path), "CYCLONE_REQUEUE_BY": "stepwatch"}
    assert requeue(environ) == "42"
    assert "asked the step watcher to requeue Slurm job 42" in capsys.readouterr().err
    rd = RunDir(tmp_path)
    assert not rd.take_requeue_request("41")  # another job's request is not this one's
    assert rd.take_requeue_request("42") and not rd.take_requeue_request("42")  # taken once


def test_no_container_no_container_words():
    spec = spec_from_dict({"name": "c", "resources": {"profile": "local"}})
    text = render_script(resolve(spec, load_profile("local")), "/r", python=PY, environ=NO_USER_TEMPLATES)
    assert "ch-run" not in text and "container" not in text and f"    {PY} -m cyclone_kit.runtime" in text


# ------------------------------------------------------------------ doctor: the image runs, imports torch, sees GPUs
REPORTS = Path(__file__).parent / "doctor_reports"
REPORTS_GPU = Path(__file__).parent / "doctor_reports_gpu"
BOX = {"runtime": "charliecloud", "image": "/img", "pythonpath": ["/w/site"]}


def _in_box(folder: Path, **changes: object) -> tuple[dict, ...]:
    reports = [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
    return tuple({**r, "container": "charliecloud", **changes} for r in reports)


def _smoke(reports: tuple[dict, ...], stderr: str = "") -> SmokeResult:
    return SmokeResult(job_id="7", state="COMPLETED", finished=True, reports=reports, stderr=stderr, run_dir="/r")


CPU_BOX = doctor_request("local", "cpu", 2, "", container=ContainerConfig(**{**BOX, "pythonpath": ("/w/site",)}))
GPU_BOX = doctor_request("cyclone", "gpu", 2, "p163", container=ContainerConfig(**{**BOX, "pythonpath": ("/w/site",)}))


def test_doctor_passes_an_image_that_runs_and_imports_torch():
    check = doctor.check_container(CPU_BOX, _smoke(_in_box(REPORTS)))
    assert check.ok is True and check.detail.startswith("charliecloud image /img runs on 2 ranks: torch 2.14.1")
    host = HostVersions(python="3.11.7", torch="2.14.1")
    python = doctor.check_python(CPU_BOX, _smoke(_in_box(REPORTS, python="3.11.2")), host)
    assert python.ok is True and "in the charliecloud image" in python.detail  # the image's own 3.11.x is fine
    names = [c.check for c in doctor.live_checks(CPU_BOX, _smoke(_in_box(REPORTS)), host)]
    assert names[:3] == ["smoke_job", "container", "python"]
    assert "container" not in [c.check for c in doctor.live_checks(doctor_request("local", "cpu", 2, ""),
                                                                      _smoke(_in_box(REPORTS)), host)]


@pytest.mark.parametrize(("job", "reports", "stderr", "words", "hint"), [
    ("cpu", "none", "ch-run[1]: error: can't execve(2): python3: No such file or directory (ch_core.c:1)\n",
     "did not start on rank(s) 0-1: ch-run[1]: error: can't execve(2)", "srun -N1 -p cpu ch-run IMAGE -- python3"),
    ("cpu", "outside", "", "rank(s) 0-1 did not run in the charliecloud image /img", "user template"),
    ("cpu", "no-torch", "", "import torch failed in the charliecloud image /img on rank(s) 0-1: ModuleNotFoundError",
     "container.host_venv"),
    ("gpu", "blind", "", "torch in the charliecloud image /img sees no GPU on rank(s) 0-7 of a partition with 4",
     "ch-fromhost --nvidia"),
])
def test_doctor_names_what_is_wrong_with_the_image(job, reports, stderr, words, hint):
    chosen = {"none": (), "outside": _in_box(REPORTS, container=""),
              "no-torch": _in_box(REPORTS, torch={"ok": False, "error": "ModuleNotFoundError: No module named 'torch'"}),
              "blind": _in_box(REPORTS_GPU)}[reports]
    check = doctor.check_container(CPU_BOX if job == "cpu" else GPU_BOX, _smoke(chosen, stderr))
    assert check.ok is False and words in check.detail and hint in check.hint, check


def test_doctor_refuses_an_image_python_of_another_minor_version():
    check = doctor.check_python(CPU_BOX, _smoke(_in_box(REPORTS, python="3.12.1")), HostVersions("3.11.7", "2.14.1"))
    assert check.ok is False and "need python 3.11" in check.detail and "host_venv = false" in check.hint


def test_doctor_smoke_job_runs_its_probe_in_the_container():
    text = render_script(CPU_BOX, "/tmp/runs/d", python=PY, template="doctor.sbatch.j2", environ=NO_USER_TEMPLATES,
                         extra={"probe_timeout_s": 30, "probe_megabytes": 8, "probe_dir": "/tmp/runs/d/doctor"})
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("ch-run"))
    assert "--set-env=CYCLONE_CONTAINER=charliecloud" in line and line.strip().endswith(
        "/img -- python3 -m cyclone_kit.doctor.probe --out /tmp/runs/d/doctor \\")


# ------------------------------------------------------------------ the local backend runs its ranks in the container
def test_local_backend_plan_wraps_the_ranks_and_gives_them_the_venv():
    from cyclone_kit.backends.local import LocalBackend, local_job

    spec = spec_from_dict({"name": "c", "container": {**BOX, "pythonpath": ["/w/site", "/w/proj"]}})
    plan = LocalBackend(threads=1).launch_plan(local_job(spec, 2), "/tmp/runs/c", environ={"PYTHONPATH": "/mine", "PATH": "/bin"})
    assert plan.command[:9] == ("ch-run", "-b", "/tmp", "-b", "/w", "--set-env=CYCLONE_REQUEUE_BY=stepwatch",
                                "--set-env=CYCLONE_CONTAINER=charliecloud", "--cd=/tmp/runs/c", "/img")
    assert plan.command[9:] == ("--", "python3", "-m", "cyclone_kit.runtime", "--run-dir", "/tmp/runs/c")
    assert {r["PYTHONPATH"] for r in plan.ranks} == {"/mine:/w/site:/w/proj"}
    assert {r["USER"] for r in plan.ranks} == {getpass.getuser()}  # ch-run needs it; environ had none


def test_sweep_container_flag_reaches_every_point(tmp_path):
    from cyclone_kit.config.sweep import load_sweep
    from cyclone_kit.submit.study import plan

    (tmp_path / "sw.toml").write_text(f"[sweep]\nname = 's'\nmode = 'strong'\nbase = '{REPO / 'jobs' / 'smoke.toml'}'\n"
                                      "world_sizes = [1, 2]\nglobal_batch_size = 32\n")
    sweep = load_sweep(tmp_path / "sw.toml", ["container.runtime=apptainer"], [("container.image", "/i.sif")])
    runs = plan(sweep, load_profile("local"))
    assert len(runs) == 2 and {r.job.spec.container for r in runs} == {ContainerConfig(runtime="apptainer", image="/i.sif")}
    text = render_script(runs[1].job, "/tmp/runs/p1", python=PY, environ=NO_USER_TEMPLATES)
    assert "apptainer exec --bind /tmp/runs/p1 --env CYCLONE_REQUEUE_BY=stepwatch" in text


# ------------------------------------------------------------------ run takes the profile's [container], as submit does
def test_run_merges_the_profiles_container_under_the_jobs(tmp_path):
    from cyclone_kit.cli.app import build_parser
    from cyclone_kit.cli.run import spec_for_run

    site = tmp_path / "site.toml"
    site.write_text('name = "site"\n[partitions.cpu]\nnodes = 1\ncpus_per_node = 4\nmax_time = "01:00:00"\ndefault = true\n'
                    '[container]\nruntime = "charliecloud"\nbinds = ["/scratch"]\npython = "python3.11"\n')
    job = tmp_path / "job.toml"
    job.write_text(f'name = "j"\n[resources]\nprofile = "{site}"\n')

    def box(*argv):
        return spec_for_run(build_parser().parse_args(["run", str(job), *argv])).container

    # the profile's runtime, binds and python; the job's image; binds: the profile's, then the job's
    assert box("--container", "/img", "--set", 'container.binds=["/data"]') == ContainerConfig(
        runtime="charliecloud", image="/img", binds=("/scratch", "/data"), python="python3.11")
    # the job's own values win
    assert box("--container", "/i.sif", "--set", "container.runtime=apptainer", "--set", "container.python=python3.12") \
        == ContainerConfig(runtime="apptainer", image="/i.sif", binds=("/scratch",), python="python3.12")
    assert box() is None  # a runtime in the profile alone puts no run in a container
    site.write_text(site.read_text() + 'image = "/site.img"\n')  # a profile's default image: every run in it
    assert box() == ContainerConfig(runtime="charliecloud", image="/site.img", binds=("/scratch",), python="python3.11")
