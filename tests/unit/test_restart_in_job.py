"""Issue 31: the pure parts of in-job restarts: the next node list, the srun words, the watcher's options,
the restart record and its line, the spec's fields and their one-line errors, the rendered script."""

from __future__ import annotations

import pytest

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir import failures
from cyclone_kit.rundir.restarts import (
    add_fallback,
    fallback_line,
    read_fallbacks,
    read_restarts,
    restart_line,
    with_first_step,
    write_restarts,
)
from cyclone_kit.runtime.watchers import jobstep as sw
from cyclone_kit.submit.render import render_script

ALLOC = ["c1", "c2", "g1"]


@pytest.mark.parametrize(("current", "bad", "wanted", "low", "expected"), [
    (["c1", "c2"], {"c2"}, 2, 2, ["c1", "g1"]),             # a spare takes the lost node's place
    (["c1", "c2"], {"c1"}, 2, 2, ["c2", "g1"]),             # the first node lost: rank 0 moves to c2
    (["c1", "g1"], {"c2", "g1"}, 2, 1, ["c1"]),             # no spare left: shrink to min_nodes
    (["c1", "g1"], {"c2", "g1"}, 2, 2, None),               # ... unless that is below min_nodes
    (["c1", "c2"], {"c1", "c2", "g1"}, 2, 1, None),         # no healthy node at all
    (["g1", "c1"], {"c2"}, 2, 2, ["c1", "g1"]),             # always in the allocation's order
])
def test_next_nodes(current, bad, wanted, low, expected):
    assert sw.next_nodes(ALLOC, current, bad, wanted, low) == expected


def test_next_nodes_skips_nodes_that_left_the_allocation():
    assert sw.next_nodes(["c1", "g1"], ["c1", "c2"], {"c2"}, 2, 1) == ["c1", "g1"]
    assert sw.next_nodes(["c1"], ["c1", "c2"], set(), 2, 2) is None


def test_step_argv_places_the_nodes_after_srun_and_overlaps_on_a_restart():
    argv = ["srun", "--kill-on-bad-exit=1", "python", "-m", "x"]
    assert sw.step_argv(argv, ["c1", "c2"], 2) == ["srun", "--nodes=2", "--ntasks=4", "--nodelist=c1,c2",
                                                   "--kill-on-bad-exit=1", "python", "-m", "x"]
    assert sw.step_argv(["/usr/bin/srun", "a"], ["c1"], 1, restart=1) == [
        "/usr/bin/srun", "--nodes=1", "--ntasks=1", "--nodelist=c1", "--overlap", "a"]
    assert sw.step_argv(["mpirun", "a"], ["c1"], 1) == ["mpirun", "a"]


def test_parse_args():
    assert sw.parse_args(["--run-dir", "/r", "--", "srun", "x"], {}) == ("/r", None, ["srun", "x"])
    run, policy, cmd = sw.parse_args(["--run-dir", "/r", "--nodes", "2", "--min-nodes", "1", "--tasks-per-node", "4",
                                      "--", "srun"], {})
    assert (run, policy, cmd) == ("/r", sw.RestartPolicy(2, 1, 4), ["srun"])
    assert sw.parse_args(["--nodes", "2", "--min-nodes", "5", "srun"], {"CYCLONE_RUN_DIR": "/e"})[:2] == (
        "/e", sw.RestartPolicy(2, 2, 1))
    with pytest.raises(ValueError, match="positive"):
        sw.parse_args(["--nodes", "x", "--", "srun"], {})
    with pytest.raises(ValueError, match="needs a value"):
        sw.parse_args(["--nodes"], {})


def _view(progress=None, errors=None, failure=None):
    return sw.SegmentView(failure, errors or {}, progress or {})


def test_bad_hosts_of_a_lost_rank_and_a_stall():
    lost = {"cause": "rank_lost", "hosts": ["c2"], "lost": [1]}
    assert sw.bad_hosts(lost, _view()) == ["c2"]
    stall = {"cause": "stalled", "stuck": [1], "host": "c9", "ranks": [{"rank": 0, "host": "c1"}, {"rank": 1, "host": "c2"}]}
    assert sw.bad_hosts(stall, _view({1: {"host": "c2"}})) == ["c2"]
    assert sw.bad_hosts({"cause": "stalled", "host": "c1", "rank": 0}, _view()) == ["c1"]
    assert sw.bad_hosts(None, _view()) == []


def test_fault_time_and_last_step():
    errors = {0: {"rank": 0, "time": "2026-01-01T00:00:05+00:00"}}
    lost = {"cause": "rank_lost", "lost": [1], "time": "2026-01-01T00:00:20+00:00"}
    view = _view({0: {"step": 12}, 1: {"step": 11, "beat_time": 1.0}}, errors)
    assert sw.fault_time(lost, view) == "2026-01-01T00:00:05+00:00"  # the first peer error
    assert sw.fault_time(lost, _view({1: {"beat_time": 0.5}})) == "1970-01-01T00:00:00.500+00:00"  # else the last beat
    stall = {"cause": "stalled", "stuck": [1], "time": "x"}
    assert sw.fault_time(stall, _view({1: {"progress_time": 2.0}})) == "1970-01-01T00:00:02.000+00:00"
    assert sw.last_step(view) == 12 and sw.last_step(_view()) is None


def test_restart_port_is_the_steps_port_or_the_next_free_one():
    from cyclone_kit.core.ports import job_port

    assert sw.restart_port("145", 1, lambda p: True) == job_port("145", 1)
    busy = job_port("145", 1)
    assert sw.restart_port("145", 1, lambda p: p != busy) == busy + 1


def test_first_step_after():
    recs = [{"kind": "start", "time": "1"}, {"kind": "step", "step": 1, "time": "2"},
            {"kind": "start", "time": "5", "start_step": 10}, {"kind": "step", "step": 11, "time": "6"}]
    assert sw.first_step_after(recs, "4") == (recs[2], recs[3])
    assert sw.first_step_after(recs, "7") is None


def test_segment_id_counts_in_job_restarts():
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    assert failures.segment_id(env) == "7:1"
    assert failures.segment_id({**env, failures.INJOB_RESTARTS_VAR: "2"}) == "7:1.2"
    assert failures.segment_id({**env, failures.INJOB_RESTARTS_VAR: "0"}) == "7:1"


ENTRY = {"restart": 1, "cause": "rank_lost", "left_out": ["c2"], "nodes_before": ["c1", "c2"],
         "nodes_after": ["c1", "g1"], "spares": ["g1"], "shrunk": False, "world_size_before": 2,
         "world_size_after": 2, "fault_time": "2026-01-01T00:00:00+00:00", "last_step": 23,
         "global_batch_before": 64}


def test_restart_record_round_trip_and_line(tmp_path):
    assert restart_line(ENTRY, 3) == ("in-job restart 1 of at most 3: rank_lost on c2 at step 23; left out c2, now "
                                      "c1,g1 (spare g1); no step since")
    done = with_first_step(ENTRY, first_step=21, first_step_time="2026-01-01T00:00:21.5+00:00", start_step=20,
                           global_batch=64)
    assert (done["resumed_step"], done["resumed_from"], done["steps_recomputed"], done["recovery_s"]) == (
        20, "start record", 3, 21.5)
    assert restart_line(done).endswith("first step again 21.5 s after the fault (step 21); 3 step(s) recomputed "
                                       "from the checkpoint of step 20")
    script = with_first_step(ENTRY, first_step=15, first_step_time="bad", start_step=0, global_batch=None)
    assert (script["resumed_step"], script["resumed_from"], script["recovery_s"]) == (14, "first step record", None)
    shrunk = {**ENTRY, "shrunk": True, "spares": [], "nodes_after": ["c1"], "world_size_after": 1,
              "global_batch_after": 32}
    assert "now c1 (shrunk: world 2 -> 1 ranks, global batch 64 -> 32)" in restart_line(shrunk)
    write_restarts(tmp_path, [done, shrunk], "145")
    assert read_restarts(tmp_path) == [done, shrunk]
    assert read_restarts(tmp_path / "none") == []


def _job(**resources):
    spec = spec_from_dict({"name": "demo", "resources": {"profile": "local", "ntasks_per_node": 1, **resources}})
    return resolve(spec, load_profile("local"))


def test_resolve_spares_and_min_nodes():
    job = _job(partition="wide", nodes=2, spare_nodes=1)
    assert (job.alloc_nodes, job.spare_nodes, job.min_nodes, job.restarts_in_job) == (3, 1, 2, True)
    assert _job(partition="cpu", nodes=2, min_nodes=1).restarts_in_job
    assert not _job(partition="cpu", nodes=2).restarts_in_job


@pytest.mark.parametrize(("resources", "message"), [
    ({"partition": "cpu", "nodes": 2, "spare_nodes": 1}, "need 3 nodes but partition 'cpu'"),
    ({"partition": "cpu", "nodes": 1, "min_nodes": 2}, "--min-nodes=2 is more than --nodes=1"),
    ({"partition": "cpu", "nodes": 2, "min_nodes": 1, "launcher": "torchrun"}, "torchrun has its own"),
    ({"partition": "cpu", "nodes": 1, "spare_nodes": -1}, "resources.spare_nodes must not be negative"),
])
def test_bad_restart_requests_fail_with_a_hint(resources, message):
    with pytest.raises(ValidationError) as caught:
        _job(**resources)
    assert message in str(caught.value) and caught.value.hint


def test_submit_flags_render_the_restart(capsys):
    from cyclone_kit.cli.app import main

    assert main(["submit", "jobs/smoke.toml", "--profile", "local", "--partition", "wide", "--nodes", "2",
                 "--spare-nodes", "1", "--min-nodes", "1", "--ntasks-per-node", "1", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text, text
    assert "--nodes 2 --min-nodes 1 --tasks-per-node 1 -- \\\n    srun " in text, text
    assert main(["submit", "jobs/smoke.toml", "--profile", "local", "--partition", "cpu", "--nodes", "2",
                 "--spare-nodes", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HINT: use --spare-nodes=0" in err, err


def test_no_restart_options_render_no_restart():
    job = _job(partition="cpu", nodes=2)
    text = render_script(job, "/r", python="/py", environ={"CYCLONE_KIT_TEMPLATES": "/nonexistent"})
    assert "--no-kill" not in text and "--min-nodes" not in text and "#SBATCH --nodes=2\n" in text


def test_the_report_marks_each_restart(tmp_path):
    import json

    from cyclone_kit.analysis.ingest import load_runs
    from cyclone_kit.analysis.render import Bullets, Heading
    from cyclone_kit.analysis.report_content import _restart_blocks

    run = tmp_path / "run"
    run.mkdir()
    start = {"kind": "start", "schema": 1, "time": "2026-01-01T00:00:00+00:00", "world_size": 2, "num_nodes": 2}
    (run / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    shrunk = {**ENTRY, "shrunk": True, "spares": [], "nodes_after": ["c1"], "world_size_after": 1}
    write_restarts(run, [shrunk], "145")
    data = load_runs([run], warn=False)
    assert data.restarts == ((str(run), shrunk),)
    heading, _, bullets = _restart_blocks(data)
    assert isinstance(heading, Heading) and isinstance(bullets, Bullets)
    (line,) = bullets.items
    assert line.startswith(f"{run}: in-job restart 1: rank_lost on c2") and "mixes world sizes" in line, line
    assert _restart_blocks(type(data)(data.runs, data.steps, data.epochs, data.ranks, ())) == []


def test_only_lost_left_once_every_other_rank_is_gone():
    peer = {0: {"rank": 0, "time": "t", "type": "RuntimeError", "message": "Connection reset by peer"}}
    running = {0: {"state": "running"}, 1: {"state": "running", "host": "c2"}}
    assert not sw.only_lost_left(_view(running, peer))  # rank 0 has not exited yet
    assert sw.only_lost_left(_view({**running, 0: {"state": "exited"}}, peer))
    assert not sw.only_lost_left(_view({0: {"state": "exited"}, 1: {"state": "running"}}))  # no peer-lost error


def test_segment_view_leaves_out_the_records_of_the_step_before_a_restart(tmp_path):
    import json
    import time

    (tmp_path / "ranks").mkdir()
    old = tmp_path / "ranks" / "error-rank-00001.json"
    old.write_text(json.dumps({"rank": 1, "type": "Stalled"}))
    (tmp_path / "failure.json").write_text(json.dumps({"cause": "stalled", "segment": "7:0"}))
    now = time.time()  # the restarted step starts right after the old step's records were written
    stale = {str(old): old.stat().st_mtime}
    view = sw.segment_view(tmp_path, "7:0.1", now, stale)
    assert (view.failure, view.errors, view.failed) == (None, {}, False)
    assert sw.segment_view(tmp_path, "7:0", now).errors  # without the snapshot: taken as this step's


def test_keep_global_batch_accumulates_on_a_shrunk_world():
    from cyclone_kit.config.job import TrainConfig
    from cyclone_kit.runtime.engine.plan import keep_global_batch

    tc = TrainConfig(model="tiny_cnn", batch_size=32)
    kept, said = keep_global_batch(tc, 1, 64)
    assert kept.grad_accum == 2 and said == "global batch 64 kept on 1 rank(s): grad_accum 1 -> 2"
    assert keep_global_batch(tc, 2, 64) == (tc, "")
    same, said = keep_global_batch(tc, 3, 64)
    assert same is tc and said.startswith("global batch 96 (was 64): 64 is not a whole number of 3 rank(s)")
    entry = {**ENTRY, "shrunk": True, "spares": [], "nodes_after": ["c1"], "world_size_after": 1,
             "global_batch_after": 64}
    assert "(shrunk: world 2 -> 1 ranks, global batch 64 kept)" in restart_line(entry)


def test_restart_plan_falls_back_to_the_requeue():
    policy = sw.RestartPolicy(2, 2, 1, max_restarts=1)
    assert sw.restart_plan(policy, 0, ALLOC, ["c1", "c2"], {"c2"}) == (["c1", "g1"], "")
    assert sw.restart_plan(policy, 1, ALLOC, ["c1", "g1"], {"c2", "g1"}) == (
        None, "already restarted 1 time(s) in the job (checkpoint.max_restarts=1)")
    assert sw.restart_plan(sw.RestartPolicy(2, 2, 1), 1, ALLOC, ["c1", "g1"], {"c2", "g1"}) == (
        None, "no healthy node left to restart on (left out c2,g1; at least 2 needed)")
    assert sw.restart_plan(policy, 0, ALLOC, ["c1", "c2"], set())[0] is None  # nothing blamed: requeue


def test_a_fallback_to_the_requeue_is_recorded_beside_the_restarts_and_worded(tmp_path):
    failure = {"cause": "rank_lost", "hosts": ["c2"], "lost": [1], "segment": "173:0"}
    why = "already restarted 0 time(s) in the job (checkpoint.max_restarts=0)"
    entry = sw.fallback_entry("173", sw._Step(137, False, _view(failure=failure), "rank_lost"), why, "0")
    assert {k: entry[k] for k in ("job_id", "segment", "cause", "hosts", "why", "requeue")} == {
        "job_id": "173", "segment": "173:0", "cause": "rank_lost", "hosts": ["c2"], "why": why, "requeue": 0}
    assert fallback_line(entry) == (f"no in-job restart after rank_lost on c2: {why}; fell back to the requeue")
    write_restarts(tmp_path, [ENTRY], "173")
    add_fallback(tmp_path, entry, "173")
    assert read_restarts(tmp_path) == [ENTRY] and read_fallbacks(tmp_path) == [entry]
    write_restarts(tmp_path, [ENTRY, ENTRY], "173")  # a later restart keeps the fall-backs
    assert read_fallbacks(tmp_path) == [entry] and len(read_restarts(tmp_path)) == 2
    assert read_fallbacks(tmp_path / "none") == []
