"""Rollout side: SGLang client and launcher, the embedded SGLang-compatible server, the router.

Light to import (aiohttp only); the embedded server and its torch/transformers engine load on use.
"""

from megatron_dapo.rollout.client import SGLangClient, SGLangConnectionError, SGLangError, SGLangHTTPError
from megatron_dapo.rollout.router import NoHealthyServer, Router
from megatron_dapo.rollout.types import Sample, SamplingParams, WeightVersionSpan

__all__ = ["SGLangClient", "SGLangError", "SGLangHTTPError", "SGLangConnectionError", "Router", "NoHealthyServer",
           "Sample", "SamplingParams", "WeightVersionSpan"]
