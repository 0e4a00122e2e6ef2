"""What one request may cost the embedded server, so that a hostile or careless request fails only itself.

SGLang bounds none of this; here a request beyond a limit is answered 400 naming the limit and the
server flag that sets it, before any work is queued for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

INT32_MAX = 2**31 - 1  # largest top_k / max_new_tokens that the batched sampling step's tensors hold


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 64 << 20  # --max-request-bytes: a request body, however it is sent
    max_n: int = 1024  # --max-n: sequences one /generate may start (n, or prompts x n in a batch)
    group_timeout_s: float = 60.0  # --weight-group-timeout-s: forming a weight-update group
    release_wait_s: float = 600.0  # --release-wait-timeout-s: a request's wait for released memory to resume

    def __post_init__(self):
        for flag, value in (
            ("--max-request-bytes", self.max_request_bytes),
            ("--max-n", self.max_n),
            ("--weight-group-timeout-s", self.group_timeout_s),
            ("--release-wait-timeout-s", self.release_wait_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag}: must be a positive number, got {value}")


def sampling_range_problem(sp, vocab_size: int, at: str) -> str | None:
    """Why the validated sampling params `sp` (SamplingParamsIn) cannot run in a shared batch, or None.

    Ranges are the real ones of the sampling step: a value that passes here cannot overflow or poison the
    tensors that every request of the batch shares.
    """
    # SGLang reads a top_k at or above the vocabulary as "whole vocabulary" (its own -1 becomes 1 << 30),
    # so clients send such values: accept them up to what the int32 / int64 batch tensors hold.
    if sp.top_k is not None and sp.top_k != -1 and not 1 <= sp.top_k <= INT32_MAX:
        return f"sampling_params{at}.top_k: {sp.top_k} is not -1 (whole vocabulary) or in 1..{INT32_MAX}"
    if sp.temperature is not None and not math.isfinite(sp.temperature):
        return f"sampling_params{at}.temperature: {sp.temperature} is not a finite number >= 0"
    if sp.max_new_tokens is not None and sp.max_new_tokens > INT32_MAX:
        return f"sampling_params{at}.max_new_tokens: {sp.max_new_tokens} is above {INT32_MAX}"
    if sp.stop_token_ids and not all(0 <= t < vocab_size for t in sp.stop_token_ids):
        return f"sampling_params{at}.stop_token_ids: ids must be in [0, {vocab_size})"
    return None


class BodySizeLimit:
    """ASGI middleware: read a request body up to `max_bytes` before the app sees it; 400 beyond.

    Checks the declared Content-Length first, then counts what actually arrives (a chunked body has no
    length), so an oversized body is never buffered whole.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone; nothing to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, size)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what comes after the body: a disconnect, if any
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int):
        message = (
            f"request body: {size} bytes or more is above the limit of {self.max_bytes} "
            "(server flag --max-request-bytes)"
        )
        payload = json.dumps({"error": {"message": message}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
