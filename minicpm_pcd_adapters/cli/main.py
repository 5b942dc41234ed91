"""The `pcd` parser: each command module adds its own arguments; `main` runs the one asked for."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minicpm_pcd_adapters.cli import calibrate, classify, evaluate, label, manifest, run_batch, serve, suggest

COMMANDS = {
    "classify": classify,
    "evaluate": evaluate,
    "calibrate": calibrate,
    "suggest": suggest,
    "label": label,
    "serve": serve,
    "run-batch": run_batch,
    "manifest": manifest,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pcd", description="Typed classification with parallel constrained decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(COMMANDS[args.command].main(args))
