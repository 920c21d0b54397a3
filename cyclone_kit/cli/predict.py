"""``predict``: what N nodes will give, from a 1-node calibration and the network's measured figures."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``predict``."""
    p = sub.add_parser(
        "predict",
        help="predict step time, throughput, efficiency and cost at N nodes",
        description="T(N) = T_data + T_compute + max(0, T_comm(N) - overlap) + T_fixed, calibrated from the phases "
        "of a study's 1-node run (or a given compute time for a job spec), with the gradient all-reduce costed on "
        "the network figures of `cyclone-kit doctor` (--network) or the partition's published ones. Prints per N: "
        "step time, samples/s, efficiency, device-hours per 1M samples, and every assumption. Exit 2 on bad input.",
    )
    p.add_argument("target", metavar="SPEC|STUDY", help="a study or run directory (calibrates from its 1-node run) "
                   "or a job spec .toml")
    p.add_argument("--nodes", default="1,2,4,8,16", help="node counts, comma-separated (default: 1,2,4,8,16)")
    p.add_argument("--ntasks-per-node", type=int, default=None, help="ranks per node (default: the study's, or one "
                   "per GPU)")
    p.add_argument("--network", default=None, metavar="NETWORK_JSON", help="a doctor run's network.json (or its run "
                   "directory); default: the partition's published [network] figures")
    p.add_argument("--profile", default=None, help="cluster profile (default: the study's or the spec's)")
    p.add_argument("--partition", default=None, help="partition (default: the study's or the spec's)")
    p.add_argument("--compute-s", type=float, default=None, help="SPEC only: one device's compute time per step "
                   "at the spec's batch, e.g. from a published benchmark (labelled as given)")
    p.add_argument("--compute-source", default=None, help="where --compute-s comes from, printed with it")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Predict and print; 0 on success (bad input raises a ValidationError: exit 2)."""
    from pathlib import Path

    from cyclone_kit.analysis import forecast as fc
    from cyclone_kit.core.errors import ValidationError

    nodes = fc.parse_nodes(args.nodes)
    if args.ntasks_per_node is not None and args.ntasks_per_node < 1:
        raise ValidationError(f"--ntasks-per-node {args.ntasks_per_node} is not a rank count", hint="use 1 or more")
    target = Path(args.target)
    if not target.exists():
        raise ValidationError(f"{target} does not exist", hint="pass a study or run directory, or a job spec .toml")
    if target.is_file() and target.suffix == ".toml":
        result = fc.forecast_spec(target, nodes, args.ntasks_per_node, args.network, args.profile, args.partition,
                                  args.compute_s, args.compute_source or "")
    else:
        if args.compute_s is not None:
            raise ValidationError("--compute-s is for a job spec; a study calibrates from its own 1-node run",
                                  hint=f"drop --compute-s, or pass a job spec instead of {target}")
        result = fc.forecast_study(target, nodes, args.ntasks_per_node, args.network, args.profile, args.partition)
    sys.stdout.write(fc.forecast_json(result) + "\n" if args.json else fc.format_forecast(result))
    return 0
