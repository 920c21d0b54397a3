"""Containers (issue 30): the runtimes' words, the binds a job needs, the [container] table and its checks."""

from __future__ import annotations

import shlex

import pytest

from cyclone_kit.config.container import ContainerConfig, container_paths, container_problems, host_paths, merged
from cyclone_kit.config.job import spec_from_dict, spec_to_dict
from cyclone_kit.config.profile import load_profile, profile_from_dict
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
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
    assert words[:9] == ["ch-run", "-b", "/tmp", "-b", "/w", "--set-env=CYCLONE_REQUEUE_BY=stepwatch",
                         f"--cd={run_dir}", "/img dir/x", "--"]
    assert words[9:] == ["python3", "-m", "cyclone_kit.runtime", "--run-dir", run_dir]
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
