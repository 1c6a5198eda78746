"""`radixserve serve ...`: flags are ServerConfig's fields (defaults read from it)."""
from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, Sequence

from radixserve.frontend.config import LOG_LEVELS, ServerConfig
from radixserve.scheduler.config import ATTENTION_BACKENDS, DTYPES, EVICTION_POLICIES, SCHEDULE_POLICIES

_CHOICES = {
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "schedule_policy": SCHEDULE_POLICIES,
    "eviction_policy": EVICTION_POLICIES,
    "log_level": LOG_LEVELS,
}
_HELP = {
    "model": "checkpoint directory (None: the built-in demo model)",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port, printed in the ready line)",
    "api_key": "require 'Authorization: Bearer KEY' (health endpoints stay open)",
    "served_model_name": "the model name clients send (None: the model path, or radixserve-demo for the demo model)",
    "dtype": "weights and activations dtype",
    "context_length": "cap the model's context length (None: the model's)",
    "kv_cache_tokens": "KV cache size in token slots (None: the engine's device default)",
    "page_size": "KV page size in tokens",
    "chunked_prefill_size": "max prompt tokens computed per step",
    "max_running_requests": "max requests decoding together",
    "schedule_policy": "order of the waiting queue",
    "disable_radix_cache": "turn prefix matching off",
    "attention_backend": "attention kernels",
    "eviction_policy": "which cached prefixes go first",
    "seed": "seed for requests that give none",
    "device": "torch device (None: cuda if available, else cpu)",
    "num_threads": "torch intra-op threads for the model (None: the cores this process may use)",
    "disable_shared_prefix_attention": "read shared prefixes per request instead of once per step",
    "shared_prefix_min_tokens": "shortest shared prefix read once for all requests below it (0: any)",
    "max_queued_requests": "requests accepted beyond --max-running-requests before 429",
    "max_tokens_default": "chat: generate until EOS or the context end, capped by this",
    "max_n": "the largest n (choices per prompt) a request may ask for",
    "max_body_bytes": "larger request bodies get 413",
    "graceful_timeout_s": "on SIGTERM, seconds running requests may take to finish",
    "log_level": "logging level",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="A RadixAttention-style LLM server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible and SGLang-native HTTP server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(ServerConfig)
    for f in fields(ServerConfig):
        _add_flag(serve, f.name, hints[f.name], f.default)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    return ServerConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    from radixserve.frontend.launch import run_server  # torch and the engine load only to serve

    try:
        return run_server(config)
    except ValueError as exc:  # a bad model directory or engine setting: say so without a traceback
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2


def _add_flag(parser: argparse.ArgumentParser, name: str, hint: Any, default: Any) -> None:
    flag = "--" + name.replace("_", "-")
    if name == "graceful_timeout_s":
        flag = "--graceful-timeout"
    help_text = _HELP.get(name, name.replace("_", " "))
    if default is MISSING:
        default = None
    base = _base_type(hint)
    if base is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                            help=help_text)
        return
    parser.add_argument(flag, dest=name, type=base, default=default, choices=_CHOICES.get(name),
                        metavar=None if name in _CHOICES else name.upper(), help=help_text)


def _base_type(hint: Any) -> type:
    """int from `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


if __name__ == "__main__":
    sys.exit(main())
