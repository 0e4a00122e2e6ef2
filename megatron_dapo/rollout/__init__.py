"""Rollout servers: SGLang client, protocol and launcher, the weight-update wire format. The embedded
SGLang-compatible server is its own package above this one (megatron_dapo.embedded_server).

Light to import (aiohttp only).
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
