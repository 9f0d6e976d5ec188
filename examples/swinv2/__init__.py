"""Hugging Face transformers' Swin V2 (``Swinv2Model``) run window-parallel by winsp: ``parallelize(model, config)``."""

from .adapter import parallelize, plan

__all__ = ["parallelize", "plan"]
