"""``report``: read every run below DIR... and write the scaling report (CSV, plots, MD, HTML).

Importing this module is cheap: pandas and matplotlib are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``report``."""
    p = sub.add_parser(
        "report",
        help="strong/weak scaling report (CSV, plots, Markdown, HTML) from run directories",
        description="Find every metrics.jsonl below the given study or run directories and write "
        "scaling.csv, speed-up/efficiency/throughput plots (PNG and SVG), report.md and a "
        "self-contained report.html to OUT. Incomplete runs are listed, not counted; corrupt "
        "lines are skipped with a warning.",
    )
    p.add_argument("paths", nargs="+", metavar="DIR", help="study directories (runs/<study>), run directories "
                   "or metrics.jsonl files")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory (created)")
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="compare with another platform: PATH is a run directory or metrics.jsonl (e.g. a 1-GPU run "
        "on Colab or Kaggle) or a CSV with columns name,device,samples_per_s "
        "(e.g. analysis/reference_baselines.csv); repeatable",
    )
    p.add_argument("--title", default="Scaling report", help="report title")
    p.add_argument("--network", default=None, metavar="NETWORK_JSON", help="a doctor run's network.json (or its "
                   "run directory) for the predicted-vs-measured section; default: the partition's published figures "
                   "where the profile has them")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the report; prints the table summary and where the files are."""
    from cyclone_kit.analysis.ingest import MetricsWarning
    from cyclone_kit.analysis.report import write_report

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MetricsWarning)
        result = write_report(args.paths, args.output, args.baseline, title=args.title, network=args.network)
    for warning in caught:
        if issubclass(warning.category, MetricsWarning):
            sys.stderr.write(f"warning: {warning.message}\n")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    runs = result.data.runs
    table = result.table
    complete = int(runs["complete"].sum())
    print(f"read {len(runs)} run(s): {complete} complete, {len(runs) - complete} incomplete")
    for _, row in table.iterrows():
        print(
            f"  {row['study']} [{row['strategy']}, {row['mode']}] N={int(row['world_size'])}: "
            f"{row['samples_per_s']:.1f} samples/s, speed-up {row['speedup']:.2f}, "
            f"efficiency {100 * row['efficiency']:.1f} %, "
            f"{row['device_hours_per_1m_samples']:.3g} device-hours per 1M samples"
        )
    for fit in result.fits:
        verdict = result.checks.fit(fit.study, fit.strategy)
        if verdict is not None and not verdict.meaningful:
            print(f"  {fit.study} [{fit.strategy}]: no meaningful fit ({verdict.reason})")
        else:
            print(f"  {fit.study} [{fit.strategy}]: {fit.law} serial fraction s = {fit.serial_fraction:.4f}")
    for line in result.checks.warnings:
        sys.stderr.write(f"warning: {line}\n")
    if table.empty:
        sys.stderr.write("warning: no complete run: the report lists the incomplete runs only\n")
    print(f"report: {result.out_dir / 'report.html'}")
    print(f"table:  {result.out_dir / 'scaling.csv'}")
    return 0
