"""``NaDiTConfig``: the constructor arguments of SeedVR2's NaDiT, validated and normalised once.

The field names are the reference constructor's keyword names (as stored in the ``config`` metadata of the golden
files and in ``configs_3b/main.yaml``), so a reference config dict can be passed straight in. Per-layer options given
as one value (``window``, ``window_method``, ``block_type``) are expanded to one entry per layer, and lists become
tuples so the config is hashable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

__all__ = ["NaDiTConfig", "NORM_TYPES", "MLP_TYPES", "WINDOW_METHODS"]

#: Normalisation names the reference accepts; the "fused" ones are apex kernels with the same math.
NORM_TYPES = (None, "layer", "rms", "fusedln", "fusedrms")
MLP_TYPES = ("normal", "swiglu")
WINDOW_METHODS = ("720pwin_by_size_bysize", "720pswin_by_size_bysize")
BLOCK_TYPES = ("mmdit_sr",)
ROPE_TYPES = (None, "mmrope3d")
ADA_TYPES = ("single",)

Triple = tuple[int, int, int]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"NaDiTConfig: {name} must be a positive integer, got {value!r}")
    return int(value)


def _triple(name: str, value: Any) -> Triple:
    if _is_int(value):
        value = (value, value, value)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise ValueError(f"NaDiTConfig: {name} must be an integer or three integers (t, h, w), got {value!r}")
    return tuple(_positive_int(f"{name}[{i}]", v) for i, v in enumerate(value))  # type: ignore[return-value]


def _per_layer(name: str, value: Any, num_layers: int, is_single) -> tuple:
    """Expand a single value to ``num_layers`` entries; a list must have exactly ``num_layers`` entries."""
    if is_single(value):
        return (value,) * num_layers
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"NaDiTConfig: {name} must be one value or a list of num_layers values, got {value!r}")
    if len(value) != num_layers:
        raise ValueError(
            f"NaDiTConfig: {name} has {len(value)} entries but num_layers is {num_layers}; give one value "
            f"or exactly one entry per layer"
        )
    return tuple(value)


def _choice(name: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ValueError(f"NaDiTConfig: unsupported {name}={value!r}; supported: {list(allowed)}")
    return value


@dataclass(frozen=True, init=False)
class NaDiTConfig:
    """Architecture of a SeedVR2 NaDiT (``models/dit_v2``). See :meth:`seedvr2_3b` for the released 3B model.

    Construct with the reference keyword names: ``NaDiTConfig(vid_dim=..., heads=..., ...)``. Unknown keys, missing
    required keys and unsupported values raise ``ValueError`` naming the key.
    """

    vid_in_channels: int = field(metadata={"required": True})
    vid_out_channels: int = field(metadata={"required": True})
    vid_dim: int = field(metadata={"required": True})
    txt_in_dim: int = field(metadata={"required": True})
    txt_dim: int = field(metadata={"required": True})
    emb_dim: int = field(metadata={"required": True})
    heads: int = field(metadata={"required": True})
    head_dim: int = field(metadata={"required": True})
    expand_ratio: int = field(metadata={"required": True})
    norm: Optional[str] = field(metadata={"required": True})
    norm_eps: float = field(metadata={"required": True})
    ada: str = field(metadata={"required": True})
    qk_bias: bool = field(metadata={"required": True})
    qk_norm: Optional[str] = field(metadata={"required": True})
    patch_size: Triple = field(metadata={"required": True})
    num_layers: int = field(metadata={"required": True})
    block_type: tuple[str, ...] = field(metadata={"required": True})
    #: an int n (the first n layers keep separate video/text weights) or one bool per layer
    mm_layers: Union[int, tuple[bool, ...]] = field(metadata={"required": True})
    mlp_type: str = "normal"
    patch_type: str = "v1"
    #: the reference default ("rope3d") is not implemented by dit_v2 itself; every released config uses mmrope3d
    rope_type: Optional[str] = "mmrope3d"
    rope_dim: Optional[int] = None
    window: tuple[Triple, ...] = field(default=None, metadata={"required": True})  # type: ignore[assignment]
    window_method: tuple[str, ...] = field(default=None, metadata={"required": True})  # type: ignore[assignment]
    msa_type: Optional[tuple] = None
    mca_type: Optional[tuple] = None
    txt_in_norm: Optional[str] = None
    txt_in_norm_scale_factor: float = 0.01
    txt_proj_type: Optional[str] = "linear"
    vid_out_norm: Optional[str] = None

    def __init__(self, **kwargs: Any) -> None:
        known = {f.name: f for f in fields(self)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"NaDiTConfig: unknown key(s) {unknown}; known keys are {sorted(known)}")
        for name, f in known.items():
            if name in kwargs:
                value = kwargs[name]
            elif f.metadata.get("required"):
                raise ValueError(f"NaDiTConfig: missing required key {name!r}")
            else:
                value = f.default
            object.__setattr__(self, name, value)
        self._validate()

    # ------------------------------------------------------------------ validation / normalisation
    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _validate(self) -> None:
        for name in ("vid_in_channels", "vid_out_channels", "vid_dim", "emb_dim", "heads", "head_dim", "num_layers"):
            self._set(name, _positive_int(name, getattr(self, name)))
        if not _is_int(self.txt_in_dim):
            raise ValueError(
                f"NaDiTConfig: txt_in_dim must be one positive integer (a list of text encoders is not supported), "
                f"got {self.txt_in_dim!r}"
            )
        self._set("txt_in_dim", _positive_int("txt_in_dim", self.txt_in_dim))
        txt_dim = _positive_int("txt_dim", self.txt_dim)
        if txt_dim != self.vid_dim:
            raise ValueError(
                f"NaDiTConfig: txt_dim={txt_dim} must equal vid_dim={self.vid_dim} (the blocks share modulation "
                f"and, past mm_layers, weights between the two streams)"
            )
        self._set("txt_dim", txt_dim)
        if self.emb_dim != 6 * self.vid_dim:
            raise ValueError(
                f"NaDiTConfig: emb_dim={self.emb_dim} must be 6 * vid_dim = {6 * self.vid_dim} (ada='single' takes "
                f"shift/scale/gate for two sub-layers from the time embedding)"
            )
        if not (isinstance(self.expand_ratio, (int, float)) and not isinstance(self.expand_ratio, bool)
                and self.expand_ratio > 0):
            raise ValueError(f"NaDiTConfig: expand_ratio must be a positive number, got {self.expand_ratio!r}")
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or self.norm_eps <= 0:
            raise ValueError(f"NaDiTConfig: norm_eps must be a positive number, got {self.norm_eps!r}")
        self._set("norm_eps", float(self.norm_eps))
        for name in ("norm", "qk_norm", "vid_out_norm", "txt_in_norm"):
            _choice(name, getattr(self, name), NORM_TYPES)
        _choice("ada", self.ada, ADA_TYPES)
        _choice("mlp_type", self.mlp_type, MLP_TYPES)
        _choice("patch_type", self.patch_type, ("v1",))
        _choice("rope_type", self.rope_type, ROPE_TYPES)
        _choice("txt_proj_type", self.txt_proj_type, (None, "linear"))
        if not isinstance(self.qk_bias, bool):
            raise ValueError(f"NaDiTConfig: qk_bias must be a bool, got {self.qk_bias!r}")
        if not isinstance(self.txt_in_norm_scale_factor, (int, float)):
            raise ValueError(
                f"NaDiTConfig: txt_in_norm_scale_factor must be a number, got {self.txt_in_norm_scale_factor!r}"
            )
        self._set("patch_size", _triple("patch_size", self.patch_size))
        n = self.num_layers

        block_type = _per_layer("block_type", self.block_type, n, lambda v: isinstance(v, str))
        for i, b in enumerate(block_type):
            _choice(f"block_type[{i}]", b, BLOCK_TYPES)
        self._set("block_type", block_type)

        if self.window is None:
            raise ValueError("NaDiTConfig: window is required (the number of windows per axis, e.g. (4, 3, 3))")
        is_one_window = lambda v: _is_int(v) or (  # noqa: E731
            hasattr(v, "__len__") and not isinstance(v, str) and len(v) == 3 and all(_is_int(x) for x in v)
        )
        window = _per_layer("window", self.window, n, is_one_window)
        self._set("window", tuple(_triple(f"window[{i}]", w) for i, w in enumerate(window)))

        if self.window_method is None:
            raise ValueError(f"NaDiTConfig: window_method is required (one of {list(WINDOW_METHODS)} per layer)")
        methods = _per_layer("window_method", self.window_method, n, lambda v: isinstance(v, str))
        for i, m in enumerate(methods):
            _choice(f"window_method[{i}]", m, WINDOW_METHODS)
        self._set("window_method", methods)

        for name in ("msa_type", "mca_type"):
            value = getattr(self, name)
            values = _per_layer(name, value, n, lambda v: v is None or isinstance(v, str))
            if any(v not in (None, "None") for v in values):
                raise ValueError(f"NaDiTConfig: unsupported {name}={value!r}; only None is supported")
            self._set(name, None)

        mm = self.mm_layers
        if _is_int(mm):
            if mm < 0:
                raise ValueError(f"NaDiTConfig: mm_layers must be >= 0, got {mm}")
            self._set("mm_layers", int(mm))
        else:
            flags = _per_layer("mm_layers", mm, n, lambda v: False)
            if not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"NaDiTConfig: mm_layers must be an int or one bool per layer, got {mm!r}")
            self._set("mm_layers", flags)

        if self.rope_type is not None:
            rope_dim = self.rope_dim if self.rope_dim is not None else self.head_dim // 2
            rope_dim = _positive_int("rope_dim", rope_dim)
            self._set("rope_dim", rope_dim)
            if self.rope_freqs_per_axis < 1:
                raise ValueError(f"NaDiTConfig: rope_dim={rope_dim} is too small for 3-axis RoPE (need >= 6)")
            if self.rotary_span > self.head_dim:
                raise ValueError(
                    f"NaDiTConfig: rope_dim={rope_dim} rotates {self.rotary_span} channels, more than "
                    f"head_dim={self.head_dim}"
                )

    # ------------------------------------------------------------------ derived quantities
    def separate_stream_weights(self, layer: int) -> bool:
        """True when block ``layer`` keeps separate video/text weights (keys ``.vid``/``.txt``), else ``.all``."""
        if isinstance(self.mm_layers, int):
            return layer < self.mm_layers
        return bool(self.mm_layers[layer])

    @property
    def rope_freqs_per_axis(self) -> int:
        """Length of each block's RoPE frequency buffer: (rope_dim // 3) // 2."""
        return (self.rope_dim // 3) // 2 if self.rope_type is not None else 0

    @property
    def rotary_span(self) -> int:
        """Channels of each head that RoPE rotates (3 axes x 2 channels per frequency); the rest pass through."""
        return 6 * self.rope_freqs_per_axis

    @property
    def mlp_hidden_dim(self) -> int:
        """Hidden width of the block MLPs (SwiGLU rounds 2/3 of the expanded width up to a multiple of 256)."""
        if self.mlp_type == "swiglu":
            hidden = int(2 * self.vid_dim * self.expand_ratio / 3)
            return 256 * ((hidden + 255) // 256)
        return int(self.vid_dim * self.expand_ratio)

    @property
    def patch_volume(self) -> int:
        t, h, w = self.patch_size
        return t * h * w

    # ------------------------------------------------------------------ constructors
    @classmethod
    def seedvr2_3b(cls) -> "NaDiTConfig":
        """The released SeedVR2 3B DiT (``configs_3b/main.yaml``)."""
        return cls.seedvr2_at_size(
            vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=32, mm_layers=10, rope_dim=128
        )

    @classmethod
    def seedvr2_at_size(
        cls, *, vid_dim: int, txt_in_dim: int, heads: int, head_dim: int, num_layers: int, mm_layers: int,
        rope_dim: int,
    ) -> "NaDiTConfig":
        """The SeedVR2 3B architecture at another width and depth: every other choice as released (33 -> 16
        channels, fused RMS norms, SwiGLU, 1x2x2 patches, (4, 3, 3) windows alternating regular/shifted, mmrope3d).
        """
        return cls(
            vid_in_channels=33,
            vid_out_channels=16,
            vid_dim=vid_dim,
            vid_out_norm="fusedrms",
            txt_in_dim=txt_in_dim,
            txt_in_norm="fusedln",
            txt_dim=vid_dim,
            emb_dim=6 * vid_dim,
            heads=heads,
            head_dim=head_dim,
            expand_ratio=4,
            norm="fusedrms",
            norm_eps=1.0e-05,
            ada="single",
            qk_bias=False,
            qk_norm="fusedrms",
            patch_size=(1, 2, 2),
            num_layers=num_layers,
            mm_layers=mm_layers,
            mlp_type="swiglu",
            msa_type=None,
            block_type="mmdit_sr",
            window=(4, 3, 3),
            window_method=[WINDOW_METHODS[i % 2] for i in range(num_layers)],
            rope_type="mmrope3d",
            rope_dim=rope_dim,
        )

    @classmethod
    def from_metadata(cls, metadata: Union[str, Mapping[str, Any]], key: str = "config") -> "NaDiTConfig":
        """Build from a JSON config string, a config dict, or a safetensors metadata dict holding one under ``key``."""
        if isinstance(metadata, (str, bytes)):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError as err:
                raise ValueError(f"NaDiTConfig.from_metadata: not valid JSON ({err})") from None
        if not isinstance(metadata, Mapping):
            raise ValueError(f"NaDiTConfig.from_metadata: expected a JSON object, got {type(metadata).__name__}")
        if key in metadata and isinstance(metadata[key], (str, bytes, Mapping)) and "vid_dim" not in metadata:
            return cls.from_metadata(metadata[key], key=key)
        return cls(**dict(metadata))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-able values (lists for tuples), using the reference keyword names."""

        def plain(v: Any) -> Any:
            return [plain(x) for x in v] if isinstance(v, tuple) else v

        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}
