"""``NaDiTConfig``: the constructor arguments of SeedVR2's NaDiT, validated and normalised once.

The field names are the reference constructors' keyword names (as stored in the ``config`` metadata of the golden
files and in ``configs_3b/main.yaml`` / ``configs_7b/main.yaml``), so a reference config dict can be passed straight
in. Per-layer options given as one value (``window``, ``window_method``, ``block_type``) are expanded to one entry per
layer, and lists become tuples so the config is hashable.

SeedVR2 ships two DiT classes with different keyword sets. A config with ``qk_rope`` is the 7B's (``models/dit``);
one without is the 3B's (``models/dit_v2``, where ``mm_layers`` is required). Mixing keys of the two is refused. The
architectural differences the blocks act on are derived here, one property each: :meth:`NaDiTConfig.stream_sharing`,
:attr:`NaDiTConfig.last_layer_video_only` and :attr:`NaDiTConfig.rope_kind`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

__all__ = [
    "NaDiTConfig", "StreamSharing", "RELEASED_MODELS", "NORM_TYPES", "MLP_TYPES", "WINDOW_METHODS", "ARCHITECTURES",
]

#: Normalisation names the reference accepts; the "fused" ones are apex kernels with the same math.
NORM_TYPES = (None, "layer", "rms", "fusedln", "fusedrms")
MLP_TYPES = ("normal", "swiglu")
WINDOW_METHODS = ("720pwin_by_size_bysize", "720pswin_by_size_bysize")
BLOCK_TYPES = ("mmdit_sr",)
ROPE_TYPES = (None, "mmrope3d")
ADA_TYPES = ("single",)
#: names of the released SeedVR2 DiTs, see :meth:`NaDiTConfig.released`
RELEASED_MODELS = ("3b", "7b")
#: reference module of each architecture: "dit_v2" is the 3B's NaDiT, "dit" the 7B's
ARCHITECTURES = ("dit_v2", "dit")

#: keys only the 3B's constructor (models/dit_v2) has, with the value that means "not given"
_DIT_V2_ONLY = {
    "mm_layers": None, "patch_type": "v1", "rope_type": None, "rope_dim": None, "msa_type": None, "mca_type": None,
    "txt_in_norm": None, "txt_in_norm_scale_factor": 0.01, "txt_proj_type": "linear", "vid_out_norm": None,
}
#: keys only the 7B's constructor (models/dit) has, with the value that means "not given"
_DIT_ONLY = {"qk_rope": None, "shared_qkv": None, "shared_mlp": None, "temporal_window_size": None,
             "temporal_shifted": None}

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


def _is_given(value: Any, neutral: Any) -> bool:
    # float defaults compare by value; anything else must equal the neutral value exactly
    return not (value is neutral or value == neutral)


@dataclass(frozen=True)
class StreamSharing:
    """Which sub-layers of one block use one module for both streams (checkpoint key ``.all``) instead of two
    (``.vid``/``.txt``): the q/k/v and output projections, the per-head q/k norms, the MLP and the ADA modulation."""

    qkv: bool
    qk_norm: bool
    mlp: bool
    ada: bool


def _released_common(vid_dim: int, txt_in_dim: int, heads: int, head_dim: int, num_layers: int) -> dict[str, Any]:
    """The keywords both released configs give alike: 33 -> 16 channels, fused RMS norms, 1x2x2 patches, (4, 3, 3)
    windows alternating regular/shifted, text projected to the video width."""
    return dict(
        vid_in_channels=33, vid_out_channels=16, vid_dim=vid_dim, txt_in_dim=txt_in_dim, txt_dim=vid_dim,
        emb_dim=6 * vid_dim, heads=heads, head_dim=head_dim, expand_ratio=4, norm="fusedrms", norm_eps=1e-5,
        ada="single", qk_bias=False, qk_norm="fusedrms", patch_size=(1, 2, 2), num_layers=num_layers,
        block_type="mmdit_sr", window=(4, 3, 3), window_method=[WINDOW_METHODS[i % 2] for i in range(num_layers)],
    )


@dataclass(frozen=True, init=False)
class NaDiTConfig:
    """Architecture of a SeedVR2 NaDiT: the 3B's (``models/dit_v2``, :meth:`seedvr2_3b`) or the 7B's (``models/dit``,
    :meth:`seedvr2_7b`).

    Construct with the reference keyword names: ``NaDiTConfig(vid_dim=..., heads=..., ...)``. Unknown keys, missing
    required keys, keys of the other architecture and unsupported values raise ``ValueError`` naming the key.
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
    #: (3B) an int n (the first n layers keep separate video/text weights) or one bool per layer; required there
    mm_layers: Union[int, tuple[bool, ...], None] = None
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
    #: (7B) window-local 3D RoPE on video q/k over head_dim // 2 channels; its presence selects the 7B architecture
    qk_rope: Optional[bool] = None
    #: (7B) one q/k/v + output projection for both streams (False in the release)
    shared_qkv: Optional[bool] = None
    #: (7B) one MLP for both streams (False in the release)
    shared_mlp: Optional[bool] = None
    #: (7B) options of other block types than "mmdit_sr"; accepted with their neutral values only
    temporal_window_size: Optional[int] = None
    temporal_shifted: Optional[bool] = None

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
        self._check_architecture_keys(kwargs)
        self._validate()

    def _check_architecture_keys(self, given: Mapping[str, Any]) -> None:
        """Refuse keys of the other architecture; fill the chosen one's defaults (and its required keys)."""
        if self.qk_rope is None:  # the 3B's models/dit_v2
            stray = sorted(k for k, neutral in _DIT_ONLY.items() if k in given and _is_given(given[k], neutral))
            if stray:
                raise ValueError(
                    f"NaDiTConfig: key(s) {stray} belong to the 7B's NaDiT (models/dit), which also requires qk_rope; "
                    f"give qk_rope=True for the 7B architecture, or drop them for the 3B's"
                )
            if self.mm_layers is None:
                raise ValueError("NaDiTConfig: missing required key 'mm_layers' (the 3B's NaDiT, models/dit_v2; "
                                 "give qk_rope instead for the 7B's)")
            return
        stray = sorted(k for k, neutral in _DIT_V2_ONLY.items() if k in given and _is_given(given[k], neutral))
        if stray:
            raise ValueError(
                f"NaDiTConfig: key(s) {stray} belong to the 3B's NaDiT (models/dit_v2) and cannot be combined with "
                f"qk_rope (the 7B's, models/dit)"
            )
        if not isinstance(self.qk_rope, bool):
            raise ValueError(f"NaDiTConfig: qk_rope must be a bool, got {self.qk_rope!r}")
        for name in ("shared_qkv", "shared_mlp"):
            value = getattr(self, name)
            if value is None:
                self._set(name, False)  # the reference default
            elif not isinstance(value, bool):
                raise ValueError(f"NaDiTConfig: {name} must be a bool, got {value!r}")
        if self.temporal_window_size is not None:
            raise ValueError(f"NaDiTConfig: unsupported temporal_window_size={self.temporal_window_size!r}; only "
                             f"None is supported (it is used by block types other than 'mmdit_sr')")
        if self.temporal_shifted not in (None, False):
            raise ValueError(f"NaDiTConfig: unsupported temporal_shifted={self.temporal_shifted!r}; only False is "
                             f"supported (it is used by block types other than 'mmdit_sr')")
        self._set("temporal_shifted", False)
        for name, neutral in _DIT_V2_ONLY.items():
            self._set(name, neutral)  # the 3B's defaults mean nothing here (its rope_type default is "mmrope3d")

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
        if mm is None:
            pass  # the 7B's: sharing comes from shared_qkv / shared_mlp
        elif _is_int(mm):
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
            self._set("rope_dim", _positive_int("rope_dim", rope_dim))
        if self.rope_kind is not None:
            if self.rope_freqs_per_axis < 1:
                raise ValueError(
                    f"NaDiTConfig: RoPE over {self.rope_input_dim} channels is too small for 3 axes (need >= 6; "
                    f"{'rope_dim' if self.rope_type is not None else 'head_dim // 2'} sets it)"
                )
            if self.rotary_span > self.head_dim:
                raise ValueError(
                    f"NaDiTConfig: rope_dim={self.rope_input_dim} rotates {self.rotary_span} channels, more than "
                    f"head_dim={self.head_dim}"
                )

    # ------------------------------------------------------------------ derived quantities
    @property
    def architecture(self) -> str:
        """``"dit_v2"`` (the 3B's reference module) or ``"dit"`` (the 7B's); chosen by the presence of ``qk_rope``."""
        return "dit_v2" if self.qk_rope is None else "dit"

    def separate_stream_weights(self, layer: int) -> bool:
        """(3B) True when block ``layer`` keeps separate video/text weights (``.vid``/``.txt``), else ``.all``."""
        if self.mm_layers is None:
            raise ValueError("separate_stream_weights needs mm_layers (the 3B's); use stream_sharing(layer)")
        if isinstance(self.mm_layers, int):
            return layer < self.mm_layers
        return bool(self.mm_layers[layer])

    def stream_sharing(self, layer: int) -> StreamSharing:
        """Which sub-layers of block ``layer`` share one module between video and text.

        3B: every sub-layer of a block past ``mm_layers``. 7B: the projections per ``shared_qkv``, the MLP per
        ``shared_mlp``; q/k norms and modulation always keep one module per stream.
        """
        if self.architecture == "dit_v2":
            shared = not self.separate_stream_weights(layer)
            return StreamSharing(qkv=shared, qk_norm=shared, mlp=shared, ada=shared)
        return StreamSharing(qkv=self.shared_qkv, qk_norm=False, mlp=self.shared_mlp, ada=False)

    @property
    def last_layer_video_only(self) -> bool:
        """True (3B) when the last block has no text modulation or text MLP; the 7B's last block is complete."""
        return self.architecture == "dit_v2"

    @property
    def rope_kind(self) -> Optional[str]:
        """Which RoPE the attention applies, or None.

        ``"mmrope3d"`` (3B): video and text, integer positions (window-local video coordinates after the text),
        "language" frequencies. ``"rope3d"`` (7B ``qk_rope``): video only, each window axis mapped onto [-1, 1],
        "pixel" frequencies.
        """
        if self.architecture == "dit":
            return "rope3d" if self.qk_rope else None
        return self.rope_type

    @property
    def rope_input_dim(self) -> int:
        """Channels the RoPE is defined over: ``rope_dim`` (3B) or ``head_dim // 2`` (7B); 0 without RoPE."""
        if self.rope_kind is None:
            return 0
        return self.rope_dim if self.architecture == "dit_v2" else self.head_dim // 2

    @property
    def rope_freqs_per_axis(self) -> int:
        """Length of each block's RoPE frequency buffer: (rope input dim // 3) // 2."""
        return (self.rope_input_dim // 3) // 2

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
    def released(cls, model: str) -> "NaDiTConfig":
        """The released DiT named ``model``: ``"3b"`` (:meth:`seedvr2_3b`) or ``"7b"`` (:meth:`seedvr2_7b`)."""
        if model == "3b":
            return cls.seedvr2_3b()
        if model == "7b":
            return cls.seedvr2_7b()
        raise ValueError(f"unknown SeedVR2 model {model!r}; released models: {list(RELEASED_MODELS)}")

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
            **_released_common(vid_dim, txt_in_dim, heads, head_dim, num_layers),
            vid_out_norm="fusedrms",
            txt_in_norm="fusedln",
            mm_layers=mm_layers,
            mlp_type="swiglu",
            msa_type=None,
            rope_type="mmrope3d",
            rope_dim=rope_dim,
        )

    @classmethod
    def seedvr2_7b(cls) -> "NaDiTConfig":
        """The released SeedVR2 7B DiT (``configs_7b/main.yaml``)."""
        return cls.seedvr2_7b_at_size(vid_dim=3072, txt_in_dim=5120, heads=24, head_dim=128, num_layers=36)

    @classmethod
    def seedvr2_7b_at_size(
        cls, *, vid_dim: int, txt_in_dim: int, heads: int, head_dim: int, num_layers: int
    ) -> "NaDiTConfig":
        """The SeedVR2 7B architecture at another width and depth: every other choice as released (the 3B's channels,
        norms, patches and windows; GELU MLP, separate stream weights, video-only window RoPE via ``qk_rope``).
        """
        return cls(
            **_released_common(vid_dim, txt_in_dim, heads, head_dim, num_layers),
            qk_rope=True,
            shared_mlp=False,
            shared_qkv=False,
            mlp_type="normal",
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
        """The config as plain JSON-able values (lists for tuples), using the keyword names of its architecture's
        reference class (the other architecture's keys are left out, so the dict builds the same config again)."""

        def plain(v: Any) -> Any:
            return [plain(x) for x in v] if isinstance(v, tuple) else v

        foreign = _DIT_ONLY if self.architecture == "dit_v2" else _DIT_V2_ONLY
        return {f.name: plain(getattr(self, f.name)) for f in fields(self) if f.name not in foreign}
