"""``report`` end to end in this process: the CLI's report command and write_report on synthetic studies.

Integration tier: the report asks ``sacct`` (a real process) for the runs' job ids' cost.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pandas as pd
import pytest

from cyclone_kit.analysis.report import write_report
from cyclone_kit.analysis.synthetic import SyntheticRun, write_run, write_study

Cpu = partial(SyntheticRun, device="cpu", device_name=None, model="tiny_cnn", per_device_batch_size=32, steps=40)


def test_the_cli_report_refuses_the_bogus_fit_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cyclone_kit.cli.app import main

    study = write_study(tmp_path, "bad", "strong", [("n1", Cpu(1, 100.0)), ("n2", Cpu(2, 88.0))])
    assert main(["report", str(study), "-o", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "bad [ddp]: no meaningful fit" in captured.out
    assert "serial fraction s = 1.0000" not in captured.out
    assert "warning: bad (ddp) N=2: worse than serial" in captured.err


def test_a_study_with_no_complete_run_still_reports(tmp_path: Path) -> None:
    write_run(tmp_path / "s" / "a", SyntheticRun(2, 1.0, statuses=(None,)))
    result = write_report([tmp_path / "s"], tmp_path / "out")
    assert result.table.empty
    assert not (tmp_path / "out" / "speedup.png").exists()
    assert "no end record" in (tmp_path / "out" / "report.md").read_text()


def test_cli_report_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cyclone_kit.cli.app import main

    study = write_study(tmp_path, "w", "weak", [("n1", SyntheticRun(1, 10.0)), ("n2", SyntheticRun(2, 19.0))])
    assert main(["report", str(study), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "N=2: 19.0 samples/s, speed-up 1.90, efficiency 95.0 %" in out
    assert "gustafson" in out
    assert pd.read_csv(tmp_path / "out" / "scaling.csv")["efficiency"].tolist() == pytest.approx([1.0, 0.95])
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "-o", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no metrics.jsonl found under") and "HINT:" in err and "\n" not in err
    assert main(["report", str(study), "-o", str(tmp_path / "o3"), "--baseline", "oops"]) == 2
