"""The embedded SGLang-compatible HTTP server (FastAPI + uvicorn) around `Engine`.

Same routes, request fields and answer shapes as SGLang 0.5.23 for what this project uses (see
`megatron_dapo/rollout/protocol.py`). Binds 127.0.0.1 unless told otherwise. With an api key, every
route requires `Authorization: Bearer <key>` and answers 401 otherwise, except `/health*`, which SGLang
leaves open for probes. Malformed bodies answer 400 with a message naming the field.

The routes live in `routes/`, one router per concern: generation (generate.py), weight updates and their
locking (weights.py), engine commands (admin.py), what the server tells about itself (info.py). They share
one `ServerState` (state.py). Hardening beyond SGLang (limits.py): a body-size limit, a cap on the
sequences of one /generate, sampling values checked to the ranges the shared batch step can hold, `text`
tokenized off the event loop, calls that wait on a peer in daemon threads of their own.

    megatron-dapo serve --model DIR [--port P] [--api-key K] [--host H] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import secrets
import time

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from megatron_dapo.bridge import fp8
from megatron_dapo.bridge.hf_loader import HFWeightLoader
from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.embedded_server.engine import BATCHING, Engine, GenRequest
from megatron_dapo.embedded_server.limits import BodySizeLimit, ServerLimits
from megatron_dapo.embedded_server.load_stats import StepTrace
from megatron_dapo.embedded_server.memory import ModelMemory
from megatron_dapo.embedded_server.routes import admin, generate, info, weights
from megatron_dapo.embedded_server.state import ServerState
from megatron_dapo.runtime.cli_args import number
from megatron_dapo.runtime.lifetime import exit_with_parent_from_env
from megatron_dapo.runtime.net import LOOPBACK

OPEN_PATHS = ("/health", "/ready", "/metrics")  # as SGLang's decide_request_auth
SHUTDOWN_GRACE_S = 5  # SIGTERM: in-flight requests get this long, then are cancelled
# SIGTERM: the process is gone by then even if the graceful shutdown stalls (a stuck thread, a call that
# never returns): faulthandler's own thread dumps every thread's stack to stderr and exits, GIL or not
EXIT_DEADLINE_S = 20


class EmbeddedServer:
    """The server's state (`state`, its `engine`) and its FastAPI `app`."""

    def __init__(
        self,
        model,
        tokenizer=None,
        model_path: str = "",
        api_key: str | None = None,
        weight_version: str = "default",
        max_batch: int = 64,
        seed: int = 0,
        batch_invariant: bool = False,
        served_model_name: str | None = None,
        limits: ServerLimits | None = None,
        step_trace: str | None = None,
        batching: str = "static",
        max_total_tokens: int | None = None,
        return_routed_experts: bool = False,
        speed: float = 1.0,
        memory_saver: bool = False,  # SGLang's --enable-memory-saver: release frees the weights (memory.py)
        weights_cpu_backup: bool = False,  # SGLang's --enable-weights-cpu-backup: ... keeping a host copy
    ):
        self.engine = Engine(
            model,
            tokenizer,
            max_batch=max_batch,
            seed=seed,
            weight_version=weight_version,
            batch_invariant=batch_invariant,
            batching=batching,
            max_total_tokens=max_total_tokens,
            step_trace=StepTrace(step_trace) if step_trace else None,
            return_routed_experts=return_routed_experts,
            speed=speed,
        )
        self.state = ServerState(
            engine=self.engine,
            loader=HFWeightLoader(model),
            limits=limits or ServerLimits(),
            model_path=model_path,
            served_model_name=served_model_name or model_path,  # SGLang's default
            api_key=api_key,
            memory=ModelMemory(model, memory_saver, weights_cpu_backup),
            launch_settings={
                "random_seed": seed,
                "max_running_requests": max_batch,
                "max_total_tokens": max_total_tokens,
                "enable_deterministic_inference": batch_invariant,
                "enable_return_routed_experts": return_routed_experts,
                "enable_memory_saver": memory_saver,
                "enable_weights_cpu_backup": weights_cpu_backup,
            },
        )
        self.app = _build_app(self.state)

    def _make_requests(self, body: S.GenerateIn) -> list[GenRequest] | str:
        """The engine requests of a /generate body, or its 400 message."""
        return generate.make_requests(self.state, body)


def _build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="megatron-dapo embedded SGLang-compatible server", lifespan=_lifespan)
    app.state.server = state
    app.add_exception_handler(RequestValidationError, _validation)
    # Added first, so it runs inside the auth check: a client without the key is refused before any
    # of its body is read.
    app.add_middleware(BodySizeLimit, max_bytes=state.limits.max_request_bytes)
    app.middleware("http")(_auth)
    for routes in (info, generate, admin, weights):
        app.include_router(routes.router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    app.state.server.close()


async def _validation(request: Request, exc: RequestValidationError):
    # SGLang answers 400, not FastAPI's 422, with this shape.
    return JSONResponse(
        {
            "object": "error",
            "message": f"{request.url.path}: {generate.field_message(exc)}",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        },
        status_code=400,
    )


async def _auth(request: Request, call_next):
    api_key = request.app.state.server.api_key
    if api_key and not request.url.path.startswith(OPEN_PATHS):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token, api_key):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return await call_next(request)


def fp8_block_checkpoint(path: str) -> bool:
    """Whether the HF checkpoint at `path` is FP8 block-quantized (its config.json's quantization_config)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return False
    with open(cfg_file) as f:
        qc = json.load(f).get("quantization_config")
    try:
        return fp8.is_fp8_block_config(qc)
    except fp8.Fp8FormatError as e:
        raise fp8.Fp8FormatError(f"{cfg_file}: {e}") from None


def load_fp8_block_model(path: str, dtype: torch.dtype):
    """An FP8 block checkpoint served in `dtype`: the model built from its config without the quantization
    (transformers' FP8 path needs a GPU), each weight dequantized from its float8 values and block scales."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dapo.bridge.hf_io import HFCheckpointReader

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = HFCheckpointReader(path)
    stream = fp8.DequantizingStream(torch.float32)
    HFWeightLoader(model).load(stream.feed((name, reader.read(name)) for name in sorted(reader.names())))
    stream.finish()
    return model


def load_model(path: str, device: str = "auto", dtype: str = "auto"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    dt = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    dt = dt or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if fp8_block_checkpoint(path):
        model = load_fp8_block_model(path, dt)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
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
    p.add_argument(
        "--api-key",
        default=os.environ.get("MEGATRON_DAPO_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $MEGATRON_DAPO_API_KEY)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-batch", type=int, default=64, help="most sequences running at once")
    p.add_argument(
        "--batching",
        choices=BATCHING,
        default="static",
        help="static: a batch runs until its last sequence ends, arrivals wait for the next one; "
        "continuous: arrivals are prefilled between decode steps and join the running batch "
        "(as SGLang schedules)",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="the KV pool in tokens (SGLang's flag): requests wait while the running sequences fill it, "
        "and a decode step that would overflow it retracts sequences (default: --max-batch "
        "sequences of the full context)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None, help="the name /v1/models reports (default: --model)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant generation (SGLang's flag name): a request's tokens and logprobs do not "
        "depend on the other requests; one forward per sequence and step (slower). "
        "sampling_seed is honoured either way",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="SGLang's flag: a request with return_routed_experts gets the top-k expert ids of every MoE "
        "layer for every token (meta_info.routed_experts), for rollout routing replay; MoE models only",
    )
    defaults = ServerLimits()
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="largest request body; larger ones are answered 400 before they are read whole",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=defaults.max_n,
        help="most sequences one /generate may start (its n, or the prompts of a batch)",
    )
    p.add_argument(
        "--weight-group-timeout-s",
        type=float,
        default=defaults.group_timeout_s,
        help="/init_weights_update_group answers with an error if the group has not formed by then",
    )
    p.add_argument(
        "--release-wait-timeout-s",
        type=float,
        default=defaults.release_wait_s,
        help="a /generate arriving while memory is released (/release_memory_occupation) waits this long "
        "for /resume_memory_occupation, then is answered 503 naming the released tags",
    )
    p.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="SGLang's flag: /release_memory_occupation frees the weights' storage (their contents are "
        "dropped: the next weight update writes them after resume) and returns freed KV memory",
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="SGLang's flag: with --enable-memory-saver, keep a host copy of the weights while released and "
        "restore it on resume",
    )
    p.add_argument(
        "--step-trace",
        default=None,
        metavar="PATH",
        help="append one JSON line per prefill / decode step (batch, KV tokens, seconds) to PATH, for "
        "`megatron-dapo profile-engine --from-trace`; off by default",
    )
    p.add_argument(
        "--slowdown",
        type=number(float, 0.0, 1.0, low_open=True),
        default=1.0,
        metavar="F",
        help="run at F times this machine's pace, 0 < F <= 1: every prefill and decode step sleeps until it "
        "has taken 1/F of its own time (counted in /v1/loads and --step-trace), as a slower GPU would; "
        "the simulator's --engine-speed (default 1: no slowdown)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        limits = ServerLimits(
            args.max_request_bytes, args.max_n, args.weight_group_timeout_s, args.release_wait_timeout_s
        )
    except ValueError as e:
        parser.error(str(e))
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        parser.error(f"--max-total-tokens {args.max_total_tokens}: must be >= 1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    exit_with_parent_from_env()  # launched by a run (rollout.launcher): not outliving it
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    server = EmbeddedServer(
        model,
        tokenizer,
        model_path=args.model,
        api_key=args.api_key,
        weight_version=args.weight_version,
        max_batch=args.max_batch,
        seed=args.seed,
        batch_invariant=args.enable_deterministic_inference,
        served_model_name=args.served_model_name,
        limits=limits,
        step_trace=args.step_trace,
        batching=args.batching,
        max_total_tokens=args.max_total_tokens,
        return_routed_experts=args.enable_return_routed_experts,
        speed=args.slowdown,
        memory_saver=args.enable_memory_saver,
        weights_cpu_backup=args.enable_weights_cpu_backup,
    )
    print(
        f"embedded server: {args.model} on {server.engine.device} ({args.batching} batching), "
        f"loaded in {time.time() - t0:.1f}s, listening on http://{args.host}:{args.port}",
        flush=True,
    )
    # A SIGTERM cancels what is still running after the grace period (a receive from a dead trainer,
    # say) instead of waiting for it; calls that wait on a peer run in daemon threads nobody joins.
    config = uvicorn.Config(
        server.app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    _deadline_server(config).run()
    return 0


def _deadline_server(config):
    """A uvicorn server whose first SIGINT / SIGTERM also arms the hard exit deadline (EXIT_DEADLINE_S)."""
    import uvicorn

    class DeadlineServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)
            super().handle_exit(sig, frame)

    return DeadlineServer(config)
