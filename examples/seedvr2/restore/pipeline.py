"""SeedVR2 one-step video restoration: encode, one Euler step of the v-prediction DiT, decode.

The math, as SeedVR2 runs it (facts taken from the reference, code written here):

* frames: a clip of ``t > 1`` frames is extended with copies of its last frame to ``4k + 1`` frames (at least 5), the
  causal VAE's natural length, and the result is trimmed back; a single frame (an image) is used as is. winsp never
  splits frames between ranks, so the SP degree does not change this padding;
* encode: the VAE posterior's mode, moved to ``(t, h, w, c)`` and multiplied by the scaling factor 0.9152;
* condition (task ``sr``): the latent followed by one channel of ones -> ``(t, h, w, 17)``;
* diffusion: a linear-interpolation ("lerp") schedule ``x_t = (1 - t/T) x_0 + (t/T) noise`` with ``T = 1000``,
  trailing sampling timesteps (one step: ``t = 1000``), and a model that predicts the velocity ``v = noise - x_0``
  ("v_lerp"). The DiT sees ``noise ++ condition`` flattened to ``[L, 33]`` in ``(t h w)`` order, the text embedding,
  and the timestep; classifier-free guidance at scale 1.0 means the negative prompt is never run;
* the Euler sampler's last step returns the endpoint ``x_0 = (x_t - (t/T) v) / 1`` which at ``t = T`` is
  ``noise - v``;
* decode: divide by the scaling factor, back to ``(c, t, h, w)``, VAE decode, trim to the input's frame count.
  The result is in [-1, 1] space before clipping and colour fix (both done by the caller, see
  :mod:`examples.seedvr2.cli.restore`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch

from ..media.color_fix import apply_color_fix
from ..models.vae.modes import VAE_MODES, make_vae_runner
from . import stage_clock
from .temporal import (
    DEFAULT_BATCH_FRAMES,
    DEFAULT_OVERLAP,
    TemporalBlender,
    causal_frame_count,
    clip_noise,
    temporal_batches,
)

__all__ = [
    "SeedVR2Pipeline",
    "VAE_PARALLEL_MODES",
    "SCALING_FACTOR",
    "NUM_TIMESTEPS",
    "causal_frame_count",
    "pad_to_causal_length",
    "sr_condition",
    "trailing_timesteps",
    "v_lerp_endpoint",
    "euler_v_lerp_sample",
    "NonFiniteOutput",
    "check_finite",
    "FiniteChecks",
]

SCALING_FACTOR = 0.9152
NUM_TIMESTEPS = 1000.0
LATENT_CHANNELS = 16
VAE_PARALLEL_MODES = VAE_MODES


class NonFiniteOutput(ValueError):
    """A stage produced NaN or infinite values (damaged weights, or weights of another model): no output is written
    from it."""


def check_finite(values: torch.Tensor, stage: str) -> torch.Tensor:
    """``values`` unchanged, or :class:`NonFiniteOutput` naming ``stage`` when any value is NaN or infinite (reads the
    answer on the host at once: a device sync; :class:`FiniteChecks` defers it)."""
    checks = FiniteChecks()
    checks.add(values, stage)
    checks.raise_if_any()
    return values


class FiniteChecks:
    """NaN/inf counts of a batch's stages, counted on the device as the stages finish and read on the host once, with
    the batch's result (so the stages themselves never wait for the host)."""

    def __init__(self) -> None:
        self._stages: list[tuple[str, int, torch.Tensor]] = []

    def add(self, values: torch.Tensor, stage: str) -> torch.Tensor:
        """Count ``values``' non-finite elements on their device (no sync); returns ``values``."""
        self._stages.append((stage, values.numel(), (~torch.isfinite(values)).sum()))
        return values

    def raise_if_any(self) -> None:
        """:class:`NonFiniteOutput` naming the first stage with a non-finite value (one host read of all counts)."""
        if not self._stages:
            return
        counts = torch.stack([bad.to(self._stages[0][2].device) for _, _, bad in self._stages]).tolist()
        for (stage, numel, _), bad in zip(self._stages, counts, strict=True):
            if bad:
                raise NonFiniteOutput(f"{stage} produced {bad} non-finite values (NaN or inf) of {numel}: its "
                                      f"weights are damaged or are not this model's; nothing was written")


# ---- pure functions -----------------------------------------------------------------------------------------------


def pad_to_causal_length(video: torch.Tensor, temporal_factor: int = 4) -> torch.Tensor:
    """Append copies of the last frame of ``video [c, t, h, w]`` up to :func:`causal_frame_count` frames."""
    t = video.shape[1]
    extra = causal_frame_count(t, temporal_factor) - t
    if extra == 0:
        return video
    return torch.cat([video, video[:, -1:].expand(-1, extra, -1, -1)], dim=1)


def sr_condition(latent: torch.Tensor) -> torch.Tensor:
    """The ``sr`` task condition of a ``(t, h, w, c)`` latent: the latent, then one channel of ones."""
    return torch.cat([latent, latent.new_ones(latent.shape[:-1] + (1,))], dim=-1)


def trailing_timesteps(steps: int, T: float = NUM_TIMESTEPS, shift: float = 1.0) -> torch.Tensor:
    """``steps`` sampling timesteps spaced evenly from ``T`` down, excluding 0 ("trailing"), with an SD3-style shift."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    u = 1.0 - torch.arange(steps, dtype=torch.float64) / steps  # 1, 1 - 1/n, ..., 1/n
    u = shift * u / (1.0 + (shift - 1.0) * u)
    return (u * T).to(torch.float32)


def v_lerp_endpoint(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor | float, T: float = NUM_TIMESTEPS):
    """``(x_0, x_T)`` implied by velocity ``v = x_T - x_0`` at ``x_t = (1 - t/T) x_0 + (t/T) x_T``."""
    b = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device) / T
    a = 1.0 - b
    return (x_t - b * v) / (a + b), (x_t + a * v) / (a + b)


def euler_v_lerp_sample(
    noise: torch.Tensor,
    predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    timesteps: torch.Tensor,
    T: float = NUM_TIMESTEPS,
) -> torch.Tensor:
    """Integrate the lerp flow from ``noise`` at ``timesteps[0]`` to ``x_0`` with Euler steps.

    ``predict(x_t, t)`` returns the velocity. Between timesteps the sampler re-noises its ``x_0`` estimate to the
    next timestep; after the last timestep it returns the ``x_0`` estimate (one step: ``noise - v`` at ``t = T``).
    """
    x = noise
    for i, t in enumerate(timesteps):
        x_0, x_T = v_lerp_endpoint(x, predict(x, t), t, T)
        if i + 1 == len(timesteps):
            return x_0
        s = timesteps[i + 1] / T
        x = (1.0 - s) * x_0 + s * x_T
    raise ValueError("timesteps must not be empty")


def released_models_on_meta(model: str, dtype: torch.dtype):
    """The released ``model``'s DiT (``"3b"`` or ``"7b"``) and the VAE, built on the meta device in ``dtype`` for a
    strict checkpoint load (a bf16 checkpoint loaded into a bf16 model is never cast up on the way)."""
    from ..models.dit import NaDiTConfig, SeedVR2NaDiT
    from ..models.vae import CausalVideoVAE, VideoVAEConfig

    with torch.device("meta"):
        return SeedVR2NaDiT(NaDiTConfig.released(model)).to(dtype), CausalVideoVAE(VideoVAEConfig.seedvr2()).to(dtype)


class SeedVR2Pipeline:
    """SeedVR2's one-step restorer over a DiT (:class:`~examples.seedvr2.models.dit.SeedVR2NaDiT`) and a VAE
    (:class:`~examples.seedvr2.models.vae.CausalVideoVAE`), window-parallel over an SP group.

    Args:
        dit, vae: the models, already on their device and in their compute dtype (inputs are cast to them).
        vae_parallel: how the SP ranks share the VAE: ``"replicated"`` (every rank runs the whole VAE; no
            communication), ``"height"`` (every rank encodes/decodes a band of rows, see
            :mod:`examples.seedvr2.models.vae.sharding`), ``"tiled"`` (the VAE package's tiled mode), or ``"wavefront"``
            (the ranks run consecutive causal chunks at once, with the height split too where that is faster; see
            :mod:`examples.seedvr2.models.vae.wavefront`).
        group: the SP group (a :class:`winsp.comm.group.SPGroup`, a ``torch.distributed`` process group, a 1-D
            ``DeviceMesh`` or ``mesh["sp"]`` of a larger one, or None: ``parallel_config.mesh`` if set, else a single
            rank). The DiT's window runtime is built over it with ``ulysses_degree`` = its size.
        parallel_config: optional :class:`winsp.DiffusionParallelConfig` (e.g. to pick the attention backend); its
            ``ulysses_degree`` must equal the group size.
        steps: Euler steps (SeedVR2 is trained for 1).
        vae_temporal_chunk: frames per causal VAE chunk (the reference's slicing, 4), or None for whole clips.
        vae_tile_size, vae_tile_overlap: tile and overlap in pixels for ``vae_parallel="tiled"`` (every rank runs
            all tiles; tiling bounds memory, it is approximate, see :mod:`examples.seedvr2.models.vae.tiling`).
        shard_weights: hold 1/P of the DiT's block weights on each of the group's P ranks and gather each block
            just before it runs, the next one prefetched (see :mod:`examples.seedvr2.weights.sharded`); the output is
            bitwise that of replicated weights. A DiT loaded sharded (``from_checkpoints(..., shard_weights=True)``)
            stays as it is; a whole one keeps this rank's chunk of each block and drops the rest.

    Every rank must pass the same inputs (and, when noise is drawn, identically seeded generators); every rank
    gets the full result.
    """

    def __init__(
        self,
        dit: torch.nn.Module,
        vae: torch.nn.Module,
        vae_parallel: str = "replicated",
        *,
        group=None,
        parallel_config=None,
        steps: int = 1,
        scaling_factor: float = SCALING_FACTOR,
        vae_temporal_chunk: Optional[int] = 4,
        vae_tile_size: int = 256,
        vae_tile_overlap: int = 64,
        shard_weights: bool = False,
    ) -> None:
        import winsp
        from winsp.comm.group import SPGroup

        if vae_parallel not in VAE_PARALLEL_MODES:
            raise ValueError(f"vae_parallel must be one of {VAE_PARALLEL_MODES}, got {vae_parallel!r}")
        self.dit, self.vae, self.vae_parallel = dit, vae, vae_parallel
        if group is None and getattr(parallel_config, "mesh", None) is not None:
            group = parallel_config.mesh
        self.group = group if isinstance(group, SPGroup) else SPGroup(group)
        from ..weights.sharded import shard_loaded_dit, sharded_weights_of

        if shard_weights:
            shard_loaded_dit(dit, self.group)
        self.weight_shards = sharded_weights_of(dit)
        if self.weight_shards is not None and self.weight_shards.group.size != self.group.size:
            raise ValueError(f"the DiT's weights are sharded over {self.weight_shards.group.size} ranks but the "
                             f"pipeline's group has {self.group.size}; shard them over the same group")
        if parallel_config is None:
            parallel_config = winsp.DiffusionParallelConfig(ulysses_degree=self.group.size)
        self.runtime = dit.build_runtime(parallel_config=parallel_config, group=self.group)
        self.timesteps = trailing_timesteps(steps)
        self.scaling_factor = float(scaling_factor)
        vae.set_temporal_chunking(vae_temporal_chunk)
        self.vae_tile_size, self.vae_tile_overlap = vae_tile_size, vae_tile_overlap
        # height sharding over one rank is the whole frame: run it as such
        mode = "replicated" if vae_parallel in ("height", "wavefront") and self.group.size == 1 else vae_parallel
        self.vae_splits: set = set()  # the wavefront's (encode, decode) splits used so far
        self.vae_runner = make_vae_runner(
            mode, vae, group=self.group, tile_size=vae_tile_size, overlap=vae_tile_overlap
        )

    @classmethod
    def from_checkpoints(
        cls, dit_checkpoint=None, vae_checkpoint=None, *, model: str = "3b", device="cpu",
        dtype: torch.dtype = torch.float32, report: Optional[Callable[[str], None]] = None, weights: str = "stored",
        shard_weights: bool = False, **kwargs,
    ) -> "SeedVR2Pipeline":
        """The pipeline of the released ``model`` (``"3b"`` or ``"7b"``): its DiT and the VAE built on the meta device
        in ``dtype``, loaded strictly from the two checkpoints (``report`` gets the loaders' one-line cast notes), on
        ``device``; ``weights`` (``stored``, ``fp8``, ``compute``) says which DiT Linear weights stay packed (see
        :mod:`~examples.seedvr2.checkpoints.dtypes`). With neither checkpoint: the tiny demo weights of that
        architecture (:mod:`~examples.seedvr2.models.demo`). ``shard_weights``: each rank of ``group`` reads only its
        chunk of the DiT's blocks from the file (see :mod:`~examples.seedvr2.weights.sharded`). ``kwargs`` go to the
        constructor (``vae_parallel``, ``group``, ...)."""
        from ..models.dit import load_dit_checkpoint
        from ..models.vae import load_vae_checkpoint

        if (dit_checkpoint is None) != (vae_checkpoint is None):
            raise ValueError("give both dit_checkpoint and vae_checkpoint, or neither for the demo weights")
        if dit_checkpoint is None:
            from ..models.demo import demo_models

            dit, vae = demo_models(device, dtype, model=model)
            return cls(dit, vae, shard_weights=shard_weights, **kwargs)
        dit, vae = released_models_on_meta(model, dtype)
        if shard_weights:
            from ..weights.sharded import load_sharded_dit

            load_sharded_dit(dit, dit_checkpoint, kwargs.get("group"), weights=weights, report=report, device=device)
        else:
            load_dit_checkpoint(dit, dit_checkpoint, report=report, weights=weights)
        load_vae_checkpoint(vae, vae_checkpoint, report=report)
        return cls(dit.to(device).eval(), vae.to(device).eval(), **kwargs)

    # ---- properties -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.dit.parameters()).device

    @property
    def txt_in_dim(self) -> int:
        return self.dit.config.txt_in_dim

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent row/column (8)."""
        return self.vae.config.spatial_downsample_factor

    @property
    def temporal_factor(self) -> int:
        """Frames per latent frame (4), past the first frame."""
        return self.vae.config.temporal_downsample_factor

    def describe(self) -> str:
        """One line: the DiT's execution path and how the VAE runs."""
        vae = {"replicated": "VAE replicated", "height": f"VAE height-sharded x{self.group.size}",
               "tiled": f"VAE tiled ({self.vae_tile_size}px tiles)",
               "wavefront": f"VAE wavefront x{self.group.size}"}[self.vae_parallel]
        if self.vae_parallel == "wavefront" and self.vae_splits:  # what the cost model chose for the clips that ran
            from ..models.vae.wavefront import describe_splits

            chosen = sorted({describe_splits(*splits) for splits in self.vae_splits})
            vae += f" ({'; '.join(chosen)})"
        weights = ("" if self.weight_shards is None else
                   f"; DiT blocks sharded x{self.group.size} ({self.weight_shards.shard_bytes / 2**30:.2f} GiB a rank)")
        return f"{self.runtime.describe(self.device)}; {vae}{weights}"

    def _note_vae_splits(self, frames: int, latent_rows: int) -> None:
        """Remember the wavefront's (encode, decode) splits for a padded clip of ``frames`` frames (for describe)."""
        if self.vae_parallel == "wavefront" and self.group.size > 1:
            from ..models.vae.wavefront import clip_splits

            chunk = self.vae.temporal_chunk
            self.vae_splits.add(clip_splits(self.group.size, frames, latent_rows, temporal_chunk=chunk,
                                            temporal_factor=self.temporal_factor))

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """The ``(t', h', w', 16)`` latent (and noise) shape of a clip of this size."""
        frames = causal_frame_count(num_frames, self.temporal_factor)
        f = self.spatial_factor
        return (1 + (frames - 1) // self.temporal_factor, height // f, width // f, self.vae.config.latent_channels)

    # ---- stages -----------------------------------------------------------------------------------------------
    def check_video(self, video: torch.Tensor) -> None:
        """``ValueError`` unless ``video`` is ``[3, t, h, w]`` with h, w multiples of 16 (latent sides even)."""
        if not isinstance(video, torch.Tensor) or video.dim() != 4 or video.shape[0] != 3:
            shape = list(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
            raise ValueError(f"video must be a [3, t, h, w] tensor, got {shape}")
        multiple = self.spatial_factor * self.dit.config.patch_size[1]
        t, h, w = video.shape[1:]
        if t < 1 or h < multiple or w < multiple or h % multiple or w % multiple:
            raise ValueError(
                f"video is {t} frames of {h}x{w}; it needs >= 1 frame and height/width that are positive "
                f"multiples of {multiple} (crop or resize first, see examples.seedvr2.media)"
            )

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """``[3, t, h, w]`` in [-1, 1] -> scaled latent ``(t', h', w', 16)`` (float32), frames padded to 4k + 1."""
        self.check_video(video)
        x = pad_to_causal_length(video, self.temporal_factor)[None].to(self.device)
        self._note_vae_splits(x.shape[2], x.shape[3] // self.spatial_factor)
        latent = self.vae_runner.encode(x)
        return latent[0].permute(1, 2, 3, 0).float() * self.scaling_factor

    def denoise(
        self,
        latent: torch.Tensor,
        txt: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        trace: Optional[dict] = None,
    ) -> torch.Tensor:
        """Sample the restored latent ``(t', h', w', 16)`` conditioned on ``latent`` and text ``txt [L, txt_in_dim]``.

        ``noise`` (same shape as ``latent``) defaults to a standard normal draw from ``generator`` (on the CPU, so
        equally seeded generators give the same noise on every rank and device). ``trace`` (a dict) receives the
        condition, the DiT input/output of the first step and the timesteps.
        """
        if latent.dim() != 4:
            raise ValueError(f"latent must be (t, h, w, c), got shape {list(latent.shape)}")
        if txt.dim() != 2 or txt.shape[1] != self.txt_in_dim:
            raise ValueError(f"txt must be [L, {self.txt_in_dim}] (the DiT's txt_in_dim), got {list(txt.shape)}")
        if txt.shape[0] < 1:
            raise ValueError("txt must have at least one token")
        if noise is None:
            noise = torch.randn(tuple(latent.shape), generator=generator, dtype=torch.float32)
        elif tuple(noise.shape) != tuple(latent.shape):
            raise ValueError(f"noise must have the latent's shape {list(latent.shape)}, got {list(noise.shape)}")
        device = self.device
        latent, noise, txt = latent.to(device), noise.to(device, torch.float32), txt.to(device)
        condition = sr_condition(latent.float())
        # shapes are host values the DiT plans with: built on the host, never read back from the device
        vid_shape = torch.tensor([list(latent.shape[:3])], dtype=torch.long)
        txt_shape = torch.tensor([[txt.shape[0]]], dtype=torch.long)

        def predict(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            vid = torch.cat([x_t, condition], dim=-1).reshape(-1, condition.shape[-1] + x_t.shape[-1])
            timestep = t.reshape(1).to(device)
            with torch.no_grad():
                v = self.dit(vid, txt, vid_shape, txt_shape, timestep).float()
            if trace is not None and "dit_vid" not in trace:
                trace.update(condition=condition, dit_vid=vid, timestep=timestep, velocity=v)
            return v.reshape(x_t.shape)

        return euler_v_lerp_sample(noise, predict, self.timesteps.to(device))

    def decode(self, latent: torch.Tensor, num_frames: int) -> torch.Tensor:
        """Scaled latent ``(t', h', w', 16)`` -> ``[3, num_frames, h, w]`` float32 (the padding frames dropped)."""
        z = (latent.to(self.device).float() / self.scaling_factor).permute(3, 0, 1, 2)[None]
        video = self.vae_runner.decode(z)
        return video[0, :, :num_frames].float()

    def restore(
        self,
        video: torch.Tensor,
        txt: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        trace: Optional[dict] = None,
    ) -> torch.Tensor:
        """Restore ``video [3, t, h, w]`` in [-1, 1]; returns ``[3, t, h, w]`` in [-1, 1] space, unclipped.

        ``noise`` is the ``(t', h', w', 16)`` latent noise (see :meth:`latent_shape`), drawn from ``generator`` when
        not given. ``trace`` (a dict) receives the intermediates (``latent``, ``condition``, ``dit_vid``,
        ``timestep``, ``velocity``, ``restored_latent``).
        """
        restored, checks = self.restore_on_device(video, txt, noise=noise, generator=generator, trace=trace)
        checks.raise_if_any()
        return restored

    def restore_on_device(
        self,
        video: torch.Tensor,
        txt: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        trace: Optional[dict] = None,
    ) -> tuple[torch.Tensor, FiniteChecks]:
        """:meth:`restore`'s compute: encode, denoise and decode on the device without reading a value back; returns
        the restored video and the stages' pending :class:`FiniteChecks` (``raise_if_any`` reads them: the batch's one
        host sync, taken where its result leaves the device anyway)."""
        checks = FiniteChecks()
        with stage_clock.stage("VAE encode"):
            latent = checks.add(self.encode(video), "the VAE encoder")
        with stage_clock.stage("DiT"):
            restored = checks.add(self.denoise(latent, txt, noise=noise, generator=generator, trace=trace), "the DiT")
        if trace is not None:
            trace.update(latent=latent, restored_latent=restored)
        with stage_clock.stage("VAE decode"):
            return checks.add(self.decode(restored, video.shape[1]), "the VAE decoder"), checks

    # ---- long clips -------------------------------------------------------------------------------------------
    def restore_batch(
        self, video: torch.Tensor, txt: torch.Tensor, start: int, seed: int, color_fix: str | bool = "none"
    ) -> torch.Tensor:
        """Restore the temporal batch ``video [3, t, h, w]`` that begins at clip frame ``start``, with noise keyed by
        its position in the clip (:func:`~examples.seedvr2.restore.temporal.clip_noise`), then the ``color_fix``
        colour fix towards the input (``"wavelet"``, ``"adain"``, ``"lab"`` or ``"none"``, see
        :mod:`~examples.seedvr2.media.color_fix`; True means wavelet, False none). Any rank (any group) restoring this
        batch gets the same result."""
        t, h, w = video.shape[1:]
        f = self.spatial_factor
        noise = clip_noise(seed, start, t, (h // f, w // f), self.vae.config.latent_channels, self.temporal_factor)
        restored = self.restore(video, txt, noise=noise)
        return self._color_fix(color_fix, restored, video)

    @staticmethod
    def _color_fix(color_fix: str | bool, restored: torch.Tensor, video: torch.Tensor) -> torch.Tensor:
        """``restored [3, t, h, w]`` colour-fixed towards ``video`` (frame by frame)."""
        method = ("wavelet" if color_fix else "none") if isinstance(color_fix, bool) else color_fix
        if method == "none":
            return restored
        with stage_clock.stage("colour fix"):
            reference = video.to(restored.device).transpose(0, 1)
            return apply_color_fix(method, restored.transpose(0, 1), reference).transpose(0, 1)

    def restore_batch_frames(
        self, video: torch.Tensor, txt: torch.Tensor, start: int, seed: int, color_fix: str | bool,
        finish: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """:meth:`restore_batch`, then ``finish`` (e.g. the conversion to 8-bit output frames): ``[3, t', h, w]``
        float frames -> a tensor of ``t'`` rows (frames first). Returns ``finish`` of the whole batch on every rank.

        The colour fix and ``finish`` work frame by frame, so the group's ranks share them: each takes a contiguous
        run of the batch's frames, and the finished rows (8-bit frames: a quarter of the float32 bytes) are gathered.
        The result is the same as fixing and finishing the whole batch on one rank (each frame's arithmetic does not
        depend on the others; tested bit for bit). ``SEEDVR2_SERIAL_IO=1`` does it all on every rank instead.
        """
        from winsp.comm.spatial import band_offsets, band_sizes

        from .overlap import serial_io

        group = self.group
        if group.is_single or serial_io():
            fixed = self.restore_batch(video, txt, start, seed, color_fix)
            with stage_clock.stage("to frames"):
                return finish(fixed)
        restored = self.restore_batch(video, txt, start, seed, "none")
        t = video.shape[1]
        sizes = band_sizes(t, group.size)
        first = band_offsets(sizes)[group.rank]
        frames = slice(first, first + sizes[group.rank])
        fixed = self._color_fix(color_fix, restored[:, frames], video[:, frames])
        with stage_clock.stage("to frames"):
            mine = finish(fixed)
        with stage_clock.stage("frames gather"):
            return group.all_gather_rows(mine.to(restored.device), sizes).to(mine.device)

    def restore_stream(
        self,
        frames: Iterable[torch.Tensor],
        txt: torch.Tensor,
        *,
        batch_frames: int = DEFAULT_BATCH_FRAMES,
        overlap: int = DEFAULT_OVERLAP,
        seed: int = 0,
        color_fix: str | bool = "none",
    ) -> Iterator[torch.Tensor]:
        """Restore a clip of any length from an iterator of frames ``[3, h, w]`` (in [-1, 1]), yielding restored
        frames ``[3, h, w]`` in order as soon as they are final.

        The clip is cut into temporal batches of ``batch_frames`` (4n + 1) frames sharing ``overlap`` frames, which
        are cross-faded (see :mod:`examples.seedvr2.restore.temporal`). At most one batch of input, its result and
        ``overlap`` held frames are alive at a time, so memory does not depend on the clip's length.
        """
        blender = TemporalBlender()
        for batch, clip in temporal_batches(frames, batch_frames, overlap):
            restored = self.restore_batch(clip.transpose(0, 1), txt, batch.start, seed, color_fix)
            yield from blender.push(batch, restored.transpose(0, 1), overlap)
        yield from blender.finish()
