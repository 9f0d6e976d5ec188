"""Configuration of the SeedVR2 causal video VAE, using the keyword names of the reference's YAML file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["VideoVAEConfig"]

_ACTIVATIONS = ("silu", "swish")
# "pad", "tail" and "replicate" only say how the reference would inflate 2D (image) weights into 3D ones when
# loading an image checkpoint; with 3D weights (every released checkpoint) they change nothing.
_INFLATION_MODES = ("pad", "tail", "replicate", "none")
_DOWN_BLOCK = "DownEncoderBlock3D"
_UP_BLOCK = "UpDecoderBlock3D"


@dataclass
class VideoVAEConfig:
    """Architecture of the causal video VAE (released setting: 8x spatial, 4x temporal, 16 latent channels)."""

    act_fn: str = "silu"
    block_out_channels: list[int] = field(default_factory=lambda: [128, 256, 512, 512])
    down_block_types: list[str] = field(default_factory=lambda: [_DOWN_BLOCK] * 4)
    in_channels: int = 3
    latent_channels: int = 16
    layers_per_block: int = 2
    norm_num_groups: int = 32
    out_channels: int = 3
    slicing_sample_min_size: int = 4
    temporal_scale_num: int = 2
    inflation_mode: str = "pad"
    up_block_types: list[str] = field(default_factory=lambda: [_UP_BLOCK] * 4)
    spatial_downsample_factor: int = 8
    temporal_downsample_factor: int = 4
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    freeze_encoder: bool = False

    def __post_init__(self) -> None:
        self.block_out_channels = list(self.block_out_channels)
        self.down_block_types = list(self.down_block_types)
        self.up_block_types = list(self.up_block_types)
        self._validate()

    # ---- construction helpers -------------------------------------------------------------------------

    @classmethod
    def seedvr2(cls) -> "VideoVAEConfig":
        """The released SeedVR2 VAE (``s8_c16_t4_inflation_sd3.yaml``)."""
        return cls()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "VideoVAEConfig":
        """Build from a mapping of reference keyword names; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"VideoVAEConfig: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_metadata(cls, metadata: str | Mapping[str, Any]) -> "VideoVAEConfig":
        """Build from the reference's config (a JSON string or mapping), ignoring its ``__object__`` entry."""
        values = json.loads(metadata) if isinstance(metadata, str) else dict(metadata)
        if not isinstance(values, dict):
            raise ValueError(f"VideoVAEConfig.from_metadata expects a JSON object, got {type(values).__name__}")
        values.pop("__object__", None)
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived facts ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.block_out_channels)

    def encoder_block_downsamples_time(self, index: int) -> bool:
        """Whether encoder block ``index`` halves time (the last ``temporal_scale_num`` downsampling blocks do)."""
        return self.num_blocks - 1 - self.temporal_scale_num <= index < self.num_blocks - 1

    def decoder_block_upsamples_time(self, index: int) -> bool:
        """Whether decoder block ``index`` doubles time (the first ``temporal_scale_num`` blocks do)."""
        return index < self.temporal_scale_num and index < self.num_blocks - 1

    # ---- validation ------------------------------------------------------------------------------------

    def _validate(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VideoVAEConfig.{name} must be a positive integer, got {value!r}")

        for name in ("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups",
                     "slicing_sample_min_size", "spatial_downsample_factor", "temporal_downsample_factor"):
            positive_int(name)
        for name in ("use_quant_conv", "use_post_quant_conv", "freeze_encoder"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"VideoVAEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.act_fn not in _ACTIVATIONS:
            raise ValueError(f"VideoVAEConfig.act_fn={self.act_fn!r} is not supported; use one of {_ACTIVATIONS}")
        if self.inflation_mode not in _INFLATION_MODES:
            raise ValueError(
                f"VideoVAEConfig.inflation_mode={self.inflation_mode!r} is not supported; use one of "
                f"{_INFLATION_MODES}"
            )
        if not self.block_out_channels:
            raise ValueError("VideoVAEConfig.block_out_channels must not be empty")
        for i, ch in enumerate(self.block_out_channels):
            if isinstance(ch, bool) or not isinstance(ch, int) or ch < 1:
                raise ValueError(f"VideoVAEConfig.block_out_channels[{i}] must be a positive integer, got {ch!r}")
            if ch % self.norm_num_groups:
                raise ValueError(
                    f"VideoVAEConfig.block_out_channels[{i}]={ch} is not divisible by norm_num_groups="
                    f"{self.norm_num_groups}"
                )
        n = self.num_blocks
        for name, expected in (("down_block_types", _DOWN_BLOCK), ("up_block_types", _UP_BLOCK)):
            types = getattr(self, name)
            if len(types) != n:
                raise ValueError(
                    f"VideoVAEConfig.{name} has {len(types)} entries but block_out_channels has {n}"
                )
            bad = sorted({t for t in types if t != expected})
            if bad:
                raise ValueError(f"VideoVAEConfig.{name}: unsupported block types {bad}; only {expected!r}")
        if (isinstance(self.temporal_scale_num, bool) or not isinstance(self.temporal_scale_num, int)
                or not 0 <= self.temporal_scale_num <= n - 1):
            raise ValueError(
                f"VideoVAEConfig.temporal_scale_num must be an integer in [0, {n - 1}], got {self.temporal_scale_num!r}"
            )
        if self.spatial_downsample_factor != 2 ** (n - 1):
            raise ValueError(
                f"VideoVAEConfig.spatial_downsample_factor={self.spatial_downsample_factor} does not match the "
                f"{n - 1} spatial downsampling blocks (expected {2 ** (n - 1)})"
            )
        if self.temporal_downsample_factor != 2 ** self.temporal_scale_num:
            raise ValueError(
                f"VideoVAEConfig.temporal_downsample_factor={self.temporal_downsample_factor} does not match "
                f"temporal_scale_num={self.temporal_scale_num} (expected {2 ** self.temporal_scale_num})"
            )
