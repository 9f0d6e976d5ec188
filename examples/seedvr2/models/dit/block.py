"""One NaDiT transformer block ("mmdit_sr"): window attention over [video window, text], then an MLP, both ADA-gated.

The block sees only this rank's video rows (in its own window layout) and the full replicated text. Everything but
the attention is tokenwise; the attention itself, the window bookkeeping and the text reduction go through the
:class:`BlockContext`, which the model builds from a ``winsp`` request.

One block class serves both released architectures; where they differ the config holds one switch each:
  * ``cfg.stream_sharing(layer)``: which sub-layers use one module for both streams (keys ``.all``) instead of two
    (``.vid``/``.txt``). 3B: everything past ``mm_layers``; 7B: nothing (``shared_qkv``/``shared_mlp`` False);
  * ``cfg.last_layer_video_only`` (3B): the last block has no text modulation or text MLP, so its text enters
    attention normalised but *unmodulated*. The 7B's last block is complete and modulates its text;
  * ``cfg.rope_kind``: mmrope3d (3B, video and text) or rope3d (7B ``qk_rope``, video only), see :mod:`.rope`;
  * ``cfg.mlp_type``: SwiGLU (3B) or GELU (7B), see :func:`.layers.make_mlp`.
Either way the last block's text output is never read, so it is not computed here.
"""

from __future__ import annotations

from typing import Optional, Protocol

from torch import Tensor, nn

from .config import NaDiTConfig, StreamSharing
from .layers import Modulation, StreamPair, make_mlp, make_norm
from .rope import RotaryEmbedding3d, apply_rope

__all__ = ["BlockContext", "WindowMMAttention", "NaDiTBlock"]


class BlockContext(Protocol):
    """What a block needs from the forward: per-sample embeddings, row->sample maps, RoPE tables and attention."""

    #: ``[b, 2, 3, dim]`` time-embedding slots (slot 0 attention, 1 MLP; shift, scale, gate)
    emb_slots: Tensor

    def vid_rows(self, per_sample: Tensor) -> Tensor:
        """Expand ``[b, dim]`` per-sample values to the local video rows (or a broadcastable ``[1, dim]``)."""

    def txt_rows(self, per_sample: Tensor) -> Tensor:
        """Expand ``[b, dim]`` per-sample values to the text rows (or a broadcastable ``[1, dim]``)."""

    def rope_vid(self, rope: RotaryEmbedding3d) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` for the local video rows in the current layout."""

    def rope_txt(self, rope: RotaryEmbedding3d) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` for the text rows."""

    def attention(self, q_vid, k_vid, v_vid, q_txt, k_txt, v_txt, *, layer: int, text_output: bool = True):
        """Window attention of ``layer`` plus the text reduction (the winsp request's ``attention``)."""


class WindowMMAttention(nn.Module):
    """QKV projection, per-head q/k norm, window-local RoPE, window attention and output projection, per stream."""

    def __init__(self, cfg: NaDiTConfig, sharing: StreamSharing, layer: int) -> None:
        super().__init__()
        self.layer = layer
        inner = cfg.heads * cfg.head_dim
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        dim = cfg.vid_dim
        self.proj_qkv = StreamPair(lambda: nn.Linear(dim, 3 * inner, bias=cfg.qk_bias), shared=sharing.qkv)
        self.proj_out = StreamPair(lambda: nn.Linear(inner, dim), shared=sharing.qkv)
        make_qk_norm = lambda: make_norm(cfg.qk_norm, cfg.head_dim, cfg.norm_eps, True)  # noqa: E731
        self.norm_q = StreamPair(make_qk_norm, shared=sharing.qk_norm)
        self.norm_k = StreamPair(make_qk_norm, shared=sharing.qk_norm)
        kind = cfg.rope_kind
        self.rope = RotaryEmbedding3d(cfg.rope_input_dim, kind) if kind is not None else None

    def _qkv(self, x: Tensor, stream: str) -> tuple[Tensor, Tensor, Tensor]:
        pick = (lambda pair: pair.for_vid()) if stream == "vid" else (lambda pair: pair.for_txt())
        qkv = pick(self.proj_qkv)(x).view(x.shape[0], 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        return pick(self.norm_q)(q), pick(self.norm_k)(k), v

    def forward(
        self, vid: Tensor, txt: Tensor, ctx: BlockContext, *, need_txt_out: bool = True
    ) -> tuple[Tensor, Optional[Tensor]]:
        q_v, k_v, v_v = self._qkv(vid, "vid")
        q_t, k_t, v_t = self._qkv(txt, "txt")
        if self.rope is not None:
            cos, sin = ctx.rope_vid(self.rope)
            q_v, k_v = apply_rope(q_v, cos, sin), apply_rope(k_v, cos, sin)
        if self.rope is not None and self.rope.rotates_text:
            cos, sin = ctx.rope_txt(self.rope)
            q_t, k_t = apply_rope(q_t, cos, sin), apply_rope(k_t, cos, sin)
        vid_out, txt_out = ctx.attention(q_v, k_v, v_v, q_t, k_t, v_t, layer=self.layer, text_output=need_txt_out)
        vid_out = self.proj_out.for_vid()(vid_out.flatten(1))
        if not need_txt_out:
            return vid_out, None
        return vid_out, self.proj_out.for_txt()(txt_out.flatten(1))


class NaDiTBlock(nn.Module):
    """Pre-norm block: ``x += gate * attn(mod(norm(x)))``, then ``x += gate * mlp(mod(norm(x)))``, for both streams."""

    def __init__(self, cfg: NaDiTConfig, layer: int) -> None:
        super().__init__()
        sharing = cfg.stream_sharing(layer)
        self.layer = layer
        self.is_last = layer == cfg.num_layers - 1
        # 3B: the last block's text skips modulation and the MLP (its video-only sub-layers); the 7B's keeps them
        self.video_only = self.is_last and cfg.last_layer_video_only
        # attn_norm / mlp_norm of the reference have no parameters (elementwise_affine=False): one module serves both
        self.norm = make_norm(cfg.norm, cfg.vid_dim, cfg.norm_eps, False)
        self.attn = WindowMMAttention(cfg, sharing, layer)
        hidden = cfg.mlp_hidden_dim
        self.mlp = StreamPair(lambda: make_mlp(cfg.mlp_type, cfg.vid_dim, hidden), shared=sharing.mlp,
                              video_only=self.video_only)
        self.ada = StreamPair(lambda: Modulation(cfg.vid_dim, ("attn", "mlp")), shared=sharing.ada,
                              video_only=self.video_only)

    @staticmethod
    def _modulate(x: Tensor, mod: Modulation, name: str, slot: Tensor, rows) -> Tensor:
        scale, shift = mod.scale_shift(name, slot)
        return x * rows(scale) + rows(shift)

    def forward(self, vid: Tensor, txt: Tensor, ctx: BlockContext) -> tuple[Tensor, Tensor]:
        attn_slot, mlp_slot = ctx.emb_slots[:, 0], ctx.emb_slots[:, 1]
        ada_v = self.ada.for_vid()
        # a video-only last block's text enters attention unmodulated (even where its modulation weights are shared)
        ada_t = None if self.video_only else self.ada.for_txt()

        v = self._modulate(self.norm(vid), ada_v, "attn", attn_slot, ctx.vid_rows)
        t = self.norm(txt)
        if ada_t is not None:
            t = self._modulate(t, ada_t, "attn", attn_slot, ctx.txt_rows)
        v, t = self.attn(v, t, ctx, need_txt_out=not self.is_last)
        vid = vid + v * ctx.vid_rows(ada_v.gate("attn", attn_slot))

        v = self._modulate(self.norm(vid), ada_v, "mlp", mlp_slot, ctx.vid_rows)
        v = self.mlp.for_vid()(v)
        vid = vid + v * ctx.vid_rows(ada_v.gate("mlp", mlp_slot))
        if self.is_last:
            return vid, txt  # the text stream ends here; its last output is never read

        txt = txt + t * ctx.txt_rows(ada_t.gate("attn", attn_slot))
        t = self._modulate(self.norm(txt), ada_t, "mlp", mlp_slot, ctx.txt_rows)
        t = self.mlp.for_txt()(t)
        txt = txt + t * ctx.txt_rows(ada_t.gate("mlp", mlp_slot))
        return vid, txt
