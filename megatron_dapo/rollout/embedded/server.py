"""The embedded SGLang-compatible HTTP server (FastAPI + uvicorn) around `Engine`.

Same routes, request fields and answer shapes as SGLang 0.5.23 for what this project uses (see
`megatron_dapo/rollout/protocol.py`). Binds 127.0.0.1 unless told otherwise. With an api key, every
route requires `Authorization: Bearer <key>` and answers 401 otherwise, except `/health*`, which SGLang
leaves open for probes. Malformed bodies answer 400 with a message naming the field.

Weight updates follow SGLang's locking: while generation is paused an update proceeds at once; otherwise
it waits for in-flight requests to finish and holds new ones back until it is done. As in SGLang 0.5.23,
updates are refused outside a `/begin_weight_update` ... `/end_weight_update` session, and an update
with `flush_cache` loads the weights but fails when requests are still running (or queued, unless
paused), as after an in_place pause: SGLang would keep serving their stale cache.

Hardening beyond SGLang (limits.py): a body-size limit, a cap on the sequences of one /generate,
sampling values checked to the ranges the shared batch step can hold, `text` tokenized off the event
loop. Calls that wait on a peer (forming, destroying or receiving over a weight-update group) run in
their own daemon threads: they never hold up the admin routes or a SIGTERM, group formation answers
within --weight-group-timeout-s, and a group that forms after its client was answered is destroyed.

    megatron-dapo serve --model DIR [--port P] [--api-key K] [--host H] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import functools
import logging
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from megatron_dapo.rollout import weight_group as wgroup
from megatron_dapo.rollout.embedded import load_report
from megatron_dapo.rollout.embedded import schemas as S
from megatron_dapo.rollout.embedded.engine import BATCHING, Engine, GenRequest
from megatron_dapo.rollout.embedded.limits import BodySizeLimit, ServerLimits, sampling_range_problem
from megatron_dapo.rollout.embedded.load_stats import StepTrace
from megatron_dapo.rollout.embedded.tensor_payload import load_named_tensors
from megatron_dapo.rollout.embedded.weight_receiver import FlatBucketHomes, announcement_problem, receive
from megatron_dapo.rollout.embedded.weights import HFWeightLoader, WeightLoadError
from megatron_dapo.rollout.protocol import SGLANG_VERSION
from megatron_dapo.runtime.net import LOOPBACK

log = logging.getLogger("megatron_dapo.embedded")
OPEN_PATHS = ("/health", "/ready", "/metrics")  # as SGLang's decide_request_auth
FLUSH_CACHE_TEXT = ("Cache flushed.\nPlease check backend logs for more details. "
                    "(When there are running or waiting requests, the operation will not be performed.)\n")
# SGLang 0.5.23's own messages (srt/managers/scheduler_components/weight_updater.py, http_server.py)
NO_SESSION = "{route} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_TO_END = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")
FLUSH_FAILED_TEXT = "Flush cache failed.\n"
SHUTDOWN_GRACE_S = 5  # SIGTERM: in-flight requests get this long, then are cancelled


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run blocking `fn` in a thread of its own that neither an executor nor interpreter exit waits for:
    for calls that wait on a peer, which may never answer."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run():
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting route
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile (shutdown): nobody waits any more
            pass

    threading.Thread(target=run, name=f"embedded-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def _field_message(exc: RequestValidationError | ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in err.get("loc", ()) if p != "body"])
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "not a field this server accepts (unknown to SGLang or not implemented here)"
        parts.append(f"{loc or 'body'}: {msg}")
    return "; ".join(parts)


class _UpdateGate:
    """Generation holds it shared, an unpaused weight update exclusively (writer first), as SGLang's lock."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.readers = 0
        self.writer = False

    async def acquire_read(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer)
            self.readers += 1

    async def release_read(self):
        async with self.cond:
            self.readers -= 1
            self.cond.notify_all()

    async def acquire_write(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer)
            self.writer = True
            await self.cond.wait_for(lambda: self.readers == 0)

    async def release_write(self):
        async with self.cond:
            self.writer = False
            self.cond.notify_all()


class EmbeddedServer:
    def __init__(self, model, tokenizer=None, model_path: str = "", api_key: str | None = None,
                 weight_version: str = "default", max_batch: int = 64, seed: int = 0, batch_invariant: bool = False,
                 served_model_name: str | None = None, limits: ServerLimits | None = None,
                 step_trace: str | None = None, batching: str = "static", max_total_tokens: int | None = None):
        self.engine = Engine(model, tokenizer, max_batch=max_batch, seed=seed, weight_version=weight_version,
                             batch_invariant=batch_invariant, batching=batching, max_total_tokens=max_total_tokens,
                             step_trace=StepTrace(step_trace) if step_trace else None)
        self.loader = HFWeightLoader(model)
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path  # SGLang's default
        self.startup_time = time.time()
        self.launch_settings = {"random_seed": seed, "max_running_requests": max_batch,
                                "max_total_tokens": max_total_tokens,
                                "enable_deterministic_inference": batch_invariant}
        self.api_key = api_key
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.update_session: str | None = None  # the selector of the open weight-update session
        self._recv_buffer: torch.Tensor | None = None
        self.homes = FlatBucketHomes(self.loader)
        self.limits = limits or ServerLimits()
        # Own threads, so that neither long tokenizations nor waits on a peer can delay an admin command.
        self._admin_pool = ThreadPoolExecutor(2, thread_name_prefix="embedded-admin")
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="embedded-tokenize")
        self.app = self._build_app()

    # ---- helpers -------------------------------------------------------------------------------
    def _bad(self, message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    async def _wait_unpaused(self):
        while self.engine.is_paused():
            await asyncio.sleep(0.01)

    async def _exclusive(self, fn, *args):
        """Run blocking `fn` in a thread, as a weight update: at once if paused, else after draining."""
        async with self._update_lock:
            if self.engine.is_paused():
                return await in_daemon_thread(fn, *args)
            await self.gate.acquire_write()
            try:
                return await in_daemon_thread(fn, *args)
            finally:
                await self.gate.release_write()

    async def _admin(self, request: Request, fn, *args):
        """Apply an admin command on the admin threads, unless its client has already given up on it."""
        if await request.is_disconnected():
            log.warning("%s: the client gave up before it was applied; not applied", request.url.path)
            return None
        return await asyncio.get_running_loop().run_in_executor(self._admin_pool, fn, *args)

    async def _drop_group(self, name: str, pg=None) -> None:
        """Destroy the weight-update group `name` (only if it is still `pg`, when given: a failed update must not
        take down the group that replaced its own). In a daemon thread: a dead peer may hang the teardown."""
        if pg is not None and self.groups.get(name) is not pg:
            return
        pg = self.groups.pop(name, None)
        if pg is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(in_daemon_thread(wgroup.destroy_weight_update_group, pg)),
                                       self.limits.group_timeout_s)

    async def _tokenized(self, body: S.GenerateIn) -> S.GenerateIn:
        """`body` with its `text` tokenized (off the event loop: a long text takes seconds)."""
        if body.text is None or body.input_ids is not None or self.engine.tokenizer is None:
            return body
        encode = self.engine.tokenizer.encode
        texts = body.text if isinstance(body.text, list) else [body.text]
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool,
                                                               lambda: [encode(t) for t in texts])
        return body.model_copy(update={"input_ids": ids if isinstance(body.text, list) else ids[0], "text": None})

    def _scratch_buffer(self, layout) -> torch.Tensor:
        """Receive buffer for a flattened bucket that will not be loaded (a refused update must still take
        its bytes off the wire): kept between such updates on the CPU, fresh on a GPU."""
        if self.engine.device.type != "cpu":
            return torch.empty(layout.nbytes, dtype=torch.uint8, device=self.engine.device)
        if self._recv_buffer is None or self._recv_buffer.numel() < layout.nbytes:
            self._recv_buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        return self._recv_buffer[:layout.nbytes]

    def _max_update_bytes(self) -> int:
        # No update carries more than every parameter at twice its size (a float64 sender to a float32 server).
        return 2 * sum(p.numel() * p.element_size() for p in self.loader.params.values())

    def _load(self, named, weight_version, home=None, flush_cache: bool = False) -> bool:
        """Load; returns False when `flush_cache` asked for a flush that SGLang would refuse (busy)."""
        with self.engine.step_lock:
            if home is not None:
                self.homes.adopt(*home, named)
            self.loader.load(named)
            if weight_version is not None:
                self.engine.set_weight_version(weight_version)
            return not flush_cache or self.engine.is_idle()

    def _refused(self, route: str) -> JSONResponse | None:
        if self.update_session is None:
            return JSONResponse({"success": False, "message": NO_SESSION.format(route=route)}, 400)
        return None

    @staticmethod
    def _loaded(flushed: bool, message: str) -> dict | JSONResponse:
        """The answer to an update that loaded: with flush_cache, SGLang fails it unless the cache was
        flushed, i.e. the engine was idle right after the load (`_load` tells)."""
        if not flushed:
            return JSONResponse({"success": False, "message": NOT_FLUSHED}, 400)
        return {"success": True, "message": message}

    def _check_known(self, names, shapes) -> str | None:
        for name, shape in zip(names, shapes):
            try:
                dst, _ = self.loader.target(name)
            except WeightLoadError as e:
                return str(e)
            if list(dst.shape) != list(shape):
                return f"{name}: shape {list(shape)} != expected {list(dst.shape)}"
        return None

    def _model_card(self, name: str) -> dict:
        # SGLang's ModelCard (entrypoints/openai/protocol.py)
        return {"id": name, "object": "model", "created": int(self.startup_time), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": self._context_length()}

    def _context_length(self) -> int | None:
        return getattr(self.engine.model.config, "max_position_embeddings", None)

    def _accelerator(self) -> str | None:
        dev = self.engine.device
        return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None

    def _server_info(self) -> dict:
        """SGLang's /server_info shape: the launch settings (ServerArgs names), then live state."""
        eng = self.engine
        load = eng.load_report()
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name, "skip_tokenizer_init": eng.tokenizer is None,
            "device": eng.device.type, "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."),
            "context_length": self._context_length(), "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "weight_version": eng.weight_version, **self.launch_settings,
            "max_req_input_len": eng.max_context - 1, "startup_time": self.startup_time,
            "internal_states": [{"num_running_reqs": load.running, "num_waiting_reqs": load.waiting,
                                 "paused": eng.is_paused()}],
            "version": SGLANG_VERSION, "frontend": "megatron-dapo embedded",
        }

    def _make_requests(self, body: S.GenerateIn) -> list[GenRequest] | str:
        """The engine requests of a /generate body (one prompt, or a batch of prompts), or a 400 message."""
        if body.text is not None and body.input_ids is not None:
            return "text / input_ids: send one of them, not both (as SGLang)"
        if not body.is_batch:
            if isinstance(body.rid, list) or isinstance(body.sampling_params, list):
                return "rid / sampling_params: a list needs a batch of prompts (input_ids as a list of lists)"
            return self._entry_requests(body, body.input_ids, body.sampling_params, body.rid, "", body.text)
        prompts = body.input_ids if body.input_ids is not None else body.text
        k = len(prompts)
        sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * k
        if body.rid is None:
            base = uuid.uuid4().hex
            rids = [f"{base}_{i}" for i in range(k)]
        else:
            rids = body.rid if isinstance(body.rid, list) else [f"{body.rid}_{i}" for i in range(k)]
        if len(sps) != k or len(rids) != k:
            return (f"sampling_params / rid: {len(sps)} / {len(rids)} entries for a batch of {k} prompts "
                    "(need one each, or one sampling_params dict for all)")
        if k > self.limits.max_n:
            return f"input_ids: a batch of {k} prompts is above the limit of {self.limits.max_n} (server flag --max-n)"
        reqs = []
        for i, (prompt, sp, rid) in enumerate(zip(prompts, sps, rids)):
            ids, text = (None, prompt) if isinstance(prompt, str) else (prompt, None)
            entry = self._entry_requests(body, ids, sp, rid, f"[{i}]", text)
            if isinstance(entry, str):
                return entry
            if len(entry) > 1:
                return f"sampling_params[{i}].n: n > 1 inside a batch is not implemented here; send n prompts"
            reqs += entry
        if len({r.rid for r in reqs}) < len(reqs):
            return "rid: the batch repeats a rid"
        return reqs

    def _entry_requests(self, body: S.GenerateIn, ids, sp_raw, rid, at: str, text=None) -> list[GenRequest] | str:
        """One prompt's requests (n of them); `at` ("" or "[i]") locates it in a batch for messages."""
        eng = self.engine
        if ids is None:
            if text is None:
                return "input_ids: required (or text, with a tokenizer)"
            if eng.tokenizer is None:
                return "text: this server has no tokenizer; send input_ids"
            ids = eng.tokenizer.encode(text)
        if not ids:
            return f"input_ids{at}: empty prompt"
        if len(ids) >= eng.max_context:  # first: bounds the per-token check below
            return f"input_ids{at}: prompt of {len(ids)} tokens does not fit the context of {eng.max_context}"
        for i, t in enumerate(ids):
            if not 0 <= t < eng.vocab_size:
                return f"input_ids{at}[{i}]={t} is outside the vocabulary [0, {eng.vocab_size})"
        try:
            sp = S.SamplingParamsIn.model_validate(sp_raw or {})
        except ValidationError as e:
            return _field_message(e, prefix=f"sampling_params{at}")
        problem = sampling_range_problem(sp, eng.vocab_size, at)
        if problem is not None:
            return problem
        if (sp.n or 1) > self.limits.max_n:
            return f"sampling_params{at}.n: {sp.n} is above the limit of {self.limits.max_n} (server flag --max-n)"
        stop_strs = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        if stop_strs and eng.tokenizer is None:
            return f"sampling_params{at}.stop: stop strings need a tokenizer; use stop_token_ids"
        stop_regex = (sp.stop_regex,) if isinstance(sp.stop_regex, str) else tuple(sp.stop_regex or ())
        if stop_regex and eng.tokenizer is None:
            return f"sampling_params{at}.stop_regex: stop patterns need a tokenizer; use stop_token_ids"
        n = sp.n or 1
        rid = rid or uuid.uuid4().hex
        rids = [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
        for r in rids:
            if r in eng._active:
                return f"rid: {r!r} is already in flight"
        return [
            GenRequest(
                rid=r, prompt=list(ids),
                max_new_tokens=128 if sp.max_new_tokens is None else sp.max_new_tokens,
                temperature=1.0 if sp.temperature is None else sp.temperature,
                top_p=1.0 if sp.top_p is None else sp.top_p,
                top_k=-1 if sp.top_k is None else sp.top_k,
                stop_token_ids=frozenset(sp.stop_token_ids or ()),
                stop_strs=stop_strs, ignore_eos=bool(sp.ignore_eos),
                return_logprob=bool(body.return_logprob),
                logprob_start_len=-1 if body.logprob_start_len is None else body.logprob_start_len,
                sampling_seed=sp.sampling_seed,  # shared by the n copies, as in SGLang
                min_p=sp.min_p or 0.0,
                frequency_penalty=sp.frequency_penalty or 0.0,
                presence_penalty=sp.presence_penalty or 0.0,
                repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
                min_new_tokens=sp.min_new_tokens or 0,
                stop_regex=stop_regex,
                top_logprobs_num=body.top_logprobs_num or 0,
                return_text_in_logprobs=body.return_text_in_logprobs,
                skip_special_tokens=sp.skip_special_tokens is not False,
                spaces_between_special_tokens=sp.spaces_between_special_tokens is not False,
            )
            for r in rids
        ]

    # ---- app -----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            yield
            eng.close()
            for pool in (self._admin_pool, self._tokenize_pool):
                pool.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="megatron-dapo embedded SGLang-compatible server", lifespan=lifespan)
        self.gate = _UpdateGate()
        self._update_lock = asyncio.Lock()
        eng = self.engine

        @app.exception_handler(RequestValidationError)
        async def _validation(request: Request, exc: RequestValidationError):
            # SGLang answers 400, not FastAPI's 422, with this shape.
            return JSONResponse({"object": "error", "message": f"{request.url.path}: {_field_message(exc)}",
                                 "type": "Bad Request", "param": None, "code": 400}, status_code=400)

        # Added first, so it runs inside the auth check: a client without the key is refused before any
        # of its body is read.
        app.add_middleware(BodySizeLimit, max_bytes=self.limits.max_request_bytes)

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if self.api_key and not request.url.path.startswith(OPEN_PATHS):
                header = request.headers.get("Authorization", "")
                scheme, _, token = header.partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(token, self.api_key):
                    return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        @app.get("/health")
        @app.get("/health_generate")
        async def health():
            return Response(status_code=200)

        @app.get("/get_model_info")
        @app.get("/model_info")
        async def model_info():
            cfg = eng.model.config
            return {
                "model_path": self.model_path, "served_model_name": self.served_model_name,
                # SGLang's tokenizer_path defaults to the model path, tokenizer files or not
                "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": eng.weight_version, "load_format": None,
                "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
            }

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def server_info():
            return self._server_info()

        @app.get("/v1/models")
        async def list_models():
            return {"object": "list", "data": [self._model_card(self.served_model_name)]}

        @app.get("/v1/models/{model:path}")
        async def retrieve_model(model: str):
            if model != self.served_model_name:
                return JSONResponse({"error": {"message": f"The model '{model}' does not exist",
                                               "type": "invalid_request_error", "param": "model",
                                               "code": "model_not_found"}}, status_code=404)
            return self._model_card(model)

        @app.get("/v1/loads")
        async def loads(dp_rank: int | None = None, include: str | None = None, format: str | None = None):
            try:
                sections = load_report.parse_include(include)
            except ValueError as e:
                return JSONResponse({"detail": str(e)}, status_code=400)
            rows = [] if dp_rank not in (None, 0) else [load_report.select(load_report.load_row(eng), sections)]
            if format == "prometheus":
                return PlainTextResponse(load_report.prometheus_text(rows),
                                         media_type="text/plain; version=0.0.4; charset=utf-8")
            return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "version": SGLANG_VERSION, "accelerator": self._accelerator(), "num_accelerators": 1,
                    "loads": rows}

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(body: S.GenerateIn):
            reqs = self._make_requests(await self._tokenized(body))
            if isinstance(reqs, str):
                return self._bad(reqs)
            await self._wait_unpaused()
            await self.gate.acquire_read()
            try:
                futures = [asyncio.wrap_future(f) for f in eng.submit_many(reqs)]
                answers = await asyncio.gather(*futures)
            except ValueError as e:
                return self._bad(str(e))
            finally:
                await self.gate.release_read()
            return answers[0] if len(answers) == 1 and not body.is_batch else answers

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            # No prefix cache outlives a batch here; nothing to flush, but a busy server refuses as SGLang's
            # does, with SGLang's texts.
            if not eng.is_idle():
                return PlainTextResponse(FLUSH_FAILED_TEXT, status_code=400)
            return PlainTextResponse(FLUSH_CACHE_TEXT)

        @app.post("/abort_request")
        async def abort_request(body: S.AbortIn, request: Request):
            await self._admin(request, eng.abort, body.rid, body.abort_all)
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(body: S.PauseIn, request: Request):
            await self._admin(request, eng.pause, body.mode)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation(body: S.ContinueIn, request: Request):
            await self._admin(request, eng.resume)
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        async def release_memory(body: S.MemoryIn):
            if eng.device.type == "cuda" and (body.tags is None or "weights" in body.tags):
                def _off():
                    with eng.step_lock:
                        eng.model.to("cpu")
                        torch.cuda.empty_cache()
                await asyncio.to_thread(_off)
            return None  # SGLang's handler returns None: a JSON `null` body

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def resume_memory(body: S.MemoryIn):
            if eng.device.type == "cuda" and (body.tags is None or "weights" in body.tags):
                def _on():
                    with eng.step_lock:
                        eng.model.to(eng.device)
                await asyncio.to_thread(_on)
            return None  # as SGLang: a JSON `null` body

        @app.post("/init_weights_update_group")
        async def init_group(body: S.InitGroupIn, request: Request):
            if body.rank_offset >= body.world_size:
                return JSONResponse({"success": False, "message":
                                     f"rank_offset: {body.rank_offset} >= world_size {body.world_size}"}, 400)
            if body.group_name in self.groups:
                # As SGLang does, a new group replaces one of the same name: its trainer may have died
                # (killed, then resumed) without destroying it. A peer that is gone cannot take part
                # in the teardown, which therefore tolerates failures.
                log.warning("init_weights_update_group: replacing existing group %r", body.group_name)
                await self._drop_group(body.group_name)
            timeout = self.limits.group_timeout_s
            forming = in_daemon_thread(functools.partial(
                wgroup.init_weight_update_group, body.master_address, body.master_port, body.rank_offset,
                body.world_size, body.group_name, body.backend, connect_timeout_s=timeout))

            def destroy_late(done: asyncio.Future):  # formed after its client was answered: never used
                if not done.cancelled() and done.exception() is None:
                    log.warning("init_weights_update_group: group %r formed after its request was answered; "
                                "destroyed", body.group_name)
                    threading.Thread(target=wgroup.destroy_weight_update_group, args=(done.result(),),
                                     daemon=True).start()
            try:
                pg = await asyncio.wait_for(asyncio.shield(forming), timeout)
            except asyncio.TimeoutError:
                forming.add_done_callback(destroy_late)
                return JSONResponse({"success": False, "message": (
                    f"Failed to init group: {body.group_name!r} at {body.master_address}:{body.master_port} did "
                    f"not form within {timeout:g}s (server flag --weight-group-timeout-s)")}, 400)
            except asyncio.CancelledError:
                forming.add_done_callback(destroy_late)
                raise
            except Exception as e:
                return JSONResponse({"success": False, "message": f"Failed to init group: {e}"}, 400)
            if await request.is_disconnected():
                destroy_late(forming)
                return JSONResponse({"success": False, "message": "the client gave up; group destroyed"}, 400)
            self.groups[body.group_name] = pg
            return {"success": True, "message": "Succeeded to initialize custom process group."}

        @app.post("/destroy_weights_update_group")
        async def destroy_group(body: S.DestroyGroupIn):
            if body.group_name not in self.groups:
                return JSONResponse({"success": False, "message": f"group_name: no group {body.group_name!r}"}, 400)
            await self._drop_group(body.group_name)
            return {"success": True, "message": "Succeeded to destroy custom process group."}

        @app.post("/begin_weight_update")
        async def begin_weight_update(body: S.BeginUpdateIn):
            if self.update_session is not None:
                return JSONResponse({"success": False, "message": SESSION_OPEN}, 400)
            self.update_session = body.selector
            return {"success": True, "message": "Success"}

        @app.post("/end_weight_update")
        async def end_weight_update(body: S.EndUpdateIn):
            if self.update_session is None:
                return JSONResponse({"success": False, "message": NO_SESSION_TO_END}, 400)
            self.update_session = None
            return {"success": True, "message": "Success"}

        @app.post("/update_weights_from_distributed")
        async def update_distributed(body: S.UpdateDistributedIn):
            if (refused := self._refused("update_weights_from_distributed")) is not None:
                if body.group_name in self.groups:
                    # as below: the sender broadcasts anyway, and the next update must not load its bytes
                    log.warning("update outside a weight-update session: group %r destroyed", body.group_name)
                    await self._drop_group(body.group_name)
                return refused
            pg = self.groups.get(body.group_name)
            if pg is None:
                return JSONResponse({"success": False, "message": f"group_name: no group {body.group_name!r}; "
                                     "call /init_weights_update_group first"}, 400)
            unreceivable = announcement_problem(body.names, body.dtypes, body.shapes, self._max_update_bytes())
            if unreceivable is not None:
                # The sender broadcasts regardless; bytes left on the wire would be loaded by the next update.
                await self._drop_group(body.group_name, pg)
                return JSONResponse({"success": False, "message": (
                    f"Failed to update weights: {unreceivable}; its broadcast cannot be received, so group "
                    f"{body.group_name!r} was destroyed: call /init_weights_update_group again")}, 400)
            if body.abort_all_requests:
                await asyncio.to_thread(eng.abort, None, True)
            problem = self._check_known(body.names, body.shapes)

            def into(name, dtype, shape):
                # Receive straight into the parameter: nothing is generating now (paused, or drained
                # by the update gate), and it saves a copy of every byte.
                dst, _ = self.loader.target(name)
                ok = dst.dtype == dtype and dst.is_contiguous() and dst.device == eng.device
                return dst if ok else None

            received = []  # (layout, flat) of a flattened bucket meant for the model

            def flat_buffer(layout):
                if problem is not None:
                    return self._scratch_buffer(layout)
                received.append((layout, self.homes.buffer(layout, eng.device)))
                return received[-1][1]

            def run():
                named = receive(pg, body.names, body.dtypes, body.shapes, eng.device,
                                flattened=body.load_format == "flattened_bucket",
                                into=into if problem is None else None, flat_buffer=flat_buffer)
                if problem is None:
                    return self._load(named, body.weight_version, home=received[0] if received else None,
                                      flush_cache=body.flush_cache)

            try:
                flushed = await self._exclusive(run)
            except Exception as e:
                # A receive that failed part-way leaves the group out of step with the sender.
                await self._drop_group(body.group_name, pg)
                return JSONResponse({"success": False, "message": (
                    f"Failed to update weights: {e}; group {body.group_name!r} was destroyed: "
                    "call /init_weights_update_group again")}, 400)
            if problem is not None:
                return JSONResponse({"success": False, "message": f"Failed to update weights: {problem}"}, 400)
            msg = "Succeeded to update parameter online."
            if body.weight_version is not None:
                msg += f" Weight version updated to {body.weight_version}."
            return self._loaded(flushed, msg)

        @app.post("/update_weights_from_tensor")
        async def update_tensor(body: S.UpdateTensorIn):
            if (refused := self._refused("update_weights_from_tensor")) is not None:
                return refused
            if len(body.serialized_named_tensors) != 1:
                return JSONResponse({"success": False, "message": "serialized_named_tensors: this server has one TP "
                                     f"rank, got {len(body.serialized_named_tensors)} entries"}, 400)
            if body.abort_all_requests:
                await asyncio.to_thread(eng.abort, None, True)
            def decode():  # off the event loop: a large or deeply nested payload takes a while
                raw = base64.b64decode(body.serialized_named_tensors[0], validate=True)
                return load_named_tensors(raw, flattened=body.load_format == "flattened_bucket")
            try:
                named = await asyncio.to_thread(decode)
            except Exception as e:
                return JSONResponse({"success": False,
                                     "message": f"serialized_named_tensors: cannot deserialize ({e})"}, 400)
            problem = self._check_known([n for n, _ in named], [list(t.shape) for _, t in named])
            if problem is not None:
                return JSONResponse({"success": False, "message": f"Failed to update weights: {problem}"}, 400)
            flushed = await self._exclusive(self._load, named, body.weight_version, None, body.flush_cache)
            return self._loaded(flushed, "Success")

        @app.post("/update_weight_version")
        async def update_version(body: S.UpdateVersionIn, request: Request):
            def run():
                if body.abort_all_requests:
                    eng.abort(None, True)
                with eng.step_lock:
                    eng.set_weight_version(body.new_version)
            await self._admin(request, run)
            return {"success": True, "message": f"Weight version updated to {body.new_version}",
                    "new_version": body.new_version}

        return app


def load_model(path: str, device: str = "auto", dtype: str = "auto"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dt = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt or (torch.bfloat16 if dev.type == "cuda"
                                                                    else torch.float32))
    model.to(dev)
    tokenizer = None
    if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-dapo serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=os.environ.get("MEGATRON_DAPO_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $MEGATRON_DAPO_API_KEY)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-batch", type=int, default=64, help="most sequences running at once")
    p.add_argument("--batching", choices=BATCHING, default="static",
                   help="static: a batch runs until its last sequence ends, arrivals wait for the next one; "
                        "continuous: arrivals are prefilled between decode steps and join the running batch "
                        "(as SGLang schedules)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="the KV pool in tokens (SGLang's flag): requests wait while the running sequences fill it, "
                        "and a decode step that would overflow it retracts sequences (default: --max-batch "
                        "sequences of the full context)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None, help="the name /v1/models reports (default: --model)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant generation (SGLang's flag name): a request's tokens and logprobs do not "
                        "depend on the other requests; one forward per sequence and step (slower). "
                        "sampling_seed is honoured either way")
    defaults = ServerLimits()
    p.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                   help="largest request body; larger ones are answered 400 before they are read whole")
    p.add_argument("--max-n", type=int, default=defaults.max_n,
                   help="most sequences one /generate may start (its n, or the prompts of a batch)")
    p.add_argument("--weight-group-timeout-s", type=float, default=defaults.group_timeout_s,
                   help="/init_weights_update_group answers with an error if the group has not formed by then")
    p.add_argument("--step-trace", default=None, metavar="PATH",
                   help="append one JSON line per prefill / decode step (batch, KV tokens, seconds) to PATH, for "
                        "`megatron-dapo profile-engine --from-trace`; off by default")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        limits = ServerLimits(args.max_request_bytes, args.max_n, args.weight_group_timeout_s)
    except ValueError as e:
        parser.error(str(e))
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        parser.error(f"--max-total-tokens {args.max_total_tokens}: must be >= 1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    server = EmbeddedServer(model, tokenizer, model_path=args.model, api_key=args.api_key,
                            weight_version=args.weight_version, max_batch=args.max_batch, seed=args.seed,
                            batch_invariant=args.enable_deterministic_inference,
                            served_model_name=args.served_model_name, limits=limits, step_trace=args.step_trace,
                            batching=args.batching, max_total_tokens=args.max_total_tokens)
    print(f"embedded server: {args.model} on {server.engine.device} ({args.batching} batching), "
          f"loaded in {time.time() - t0:.1f}s, listening on http://{args.host}:{args.port}", flush=True)
    # A SIGTERM cancels what is still running after the grace period (a receive from a dead trainer,
    # say) instead of waiting for it; calls that wait on a peer run in daemon threads nobody joins.
    uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
