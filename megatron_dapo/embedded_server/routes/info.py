"""What the server tells about itself, in SGLang 0.5.23's shapes: /health, /get_model_info,
/get_server_info, /v1/models and /v1/loads (JSON, or Prometheus text with `format=prometheus`)."""

from __future__ import annotations

import datetime

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from megatron_dapo.embedded_server import load_report
from megatron_dapo.embedded_server.state import ServerState, StateDep
from megatron_dapo.rollout.protocol import SGLANG_VERSION

router = APIRouter()


@router.get("/health")
@router.get("/health_generate")
async def health():
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(st: StateDep):
    eng = st.engine
    cfg = eng.model.config
    return {
        "model_path": st.model_path,
        "served_model_name": st.served_model_name,
        # SGLang's tokenizer_path defaults to the model path, tokenizer files or not
        "tokenizer_path": st.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": eng.weight_version,
        "load_format": None,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(st: StateDep):
    """SGLang's /server_info shape: the launch settings (ServerArgs names), then live state."""
    eng = st.engine
    load = eng.load_report()
    return {
        "model_path": st.model_path,
        "tokenizer_path": st.model_path,
        "served_model_name": st.served_model_name,
        "skip_tokenizer_init": eng.tokenizer is None,
        "device": eng.device.type,
        "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."),
        "context_length": _context_length(st),
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "weight_version": eng.weight_version,
        **st.launch_settings,
        "max_req_input_len": eng.max_context - 1,
        "startup_time": st.startup_time,
        "internal_states": [
            {"num_running_reqs": load.running, "num_waiting_reqs": load.waiting, "paused": eng.is_paused()}
        ],
        "version": SGLANG_VERSION,
        "frontend": "megatron-dapo embedded",
    }


@router.get("/v1/models")
async def list_models(st: StateDep):
    return {"object": "list", "data": [_model_card(st, st.served_model_name)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, st: StateDep):
    if model != st.served_model_name:
        return JSONResponse(
            {
                "error": {
                    "message": f"The model '{model}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            status_code=404,
        )
    return _model_card(st, model)


@router.get("/v1/loads")
async def loads(st: StateDep, dp_rank: int | None = None, include: str | None = None, format: str | None = None):
    try:
        sections = load_report.parse_include(include)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    rows = [] if dp_rank not in (None, 0) else [load_report.select(load_report.load_row(st.engine), sections)]
    if format == "prometheus":
        return PlainTextResponse(
            load_report.prometheus_text(rows), media_type="text/plain; version=0.0.4; charset=utf-8"
        )
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": _accelerator(st),
        "num_accelerators": 1,
        "loads": rows,
    }


def _model_card(st: ServerState, name: str) -> dict:
    # SGLang's ModelCard (entrypoints/openai/protocol.py)
    return {
        "id": name,
        "object": "model",
        "created": int(st.startup_time),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": _context_length(st),
    }


def _context_length(st: ServerState) -> int | None:
    return getattr(st.engine.model.config, "max_position_embeddings", None)


def _accelerator(st: ServerState) -> str | None:
    dev = st.engine.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
