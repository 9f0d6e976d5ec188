"""``SeedVR2NaDiT``: SeedVR2's native-resolution diffusion transformer on a ``winsp`` window runtime.

Data flow of one forward (P ranks, P = 1 without :meth:`SeedVR2NaDiT.build_runtime`):
  1. validate the packed inputs; patchify every sample into canonical post-patch rows (one precomputed gather);
  2. ``req.scatter``: keep this rank's rows of layer 0's window layout; project them (tokenwise);
  3. per block: ``req.to_layer`` (a redistribution only where the layout changes), then the block, whose attention
     goes through ``req.attention`` (window attention + replicated text reduction);
  4. output norm, effective output modulation and projection on local rows; ``req.gather``; un-patchify.
The model never talks to ``torch.distributed``; everything that crosses ranks is in ``winsp``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from functools import partial
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn

import winsp
from winsp.utils.compile import planning
from winsp.utils.phases import plans

from .block import NaDiTBlock
from .config import NaDiTConfig
from .layers import Modulation, TimeEmbedding, make_norm
from .patch import PatchIn, PatchOut, PatchPlan, plan_patches
from .rope import RotaryEmbedding3d

__all__ = ["SeedVR2NaDiT", "ForwardContext"]

_PATCH_PLAN_CACHE_SIZE = 16


class ForwardContext:
    """Per-forward state the blocks read: embeddings, row->sample maps and RoPE tables, plus the winsp request.

    Built once per forward, before any block runs (the planning phase, which torch.compile leaves alone): RoPE tables
    depend on the layout (window-local coordinates) and on a block's frequency buffer, so they are made once per
    (layout, frequency group) and shared by every block with the same pair. ``rope_groups[i]`` names block i's group of
    equal frequency buffers (see :meth:`SeedVR2NaDiT.rope_groups`). :meth:`enter_layer` then points the per-layer
    attributes at layer i's tensors, so a block sees only tensors and never an index it would specialise on.
    """

    def __init__(self, request: "winsp.runtime.WindowRequest", emb_slots: Optional[Tensor], text_lengths: Sequence[int],
                 ropes: Sequence[Optional[RotaryEmbedding3d]], head_dim: int, rope_groups: Sequence[int],
                 device: torch.device) -> None:
        self.request = request
        self.emb_slots = emb_slots  # filled in by the forward once the time embedding is computed
        self.single_sample = len(text_lengths) == 1
        lengths = np.asarray(text_lengths, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        self.txt_sample = torch.from_numpy(np.repeat(np.arange(lengths.size), lengths)).to(device)
        txt_position = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
        width = head_dim if head_dim % 2 == 0 else None  # full-width tables: no split/concat per call
        num_layers = len(ropes)
        prepared = request.prepared
        self._row_sample = [request.layout(i).row_sample for i in range(num_layers)]
        self._rope_vid: list = [None] * num_layers
        self._rope_txt: list = [None] * num_layers
        tables: dict = {}
        txt_positions = torch.from_numpy(np.repeat(txt_position[:, None], 3, axis=1)).to(device)
        text_offset = torch.from_numpy(lengths).to(device)
        for i, rope in enumerate(ropes):
            if rope is None:
                continue
            slot = prepared.slot_of_layer[i]
            key_vid, key_txt = (rope_groups[i], "vid", slot), (rope_groups[i], "txt")
            if key_vid not in tables:
                layout = request.layout(i)
                tables[key_vid] = rope.video_tables(
                    layout.window_coords, partial(text_offset.index_select, 0, layout.row_sample),
                    layout.window_shape, width)
            if rope.rotates_text and key_txt not in tables:
                tables[key_txt] = rope.tables(txt_positions, width)
            self._rope_vid[i], self._rope_txt[i] = tables[key_vid], tables.get(key_txt)
        self.row_sample = self._row_sample[0]
        self.rope_vid_tables = self.rope_txt_tables = None

    def enter_layer(self, layer: int) -> None:
        self.row_sample = self._row_sample[layer]
        self.rope_vid_tables, self.rope_txt_tables = self._rope_vid[layer], self._rope_txt[layer]

    # ---- per-sample values on rows ------------------------------------------------------------------
    def vid_rows(self, per_sample: Tensor) -> Tensor:
        if self.single_sample:
            return per_sample
        return per_sample.index_select(0, self.row_sample)

    def txt_rows(self, per_sample: Tensor) -> Tensor:
        if self.single_sample:
            return per_sample
        return per_sample.index_select(0, self.txt_sample)

    # ---- RoPE -----------------------------------------------------------------------------------------
    def rope_vid(self, rope: RotaryEmbedding3d) -> tuple[Tensor, Tensor]:
        return self.rope_vid_tables

    def rope_txt(self, rope: RotaryEmbedding3d) -> tuple[Tensor, Tensor]:
        return self.rope_txt_tables

    def attention(self, q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, *, layer: int, text_output: bool = True):
        return self.request.attention(q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, layer=layer, text_output=text_output)


class SeedVR2NaDiT(winsp.WindowParallel, nn.Module):
    """SeedVR2's NaDiT (the 3B's ``models/dit_v2`` or the 7B's ``models/dit``, as the config says) with
    window-parallel execution through ``winsp``.

    The parameter layout mirrors the reference checkpoint except for one key per block: the RoPE frequency buffer is
    ``blocks.<i>.attn.rope.freqs`` (the reference stores ``...attn.rope.rope.freqs``); :func:`load_dit_checkpoint`
    maps it.
    """

    def __init__(self, config: NaDiTConfig) -> None:
        super().__init__()
        if not isinstance(config, NaDiTConfig):
            raise TypeError(f"config must be a NaDiTConfig, got {type(config).__name__}")
        self.config = cfg = config
        dim = cfg.vid_dim
        self.vid_in = PatchIn(cfg.vid_in_channels, cfg.patch_size, dim)
        self.txt_in = nn.Linear(cfg.txt_in_dim, cfg.txt_dim) if cfg.txt_in_dim != cfg.txt_dim else nn.Identity()
        self.emb_in = TimeEmbedding(sinusoidal_dim=256, hidden_dim=max(dim, cfg.txt_dim), output_dim=cfg.emb_dim)
        self.blocks = nn.ModuleList(NaDiTBlock(cfg, i) for i in range(cfg.num_layers))
        if cfg.vid_out_norm is not None:
            self.vid_out_norm = make_norm(cfg.vid_out_norm, dim, cfg.norm_eps, True)
            # Only out_shift/out_scale are learned. The reference declares this modulation over its own embedding
            # regrouping but, through a forward-wide cache key the first block already filled, actually reads the
            # blocks' *attention* embedding slot; the port applies that effective modulation directly.
            self.vid_out_ada = Modulation(dim, ("out",), with_in=True, with_out=False)
        else:
            self.vid_out_norm = None
            self.vid_out_ada = None
        self.vid_out = PatchOut(cfg.vid_out_channels, cfg.patch_size, dim)
        self._patch_plans: "OrderedDict[tuple, PatchPlan]" = OrderedDict()

    def rope_groups(self) -> tuple[int, ...]:
        """For each block, the first block whose RoPE frequency buffer holds the same values (-1 without RoPE).

        Decided from each buffer's host-side :meth:`RotaryEmbedding3d.frequency_key` (values are read only after a
        load or an in-place change, once), so the forward never reads device values to decide whether two blocks can
        share RoPE tables.
        """
        keys = [None if block.attn.rope is None else block.attn.rope.frequency_key() for block in self.blocks]
        first: dict = {}
        return tuple(-1 if key is None else first.setdefault(key, i) for i, key in enumerate(keys))

    # ------------------------------------------------------------------ runtime
    def window_schedule(self) -> list:
        """One winsp geometry per block, from the config's window counts and methods.

        The runtime is attached the winsp way (:class:`winsp.WindowParallel`):
        ``model.build_runtime(parallel_config=DiffusionParallelConfig(ulysses_degree=N), group=...)`` returns it.
        """
        return [winsp.make_geometry(m, w) for m, w in zip(self.config.window_method, self.config.window, strict=True)]

    def compile_blocks(self, **compile_kwargs) -> "SeedVR2NaDiT":
        """Regional compilation: ``torch.compile`` each block in place (``fullgraph=True`` unless told otherwise).

        Blocks hold no planning code and no host syncs, so each compiles as one graph; the forward's planning phase
        stays eager. Returns the model.
        """
        compile_kwargs.setdefault("fullgraph", True)
        for block in self.blocks:
            block.compile(**compile_kwargs)
        return self

    # ------------------------------------------------------------------ input handling
    def _patch_plan(self, shapes: tuple, device: torch.device) -> PatchPlan:
        """The patch indices for these pre-patch shapes, on ``device`` (LRU-cached: built once per shape set)."""
        key = (shapes, str(device))
        plan = self._patch_plans.get(key)
        if plan is None:
            plan = plan_patches(shapes, self.config.patch_size)
            plan = dataclasses.replace(plan, gather=plan.gather.to(device), scatter=plan.scatter.to(device))
            self._patch_plans[key] = plan
            while len(self._patch_plans) > _PATCH_PLAN_CACHE_SIZE:
                self._patch_plans.popitem(last=False)
        else:
            self._patch_plans.move_to_end(key)
        return plan

    def _check_inputs(self, vid, txt, vid_shape, txt_shape, timestep):
        cfg = self.config
        for name, value in (("vid", vid), ("txt", txt), ("vid_shape", vid_shape), ("txt_shape", txt_shape)):
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if vid.dim() != 2 or vid.shape[1] != cfg.vid_in_channels:
            raise ValueError(f"vid must be [L, {cfg.vid_in_channels}] (packed pre-patch rows), got {tuple(vid.shape)}")
        if txt.dim() != 2 or txt.shape[1] != cfg.txt_in_dim:
            raise ValueError(f"txt must be [L_txt, {cfg.txt_in_dim}], got {tuple(txt.shape)}")
        if not vid.is_floating_point() or not txt.is_floating_point():
            raise ValueError(f"vid and txt must be floating point, got {vid.dtype} and {txt.dtype}")
        if vid_shape.dim() != 2 or vid_shape.shape[1] != 3 or vid_shape.shape[0] < 1:
            raise ValueError(f"vid_shape must be [b, 3] (T, H, W per sample), got {tuple(vid_shape.shape)}")
        if vid_shape.is_floating_point() or txt_shape.is_floating_point():
            raise ValueError("vid_shape and txt_shape must be integer tensors")
        b = vid_shape.shape[0]
        if txt_shape.dim() != 2 or txt_shape.shape != (b, 1):
            raise ValueError(f"txt_shape must be [{b}, 1] (one text length per sample), got {tuple(txt_shape.shape)}")
        # host reads of the whole input tensors (no indexing op first: under a fake mode that would make a tensor
        # without values)
        shapes = tuple(tuple(int(v) for v in row) for row in vid_shape.tolist())
        for s, shape in enumerate(shapes):
            if min(shape) < 1:
                raise ValueError(f"vid_shape[{s}] = {shape}: every dimension must be >= 1")
            _, ph, pw = cfg.patch_size
            if shape[1] % ph or shape[2] % pw:
                raise ValueError(
                    f"vid_shape[{s}] = {shape}: height and width must be divisible by the patch size {(ph, pw)}"
                )
        total = sum(t * h * w for t, h, w in shapes)
        if total != vid.shape[0]:
            raise ValueError(f"vid has {vid.shape[0]} rows but vid_shape describes {total} (sum of T*H*W)")
        text_lengths = tuple(int(row[0]) for row in txt_shape.tolist())
        if any(n < 0 for n in text_lengths):
            raise ValueError(f"txt_shape has negative lengths: {text_lengths}")
        if sum(text_lengths) != txt.shape[0]:
            raise ValueError(f"txt has {txt.shape[0]} rows but txt_shape describes {sum(text_lengths)}")
        if not isinstance(timestep, Tensor):
            timestep = torch.tensor([float(timestep)])
        timestep = timestep.reshape(-1)
        if timestep.numel() == 1 and b > 1:
            timestep = timestep.expand(b)
        if timestep.numel() != b:
            raise ValueError(f"timestep must be a scalar or have one value per sample ({b}), got {timestep.numel()}")
        return shapes, text_lengths, timestep.to(vid.device)

    # ------------------------------------------------------------------ forward
    @planning
    @plans
    def _prepare(self, vid, txt, vid_shape, txt_shape, timestep):
        """The planning phase of a forward: checks, patch indices, the winsp request and the per-forward context.

        Everything that reads values on the host (shapes as lists, plan look-ups, index building) happens here, once;
        torch.compile leaves it alone, so the rest of the forward traces without graph breaks.
        """
        shapes, text_lengths, timestep = self._check_inputs(vid, txt, vid_shape, txt_shape, timestep)
        dtype = self.vid_in.proj.weight.dtype
        plan = self._patch_plan(shapes, vid.device)
        req = self.require_runtime().request(grids=plan.grids, text_lengths=text_lengths, device=vid.device,
                                             dtype=dtype)
        ropes = [block.attn.rope for block in self.blocks]
        ctx = ForwardContext(req, None, text_lengths, ropes, self.config.head_dim, self.rope_groups(), vid.device)
        return plan, req, ctx, timestep

    def forward(
        self,
        vid: Tensor,
        txt: Tensor,
        vid_shape: Tensor,
        txt_shape: Tensor,
        timestep: Union[Tensor, float, int],
    ) -> Tensor:
        """Predict ``[L, vid_out_channels]`` for packed pre-patch video rows ``vid [L, vid_in_channels]``.

        ``vid_shape [b, 3]`` gives each sample's pre-patch (T, H, W) (rows are sample-major, row-major (t, h, w)),
        ``txt [L_txt, txt_in_dim]`` the packed text embeddings with ``txt_shape [b, 1]`` lengths, ``timestep`` one
        value per sample (or one for all). Inputs are cast to the model's dtype. Returns the full tensor on every rank.
        """
        plan, req, ctx, timestep = self._prepare(vid, txt, vid_shape, txt_shape, timestep)
        cfg = self.config
        dtype = self.vid_in.proj.weight.dtype
        x = req.scatter(PatchIn.patchify(vid.to(dtype), plan))
        x = self.vid_in(x)
        txt = self.txt_in(txt.to(dtype))
        emb_slots = Modulation.split_embedding(self.emb_in(timestep, dtype), cfg.vid_dim)
        ctx.emb_slots = emb_slots

        for i, block in enumerate(self.blocks):
            x = req.to_layer(x, i)
            ctx.enter_layer(i)
            x, txt = block(x, txt, ctx)

        if self.vid_out_norm is not None:
            scale, shift = self.vid_out_ada.scale_shift("out", emb_slots[:, 0])
            x = self.vid_out_norm(x) * ctx.vid_rows(scale) + ctx.vid_rows(shift)
        x = req.gather(self.vid_out(x))
        return self.vid_out.unpatchify(x, plan)
