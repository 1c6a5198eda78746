"""`radixserve serve ...`: one flag per field of ServerConfig, EngineConfig and PolicyConfig (frontend/flags.py).

A bad value exits with status 2 and one line, `radixserve: error: ...`, on stderr.
`radixserve deploy kubernetes ...` (frontend/deploy/) is the one subcommand with hand-written flags.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import deploy
from .flags import add_config_flags, config_from_args, with_flag_names

PROG = "radixserve"
SERVE_EXAMPLES = """examples:
  radixserve serve                                  # the built-in demo model on http://127.0.0.1:30000
  radixserve serve --model ./my-checkpoint --port 8000 --api-key secret
  radixserve serve --model ./my-checkpoint --api-keys keys.toml   # a tenant per key (README "Tenants")
  radixserve serve --model ./base-model --chat-template chatml.jinja --served-model-name base
"""


def version() -> str:
    """The installed distribution's version (pyproject), or "unknown" when run from a bare source tree."""
    from importlib import metadata

    try:
        return metadata.version("radixserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="A RadixAttention-style LLM server.")
    parser.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the OpenAI-compatible and SGLang-native HTTP server",
                           description="Serve a checkpoint directory (or the built-in demo model) over HTTP.",
                           epilog=SERVE_EXAMPLES, formatter_class=_HelpFormatter)
    add_config_flags(serve)
    deploy.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `radixserve` alone: what there is to run
        parser.print_help()
        return 0
    try:
        if args.command == "deploy":
            return deploy.run(args)
        config = config_from_args(args)
        from .launch import run_server  # the engine starts only to serve

        return run_server(config)
    except ValueError as exc:  # a bad setting, a busy port, no CUDA, a bad model directory: no traceback
        print(f"{PROG}: error: {with_flag_names(one_line(exc))}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# -- helpers ----------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help, and the examples epilog as written."""


if __name__ == "__main__":
    sys.exit(main())
