"""Weights of a run: finding the downloaded files, loading the DiT sharded over ranks, and their bytes in memory."""
