"""Layer 6, adoption: make an existing model window-parallel without editing its code.

:func:`~winsp.adoption.parallelize.parallelize` applies a :class:`~winsp.adoption.parallelize.ParallelPlan` (plain
data about the model); :func:`~winsp.adoption.swapped.swapped` writes a module swap as one function;
:class:`~winsp.adoption.token_io.FlatTokens` reads ``[B, L, C]`` regions, :class:`~winsp.adoption.token_io.Patches` a
whole video DiT's latents; :class:`~winsp.adoption.replicated.Replicated` names the tokens every rank holds whole.
The region checks and the functional dropout policy run inside a region.
"""

from winsp.adoption.hourglass import Hourglass
from winsp.adoption.parallelize import (
    ChannelsLast,
    ParallelPlan,
    Region,
    TokenIO,
    adopt,
    is_parallelized,
    parallelize,
    unparallelize,
)
from winsp.adoption.per_sample import PerSampleOnRows
from winsp.adoption.region import ChannelsFirst
from winsp.adoption.replicated import Replicated
from winsp.adoption.sharding import shard_weights
from winsp.adoption.space_time import SpaceTime
from winsp.adoption.swapped import Swapped, swapped
from winsp.adoption.token_io import FlatTokens, Patches

__all__ = ["parallelize", "unparallelize", "is_parallelized", "ParallelPlan", "Region", "ChannelsLast", "TokenIO",
           "FlatTokens", "Patches", "Replicated", "adopt", "swapped", "Swapped", "shard_weights", "Hourglass",
           "PerSampleOnRows", "SpaceTime", "ChannelsFirst"]
