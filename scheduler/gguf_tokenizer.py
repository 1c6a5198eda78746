"""A GGUF file's tokenizer as a directory of Hugging Face tokenizer files, which scheduler/tokenizer.py reads as it
reads any checkpoint's.

transformers builds the tokenizer from the file's metadata (AutoTokenizer with `gguf_file`: the vocabulary, merges,
token types, special token ids, llama.cpp's pre-tokenizer name, the chat template) and saves it once per file into
the cache (keyed by the file's path, size and modification time): tokenizer.json, tokenizer_config.json,
chat_template.jinja, and generation_config.json with the file's end-of-sequence ids (eos, eot, eom). The saved
tokenizer_config names the generic class, so tokenizer.json is read as transformers built it from the GGUF, not
rebuilt by a model-specific class. transformers imports torch, so a process without torch (the HTTP server) builds
it in a child process; the engine process has usually built it already.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

from ..kernels.cache_dir import cache_root
from ..kernels.gguf_file import field, open_gguf

_DONE = "generation_config.json"  # written last: its presence marks a complete directory
BUILD_TIMEOUT_S = 600.0


def gguf_tokenizer_dir(path: str) -> str:
    """The cached tokenizer directory of the GGUF file `path`, built where missing."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = os.path.join(cache_root(), "gguf-tokenizers", key)
    if os.path.isfile(os.path.join(out, _DONE)):
        return out
    if "torch" in sys.modules:
        build_tokenizer_dir(path, out)
    else:
        proc = subprocess.run([sys.executable, "-m", __spec__.name, path, out], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"{path}: cannot build its tokenizer: {last}")
    return out


def build_tokenizer_dir(path: str, out: str) -> None:
    """Builds the tokenizer directory of `path` at `out` (atomically: a temporary directory renamed)."""
    from transformers import AutoTokenizer

    header = open_gguf(path)
    eos = [field(header, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    except Exception as exc:  # transformers raises many kinds for a vocabulary it cannot build
        raise ValueError(f"{path}: transformers cannot build its tokenizer: {exc}") from exc
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    config_file = os.path.join(tmp, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "TokenizersBackend"  # tokenizer.json as built from the GGUF
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(tmp, _DONE), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": eos}, f)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, _DONE)):
            raise


if __name__ == "__main__":
    try:
        build_tokenizer_dir(sys.argv[1], sys.argv[2])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
