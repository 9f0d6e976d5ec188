"""The restore: the pipeline (encode, denoise, decode), temporal batches, overlapping I/O and the stage clock."""
