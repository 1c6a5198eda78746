"""Shared command-line handling of the examples: which backend to run on."""
from __future__ import annotations

import argparse

from .. import Backend, Endpoint, Runtime


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory for the in-process engine (default: the built-in demo model)")
    parser.add_argument("--url", default=None, help="a running radixserve (or SGLang) server; overrides --model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size of the in-process engine")


def make_backend(args: argparse.Namespace) -> Backend:
    if args.url:
        return Endpoint(args.url, api_key=args.api_key)
    config = {"kv_cache_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else {}
    return Runtime(args.model, **config)
