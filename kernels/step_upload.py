"""One host-to-device upload per step: named int and float lists sent as one int64 and one float32 tensor."""
from __future__ import annotations

import torch


class StepUpload:
    """Host lists gathered before any device work and sent as one int64 and one float32 tensor;
    named slices of them are views."""

    def __init__(self) -> None:
        self._lists: dict[bool, list[list]] = {True: [], False: []}
        self._spans: dict[str, tuple[bool, int, int]] = {}
        self._size = {True: 0, False: 0}
        self._tensors: dict[bool, torch.Tensor] = {}

    def add_ints(self, name: str, values: list[int]) -> None:
        self._add(True, name, values)

    def add_floats(self, name: str, values: list[float]) -> None:
        self._add(False, name, values)

    def _add(self, is_int: bool, name: str, values: list) -> None:
        self._spans[name] = (is_int, self._size[is_int], len(values))
        self._lists[is_int].append(values)
        self._size[is_int] += len(values)

    def send(self, device: torch.device | str) -> None:
        device = torch.device(device)
        for is_int, parts in self._lists.items():
            dtype = torch.int64 if is_int else torch.float32
            if self._size[is_int]:  # one host-to-device copy per dtype
                host = torch.tensor([v for part in parts for v in part], dtype=dtype)
                if device.type == "cuda":  # pinned: the copy queues behind the forward instead of waiting for it
                    host = host.pin_memory()
                self._tensors[is_int] = host.to(device, non_blocking=True)
            else:
                self._tensors[is_int] = torch.empty(0, dtype=dtype, device=device)

    def has(self, name: str) -> bool:
        return name in self._spans

    def num(self, name: str) -> int:
        return self._spans[name][2]

    def ints(self, name: str) -> torch.Tensor:
        return self._get(name)

    def floats(self, name: str) -> torch.Tensor:
        return self._get(name)

    def _get(self, name: str) -> torch.Tensor:
        is_int, start, num = self._spans[name]
        return self._tensors[is_int][start:start + num]
