"""Hugging Face transformers' Swin V2 (``Swinv2Model``) run window-parallel by winsp: ``parallelize(model, config)``."""

from .adapter import parallelize, stage_schedule, unparallelize

__all__ = ["parallelize", "unparallelize", "stage_schedule"]
