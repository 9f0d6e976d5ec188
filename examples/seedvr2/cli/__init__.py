"""The command line: ``restore`` and ``plan``, the parser, the --ranks launcher, stop signals, progress and text.

It was one module, ``examples.seedvr2.cli``; its names still import from here (see ``examples/seedvr2/_moved.py``).
"""

from __future__ import annotations

from .._moved import moved_names

#: a name of the old module ``examples.seedvr2.cli`` -> the module that defines it now
MOVED: dict[str, str] = {
    **dict.fromkeys(("argparse", "os", "sys", "time", "Optional", "Sequence", "MediaError", "check_output_directory",
                     "printable", "PORT_TAKEN_EXIT", "env_rank", "leave_note", "record_port_taken",
                     "speaks_for_stop", "run_restore", "describe_batches", "_print_error", "_stop_message", "main",
                     "_main", "_restore_batch", "_restore_file", "STAGE_TIMES_ENV", "_write_stage_times",
                     "_write_profile"), "examples.seedvr2.cli.restore"),
    **dict.fromkeys(("dataclasses", "read_error_reason", "check_scale", "frames_to_model", "h264_frame_size",
                     "model_to_frames", "parse_resolution", "plan_geometry", "WeightsError", "how_to_get_weights",
                     "resolve_cli_weights", "LONG_RUN_S", "LoadedModels", "_read_text_embeds", "load_models",
                     "_prepare"), "examples.seedvr2.cli.stages"),
    **dict.fromkeys(("math", "dataclass", "field", "STAGES", "StageProgress"), "examples.seedvr2.cli.progress"),
    **dict.fromkeys(("Callable", "torch", "abort_world", "init_world_from_env", "shutdown_world", "EXIT_MEETING_S",
                     "COLLECTIVE_TIMEOUT_S", "Launch", "PeerFailed", "agree_to_start", "agree_loaded", "RunState",
                     "is_peer_failure", "_peer_failure"), "examples.seedvr2.cli.agreement"),
    **dict.fromkeys(("COLOR_FIXES", "DEFAULT_CRF", "WEIGHT_MODES",
                     "DEFAULT_BATCH_FRAMES", "DEFAULT_OVERLAP", "PROG",
                     "DEFAULT_TEXT_EMBEDS", "DEFAULT_SEED", "InputError", "_Parser",
                     "_crf", "build_parser"), "examples.seedvr2.cli.parser"),
    **dict.fromkeys(("IMAGE_EXTENSIONS", "default_output_path", "output_kind",
                     "same_file", "LARGE_OUTPUT_PIXELS",
                     "CPU_SECONDS_PER_MEGAPIXEL_FRAME", "_fmt_size", "_resolve_dtype",
                     "resolve_output_path", "_default_image_output",
                     "_check_output_path", "_check_shardable", "_CHECKPOINT_KEYS",
                     "_check_checkpoint_files", "_check_given_checkpoints",
                     "_txt_in_dim", "estimate_restore_time"), "examples.seedvr2.cli.checks"),
    **dict.fromkeys(("Geometry", "check_batching", "_gib", "OutOfMemory", "_MEMORY_HELP", "pinned_settings",
                     "MemoryPlan", "_model_sizes", "plan_memory", "_plan_memory", "_output_changes",
                     "_suggest_sharding", "is_out_of_memory", "out_of_memory_error", "_peak_memory",
                     "_per_rank_figures"), "examples.seedvr2.cli.memory_plan"),
}
__getattr__, __dir__ = moved_names(__name__, MOVED)
