"""The built-in demo model: a small Llama trained on a synthetic corpus (bench/demo_kit/train.py), shipped as package
data in kernels/demo_checkpoint/ with its MODEL_CARD.md. `Engine(None)` and `radixserve serve` without --model load
it. (Random-weight and scripted checkpoints for tests and benchmarks are built by radixserve.bench.checkpoints.)
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

DEMO_CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_checkpoint")


def demo_model_path() -> str:
    """The demo model's checkpoint directory (inside the installed package; nothing is built or downloaded)."""
    if not os.path.isfile(os.path.join(DEMO_CHECKPOINT_DIR, "model.safetensors")):
        raise ValueError(f"the built-in demo model is missing from {DEMO_CHECKPOINT_DIR} (a broken install?); "
                         "reinstall radixserve or run `python -m radixserve.bench.demo_kit.train`")
    logger.info("using the built-in demo model (%s): a tiny model trained on a synthetic corpus, for trying "
                "radixserve out; pass a checkpoint directory to serve a real model", DEMO_CHECKPOINT_DIR)
    return DEMO_CHECKPOINT_DIR
