"""CLI subcommands: each module exposes ``add_parser(subparsers)`` and ``run(args) -> int``."""
