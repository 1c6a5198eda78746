"""The --quantization and --quantized-activations settings (torch-free: the HTTP process validates them): their
choices and what each names. The formats, packing and kernels are kernels/quant.py's (activations: quant_act.py)."""
from __future__ import annotations

from dataclasses import dataclass

# int8: one scale per output channel, int8-g32 per 32 inputs; int4: affine, scale and min per 32 inputs (-g128: 128)
QUANTIZATIONS = ("none", "int8", "int8-g32", "int4", "int4-g128")
QUANTIZED_ACTIVATIONS = ("auto", "none", "int8")  # quant_act.resolve says what each does


@dataclass(frozen=True)
class QuantSpec:
    """What --quantization asks for: the format ("int8" | "int4") and its group along K (None: g = K, one scale
    per output channel)."""

    kind: str
    group: int | None

    def group_for(self, k: int) -> int:
        return k if self.group is None else self.group


def parse_quantization(name: str | None) -> QuantSpec | None:
    """--quantization's value: None / "none" (float weights), or one of QUANTIZATIONS. ValueError otherwise."""
    if name is None or name == "none":
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {name!r}")
    kind, _, group = name.partition("-g")
    return QuantSpec(kind, int(group) if group else (None if kind == "int8" else 32))
