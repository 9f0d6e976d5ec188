"""Video and image files: reading, writing without losing data, frame geometry, the command's inputs, colour.

It was one module, ``examples.seedvr2.media``; its names still import from here (see ``examples/seedvr2/_moved.py``).
"""

from __future__ import annotations

from .._moved import moved_names

#: a name of the old module ``examples.seedvr2.media`` -> the module that defines it now
MOVED: dict[str, str] = {
    **dict.fromkeys(("contextlib", "sys", "tempfile", "threading",
                     "record_partial", "_PARTIALS_LOCK", "_PARTIALS",
                     "_PARTIALS_CLOSED", "_partial_name", "check_output_directory",
                     "_why_not_writable", "remove_partial_outputs",
                     "atomic_output", "_RENAME_NOREPLACE", "_AT_FDCWD",
                     "_renameat2", "_libc_renameat2", "publish_no_replace",
                     "_current_umask", "output_kind", "h264_frame_size", "_pad_to",
                     "MediaWriter", "_exc_info", "write_media", "_check_frames",
                     "_write_image"), "examples.seedvr2.media.writing"),
    **dict.fromkeys(("errno", "os", "dataclass", "field", "Fraction", "Callable", "Iterator", "Optional", "np",
                     "MIN_SIDE", "MAX_SIDE", "DIVISOR", "IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "_IMAGE_DEMUXERS",
                     "DEFAULT_FPS", "DEFAULT_CRF", "MediaError", "DecoderOutOfMemory", "EncoderOutOfMemory",
                     "MediaInfo", "Media", "_open_input", "probe_media", "dropped_by_rgb24", "iter_frames",
                     "read_media", "_stream_fps", "_ffmpeg_reason", "_raise_if_short_of_memory", "same_file",
                     "default_output_path"), "examples.seedvr2.media.reading"),
    **dict.fromkeys(("math", "re", "torch", "F", "Geometry", "parse_resolution",
                     "check_scale", "plan_geometry", "resize_frames",
                     "center_crop", "frames_to_model", "model_to_frames"), "examples.seedvr2.media.geometry"),
}
__getattr__, __dir__ = moved_names(__name__, MOVED)
