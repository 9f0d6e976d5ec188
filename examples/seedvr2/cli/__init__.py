"""The command line: ``restore`` and ``plan``, the parser, the --ranks launcher, stop signals, progress and text.

It was one module, ``examples.seedvr2.cli``; its names still import from here (see ``examples/seedvr2/_moved.py``).
"""

from __future__ import annotations

from .._moved import moved_names

#: a name of the old module ``examples.seedvr2.cli`` -> the module that defines it now
MOVED: dict[str, str] = {
    **dict.fromkeys(("PROG", "DEFAULT_TEXT_EMBEDS", "DEFAULT_SEED", "STAGES", "EXIT_MEETING_S", "LONG_RUN_S",
                     "LARGE_OUTPUT_PIXELS", "CPU_SECONDS_PER_MEGAPIXEL_FRAME", "COLLECTIVE_TIMEOUT_S", "InputError",
                     "_Parser", "_crf", "build_parser", "StageProgress", "Launch", "_fmt_size", "_resolve_dtype",
                     "resolve_output_path", "_default_image_output", "_check_output_path", "_check_shardable",
                     "LoadedModels", "_read_text_embeds", "load_models", "_gib", "OutOfMemory", "_MEMORY_HELP",
                     "pinned_settings", "MemoryPlan", "_model_sizes", "PeerFailed", "agree_to_start", "agree_loaded",
                     "plan_memory", "_plan_memory", "_output_changes", "_suggest_sharding", "is_out_of_memory",
                     "out_of_memory_error", "_peak_memory", "_per_rank_figures", "_CHECKPOINT_KEYS",
                     "_check_checkpoint_files", "_check_given_checkpoints", "_txt_in_dim", "estimate_restore_time",
                     "_prepare", "RunState", "run_restore", "describe_batches", "is_peer_failure", "_peer_failure",
                     "_print_error", "_stop_message", "main", "_main", "_restore_batch", "_restore_file",
                     "STAGE_TIMES_ENV", "_write_stage_times", "_write_profile"), "examples.seedvr2.cli.restore"),
}
__getattr__, __dir__ = moved_names(__name__, MOVED)
