"""Rollout servers: SGLang client, protocol and launcher, the weight-update wire format, the embedded
SGLang-compatible server.

Light to import (aiohttp only); the embedded server and its torch/transformers engine load on use.
"""

from megatron_dapo.rollout.client import SGLangClient, SGLangConnectionError, SGLangError, SGLangHTTPError
from megatron_dapo.rollout.types import Sample, SamplingParams, WeightVersionSpan

__all__ = [
    "SGLangClient",
    "SGLangError",
    "SGLangHTTPError",
    "SGLangConnectionError",
    "Sample",
    "SamplingParams",
    "WeightVersionSpan",
]
