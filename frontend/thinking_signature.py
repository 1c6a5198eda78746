"""Signatures of the thinking blocks /v1/messages returns: an HMAC-SHA256 of the block's text under a server key.

Clients send a conversation's thinking blocks back on every turn (the anthropic SDK requires their `signature`);
a block whose signature does not verify was changed, or made by another server, and is refused with a 400, as
Anthropic refuses it. The key is `--thinking-key`, else $RADIXSERVE_THINKING_KEY, else random per server start:
replicas behind one router must share one (set either), or a turn routed to another replica is refused.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os

KEY_ENV = "RADIXSERVE_THINKING_KEY"


def signing_key(configured: str | None) -> bytes:
    """The server's key: the configured one, the environment's, or 32 random bytes."""
    key = configured or os.environ.get(KEY_ENV)
    return key.encode() if key else os.urandom(32)


def sign(key: bytes, thinking: str) -> str:
    digest = hmac.new(key, thinking.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def verify(key: bytes, thinking: str, signature: str) -> bool:
    return hmac.compare_digest(sign(key, thinking).encode(), signature.encode("utf-8", "surrogatepass"))
