"""`pcd manifest create|verify`: SHA-256 manifests of a model folder's files."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pcd_engine import MANIFEST_NAME, PCDError, read_manifest, verify_manifest, write_manifest


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("manifest", help="write or check the SHA-256 manifest of a model folder")
    action = parser.add_subparsers(dest="action", required=True)
    create = action.add_parser("create", help="hash every weight, config and tokenizer file of a folder")
    create.add_argument("folder", help="model folder (a hub snapshot folder, a `hf download` folder ...)")
    create.add_argument("--output", default=None, help=f"manifest file (default: FOLDER/{MANIFEST_NAME})")
    create.add_argument("--revision", default=None, help="hub commit the files come from (recorded; "
        "default: the commit of a hub cache snapshot folder)")  # fmt: skip
    verify = action.add_parser("verify", help="check a folder against a manifest (exit 0 or 2)")
    verify.add_argument("folder")
    verify.add_argument("--manifest", required=True, help="manifest file from `pcd manifest create`")


def main(args: argparse.Namespace) -> int:
    """`pcd manifest create|verify`: exit 0, or 2 with the file that does not match."""
    try:
        if args.action == "create":
            target = write_manifest(args.folder, args.output, revision=args.revision)
            count = len(read_manifest(target)["files"])
            print(f"pcd: {count} files hashed into {target}", file=sys.stderr)
        else:
            verify_manifest(args.folder, args.manifest)
            print(f"pcd: {args.folder} matches {args.manifest}", file=sys.stderr)
    except (PCDError, OSError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    return 0
