"""Async HTTP client for one SGLang server (or the embedded SGLang-compatible server).

Connection failures before a request reaches the server (refused, connect timeout) and 503
answers (server starting) are retried with exponential backoff; a 4xx answer raises
`SGLangHTTPError` naming the endpoint and the server's message at once. A connection lost
mid-request raises `SGLangConnectionError`, so a router can resend the request elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Sequence

import aiohttp

from megatron_dapo.rollout import payloads
from megatron_dapo.rollout.types import Sample, SamplingParams, ServerLoad
from megatron_dapo.types import RoutingShape

log = logging.getLogger(__name__)


class SGLangError(RuntimeError):
    """Base class: a request to an SGLang server failed."""

    def __init__(self, endpoint: str, message: str, status: int | None = None):
        self.endpoint, self.status, self.server_message = endpoint, status, message
        where = f"{endpoint} answered {status}" if status is not None else endpoint
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # the constructor's arguments, not the formatted message: the coordinator pickles these
        return type(self), (self.endpoint, self.server_message, self.status), self.__dict__


class SGLangHTTPError(SGLangError):
    """The server answered with an error status (4xx: our request is wrong; 5xx: the server failed)."""


class SGLangConnectionError(SGLangError):
    """The server could not be reached, or the connection broke before an answer came."""


def _server_message(status: int, raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)
    return str(body)


def _json_or_none(raw: bytes):
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


KEEPALIVE_S = 2.0


class SGLangClient:
    """One server. Use as `async with SGLangClient(url) as c:` or call `aclose()`.

    The HTTP session is opened on first use, inside the event loop that uses the client (aiohttp
    binds a session to its loop); `request_hook(method, path, body)` sees every request before it goes.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        request_hook: Callable[[str, str, dict | None], None] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self._hook = request_hook
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # aiohttp, not httpx: a loopback round trip to FastAPI took 1.6-2.1 ms instead of 4.2-6.3 ms
            # on this project's CPU machines, client CPU that rank 0 pays for every /generate of every step.
            self._session = aiohttp.ClientSession(
                base_url=self.base_url + "/",
                headers=self._headers,
                # Idle connections are dropped before the server's keep-alive (uvicorn and SGLang: 5 s)
                # would close them: a request written into a connection the server just closed fails.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s, sock_connect=self._connect_timeout_s),
                trust_env=False,  # never route loopback traffic through a proxy from the environment
            )
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        params: dict | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """(status, body bytes) of a 2xx answer; raises SGLangHTTPError / SGLangConnectionError otherwise."""
        kwargs = {}
        if body is not None:
            kwargs["json"] = body
        if params:
            kwargs["params"] = params
        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        endpoint = f"{method} {self.base_url}{path}"
        if self._hook is not None:
            self._hook(method, path, body)
        for attempt in range(self.retries + 1):
            try:
                async with self._http().request(method, path.lstrip("/"), **kwargs) as resp:
                    status, raw = resp.status, await resp.read()
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                # Nothing reached the server: safe to resend, even a /generate.
                if attempt == self.retries:
                    raise SGLangConnectionError(endpoint, f"cannot connect ({e!r})") from e
            except asyncio.TimeoutError as e:  # the server took the request and never answered
                waited = self._timeout_s if timeout_s is None else timeout_s
                raise SGLangConnectionError(endpoint, f"no answer within {waited:g} s (timed out)") from e
            except aiohttp.ClientError as e:
                raise SGLangConnectionError(endpoint, f"connection lost ({e!r})") from e
            else:
                if status == 503 and attempt < self.retries:
                    pass  # starting up or shutting down: retry after a pause
                elif status >= 400:
                    raise SGLangHTTPError(endpoint, _server_message(status, raw), status)
                else:
                    return status, raw
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise SGLangHTTPError(endpoint, "server unavailable", 503)

    async def _post(self, path: str, body: dict | None = None, **kw) -> dict | list | None:
        _, raw = await self._request("POST", path, body if body is not None else {}, **kw)
        return _json_or_none(raw)

    # ---- generation ----------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        routing: RoutingShape | None = None,
        routed_experts_start_len: int = 0,
    ) -> list[Sample]:
        """Generate `sampling.n` samples for one prompt; returns them all when the last one finishes.
        With `routing` (routing replay) each sample carries its routed experts from position
        `routed_experts_start_len` on.

        With a list of n=1 sampling params (e.g. one sampling_seed each), one batch request samples the
        prompt once per entry, so the server takes the whole group at once; samples come back in order.
        """
        sampling = sampling or SamplingParams()
        rid = rid or uuid.uuid4().hex
        start = None if routing is None else routed_experts_start_len
        if not isinstance(sampling, SamplingParams):
            if not sampling or any(sp.n != 1 for sp in sampling):
                raise ValueError("generate: a list of sampling params needs n == 1 in each entry")
            body = payloads.generate_body(
                input_ids, list(sampling), rid=rid, return_logprob=return_logprob, routed_experts_start_len=start
            )
            answer = await self._post("/generate", body)
            if not isinstance(answer, list) or len(answer) != len(sampling):
                raise SGLangHTTPError(
                    f"POST {self.base_url}/generate", f"a batch of {len(sampling)} answered with {answer!r:.200}"
                )
            return payloads.parse_generate(answer, input_ids, server=self.base_url, routing=routing)
        body = payloads.generate_body(
            input_ids,
            sampling,
            rid=rid if sampling.n == 1 else None,
            return_logprob=return_logprob,
            routed_experts_start_len=start,
        )
        answer = await self._post("/generate", body)
        samples = payloads.parse_generate(answer, input_ids, server=self.base_url, routing=routing)
        if sampling.n == 1:
            samples[0].rid = samples[0].rid or rid
        return samples

    async def generate_fixed_length(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[int]:
        """Generate exactly `max_new_tokens` tokens for each prompt, in one batch; the output lengths."""
        answer = await self._post("/generate", payloads.fixed_length_body(prompts, max_new_tokens))
        if not isinstance(answer, list) or len(answer) != len(prompts):
            raise SGLangHTTPError(
                f"POST {self.base_url}/generate", f"a batch of {len(prompts)} answered with {answer!r:.200}"
            )
        return [len(item.get("output_ids") or []) for item in answer]

    async def prompt_logprobs(self, input_ids: Sequence[int], temperature: float = 1.0) -> list[float]:
        """Logprob of each token of `input_ids` given the ones before it (len(input_ids) - 1 values)."""
        sampling = SamplingParams(temperature=temperature, max_new_tokens=0)
        body = payloads.generate_body(
            input_ids, sampling, rid=uuid.uuid4().hex, return_logprob=True, logprob_start_len=0
        )
        return payloads.parse_input_logprobs(await self._post("/generate", body))

    # ---- control -------------------------------------------------------------------------------
    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            async with self._http().get("health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.25) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise SGLangConnectionError(f"GET {self.base_url}/health", f"not healthy after {timeout_s}s")
            await asyncio.sleep(interval_s)

    async def get_model_info(self) -> dict:
        return _json_or_none((await self._request("GET", "/get_model_info"))[1])

    async def get_loads(self) -> ServerLoad:
        """The server's own load (SGLang's /v1/loads, DP rank 0, core fields)."""
        answer = _json_or_none((await self._request("GET", "/v1/loads", params={"dp_rank": "0", "include": "core"}))[1])
        try:
            return payloads.parse_loads(answer, server=self.base_url)
        except ValueError as e:
            raise SGLangHTTPError(f"GET {self.base_url}/v1/loads", str(e)) from None

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._post("/abort_request", payloads.abort_body(rid, abort_all))

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._post("/pause_generation", payloads.pause_body(mode))

    async def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        return await self._post("/continue_generation", payloads.continue_body(torch_empty_cache))

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._post("/release_memory_occupation", payloads.memory_body(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", payloads.memory_body(tags))

    # ---- weight updates ------------------------------------------------------------------------
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = payloads.DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> dict:
        body = payloads.init_group_body(master_address, master_port, rank_offset, world_size, group_name, backend)
        return _check_success("/init_weights_update_group", await self._post("/init_weights_update_group", body))

    async def destroy_weights_update_group(self, group_name: str = payloads.DEFAULT_GROUP) -> dict:
        body = payloads.destroy_group_body(group_name)
        return _check_success("/destroy_weights_update_group", await self._post("/destroy_weights_update_group", body))

    async def begin_weight_update(self, selector: str = "all") -> dict:
        """Open SGLang's weight-update session; updates are refused outside one."""
        return _check_success(
            "/begin_weight_update", await self._post("/begin_weight_update", payloads.begin_update_body(selector))
        )

    async def end_weight_update(self) -> dict:
        return _check_success("/end_weight_update", await self._post("/end_weight_update", payloads.end_update_body()))

    @contextlib.asynccontextmanager
    async def weight_update_session(self, selector: str = "all"):
        """`async with client.weight_update_session(): await client.update_weights_from_tensor(...)`;
        the session is closed also when an update fails (the update's error is the one raised)."""
        await self.begin_weight_update(selector)
        try:
            yield self
        except BaseException:
            with contextlib.suppress(SGLangError):
                await self.end_weight_update()
            raise
        await self.end_weight_update()

    async def update_weights_from_distributed(
        self,
        names,
        dtypes,
        shapes,
        group_name: str = payloads.DEFAULT_GROUP,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict:
        body = payloads.update_distributed_body(
            names, dtypes, shapes, group_name, flush_cache, abort_all_requests, weight_version, load_format
        )
        return _check_success(
            "/update_weights_from_distributed", await self._post("/update_weights_from_distributed", body)
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> dict:
        """One update; call it inside `weight_update_session()` (SGLang refuses it outside a session)."""
        body = payloads.update_tensor_body(
            serialized_named_tensors, load_format, flush_cache, abort_all_requests, weight_version
        )
        return _check_success("/update_weights_from_tensor", await self._post("/update_weights_from_tensor", body))

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        body = payloads.update_version_body(new_version, abort_all_requests)
        return _check_success("/update_weight_version", await self._post("/update_weight_version", body))


def _check_success(endpoint: str, answer) -> dict:
    if not isinstance(answer, dict) or not answer.get("success", False):
        msg = answer.get("message") if isinstance(answer, dict) else answer
        raise SGLangHTTPError(endpoint, f"server reported failure: {msg}")
    return answer
