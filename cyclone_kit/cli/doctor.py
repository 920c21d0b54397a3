"""``doctor``: check a cluster profile against the live cluster, then run a smoke job on N nodes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``doctor``."""
    p = sub.add_parser(
        "doctor",
        help="check a profile against the live cluster and run a short smoke job",
        description="Static checks of the profile against the live cluster (partition, nodes, CPUs, GPUs, memory, "
        "max time, nodelist, the account's association, modules), then a smoke job (a few minutes at most, with the "
        "profile's own setup, modules and python) that checks on every rank: python and torch versions, GPUs "
        "per task, the rank bootstrap, an all-reduce across the nodes (bandwidth and latency), an all-reduce sweep "
        "from 4 B to 64 MiB (256 MiB on GPUs) per network level fitted into latency and bus bandwidth (saved as "
        "network.json in the smoke job's run directory, for `cyclone-kit predict --network`) and the network "
        "variables. Exit 0 when every check passed, 1 when one failed, 2 for bad input.",
    )
    p.add_argument("--profile", default="cyclone", help="cluster profile name or .toml path (default: cyclone)")
    p.add_argument("--partition", help="partition (default: the profile's default)")
    p.add_argument("--nodes", type=int, default=None, help="nodes for the smoke job (default: 2, or 1 on a one-node partition)")
    p.add_argument("--ntasks-per-node", type=int, default=None, help="tasks per node for the smoke job (default: one "
                   "per GPU, one on CPU partitions); 2 or more also measure the network inside a node")
    p.add_argument("--account", help="Slurm account to check and charge (default: the profile's)")
    p.add_argument("--json", action="store_true", help="print a JSON list of {check, ok, detail, hint} "
                   "(the network_figures row adds data: the network.json document)")
    p.add_argument("--static-only", action="store_true", help="only the static checks; submit no job")
    p.add_argument("--runs-dir", default="runs", help="where the smoke job's run directory goes (default: ./runs; "
                   "it must be visible from the compute nodes)")
    p.add_argument("--container", metavar="IMAGE",
                   help="run the smoke job's probes inside this container image: checks that it starts on every "
                        "rank, imports torch and sees the partition's GPUs (default: the profile's [container] image)")
    p.add_argument("--container-runtime", metavar="NAME",
                   help="charliecloud, apptainer, singularity or pyxis (default: the profile's [container] runtime)")
    p.add_argument("--wait-timeout", type=float, default=300,
                   help="seconds to wait for the smoke job, queue included, before cancelling it (default: 300)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the checks and print one row per check (or JSON); exit 1 when one failed."""
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.doctor.checks import exit_code, format_table, to_json
    from cyclone_kit.doctor.job import DoctorOptions, run_doctor

    if args.nodes is not None and args.nodes < 1:
        raise ValidationError(f"--nodes {args.nodes} is not a node count", hint="use --nodes 1 or more")
    if args.ntasks_per_node is not None and args.ntasks_per_node < 1:
        raise ValidationError(f"--ntasks-per-node {args.ntasks_per_node} is not a task count", hint="use 1 or more")
    if not args.wait_timeout > 0:
        raise ValidationError(f"--wait-timeout {args.wait_timeout:g} is not positive", hint="e.g. --wait-timeout 300")
    options = DoctorOptions(profile=args.profile, partition=args.partition or "", nodes=args.nodes, account=args.account or "",
                            runs_dir=Path(args.runs_dir), wait_timeout_s=args.wait_timeout, static_only=args.static_only,
                            ntasks_per_node=args.ntasks_per_node, container=args.container or "",
                            container_runtime=args.container_runtime or "")
    checks = run_doctor(options, progress=lambda line: print(f"doctor: {line}", file=sys.stderr, flush=True))
    sys.stdout.write(to_json(checks) + "\n" if args.json else format_table(checks))
    return exit_code(checks)
