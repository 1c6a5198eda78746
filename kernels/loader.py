"""Reads the safetensors weights of a Hugging Face checkpoint (single file or sharded index); a GGUF file's are read by
gguf_loader.py (the runner picks)."""
from __future__ import annotations

import functools
import glob
import json
import logging
import os
import struct
from typing import Any, BinaryIO, Callable, Iterator

import torch
from tqdm import tqdm

from .gguf_file import is_gguf_path
from .model_config import ModelConfig, normalize_dtype_name

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of a CPU with native bf16 dot products


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The running CPU's /proc/cpuinfo flags, read once (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return frozenset(next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device,
                  flags: frozenset[str] | None = None) -> torch.dtype:
    """The dtype the model runs in, logged once with the reason. "auto": on the CPU see _cpu_auto_dtype
    (`flags` defaults to this CPU's); on an accelerator the checkpoint's dtype (bfloat16 if float32)."""
    ckpt = TORCH_DTYPES[normalize_dtype_name(checkpoint_dtype)]
    if requested != "auto":
        dtype, why = TORCH_DTYPES[normalize_dtype_name(requested)], "asked for with --dtype"
    elif device.type == "cpu":
        dtype, why = _cpu_auto_dtype(ckpt, cpu_flags() if flags is None else flags)
    else:
        dtype = torch.bfloat16 if ckpt == torch.float32 else ckpt
        why = f"--dtype auto on {device.type}, {_name(ckpt)} checkpoint"
    logger.info("dtype %s (%s)", _name(dtype), why)
    return dtype


def _cpu_auto_dtype(ckpt: torch.dtype, flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """A bfloat16 checkpoint stays bfloat16 where the CPU has native bf16 dot products (BF16_CPU_FLAGS): half
    the bytes streamed per decode step. Elsewhere float32: emulated bf16 (and any fp16) matmuls are slower."""
    if ckpt == torch.float32:
        return torch.float32, "--dtype auto, float32 checkpoint"
    have = sorted(set(BF16_CPU_FLAGS) & flags)
    if ckpt == torch.bfloat16 and have:
        return torch.bfloat16, f"--dtype auto keeps the bfloat16 checkpoint: this CPU has {', '.join(have)}"
    if ckpt == torch.bfloat16:
        return torch.float32, f"--dtype auto, bfloat16 checkpoint, but this CPU has no {' or '.join(BF16_CPU_FLAGS)}"
    return torch.float32, f"--dtype auto, {_name(ckpt)} checkpoint: the CPU runs it in float32"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def load_state_dict(model_path: str, dtype: torch.dtype, device: torch.device,
                    transform: Callable[[str, torch.Tensor], Any] | None = None) -> dict[str, Any]:
    """All tensors of the checkpoint, cast to `dtype` and moved to `device`, keyed by HF name, read and converted
    one at a time (at most one tensor's transient copy). `transform(name, tensor)` (quant.load_transform) may
    replace a safetensors tensor as read, before any cast: what it returns is kept when it is not the tensor it
    was given. A progress bar (bytes read) shows on a terminal (tqdm stays quiet when stderr is not one). A GGUF
    file's weights are gguf_loader.load_gguf_state_dict's."""
    files = safetensors_files(model_path)
    state: dict[str, torch.Tensor] = {}
    total = sum(os.path.getsize(p) for p in files)
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=None) as bar:
        for path in files:
            for name, tensor in read_safetensors(path):
                bar.update(tensor.numel() * tensor.element_size())
                kept = tensor if transform is None else transform(name, tensor)
                state[name] = tensor.to(device=device, dtype=dtype) if kept is tensor else kept
    logger.info("loaded %d tensors from %d file(s) in %s", len(state), len(files), model_path)
    return state


def read_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor of a .safetensors file, in file order, each read into memory of its own.
    Not through a file mapping (safetensors' get_tensor): every page of a mapping the load touches stays in
    the process's RSS as long as any tensor of it lives (a tied embedding does), a second copy of the weights
    that the model had already packed elsewhere."""
    with open(path, "rb") as f:
        header, data_start = _safetensors_header(f, path)
        entries = sorted((info["data_offsets"], name, info) for name, info in header.items() if name != "__metadata__")
        for (begin, end), name, info in entries:
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
            raw = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(data_start + begin)
            if f.readinto(memoryview(raw.numpy())) != end - begin:
                raise ValueError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
            yield name, raw.view(dtype).reshape(info["shape"])


def _safetensors_header(f: BinaryIO, path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of an open .safetensors file and the offset its data starts at."""
    try:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a safetensors file: {exc}") from exc


def checkpoint_dtype(model_path: str, config: ModelConfig) -> str:
    """The dtype the weights are stored in: config.json's when given, else the first tensor's (a GGUF file's
    config says it: gguf_file.hf_config)."""
    if config.dtype != "float32" or is_gguf_path(model_path):
        return config.dtype
    path = safetensors_files(model_path)[0]
    with open(path, "rb") as f:
        header, _ = _safetensors_header(f, path)
    stored = next((info["dtype"] for name, info in header.items() if name != "__metadata__"), "F32")
    return {"BF16": "bfloat16", "F16": "float16"}.get(stored, "float32")


def take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Removes and returns a required tensor; a missing one is an error naming it."""
    if name not in state:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return state.pop(name)


def take_optional(state: dict[str, torch.Tensor], name: str, required: bool) -> torch.Tensor | None:
    return take(state, name) if required else state.pop(name, None)
