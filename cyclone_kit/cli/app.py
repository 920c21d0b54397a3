"""The command line: parse, build config, call the library. ``main(argv) -> exit code``.

Each subcommand lives in ``cyclone_kit.cli.<name>`` exposing ``add_parser(subparsers)``
and ``run(args) -> int``. Command modules import nothing heavy at module level, so a login
node answers ``--help`` and ``submit --dry-run`` without importing torch, pandas or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from cyclone_kit.core.errors import CycloneError
from cyclone_kit.core.version import __version__

#: Subcommands in the order ``--help`` lists them.
COMMANDS = ("submit", "run", "sweep", "report", "predict", "status", "cancel", "logs", "env", "profiles", "doctor")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line with a HINT and exit code 2.

    A misspelt option gets a "did you mean" naming the closest option of the command given
    (``submit --nods 2`` -> ``--nodes``).
    """

    _argv: list[str] | None = None

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        """As argparse's, remembering the arguments for :meth:`error`'s suggestions."""
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """Print ``error: ... HINT: ...`` on one line and exit 2 (no usage block)."""
        prog, options = self.prog, list(self._option_string_actions)
        for action in self._actions:  # the sub-command given (unknown flags surface at the top parser)
            if isinstance(action, argparse._SubParsersAction):
                command = next((a for a in self._argv or () if a in action.choices), None)
                if command is not None:
                    prog, options = action.choices[command].prog, list(action.choices[command]._option_string_actions)
        hint = f"run '{prog} --help' for the valid arguments"
        guess = suggest_option(message, options)
        if guess:
            hint = f"did you mean {guess[1]} (not {guess[0]})? {hint}"
        sys.stderr.write(f"error: {message} HINT: {hint}\n")
        raise SystemExit(2)


def suggest_option(message: str, options: Sequence[str]) -> tuple[str, str] | None:
    """(misspelt flag, closest valid option) for argparse's "unrecognized arguments" message, or None."""
    import difflib

    if not message.startswith("unrecognized arguments:"):
        return None
    for token in message.split(":", 1)[1].split():
        flag = token.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, [o for o in options if o.startswith("--")], n=1, cutoff=0.6)
            if close:
                return flag, close[0]
    return None


def build_parser() -> argparse.ArgumentParser:
    """The full argparse tree (every command module registers its own sub-parser)."""
    parser = OneLineParser(
        prog="cyclone-kit",
        description="Take a PyTorch vision training job from one GPU to many Slurm nodes, and prove how well it scaled.",
    )
    parser.add_argument("--version", action="version", version=f"cyclone_kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMANDS:
        module = f"cyclone_kit.cli.{name}"
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:  # a command module that exists but is broken must fail loudly
                raise
    return parser


#: Commands that pass everything after ``--`` to the user's script.
SCRIPT_COMMANDS = ("submit", "run")


def split_script_args(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Split ``argv`` at the first ``--``: (cyclone-kit's arguments, the script's or None; pure)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def empty_option(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The first option (or positional) given an empty or blank string, e.g. ``--partition "$UNSET"``.

    argparse takes ``""`` as a value, and the layers below read ``""`` as "not given": the job would
    silently run on a default. Pass-through argument lists (a user script's own ARGS) may be empty.
    """
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, "command", None) in action.choices:
            actions += action.choices[args.command]._actions
    for action in actions:
        if not action.option_strings and action.nargs in ("*", argparse.REMAINDER):
            continue
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            return action.option_strings[-1] if action.option_strings else (action.metavar or action.dest)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (2 for every CycloneError)."""
    parser = build_parser()
    own, script_args = split_script_args(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(own)
    except SystemExit as e:
        return int(e.code or 0)
    if script_args is not None:
        if getattr(args, "command", None) not in SCRIPT_COMMANDS:
            sys.stderr.write(f"error: arguments after -- are only for a script run by {' or '.join(SCRIPT_COMMANDS)} "
                             "HINT: e.g. cyclone-kit submit train.py --nodes 2 -- --epochs 3\n")
            return 2
        args.script_args = script_args
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    empty = empty_option(parser, args)
    if empty:
        sys.stderr.write(f"error: {empty} is empty (an unset shell variable?) "
                         f"HINT: give {empty} a value, or leave it out for the default\n")
        return 2
    try:
        return int(args.func(args) or 0)
    except CycloneError as e:
        sys.stderr.write(f"error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
