"""A time-to-solution report (issue 21): the short-measurement rule on the launch shim's wall time, cost
per solution or per sample (``[script] samples_per_run``), significant digits for small rates, start-up
said, and runs of independent copies refused as scaling points. Written from the shim's own records."""

from __future__ import annotations

import json

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.runtime import pgcheck
from cyclone_kit.runtime.launch import end_record, time_to_solution_records


def test_a_time_to_solution_report_uses_wall_times_costs_solutions_and_refuses_copies(tmp_path) -> None:
    from cyclone_kit.analysis.report import write_report
    from cyclone_kit.analysis.synthetic import SyntheticRun, write_study

    points = [("n1", 1, 40.0, ""), ("n2", 2, 24.0, ""), ("n4", 4, 3.0, ""), ("n4c", 4, 11.0, pgcheck.verdict(4, None))]
    study = write_study(tmp_path, "tts", "strong", [(name, SyntheticRun(n, 1.0)) for name, n, _, _ in points])
    spec = spec_from_dict({"script": {"path": "/t.py", "samples_per_run": 60000}})
    for name, n, wall, warning in points:
        start = {"world_size": n, "num_nodes": 1, "local_world_size": n, "launcher": "slurm",
                 "hostnames": ["c1"], "slurm_job_id": str(n), "pid": 1, "time": "t0", "restart_count": 0}
        end = end_record("completed", 0, wall, "t1", process_group_world=None if warning else n, warning=warning)
        records = time_to_solution_records(start, end, spec, "train")
        (study / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    md = (write_report([study], tmp_path / "out").out_dir / "report.md").read_text()
    assert "| 1 | 1 |" in md and "| 0.025 |" in md  # 1/40 solutions per second, not 0.0
    assert "Start-up is included in every time" in md
    assert "3.0 s of wall time for the whole script (need 5 s)" in md  # the shim's wall time, not steps
    assert "0.0 s of steady state" not in md and "steady-state step record(s)" not in md
    # 40 s on one device = 0.0111 device-hours per solution = 0.185 per 1M samples of 60000 per run
    assert "1M samples take 0.185" in md and "device-h / 1M samples" in md
    assert "Not a scaling study as run: 1 run(s)" in md and "4 ranks ran as 4 independent copies" in md
