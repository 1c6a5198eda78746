"""The HTTP side never imports torch (nor transformers, which always imports torch): its modules, and the Tokenizer
loading a checkpoint, encoding, decoding and rendering chats, run in a fresh interpreter that is checked after each
step. The checkpoints are built here, in the parent (that needs torch); only the child must stay torch-free."""
import json
import subprocess
import sys

import pytest

from _http_server import tiny_model_path
from radixserve.bench.checkpoints import cached_checkpoint, scripted_model_path

HTTP_MODULES = [
    "radixserve.frontend.server",
    "radixserve.frontend.cli",
    "radixserve.frontend.openai_api",
    "radixserve.frontend.native_api",
    "radixserve.frontend.logprobs",
    "radixserve.scheduler.req",
    "radixserve.scheduler.output",
    "radixserve.scheduler.config",
    "radixserve.scheduler.detokenizer",
    "radixserve.scheduler.sampling_params",
    "radixserve.scheduler.tokenizer",
    "radixserve.kernels.forward_io",
    "radixserve.lang.endpoint",
]
HEAVY = ("torch", "transformers")

# Imports the modules one at a time, then loads each checkpoint's Tokenizer and uses it; prints, as JSON, the first
# step after which a heavy module was loaded (null when none was).
CHILD = r"""
import importlib, json, sys
heavy = %(heavy)r

def loaded():
    return sorted(name for name in heavy if name in sys.modules)

def check(step):
    if loaded():
        print(json.dumps({"step": step, "loaded": loaded()}))
        sys.exit(0)

for module in %(modules)r:
    importlib.import_module(module)
    check("import " + module)

from radixserve.scheduler.tokenizer import Tokenizer
from radixserve.scheduler.detokenizer import IncrementalDetokenizer

messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界 🚀"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "weather?"}]
tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
for path in %(paths)r:
    tok = Tokenizer(path)
    check("Tokenizer(" + path + ")")
    ids = tok.encode("héllo <|im_start|> 世界 🚀", add_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == "héllo <|im_start|> 世界 🚀", ids
    assert tok.convert_ids_to_tokens(ids)
    chat = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    assert tok.decode(chat, skip_special_tokens=False) == tok.render_chat(messages, tools=tools)
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids) + detok.finish()
    assert streamed == tok.decode(ids), streamed
    check("encode/decode/apply_chat_template on " + path)
print(json.dumps({"step": None, "loaded": loaded()}))
"""


@pytest.fixture(scope="module")
def checkpoints():
    qwen2 = cached_checkpoint("qwen2", vocab_size=5000, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              intermediate_size=64, max_position_embeddings=256)  # the Qwen2Tokenizer pipeline
    return [tiny_model_path(), scripted_model_path(), qwen2]


def test_http_side_never_imports_torch(checkpoints):
    code = CHILD % {"heavy": HEAVY, "modules": HTTP_MODULES, "paths": checkpoints}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"step": None, "loaded": []}, f"{result['loaded']} loaded by: {result['step']}"
