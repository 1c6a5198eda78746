"""Reads the safetensors weights of a Hugging Face checkpoint (single file or sharded index)."""
from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.kernels.model_config import ModelConfig, normalize_dtype_name

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """"auto" = float32 on the CPU; on an accelerator the checkpoint's dtype (bfloat16 if float32)."""
    if requested != "auto":
        return TORCH_DTYPES[normalize_dtype_name(requested)]
    if device.type == "cpu":
        return torch.float32
    ckpt = TORCH_DTYPES[normalize_dtype_name(checkpoint_dtype)]
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def safetensors_files(model_path: str) -> list[str]:
    """The weight files of a checkpoint: the shards named by the index, else every *.safetensors."""
    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"missing file: {missing[0]} (listed in {index_path})")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        legacy = glob.glob(os.path.join(model_path, "*.bin")) + glob.glob(os.path.join(model_path, "*.pt"))
        hint = " (found PyTorch .bin/.pt weights: re-save them with safe_serialization=True)" if legacy else ""
        raise ValueError(f"missing file: no *.safetensors weights in {model_path}{hint}")
    return files


def load_state_dict(model_path: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, cast to `dtype` and moved to `device`, keyed by HF name.
    A progress bar (bytes read) shows on a terminal (tqdm stays quiet when stderr is not one)."""
    files = safetensors_files(model_path)
    state: dict[str, torch.Tensor] = {}
    total = sum(os.path.getsize(p) for p in files)
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=None) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    state[name] = tensor.to(device=device, dtype=dtype)
    logger.info("loaded %d tensors from %d file(s) in %s", len(state), len(files), model_path)
    return state


def checkpoint_dtype(model_path: str, config: ModelConfig) -> str:
    """The dtype the weights are stored in: config.json's when given, else the first tensor's."""
    if config.dtype != "float32":
        return config.dtype
    first = safetensors_files(model_path)[0]
    with safe_open(first, framework="pt", device="cpu") as f:
        for name in f.keys():
            stored = f.get_slice(name).get_dtype()
            return {"BF16": "bfloat16", "F16": "float16"}.get(stored, "float32")
    return "float32"


def take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Removes and returns a required tensor; a missing one is an error naming it."""
    if name not in state:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return state.pop(name)


def take_optional(state: dict[str, torch.Tensor], name: str, required: bool) -> torch.Tensor | None:
    return take(state, name) if required else state.pop(name, None)
