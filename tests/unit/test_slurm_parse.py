"""Table tests for cyclone_kit.slurm parsers, argv builders and states.

The files in tests/unit/slurm_output/ are real, byte-exact output of the local Slurm 22.05 test
cluster (scripts/local-slurm.sh), produced by the argv that cyclone_kit.slurm.argv builds. To
recapture one: start the cluster (``--with-accounting`` for sacct), submit the jobs the comment
above its table describes, and save the output of ``squeue --noheader --states=all
--Format=<argv.SQUEUE_FIELDS>``, ``sacct --noheader --parsable2 --allocations
--format=<argv.SACCT_FIELDS>`` or ``scontrol [-o] show job ID``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.core.errors import ParseError, ValidationError
from cyclone_kit.slurm import argv
from cyclone_kit.slurm.parse import (
    JobInfo,
    parse_duration,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_fields,
    parse_scontrol_job,
    parse_squeue,
    select_job,
)
from cyclone_kit.slurm.states import JobState, parse_state

OUTPUT = Path(__file__).parent / "slurm_output"


def _output(name: str) -> str:
    return (OUTPUT / name).read_text()


# Finished jobs still in the controller (squeue --states=all): completed, failed with exit 3
# (raw wait status 768), cancelled while running (status 15 = SIGTERM), cancelled while pending,
# an array, a pending array range whose name contains "|", and a job requeued once.
SQUEUE_FINISHED = _output("squeue_finished.txt")

# Live queue: pending (node limit, array throttle, requeued -> BeginTime) and running jobs.
SQUEUE_LIVE = _output("squeue_live.txt")

# scontrol show job of a job requeued by a node failure and then cancelled (ExitCode=0:15).
SCONTROL_CANCELLED = _output("scontrol_cancelled_requeued.txt")

# scontrol show job ARRAYID: one record per task, the parent id shared by the last task.
SCONTROL_ARRAY = _output("scontrol_array.txt")

# A throttled array (--array=0-5%2) while tasks 0,1 run and 2-5 wait.
SCONTROL_ARRAY_THROTTLED = _output("scontrol_array_throttled.txt")

# A running 2-node job whose name has a space.
SCONTROL_RUNNING = _output("scontrol_running.txt")

# A running job right after `scontrol requeue`: PENDING, Restarts=1, Reason=BeginTime.
SCONTROL_REQUEUED = _output("scontrol_requeued.txt")

# scontrol -o show job (one line per record): a failed job (ExitCode=3:0) and a pending one.
SCONTROL_ONELINE_FAILED = _output("scontrol_oneline_failed.txt")
SCONTROL_ONELINE_PENDING = _output("scontrol_oneline_pending.txt")

# sacct --noheader --parsable2 --allocations --format=<argv.SACCT_FIELDS> with accounting on
# (scripts/local-slurm.sh start --with-accounting): completed, FAILED 3:0, killed by signal 9
# (0:9), cancelled running/pending ("CANCELLED by 0", "None assigned"), TIMEOUT, arrays, a
# requeued job (REQUEUED) and a name containing "|".
SACCT = _output("sacct.txt")

SACCT_EXPECTED = {
    # job id: (state, nodes, nodelist, elapsed, exit_code, signal, name)
    "24": (JobState.COMPLETED, 2, "c[1-2]", 0, 0, 0, "ok"),
    "25": (JobState.FAILED, 1, "c1", 0, 3, 0, "bad|pipe"),
    "30": (JobState.FAILED, 1, "c1", 0, 0, 9, "sig"),
    "26": (JobState.CANCELLED, 2, "c[1-2]", 3, 0, 0, "my run"),
    "27": (JobState.CANCELLED, 3, "", 0, 0, 0, "wide"),
    "15": (JobState.TIMEOUT, 1, "c1", 72, 0, 15, "to"),
    "28_2": (JobState.COMPLETED, 1, "c2", 1, 0, 0, "arr"),
    "14_[3-5]": (JobState.CANCELLED, 0, "", 0, 0, 0, "pend arr|x"),
    "23": (JobState.RUNNING, 1, "c1", 6, None, None, "to"),
    "33": (JobState.REQUEUED, 1, "c1", 1, None, None, "rq"),
    "29": (JobState.COMPLETED, 1, "g1", 1, 0, 0, "gpuj"),
}


def _by_id(jobs: list[JobInfo]) -> dict[str, JobInfo]:
    return {j.job_id: j for j in jobs}


# ------------------------------------------------------------------------------------ sbatch
@pytest.mark.parametrize(
    ("text", "job_id"),
    [
        ("123\n", "123"),
        ("123;cyclone-local\n", "123"),
        ("  42  ", "42"),
        ("sbatch: warning: something odd\n77\n", "77"),  # the job id is the last line
    ],
)
def test_parse_sbatch_parsable(text: str, job_id: str) -> None:
    assert parse_sbatch_parsable(text) == job_id


@pytest.mark.parametrize("text", ["", "\n", "Submitted batch job 123", "12a", "123;", "-1"])
def test_parse_sbatch_parsable_rejects_and_quotes_raw(text: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_sbatch_parsable(text)
    assert repr(text) in str(info.value)
    assert "HINT:" in str(info.value)


# ------------------------------------------------------------------------------------ squeue
@pytest.mark.parametrize(
    ("job_id", "state", "nodes", "nodelist", "elapsed", "reason", "exit_code", "signal", "restarts", "name"),
    [
        ("1", JobState.COMPLETED, 2, "c[1-2]", 0, "", 0, 0, 0, "t1.sh"),
        ("7", JobState.FAILED, 1, "c1", 0, "NonZeroExitCode", 3, 0, 0, "bad"),
        ("2", JobState.CANCELLED, 2, "c[1-2]", 6, "", 0, 15, 1, "wrap"),
        ("9", JobState.CANCELLED, 3, "", 0, "PartitionNodeLimit", 0, 0, 0, "big"),
        ("14_[3-5]", JobState.CANCELLED, 3, "", 0, "PartitionNodeLimit", 0, 0, 0, "pend arr|x"),
        ("8_2", JobState.COMPLETED, 1, "c2", 20, "", 0, 0, 0, "arr"),
        ("11", JobState.COMPLETED, 1, "g1", 30, "", 0, 0, 0, "gpuj"),
    ],
)
def test_parse_squeue_finished(
    job_id: str,
    state: JobState,
    nodes: int,
    nodelist: str,
    elapsed: int,
    reason: str,
    exit_code: int,
    signal: int,
    restarts: int,
    name: str,
) -> None:
    job = _by_id(parse_squeue(SQUEUE_FINISHED))[job_id]
    assert (job.state, job.nodes, job.nodelist, job.elapsed, job.reason) == (state, nodes, nodelist, elapsed, reason)
    assert (job.exit_code, job.signal, job.restart_count, job.name) == (exit_code, signal, restarts, name)
    assert job.source == "squeue"


def test_parse_squeue_counts_every_line() -> None:
    assert len(parse_squeue(SQUEUE_FINISHED)) == len(SQUEUE_FINISHED.strip().splitlines())
    assert parse_squeue("") == []


@pytest.mark.parametrize(
    ("job_id", "state", "reason", "restarts", "hosts"),
    [
        ("16", JobState.PENDING, "PartitionNodeLimit", 0, []),
        ("18_[2-5%2]", JobState.PENDING, "JobArrayTaskLimit", 0, []),
        ("21", JobState.PENDING, "BeginTime", 1, []),
        ("17", JobState.RUNNING, "", 0, ["c1", "c2"]),
        ("18_0", JobState.RUNNING, "", 0, ["c1"]),
    ],
)
def test_parse_squeue_live(job_id: str, state: JobState, reason: str, restarts: int, hosts: list[str]) -> None:
    job = _by_id(parse_squeue(SQUEUE_LIVE))[job_id]
    assert (job.state, job.reason, job.restart_count, job.hosts) == (state, reason, restarts, hosts)
    assert job.exit_code is None and job.signal is None  # not finished: no exit code yet
    assert job.state.is_active and not job.state.is_terminal


@pytest.mark.parametrize(
    "text",
    [
        "17|RUNNING|2|c[1-2]|0:04|None|0|0|my run",  # no trailing separator: format not ours
        "17|RUNNING|2|c[1-2]|0:04|\n",  # too few fields
        "17|RUNNING|two|c[1-2]|0:04|None|0|0|x|",  # node count not a number
        "17|RUNNING|2|c[1-2]|soon|None|0|0|x|",  # time not a duration
        "JOBID PARTITION NAME USER ST TIME NODES NODELIST(REASON)\n",  # default squeue format
    ],
)
def test_parse_squeue_rejects_and_quotes_raw(text: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_squeue(text)
    assert repr(text)[:60] in str(info.value)


# ------------------------------------------------------------------------------------ sacct
def test_parse_sacct_table() -> None:
    jobs = _by_id(parse_sacct(SACCT))
    assert len(jobs) == len(SACCT.strip().splitlines())
    for job_id, (state, nodes, nodelist, elapsed, exit_code, signal, name) in SACCT_EXPECTED.items():
        job = jobs[job_id]
        assert (job.state, job.nodes, job.nodelist, job.elapsed) == (state, nodes, nodelist, elapsed), job_id
        assert (job.exit_code, job.signal, job.name) == (exit_code, signal, name), job_id
        assert job.restart_count is None  # sacct does not say
        assert job.source == "sacct"


@pytest.mark.parametrize("text", ["1|COMPLETED|1|c1|0|None|0:0\n", "1|COMPLETED|1|c1|0|None|zero|x\n"])
def test_parse_sacct_rejects_and_quotes_raw(text: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_sacct(text)
    assert "raw output" in str(info.value)


# ------------------------------------------------------------------------------------ scontrol
def test_parse_scontrol_cancelled_after_requeue() -> None:
    [job] = parse_scontrol_job(SCONTROL_CANCELLED)
    assert (job.job_id, job.name, job.state, job.nodes, job.nodelist) == ("2", "wrap", JobState.CANCELLED, 2, "c[1-2]")
    assert (job.elapsed, job.exit_code, job.signal, job.restart_count) == (6, 0, 15, 1)
    assert job.source == "scontrol"


def test_parse_scontrol_array_gives_task_ids() -> None:
    jobs = parse_scontrol_job(SCONTROL_ARRAY)
    assert [j.job_id for j in jobs] == ["8_2", "8_1", "8_0"]
    assert {j.state for j in jobs} == {JobState.COMPLETED}
    assert [j.nodelist for j in jobs] == ["c2", "c1", "c1"]
    assert all(j.elapsed == 20 and j.exit_code == 0 for j in jobs)


def test_parse_scontrol_throttled_array_range() -> None:
    jobs = _by_id(parse_scontrol_job(SCONTROL_ARRAY_THROTTLED))
    assert set(jobs) == {"18_[2-5%2]", "18_1", "18_0"}
    assert jobs["18_[2-5%2]"].state is JobState.PENDING
    assert jobs["18_[2-5%2]"].reason == "JobArrayTaskLimit"
    assert jobs["18_0"].state is JobState.RUNNING


def test_parse_scontrol_running_name_with_space() -> None:
    [job] = parse_scontrol_job(SCONTROL_RUNNING)
    assert (job.name, job.state, job.hosts, job.exit_code) == ("my run", JobState.RUNNING, ["c1", "c2"], None)


def test_parse_scontrol_requeued() -> None:
    [job] = parse_scontrol_job(SCONTROL_REQUEUED)
    assert (job.state, job.reason, job.restart_count, job.nodelist) == (JobState.PENDING, "BeginTime", 1, "")


def test_parse_scontrol_oneline() -> None:
    [failed] = parse_scontrol_job(SCONTROL_ONELINE_FAILED)
    assert (failed.job_id, failed.state, failed.exit_code, failed.reason) == ("7", JobState.FAILED, 3, "NonZeroExitCode")
    [pending] = parse_scontrol_job(SCONTROL_ONELINE_PENDING)
    assert (pending.state, pending.nodes, pending.nodelist, pending.reason) == (
        JobState.PENDING,
        3,
        "",
        "PartitionNodeLimit",
    )


def test_parse_scontrol_fields_keeps_spaces_and_equals() -> None:
    fields = parse_scontrol_fields("JobId=5 JobName=my run 2\n   TRES=cpu=1,node=1 AllocNode:Sid=localhost:2570 Power=")
    assert fields["JobName"] == "my run 2"
    assert fields["TRES"] == "cpu=1,node=1"
    assert fields["AllocNode:Sid"] == "localhost:2570"
    assert fields["Power"] == ""


@pytest.mark.parametrize(
    "text",
    [
        "slurm_load_jobs error: Invalid job id specified",
        "JobId=5 JobName=x\n   JobState=RUNNING\n",  # no NumNodes, RunTime, ExitCode
        SCONTROL_RUNNING.replace("ExitCode=0:0", "ExitCode=zero"),
    ],
)
def test_parse_scontrol_rejects_and_quotes_raw(text: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_scontrol_job(text)
    assert repr(text)[:40] in str(info.value)


# ------------------------------------------------------------------------------------ sources agree
def test_squeue_and_scontrol_agree_on_the_same_jobs() -> None:
    from_squeue = _by_id(parse_squeue(SQUEUE_FINISHED))
    for job in [*parse_scontrol_job(SCONTROL_CANCELLED), *parse_scontrol_job(SCONTROL_ARRAY)]:
        other = from_squeue[job.job_id]
        assert (job.state, job.nodes, job.nodelist, job.elapsed, job.exit_code, job.signal, job.restart_count) == (
            other.state,
            other.nodes,
            other.nodelist,
            other.elapsed,
            other.exit_code,
            other.signal,
            other.restart_count,
        )


# ------------------------------------------------------------------------------------ select_job
def test_select_job_exact_and_missing() -> None:
    jobs = parse_squeue(SQUEUE_FINISHED)
    selected = select_job("8_1", jobs)
    assert selected is not None and selected.job_id == "8_1"
    assert select_job("999", jobs) is None
    assert select_job("1", []) is None


def test_select_job_summarises_an_array() -> None:
    live = parse_squeue(SQUEUE_LIVE)
    summary = select_job("18", live)
    assert summary is not None
    assert (summary.job_id, summary.state, summary.nodelist, summary.exit_code) == ("18", JobState.RUNNING, "c1", None)
    done = select_job("8", parse_squeue(SQUEUE_FINISHED))
    assert done is not None
    assert (done.state, done.nodes, done.hosts, done.exit_code) == (JobState.COMPLETED, 3, ["c1", "c2"], 0)


# ------------------------------------------------------------------------------------ durations
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0:00", 0),
        ("0:07", 7),
        ("59:59", 3599),
        ("00:00:13", 13),
        ("12:03:04", 12 * 3600 + 3 * 60 + 4),
        ("1-00:00:00", 86400),
        ("1-02:03:04", 93784),
        ("2-03", 2 * 86400 + 3 * 3600),
        ("2-03:30", 2 * 86400 + 3 * 3600 + 1800),
        ("30", 1800),
    ],
)
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "UNLIMITED", "INVALID", "N/A", "1:2:3:4", "-5", "1-"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        parse_duration(text)


# ------------------------------------------------------------------------------------ states
@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("RUNNING", JobState.RUNNING),
        ("R", JobState.RUNNING),
        ("PENDING", JobState.PENDING),
        ("PD", JobState.PENDING),
        ("CONFIGURING", JobState.PENDING),
        ("COMPLETING", JobState.COMPLETING),
        ("CG", JobState.COMPLETING),
        ("COMPLETED", JobState.COMPLETED),
        ("CANCELLED by 0", JobState.CANCELLED),
        ("CANCELLED+", JobState.CANCELLED),
        ("cancelled", JobState.CANCELLED),
        ("FAILED", JobState.FAILED),
        ("TIMEOUT", JobState.TIMEOUT),
        ("DEADLINE", JobState.TIMEOUT),
        ("PREEMPTED", JobState.PREEMPTED),
        ("REQUEUED", JobState.REQUEUED),
        ("REQUEUE_HOLD", JobState.REQUEUED),
        ("REQUEUE_FED", JobState.REQUEUED),
        ("SPECIAL_EXIT", JobState.REQUEUED),
        ("NODE_FAIL", JobState.NODE_FAIL),
        ("BOOT_FAIL", JobState.NODE_FAIL),
        ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
        ("OOM", JobState.OUT_OF_MEMORY),
        ("SUSPENDED", JobState.SUSPENDED),
        ("STOPPED", JobState.SUSPENDED),
        ("RUNNING,REQUEUE_HOLD", JobState.RUNNING),
        ("  RUNNING\n", JobState.RUNNING),
        ("", JobState.UNKNOWN),
        ("SOMETHING_NEW", JobState.UNKNOWN),
    ],
)
def test_parse_state(raw: str, state: JobState) -> None:
    assert parse_state(raw) is state


def test_terminal_and_active_states_are_disjoint_and_cover_the_common_ones() -> None:
    for state in JobState:
        assert not (state.is_terminal and state.is_active), state
    assert {s for s in JobState if s.is_terminal} == {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
    }
    assert JobState.PENDING.is_active and JobState.RUNNING.is_active and JobState.REQUEUED.is_active


# ------------------------------------------------------------------------------------ argv
def test_argv_builders() -> None:
    assert argv.sbatch("/r/job.sbatch") == ["sbatch", "--parsable", "/r/job.sbatch"]
    assert argv.sbatch("job.sbatch", ["--test-only"]) == ["sbatch", "--parsable", "--test-only", "job.sbatch"]
    assert argv.squeue("12") == [
        "squeue",
        "--noheader",
        "--states=all",
        "--jobs=12",
        "--Format=JobArrayID:|,State:|,NumNodes:|,NodeList:|,TimeUsed:|,Reason:|,RestartCnt:|,exit_code:|,Name:|",
    ]
    assert argv.sacct("12_3") == [
        "sacct",
        "--noheader",
        "--parsable2",
        "--allocations",
        "--jobs=12_3",
        "--format=JobID,State,NNodes,NodeList,ElapsedRaw,Reason,ExitCode,JobName",
    ]
    assert argv.scontrol_show_job("12") == ["scontrol", "show", "job", "12"]
    assert argv.scancel("12") == ["scancel", "12"]
    assert argv.scancel("12", signal="USR1") == ["scancel", "--signal=USR1", "12"]
    assert argv.scontrol_requeue("12_3") == ["scontrol", "requeue", "12_3"]


@pytest.mark.parametrize("bad", ["", "abc", "12 13", "12;rm -rf /", "-1", "12,13", "12_", "12_[1-3]"])
def test_argv_rejects_bad_job_ids(bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        argv.scontrol_show_job(bad)
    assert "HINT:" in str(info.value)


def test_argv_rejects_bad_signal() -> None:
    with pytest.raises(ValidationError):
        argv.scancel("12", signal="USR1; rm")


def test_a_task_of_a_pending_array_matches_its_range_record() -> None:
    from cyclone_kit.slurm.parse import array_task_ids, parse_squeue, select_job

    assert array_task_ids("[0-3,7%2]") == {0, 1, 2, 3, 7} and array_task_ids("5") == {5}
    assert array_task_ids("") == frozenset() and array_task_ids("[x]") == frozenset()
    records = parse_squeue("50_[0-49]|PENDING|1|(null)|0:00|JobHeldUser|0|0|ck-many|\n")
    info = select_job("50_7", records)
    assert info is not None and info.job_id == "50_7" and info.state.value == "PENDING"
    assert select_job("50_50", records) is None and select_job("51_7", records) is None
