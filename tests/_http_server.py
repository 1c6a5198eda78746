"""Real `radixserve serve` subprocesses for the HTTP tests, one per configuration per test session.

A server listens on 127.0.0.1 with --port 0 (the OS picks a free port) and prints its address in
its one "ready" line, which the helper reads. Servers are shared through `shared_server(name, ...)`
and stopped (SIGTERM) when the test process exits.
"""
from __future__ import annotations

import atexit
import threading

from radixserve.frontend.spawn import ServerProcess as _SpawnedServer
from radixserve.bench.demo_kit.tokenizer import TOOL_RESULT_OPEN as TOOL_RESULT_TRIGGER

SCRIPT_PRIORITY = (TOOL_RESULT_TRIGGER,)

START_TIMEOUT_S = 180.0

# Tiny checkpoints: fast to build and to run on two CPU cores.
TINY_MODEL = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, max_position_embeddings=1024, seed=3)
# Trigger word -> the text the scripted model answers with (then EOS).
SCRIPTS = {
    "weather": '<tool_call>{"name": "get_forecast", "arguments": {"city": "Paris"}}</tool_call>',
    "poem": "roses are red STOP violets are blue",
    "story": "once upon a time there was a tiny model that served many clients at once",
    TOOL_RESULT_TRIGGER: "the forecast says sunny",  # once a tool result is in the prompt (a priority trigger)
}
# A reasoning model's script (trigger "count"): its tags cut across tokens, the close tag one character a token.
THINK_TRIGGER = "count"  # not "answer": the tool prompt of the template says "answer"
THINK_REASONING = "Let me plan: two and two make four."
THINK_ANSWER = "It is four."
THINK_PIECES = ["<think>", "\n" + THINK_REASONING + "\n", "</", "t", "h", "i", "n", "k", ">", "\n\n", THINK_ANSWER]
THINK_SCRIPT = "".join(THINK_PIECES)
# Trigger "greeting": a tool call drafted inside the reasoning (never a call), then a real one in the answer.
THINK_TOOL_TRIGGER = "greeting"
THINK_TOOL_REASONING = 'I could send <tool_call>{"arguments":{},"name":"draft"}</tool_call> first.'
THINK_TOOL_CALL = '<tool_call>{"name": "get_forecast", "arguments": {"city": "Rome"}}</tool_call>'
THINK_TOOL_PIECES = ["<think>", THINK_TOOL_REASONING, "</", "t", "h", "i", "n", "k", ">", "\n\n", THINK_TOOL_CALL]
MULTIBYTE_TEXT = "世界🚀é"
EMOJI_SCRIPT = f"ok {MULTIBYTE_TEXT} done"  # trigger "emoji"; sent as one token per byte


class ServerProcess(_SpawnedServer):
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        # One intra-op thread: test processes share two cores, and oversubscribed threads stall tiny matmuls.
        super().__init__([*args, "--num-threads", "1"], start_timeout_s=START_TIMEOUT_S,
                         env={"OMP_NUM_THREADS": "1", **(env or {})})


_SERVERS: dict[str, ServerProcess] = {}
_LOCK = threading.Lock()


def shared_server(name: str, args: list[str]) -> ServerProcess:
    """One server per name for the whole test session (stopped at exit)."""
    with _LOCK:
        server = _SERVERS.get(name)
        if server is None or server.proc.poll() is not None:
            server = _SERVERS[name] = ServerProcess(args)
        return server


@atexit.register
def _stop_all() -> None:
    for server in _SERVERS.values():
        server.stop(timeout=20)


def tiny_model_path() -> str:
    from radixserve.bench.checkpoints import cached_checkpoint

    return cached_checkpoint("llama", **TINY_MODEL)


def scripted_chains() -> dict:
    """Scripts per trigger word; "emoji" is given as single-byte tokens so that its multi-byte
    characters are split across tokens (the detokenizer must hold partial characters back); "count" thinks
    (THINK_SCRIPT, its tags cut into several tokens)."""
    return dict(SCRIPTS, emoji=byte_token_ids(EMOJI_SCRIPT), **{THINK_TRIGGER: THINK_PIECES, THINK_TOOL_TRIGGER: THINK_TOOL_PIECES})


def byte_token_ids(text: str, vocab_size: int = 2048) -> list[int]:
    """One demo-tokenizer id per UTF-8 byte of text (byte-level BPE keeps all 256 byte tokens)."""
    from tokenizers import Tokenizer

    from radixserve.frontend.logprobs import bytes_to_unicode
    from radixserve.bench.demo_kit.tokenizer import tokenizer_json

    tok = Tokenizer.from_str(tokenizer_json(vocab_size))
    alphabet = bytes_to_unicode()
    return [tok.token_to_id(alphabet[b]) for b in text.encode("utf-8")]


def scripted_model_path() -> str:
    from radixserve.bench.checkpoints import cached_scripted_checkpoint

    return cached_scripted_checkpoint(scripted_chains(), priority=SCRIPT_PRIORITY)


def main_server() -> ServerProcess:
    return shared_server("main", ["--model", tiny_model_path(), "--context-length", "512",
                                  "--kv-cache-tokens", "8192", "--max-body-bytes", "65536",
                                  "--max-tokens-default", "32", "--served-model-name", "tiny"])


def tools_server() -> ServerProcess:
    """The tiny random model with room for tool prompts (a 1,024-token context): it never calls a tool on its own, so
    every call it makes is a grammar's (tool_choice)."""
    return shared_server("tools", ["--model", tiny_model_path(), "--context-length", "1024",
                                   "--kv-cache-tokens", "8192", "--served-model-name", "tiny"])


def scripted_server() -> ServerProcess:
    return shared_server("scripted", ["--model", scripted_model_path(), "--kv-cache-tokens", "32768",
                                      "--max-tokens-default", "256", "--served-model-name", "scripted"])


def reasoning_server() -> ServerProcess:
    """The scripted model behind a Qwen3-style template (enable_thinking, reasoning rendered on assistant turns)
    with --reasoning-parser qwen3: "... count ..." prompts think (THINK_SCRIPT) and then answer."""
    import os
    import tempfile

    from _tokenizer_variants import qwen3_style_template

    path = os.path.join(tempfile.mkdtemp(prefix="radixserve-qwen3-template-"), "chat_template.jinja")
    with open(path, "w", encoding="utf-8") as f:
        f.write(qwen3_style_template())
    return shared_server("reasoning", ["--model", scripted_model_path(), "--kv-cache-tokens", "8192",
                                       "--max-tokens-default", "128", "--served-model-name", "thinker",
                                       "--chat-template", path, "--reasoning-parser", "qwen3"])
