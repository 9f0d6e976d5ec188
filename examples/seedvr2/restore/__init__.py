"""The restore: the pipeline, temporal batches, overlapping I/O, the stage clock, finished batches kept to resume."""
