"""Ready-made :class:`~winsp.adoption.parallelize.TokenIO` s for regions whose tokens are not ``[B, T, H, W, C]``.

- ``FlatTokens``: tokens ``[B, L, C]`` with the grid as another argument (or fixed), flattened in any axis order.
  Hugging Face vision encoders (Swin, Swin V2, and the models built on them) take ``hidden_states [B, H*W, C]`` plus
  ``input_dimensions (H, W)`` and return a tuple or a ``ModelOutput`` whose first field is the tokens; a divided
  space-time video transformer takes ``[B, S*T, C]`` frames fastest plus its number of frames.
- ``Patches``: a whole video DiT as the region (diffusers' CogVideoX and the like): its input is the latent video
  before the patch embedding, and its output the video after the unpatchify. Each rank gets its patches as a batch of
  one video of one-patch frames, which a strided-conv patch embedding turns into exactly its tokens, and the model's
  own unpatchify turns back into patches. ``Patches.whole_grid`` swaps a module that computes a table per grid
  position from the shape of the video it is given (diffusers' RoPE modules: ``self.rope(hidden_states)``): it runs
  on the whole grid's shape and returns this rank's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import Tensor, nn

from winsp.adoption.parallelize import TokenIO
from winsp.adoption.swapped import Swapped

__all__ = ["FlatTokens", "Patches"]


@dataclass(frozen=True)
class FlatTokens(TokenIO):
    """Tokens ``[B, L, C]`` as the first positional argument, flattened from the grid in axis ``order``; the grid, the
    same for every sample, as argument ``grid_arg`` or fixed as ``grid``.

    - ``grid_arg``: the position (int) or keyword (str) of the argument giving the grid: ``(H, W)``, ``(T, H, W)``, or
      a number of frames ``T`` (an int: each frame's ``L / T`` positions are one axis, the grid ``(T, 1, L / T)``).
    - ``grid``: ``(H, W)`` or ``(T, H, W)`` fixed, for a region called without one (``grid_arg`` is then not read).
    - ``order``: the sequence's axes slowest first, a permutation of ``"thw"``: ``"thw"`` is row-major (Hugging Face's
      vision encoders), ``"hwt"`` frames fastest (a divided space-time video transformer's ``(h w t)`` tokens).

    Replicated tokens before or after the grid's (a class token) are the plan's: ``ParallelPlan(replicated=
    winsp.adoption.Replicated("first", count=1))`` takes them off before this reads the rest. The output is the tokens
    on the region's last grid in the same order: a tensor ``[B, L', C]``, or a tuple / mapping (a ``ModelOutput``)
    whose first item is replaced by it. ``refuse`` names keyword flags the region cannot honour
    (``output_hidden_states``, say): a truthy one raises ValueError.
    """

    grid_arg: Union[int, str] = 1
    refuse: tuple[str, ...] = ()
    order: str = "thw"
    grid: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.order, str) or sorted(self.order) != ["h", "t", "w"]:
            raise ValueError(f"FlatTokens.order must be a permutation of 'thw' (the sequence's axes, slowest first), "
                             f"got {self.order!r}")
        if isinstance(self.grid_arg, bool) or not isinstance(self.grid_arg, (int, str)):
            raise ValueError(f"FlatTokens.grid_arg must be a positional index or a keyword name, got "
                             f"{self.grid_arg!r}")
        if self.grid is not None:
            grid = tuple(self.grid) if isinstance(self.grid, (tuple, list)) else ()
            if len(grid) not in (2, 3) or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0
                                                   for g in grid):
                raise ValueError(f"FlatTokens.grid must be (H, W) or (T, H, W) positive integers, got {self.grid!r}")
            object.__setattr__(self, "grid", grid)

    def _grid(self, args: tuple, kwargs: dict, tokens: int) -> tuple[int, int, int]:
        if self.grid is not None:
            value: Any = self.grid
        elif isinstance(self.grid_arg, int) and self.grid_arg < len(args):
            value = args[self.grid_arg]
        elif isinstance(self.grid_arg, str) and self.grid_arg in kwargs:
            value = kwargs[self.grid_arg]
        else:
            where = f"positional argument {self.grid_arg}" if isinstance(self.grid_arg, int) else \
                f"keyword argument {self.grid_arg!r}"
            raise ValueError(f"FlatTokens: the region needs tokens [B, L, C] first and the grid as {where} (or "
                             f"FlatTokens(grid=...)); got {len(args)} positional arguments and keywords "
                             f"{sorted(kwargs)}")
        if isinstance(value, Tensor) and value.dim() == 0:
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):  # a number of frames
            if value < 1 or tokens % value:
                raise ValueError(f"FlatTokens: {value} frames do not divide the {tokens} tokens of each sample")
            return (value, 1, tokens // value)
        grid = tuple(int(g) for g in value)
        if len(grid) not in (2, 3) or math.prod(grid) != tokens:
            raise ValueError(f"FlatTokens: grid {grid} does not describe the {tokens} tokens of each sample")
        return (1,) * (3 - len(grid)) + grid  # type: ignore[return-value]

    def read(self, args: tuple, kwargs: dict) -> tuple[Tensor, list]:
        for key in self.refuse:
            if kwargs.get(key):
                raise ValueError(f"{key}={kwargs[key]!r} is not supported inside this window-parallel region")
        if not args or not isinstance(args[0], Tensor) or args[0].dim() != 3:
            got = list(args[0].shape) if args and isinstance(args[0], Tensor) else \
                type(args[0]).__name__ if args else "no positional argument"
            raise ValueError(f"FlatTokens: the region needs tokens [B, L, C] first (its first positional argument), "
                             f"got {got}")
        x = args[0]
        grid = self._grid(args, kwargs, x.shape[1])
        return self._to_canonical(x, grid).reshape(-1, x.shape[-1]), [grid] * x.shape[0]

    def _to_canonical(self, x: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """``[B, L, C]`` in ``order`` -> ``[B, T, H, W, C]``."""
        if self.order == "thw":
            return x
        sizes = dict(zip("thw", grid, strict=True))
        seq = x.reshape((x.shape[0],) + tuple(sizes[a] for a in self.order) + tuple(x.shape[2:]))
        return seq.permute(0, *(1 + self.order.index(a) for a in "thw"), *range(4, seq.dim()))

    def with_rows(self, args: tuple, kwargs: dict, rows: Tensor) -> tuple[tuple, dict]:
        return (rows,) + tuple(args[1:]), kwargs

    def output_rows(self, output: Any) -> Tensor:
        return self.first_item(output)

    def with_output(self, output: Any, rows: Tensor, grids) -> Any:
        if len(set(grids)) != 1:
            raise ValueError(f"FlatTokens: samples end on different grids {sorted(set(grids))}")
        tokens = rows.reshape((len(grids),) + tuple(grids[0]) + tuple(rows.shape[1:]))
        if self.order != "thw":
            tokens = tokens.permute(0, *(1 + "thw".index(a) for a in self.order), *range(4, tokens.dim()))
        return self.with_first_item(output, tokens.reshape((len(grids), -1) + tuple(rows.shape[1:])))


@dataclass(frozen=True)
class Patches(TokenIO):
    """A latent video ``[B, T, C, H, W]`` (``channels=2``, CogVideoX) or ``[B, C, T, H, W]`` (``channels=1``) as the
    region's first positional argument (or keyword ``name``), cut into ``patch = (pt, ph, pw)`` patches: the grid is
    ``(T / pt, H / ph, W / pw)`` and a canonical row is one patch's values ``[C * pt * ph * pw]`` (``C, pt, ph, pw``
    row-major).

    This rank's ``L`` patches reach the model as one sample whose time axis holds them one after the other
    (``[1, L * pt, C, ph, pw]``), so a patch embedding that is a convolution with stride equal to its kernel gives each
    patch's token, in order, and an unpatchify that is a reshape gives the patches back; the region's output (a tensor
    or its first item: a tuple or ``ModelOutput``) is then rebuilt as the whole video. A batch of one sample per call:
    per-sample conditioning of the model (a timestep embedding) broadcasts over the one presented sample.
    """

    patch: tuple[int, int, int] = (1, 2, 2)
    channels: int = 2
    name: str = "hidden_states"

    def __post_init__(self) -> None:
        if len(tuple(self.patch)) != 3 or not all(isinstance(p, int) and p > 0 for p in self.patch):
            raise ValueError(f"Patches.patch must be three positive integers (pt, ph, pw), got {self.patch!r}")
        if self.channels not in (1, 2):
            raise ValueError(f"Patches.channels must be 1 ([B, C, T, H, W]) or 2 ([B, T, C, H, W]), got "
                             f"{self.channels!r}")
        object.__setattr__(self, "patch", tuple(self.patch))

    def _video(self, args: tuple, kwargs: dict) -> Tensor:
        x = args[0] if args else kwargs.get(self.name)
        want = "[B, T, C, H, W]" if self.channels == 2 else "[B, C, T, H, W]"
        if not isinstance(x, Tensor) or x.dim() != 5:
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"Patches: the region's first argument (or {self.name}=) must be a {want} video, got "
                             f"{got}")
        return x if self.channels == 2 else x.transpose(1, 2)

    def read(self, args: tuple, kwargs: dict) -> tuple[Tensor, list]:
        x = self._video(args, kwargs)
        (b, t, c, h, w), (pt, ph, pw) = x.shape, self.patch
        if b != 1:
            raise ValueError(f"Patches: a batch of {b} samples; this rank's patches reach the model as one sample, so "
                             f"call the model with one sample at a time")
        if t % pt or h % ph or w % pw:
            raise ValueError(f"Patches: the video's (T, H, W) = {(t, h, w)} is not a multiple of the patch "
                             f"{self.patch}")
        grid = (t // pt, h // ph, w // pw)
        rows = x.reshape(b, grid[0], pt, c, grid[1], ph, grid[2], pw).permute(0, 1, 4, 6, 3, 2, 5, 7)
        return rows.reshape(-1, c * pt * ph * pw), [grid] * b

    def _frames(self, rows: Tensor, c: int) -> Tensor:
        """Local patch rows ``[L, C * pt * ph * pw]`` as one sample ``[1, L * pt, C, ph, pw]`` (or channels first)."""
        pt, ph, pw = self.patch
        frames = rows.reshape(-1, c, pt, ph, pw).transpose(1, 2).reshape(1, -1, c, ph, pw)
        return frames if self.channels == 2 else frames.transpose(1, 2)

    def with_rows(self, args: tuple, kwargs: dict, rows: Tensor) -> tuple[tuple, dict]:
        c = self._video(args, kwargs).shape[2]
        if args:
            return (self._frames(rows, c),) + tuple(args[1:]), kwargs
        return args, {**kwargs, self.name: self._frames(rows, c)}

    def output_rows(self, output: Any) -> Tensor:
        x = self._video((self.first_item(output),), {})
        pt, ph, pw = self.patch
        if x.shape[0] != 1 or x.shape[1] % pt or tuple(x.shape[3:]) != (ph, pw):
            raise ValueError(f"Patches: the region's output {list(x.shape)} is not this rank's patches as one sample "
                             f"of one-patch frames (patch {self.patch})")
        return x.reshape(-1, pt, x.shape[2], ph, pw).transpose(1, 2).flatten(1)

    def with_output(self, output: Any, rows: Tensor, grids) -> Any:
        (t, h, w), (pt, ph, pw) = grids[0], self.patch
        c = rows.shape[1] // (pt * ph * pw)
        video = rows.reshape(1, t, h, w, c, pt, ph, pw).permute(0, 1, 5, 4, 2, 6, 3, 7)
        video = video.reshape(1, t * pt, c, h * ph, w * pw)
        return self.with_first_item(output, video if self.channels == 2 else video.transpose(1, 2))

    def whole_grid(self, original: nn.Module, index: Optional[int] = None) -> Swapped:
        """A ``ParallelPlan.swaps`` factory for a module inside the region that computes a table per grid position
        from the *shape* of the video it is given (diffusers' RoPE modules, called as ``self.rope(hidden_states)``
        on the latent video): inside the region it gets this rank's patches, so the swap runs the original's forward
        on an empty video of the whole grid's shape (no channels: only the shape is given) and returns this rank's
        rows of each table it returns (``request.grid_rows``: tables ``[T * H * W, ...]`` or ``[T, H, W, ...]``, a
        tensor or a tuple / list of them)."""
        return Swapped(self._on_whole_grid, original, index)

    def _on_whole_grid(self, m: Swapped, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        grids = m.request.grids
        if len(grids) != 1 or not isinstance(x, Tensor) or x.dim() != 5:
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"Patches.whole_grid ({m.swapped_from}): takes this rank's patches of one video "
                             f"(5 dimensions) first, got {got}")
        (t, h, w), (pt, ph, pw) = grids[0], self.patch
        shape = (1, 0, t * pt, h * ph, w * pw) if self.channels == 1 else (1, t * pt, 0, h * ph, w * pw)
        out = m._swapped_class.forward(m, x.new_empty(shape), *args, **kwargs)
        if isinstance(out, Tensor):
            return m.request.grid_rows(out)
        if not isinstance(out, (tuple, list)) or not all(isinstance(o, Tensor) for o in out):
            raise ValueError(f"Patches.whole_grid: {m.swapped_from} returned a {type(out).__name__}; a table per "
                             f"grid position (a tensor, or a tuple / list of them) is expected")
        return type(out)(m.request.grid_rows(o) for o in out)
