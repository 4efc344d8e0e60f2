"""The ``fora`` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="fora",
        description="FoRA: Fisher-selected layers and Stiefel-constrained LoRA for TRL, PEFT and Axolotl.",
    )
    parser.add_argument("--version", action="version", version=f"fora-plugin {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
