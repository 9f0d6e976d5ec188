"""Video and image files in and out (PyAV), and the geometry that turns an input into the model's working size.

Reading gives ``uint8`` frames ``[t, h, w, 3]`` and the stream's frame rate; writing takes the same layout. Images
(png, jpg, ...) are read through the same path, since FFmpeg opens them as one-frame containers.

Geometry ("exactly the requested size"). The user asks for an output size ``(H, W)`` (``--resolution WxH``, or
``--scale S`` = the input size times ``S``, rounded). The model needs sides that are multiples of 16, so:

1. the input is resized (bicubic, antialiased, as the reference) with its aspect ratio kept so that it *covers*
   ``H x W`` (when the aspect ratios agree this is the reference's "area" resize to ``H * W`` pixels), and the excess
   is centre-cropped away, giving exactly ``H x W``;
2. that frame is centre-cropped to the largest multiple of 16 on each side (the reference's divisible crop): the
   *working size* at which the VAE and DiT run;
3. the restored result is resized back to exactly ``H x W``. When ``H`` and ``W`` are already multiples of 16 (the
   common case: 720p, 1080p width, ...) steps 2 and 3 do nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "MediaError",
    "Media",
    "Geometry",
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "MIN_SIDE",
    "read_media",
    "write_media",
    "atomic_output",
    "output_kind",
    "parse_resolution",
    "plan_geometry",
    "resize_frames",
    "center_crop",
    "frames_to_model",
    "model_to_frames",
]

MIN_SIDE = 16
MAX_SIDE = 16384
DIVISOR = 16
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv")
_IMAGE_DEMUXERS = ("image2", "png_pipe", "jpeg_pipe", "bmp_pipe", "webp_pipe", "tiff_pipe", "jpegls_pipe")
DEFAULT_FPS = Fraction(25)


class MediaError(ValueError):
    """An input or output file that cannot be used; the message is one line meant for the user."""


@dataclass
class Media:
    """Decoded frames ``uint8 [t, h, w, 3]`` (RGB), the frame rate, and whether the source was a still image."""

    frames: np.ndarray
    fps: Fraction
    is_image: bool

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


# ---- reading ------------------------------------------------------------------------------------------------------


def read_media(path: str | os.PathLike) -> Media:
    """Decode every frame of the first video stream of ``path`` (a video or an image) to RGB ``uint8``.

    Raises :class:`MediaError` for a missing or empty file, a file FFmpeg cannot open, a file without a video stream,
    a stream that fails to decode, or one that decodes to zero frames.
    """
    import av

    path = os.fspath(path)
    if not os.path.exists(path):
        raise MediaError(f"input file not found: {path}")
    if os.path.isdir(path):
        raise MediaError(f"input is a directory, not a video or image file: {path}")
    if os.path.getsize(path) == 0:
        raise MediaError(f"input file is empty: {path}")
    try:
        container = av.open(path)
    except av.FFmpegError as exc:
        raise MediaError(f"not a readable video or image: {path} ({_ffmpeg_reason(exc)})") from None
    with container:
        if not container.streams.video:
            raise MediaError(f"no video stream in {path}")
        stream = container.streams.video[0]
        is_image = container.format.name in _IMAGE_DEMUXERS
        fps = _stream_fps(stream)
        frames = []
        try:
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
        except av.FFmpegError as exc:
            if not frames:
                raise MediaError(f"cannot decode the video stream of {path} ({_ffmpeg_reason(exc)})") from None
            # A damaged tail: keep the frames that decoded (players do the same).
    if not frames:
        raise MediaError(f"no frames could be decoded from {path}")
    shapes = {f.shape for f in frames}
    if len(shapes) != 1:
        raise MediaError(f"frame size changes mid-stream in {path} ({sorted(shapes)}); not supported")
    return Media(frames=np.stack(frames), fps=fps, is_image=is_image and len(frames) == 1)


def _stream_fps(stream) -> Fraction:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and rate > 0:
            return Fraction(rate)
    return DEFAULT_FPS


def _ffmpeg_reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


# ---- writing ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to ``path`` (same extension); on success move it onto ``path``, else delete it.

    So a failed or interrupted run never leaves a partial output file under the requested name.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise MediaError(f"output directory does not exist: {directory}")
    base, ext = os.path.splitext(os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=f".partial{ext}", dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def output_kind(path: str | os.PathLike) -> str:
    """``"image"`` or ``"video"`` from the output file's extension; :class:`MediaError` for anything else."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    known = ", ".join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)
    raise MediaError(f"unsupported output extension {ext or '(none)'!r} for {os.fspath(path)}; use one of {known}")


def write_media(path: str | os.PathLike, frames: np.ndarray, fps: Fraction = DEFAULT_FPS) -> None:
    """Write ``uint8 [t, h, w, 3]`` frames: H.264 (libx264) for .mp4/.mov/.mkv, PNG or JPEG for one frame.

    The file appears atomically (see :func:`atomic_output`). H.264 uses 4:2:0 chroma when both sides are even and
    4:4:4 otherwise (4:2:0 needs even sides), so the exact requested size is always kept.
    """
    frames = _check_frames(frames)
    kind = output_kind(path)
    if kind == "image" and frames.shape[0] != 1:
        raise MediaError(
            f"cannot write {frames.shape[0]} frames to the image file {os.fspath(path)}; use a video extension (.mp4)"
        )
    with atomic_output(path) as tmp:
        if kind == "image":
            _write_image(tmp, frames[0])
        else:
            _write_h264(tmp, frames, fps)


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must be uint8 [t>=1, h, w, 3], got {frames.dtype} {list(frames.shape)}")
    return np.ascontiguousarray(frames)


def _write_image(path: str, frame: np.ndarray) -> None:
    import av

    ext = os.path.splitext(path)[1].lower()
    codec, pix_fmt = ("png", "rgb24") if ext == ".png" else ("mjpeg", "yuvj444p")
    with av.open(path, "w", format="image2", options={"update": "1"}) as container:
        stream = container.add_stream(codec)
        stream.width, stream.height, stream.pix_fmt = frame.shape[1], frame.shape[0], pix_fmt
        _encode_all(container, stream, [frame])


def _write_h264(path: str, frames: np.ndarray, fps: Fraction) -> None:
    import av

    height, width = frames.shape[1:3]
    even = height % 2 == 0 and width % 2 == 0
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1_000_000))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if even else "yuv444p"
        stream.options = {"crf": "16", "preset": "medium"}
        _encode_all(container, stream, frames)


def _encode_all(container, stream, frames) -> None:
    import av

    for array in frames:
        frame = av.VideoFrame.from_ndarray(array, format="rgb24")
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


# ---- geometry -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """How an ``input`` (h, w) becomes the ``work`` size the model sees and the exact ``output`` size written."""

    input: tuple[int, int]
    resized: tuple[int, int]  # after the aspect-keeping resize that covers the output size
    output: tuple[int, int]  # exactly what the user asked for
    work: tuple[int, int]  # output centre-cropped to multiples of 16


def parse_resolution(text: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(H, W)``; :class:`MediaError` when it is not two positive integers."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        width, height = (int(p) for p in parts)
    except ValueError:
        raise MediaError(f"--resolution must look like WIDTHxHEIGHT (e.g. 1280x720), got {text!r}") from None
    return height, width


def plan_geometry(
    input_hw: tuple[int, int], resolution: tuple[int, int] | None = None, scale: float | None = None
) -> Geometry:
    """Plan the resize/crop for an input of ``input_hw``; ``resolution`` is ``(H, W)``; neither means scale 1.

    Raises :class:`MediaError` for a scale that is not a positive finite number, or an output side under 16 or
    over 16384 pixels.
    """
    if resolution is not None and scale is not None:
        raise MediaError("give either --resolution or --scale, not both")
    in_h, in_w = (int(v) for v in input_hw)
    if resolution is None:
        scale = 1.0 if scale is None else scale
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise MediaError(f"--scale must be a positive finite number, got {scale!r}")
        out_h, out_w = round(in_h * scale), round(in_w * scale)
    else:
        out_h, out_w = (int(v) for v in resolution)
    for name, side in (("height", out_h), ("width", out_w)):
        if side < MIN_SIDE:
            raise MediaError(f"output {name} {side} is under the minimum of {MIN_SIDE} pixels")
        if side > MAX_SIDE:
            raise MediaError(f"output {name} {side} is over the maximum of {MAX_SIDE} pixels")
    cover = max(out_h / in_h, out_w / in_w)
    resized = (max(out_h, round(in_h * cover)), max(out_w, round(in_w * cover)))
    work = (out_h - out_h % DIVISOR, out_w - out_w % DIVISOR)
    return Geometry(input=(in_h, in_w), resized=resized, output=(out_h, out_w), work=work)


def resize_frames(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased resize of ``[..., h, w]`` float frames to ``size`` (the reference's area resize filter)."""
    size = (int(size[0]), int(size[1]))
    if tuple(video.shape[-2:]) == size:
        return video
    lead = video.shape[:-2]
    flat = video.reshape((-1, 1) + tuple(video.shape[-2:]))
    out = F.interpolate(flat, size=size, mode="bicubic", align_corners=False, antialias=True)
    return out.reshape(lead + size)


def center_crop(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crop ``[..., h, w]`` to ``size`` around the centre (offsets rounded as torchvision's centre crop rounds)."""
    h, w = video.shape[-2:]
    ch, cw = int(size[0]), int(size[1])
    if ch > h or cw > w:
        raise ValueError(f"cannot centre-crop {h}x{w} to a larger {ch}x{cw}")
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return video[..., top : top + ch, left : left + cw]


def frames_to_model(frames: np.ndarray | torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``uint8 [t, h, w, 3]`` -> float32 ``[3, t, H', W']`` in [-1, 1] at the working size (resize, clamp, crops)."""
    video = torch.as_tensor(np.asarray(frames)).permute(3, 0, 1, 2).float().div(255.0)  # [3, t, h, w] in [0, 1]
    video = resize_frames(video, geometry.resized).clamp(0.0, 1.0)
    video = center_crop(center_crop(video, geometry.output), geometry.work)
    return video.mul(2.0).sub(1.0)


def model_to_frames(video: torch.Tensor, geometry: Geometry) -> np.ndarray:
    """Float ``[3, t, H', W']`` in [-1, 1] at the working size -> ``uint8 [t, H, W, 3]`` at the output size."""
    video = resize_frames(video.float(), geometry.output)
    video = video.clamp(-1.0, 1.0).mul(0.5).add(0.5).mul(255.0).round()
    return video.to(torch.uint8).permute(1, 2, 3, 0).contiguous().numpy()
