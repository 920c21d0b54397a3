"""``profiles``: list the cluster profiles, or show one."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``profiles``."""
    p = sub.add_parser("profiles", help="list cluster profiles or show one",
                       description="List the built-in and user profiles (~/.config/cyclone_kit/profiles), or show one.")
    p.add_argument("name", nargs="?", help="profile name or .toml path to show")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the profile list or one profile's partitions."""
    from cyclone_kit.config.profile import load_profile, profile_names

    if not args.name:
        for name in profile_names():
            prof = load_profile(name)
            print(f"{name:<10} {prof.description}")
        return 0
    prof = load_profile(args.name)
    print(f"profile {prof.name}: {prof.description}")
    print(f"  account: {prof.account or '(none)'}{' (required)' if prof.account_required else ''}")
    print(f"  modules: {', '.join(prof.modules) or '(none)'}")
    print(f"  GPU request: --{prof.gpu_request}")
    print(f"  {'partition':<10} {'nodes':>5} {'cpus':>5} {'gpus':>5} {'mem_GB':>7} {'gpu':<6} {'max_time':<11} default")
    for p in prof.partitions:
        print(f"  {p.name:<10} {p.nodes:>5} {p.cpus_per_node:>5} {p.gpus_per_node:>5} {p.memory_gb:>7} "
              f"{p.gpu_type or '-':<6} {p.max_time:<11} {'yes' if p.default else ''}")
    return 0
