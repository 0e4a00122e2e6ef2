"""An SGLang 0.5.23 peer for the tests, built from SGLang's own code (installed, never copied here).

`ensure_installed()` pip-installs sglang==0.5.23 without dependencies, plus the small packages its HTTP
layer imports, into a cache directory (reused when present). The peer process (`python -m
tests.sglang_peer serve ...`) then runs, unmodified:
- SGLang's FastAPI app (`srt/entrypoints/http_server.py`) and its api-key middleware (`srt/utils/auth.py`);
- the tokenizer manager's control path (`TokenizerManager.pause_generation` / `continue_generation` and
  `TokenizerControlMixin`: the pause condition, the model-update lock, begin/end, the update calls);
- the scheduler's weight-update manager (`SchedulerWeightUpdaterManager`: the session gate, the flush rule)
  with `Scheduler.is_fully_idle` / `Scheduler.flush_cache` as the flush test;
- the model runner's `WeightUpdater` (process-group init, `receive_weights_from_distributed`,
  `update_weights_from_tensor`, `FlattenedTensorBucket`) and `TpModelWorker`'s group and deserialization
  methods;
- the manager's `release_memory_occupation` / `resume_memory_occupation` (the idle assertion, the tags),
  over a memory saver that records the regions it is told to pause and resume (torch_memory_saver is GPU-only).
Replaced: the model (records every tensor it is given to load), the process topology (one TP rank on
gloo) and generation (no forward pass: `scheduler.running_batch` holds placeholder requests; pause
modes move them as SGLang's scheduler moves its requests). Stubbed, because they are GPU-only or
cannot be installed beside torch 2.13 on CPU: see STUBBED.

`POST /peer/parse` (a list of /generate bodies) answers what SGLang's
`GenerateReqInput.normalize_batch_and_arguments` and `SamplingParams(...).normalize/verify` make of each.
`python -m tests.sglang_peer stops` answers where SGLang's own stop checks end a given token sequence.
`python -m tests.sglang_peer fp8-block` and `fp8-moe` run SGLang's FP8 block quantizer, linear method and MoE method
on saved tensors.
`python -m tests.sglang_peer routed-experts` encodes routed experts through SGLang's capturer and decodes
an answer's `meta_info["routed_experts"]` with SGLang's function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import types
from pathlib import Path

from tests import peer_packages
from tests.peer_packages import StubFinder

SGLANG = "sglang==0.5.23"
# What the HTTP layer, the request classes and the weight-update code import, beyond this project's
# own dependencies (pinned as SGLang 0.5.23 pins them where it does).
PACKAGES = (
    SGLANG,
    "openai==2.8.0",
    "xgrammar==0.2.7",
    "apache-tvm-ffi",
    "msgspec",
    "pyzmq",
    "orjson",
    "pybase64",
    "dill",
    "distro",
    "jiter",
    "python-multipart",
    "sniffio",
    "sentencepiece",
    "einops",
    "setproctitle",
    "gguf",
)
CACHE = Path(os.environ.get("MEGATRON_DAPO_SGLANG_CACHE", Path.home() / ".cache" / "megatron-dapo" / "sglang-0.5.23"))
# GPU-only kernels and libraries, plus torchvision (its wheels need a newer torch), soundfile and
# IPython (audio and notebook helpers): none of them is on the paths this peer runs.
STUBBED = (
    "sgl_kernel",
    "flashinfer",
    "triton_kernels",
    "vllm",
    "deep_gemm",
    "deep_ep",
    "sgl_deepep",
    "cuda",
    "cutlass",
    "quack",
    "flash_attn",
    "mooncake",
    "torchao",
    "compressed_tensors",
    "pynvml",
    "nvidia",
    "decord",
    "outlines",
    "llguidance",
    "partial_json_parser",
    "torchvision",
    "soundfile",
    "IPython",
)


def ensure_installed(cache: Path = CACHE) -> Path:
    """The cache directory with SGLang installed; raises (never skips) when PyPI cannot provide it."""
    return peer_packages.ensure_installed(cache, PACKAGES, "the SGLang peer tests")


def import_sglang(cache: Path = CACHE) -> None:
    """Make `import sglang` work in this process (call only in a process of its own: stubs stay); installs
    it first on a machine that has none (every subcommand may be the first to need it)."""
    from transformers.utils import import_utils

    ensure_installed(cache)

    # transformers caches whether torchvision exists; ask before the stub makes it look present
    import_utils.is_torchvision_available()
    import_utils.is_torchvision_greater_or_equal("0")
    sys.path.insert(0, str(cache))
    sys.meta_path.insert(0, StubFinder(STUBBED.__contains__))


# ---- the peer server -------------------------------------------------------------------------------
def _placeholder_request(i: int):
    """A request in the running batch: it holds KV until retracted (what the flush test reads)."""
    return types.SimpleNamespace(rid=f"running-{i}", finished=lambda: False, kv=types.SimpleNamespace(holds_kv=True))


class _RunningBatch:
    def __init__(self, reqs):
        self.reqs = list(reqs)
        self.batch_is_full = False

    def is_empty(self) -> bool:
        return not self.reqs


def build_peer(api_key: str | None, running_requests: int, load_path: str):
    """SGLang's control path wired to its own weight-update code over a recording model: returns the peer
    tokenizer-manager class (built inside the serving loop), SGLang's http_server module and the scheduler.
    `/v1/loads` serves the load snapshot file at `load_path`."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.runtime.net import LOOPBACK, free_port

    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{free_port()}", rank=0, world_size=1)

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers import tokenizer_manager as tm_mod
    from sglang.srt.managers.load_snapshot import ShmLoadSnapshotReader
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.aio_rwlock import RWLock

    get_context().set_server_args(
        ServerArgs(model_path="megatron-dapo/sglang-peer", device="cpu", api_key=api_key, skip_tokenizer_init=True)
    )
    # one TP rank; its "group" is what SGLang's barriers use (distributed init would build it)
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD, world_size=1)
    )

    class RecordingModel(torch.nn.Module):
        """The model SGLang loads into: keeps a copy of every tensor it is given, in order."""

        def __init__(self):
            super().__init__()
            self.received: list[tuple[str, torch.Tensor]] = []

        def load_weights(self, weights):
            self.received += [(name, t.detach().clone()) for name, t in weights]

    model = RecordingModel()
    runner = types.SimpleNamespace(model=model)
    runner.weight_updater = WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda **kw: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: runner,
    )
    worker = types.SimpleNamespace(model_runner=runner, _model_runner=runner)
    for name in (
        "init_weights_update_group",
        "destroy_weights_update_group",
        "deserialize_own_rank",
        "weight_update_runners",
    ):
        setattr(worker, name, types.MethodType(getattr(TpModelWorker, name), worker))

    class PeerScheduler:
        """The scheduler state SGLang's flush test reads; generation itself is not run."""

        def __init__(self):
            self.running_batch = _RunningBatch(_placeholder_request(i) for i in range(running_requests))
            self.waiting_queue: list = []
            self.chunked_req = self.last_batch = self.cur_batch_for_debug = self.draft_worker = None
            self.enable_overlap = self.enable_hisparse = self.enable_hierarchical_cache = self.enable_lmcache = False
            self._engine_paused = False
            self.disaggregation_mode = DisaggregationMode.NULL
            self.dllm_manager = types.SimpleNamespace(any_staging_reqs=lambda: False)
            self.grammar_manager = types.SimpleNamespace(grammar_queue=[], clear=lambda: None)
            self.flushes = 0
            self.tree_cache = types.SimpleNamespace(reset=self._count_flush)
            self.req_to_token_pool = types.SimpleNamespace(clear=lambda: None, reset_aux_cache_allocator=lambda: None)
            self.token_to_kv_pool_allocator = types.SimpleNamespace(clear=lambda: None)
            self.metrics_reporter = types.SimpleNamespace(reset_metrics=lambda: None, is_stats_logging_rank=False)
            self.weight_version = "default"
            self.is_fully_idle = types.MethodType(Scheduler.is_fully_idle, self)
            self.flush_cache = types.MethodType(Scheduler.flush_cache, self)

        def _count_flush(self):
            self.flushes += 1

        def _pp_microbatches_drained(self) -> bool:
            return True

        def record_weight_version_change(self, new_version):
            if new_version is not None:
                self.weight_version = new_version

        # what Scheduler.pause_generation / continue_generation do to the requests, without a KV pool
        def pause_generation(self, req):
            assert req.mode in ("in_place", "retract")
            self._engine_paused = True
            if req.mode == "retract":  # back to the queue, their KV released (retract_all)
                for r in self.running_batch.reqs:
                    r.kv.holds_kv = False
                self.waiting_queue += self.running_batch.reqs
                self.running_batch.reqs = []

        def continue_generation(self, req):
            self._engine_paused = False

        def abort_all(self):
            self.running_batch.reqs, self.waiting_queue = [], []

    class RecordingMemorySaver:
        """Stands in for torch_memory_saver (GPU-only): records each region SGLang pauses and resumes."""

        def __init__(self):
            self.calls: list[tuple[str, str]] = []

        def pause(self, tag):
            self.calls.append(("pause", tag))

        def resume(self, tag):
            self.calls.append(("resume", tag))

    sched = PeerScheduler()
    sched.memory_saver = RecordingMemorySaver()
    manager = SchedulerWeightUpdaterManager(
        tp_worker=worker,
        draft_worker=None,
        memory_saver_adapter=sched.memory_saver,
        flush_cache=sched.flush_cache,
        is_fully_idle=sched.is_fully_idle,
        scheduler=sched,
    )
    sched.manager, sched.model = manager, model

    class PeerTokenizerManager(tm_mod.TokenizerManager):
        """SGLang's TokenizerManager without its subprocesses: control calls reach the manager above."""

        def __init__(self):  # the real one spawns the scheduler and detokenizer processes
            self.server_args = get_context().server_args
            self.is_pause = False
            self.is_pause_cond = asyncio.Condition()
            self.model_update_lock = RWLock()
            self.mm_processor = None
            self.model_path = self.served_model_name = "megatron-dapo/sglang-peer"
            self.model_config = types.SimpleNamespace(
                hf_config=None,
                is_generation=True,
                context_len=4096,
                is_image_understandable_model=False,
                is_audio_understandable_model=False,
            )
            self.is_generation = True
            # /v1/loads reads what the peer's `/peer/load` wrote, through SGLang's shared-memory snapshot file
            self.elastic_worker_count = 1
            self.load_snapshot_reader = ShmLoadSnapshotReader(load_path, 1)
            flush = SchedulerFlushWrapper(
                flush_cache=sched.flush_cache, is_fully_idle=sched.is_fully_idle, send_output=lambda out, req: None
            )
            self.flush_cache_communicator = self._to_scheduler(flush.handle)
            for name, method in (
                ("init_weights_update_group", "init_weights_update_group"),
                ("destroy_weights_update_group", "destroy_weights_update_group"),
                ("begin_weight_update", "begin_weight_update"),
                ("end_weight_update", "end_weight_update"),
                ("update_weights_from_distributed", "update_weights_from_distributed"),
                ("update_weights_from_tensor", "update_weights_from_tensor"),
                ("release_memory_occupation", "release_memory_occupation"),
                ("resume_memory_occupation", "resume_memory_occupation"),
            ):
                setattr(self, f"{name}_communicator", self._to_scheduler(getattr(manager, method)))

        @staticmethod
        def _to_scheduler(fn):
            async def call(obj):
                out = await asyncio.to_thread(fn, obj)
                if isinstance(out, tuple):  # init/destroy answer (success, message) from the tp worker
                    return [types.SimpleNamespace(success=out[0], message=out[1])]
                return [out]

            return call

        def auto_create_handle_loop(self):
            pass

        async def _async_dispatch_to_scheduler(self, obj):  # what pause/continue send the scheduler
            {
                "PauseGenerationReqInput": sched.pause_generation,
                "ContinueGenerationReqInput": sched.continue_generation,
            }[type(obj).__name__](obj)

        def abort_request(self, rid: str = "", abort_all: bool = False):
            if abort_all:
                sched.abort_all()

    return PeerTokenizerManager, http_server, sched


def serve(port: int, api_key: str | None, running_requests: int) -> None:
    import_sglang()  # first: fastapi looks for orjson (installed beside SGLang) when it is imported
    import tempfile

    import uvicorn
    from fastapi.responses import JSONResponse, Response
    from safetensors.torch import save
    from sglang.srt.managers.load_snapshot import ShmLoadSnapshotWriter

    load_dir = tempfile.TemporaryDirectory(prefix="sglang-peer-loads-")
    load_path = os.path.join(load_dir.name, "loads.shm")
    load_writer = ShmLoadSnapshotWriter(load_path, dp_size=1, dp_rank=0)
    make_tm, http_server, sched = build_peer(api_key, running_requests, load_path)
    app = http_server.app

    @app.get("/peer/state")
    async def peer_state():
        return {
            "weight_version": sched.weight_version,
            "flushes": sched.flushes,
            "names": [n for n, _ in sched.model.received],
            "running": len(sched.running_batch.reqs),
            "waiting": len(sched.waiting_queue),
            "session_open": sched.manager._session is not None,
            "offload_tags": sorted(sched.manager.offload_tags),
            "memory_saver_calls": sched.memory_saver.calls,
        }

    @app.get("/peer/received")
    async def peer_received():
        # names may repeat across syncs: the last value of each, as the model would hold it
        return Response(
            save({n: t.contiguous() for n, t in sched.model.received}), media_type="application/octet-stream"
        )

    async def peer_parse(request):  # a plain Starlette route: the request itself, no FastAPI parsing
        return JSONResponse(json.loads(json.dumps(parse_payloads(await request.json()), default=repr)))

    app.add_route("/peer/parse", peer_parse, methods=["POST"])

    async def peer_load(request):
        """Publish a /v1/loads row (JSON) as DP rank 0's snapshot, the way SGLang's scheduler publishes its
        own: built into SGLang's LoadSnapshot, encoded with its msgpack encoder into the shared-memory slot
        that its /v1/loads route reads back with its typed decoder. 400 naming the error if SGLang's
        classes refuse the row."""
        try:
            snapshot = load_snapshot_from_row(await request.json())
        except Exception as e:  # what SGLang's classes said
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=400)
        load_writer.write(snapshot)
        return JSONResponse({})

    app.add_route("/peer/load", peer_load, methods=["POST"])

    @app.post("/peer/reset")
    async def peer_reset(running: int = running_requests):
        """Forget what was received; `running` placeholder requests in the running batch."""
        sched.model.received.clear()
        sched.running_batch.reqs = [_placeholder_request(i) for i in range(running)]
        sched.waiting_queue, sched.flushes = [], 0
        sched.memory_saver.calls.clear()
        return {}

    async def main():
        http_server.set_global_state(
            http_server._GlobalState(tokenizer_manager=make_tm(), template_manager=None, scheduler_info={})
        )
        if api_key:
            from sglang.srt.utils.auth import add_api_key_middleware

            add_api_key_middleware(app, api_key=api_key, admin_api_key=None)
        # lifespan off: SGLang's starts the OpenAI handlers and the warmup request, which need a tokenizer
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        print(f"sglang peer listening on {port}", flush=True)
        await uvicorn.Server(config).serve()

    asyncio.run(main())


def load_snapshot_from_row(row: dict):
    """SGLang's LoadSnapshot of a /v1/loads row: its constructors take the fields by name (an unknown one
    raises) and its typed msgpack decoder, the one its readers use, checks every value's type."""
    from sglang.srt.managers import load_snapshot as ls

    sections = {
        "memory": ls.MemoryMetrics,
        "speculative": ls.SpeculativeMetrics,
        "lora": ls.LoRAMetrics,
        "disaggregation": ls.DisaggregationMetrics,
        "queues": ls.QueueMetrics,
    }
    fields = {k: sections[k](**v) if k in sections and v is not None else v for k, v in row.items()}
    return ls.snapshot_decoder.decode(ls.snapshot_encoder.encode(ls.LoadSnapshot(**fields)))


# ---- SGLang's parsing of client payloads -----------------------------------------------------------
def parse_payloads(bodies: list[dict]) -> list[dict]:
    """For each /generate body: SGLang's normalized view of it, or the error its parsing raised."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for body in bodies:
        try:
            req = GenerateReqInput(**body)
            req.normalize_batch_and_arguments()
            sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params]
            parsed = []
            for sp in sps:
                p = SamplingParams(**(sp or {}))
                p.normalize(None)
                p.verify(vocab_size=1 << 20)
                parsed.append(
                    {
                        k: getattr(p, k)
                        for k in (
                            "n",
                            "temperature",
                            "top_p",
                            "top_k",
                            "max_new_tokens",
                            "sampling_seed",
                            "stop_token_ids",
                        )
                    }
                )
            rid = req.rid
            out.append(
                {
                    "ok": True,
                    "batch_size": getattr(req, "batch_size", 1),
                    "is_single": req.is_single,
                    "rid": rid,
                    "return_logprob": req.return_logprob,
                    "logprob_start_len": req.logprob_start_len,
                    "input_ids": req.input_ids,
                    "sampling": [{k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()} for d in parsed],
                }
            )
        except Exception as e:  # what SGLang's parsing said
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return out


# ---- SGLang's stop checks -------------------------------------------------------------------------
def finish_like_sglang(case: dict) -> dict:
    """Where SGLang's scheduler ends a request that generates `case["tokens"]` one per decode step
    (`Req.update_finish_state` after each), and the text its detokenizer answers for it
    (`DetokenizerManager.trim_matched_stop` on the token ids, decode, then on the text)."""
    from array import array

    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(case["tokenizer"])
    tok.additional_stop_token_ids = None  # what SGLang's get_tokenizer adds to a HF tokenizer
    params = SamplingParams(**case["sampling_params"])
    params.normalize(tok)
    req = Req("r", "", array("q", case["prompt"]), params, eos_token_ids=set(case["eos_token_ids"]))
    req.tokenizer = tok
    for t in case["tokens"]:
        req.output_ids.append(t)
        req.update_finish_state()
        if req.finished():
            break
    ids = list(req.output_ids_through_stop)
    reason = req.finished_reason.to_json() if req.finished_reason else None
    no_trim = bool(params.no_stop_trim)
    detok = types.SimpleNamespace(is_tool_call_parser_gpt_oss=False, tool_close_token_ids=())
    trim = DetokenizerManager.trim_matched_stop
    skip = params.skip_special_tokens
    text = tok.decode(trim(detok, ids, reason, no_trim), skip_special_tokens=skip)
    return {"output_ids": ids, "finish_reason": reason, "text": trim(detok, text, reason, no_trim)}


def stop_regex_max_len(pattern: str) -> int | str:
    """SGLang's tail window bound for one stop_regex (`get_max_seq_length`), or the error it raises."""
    from sglang.srt.sampling.sampling_params import get_max_seq_length

    try:
        return get_max_seq_length(pattern)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def stops(cases: dict) -> dict:
    import_sglang()
    return {
        "finish": [finish_like_sglang(c) for c in cases.get("finish", [])],
        "max_len": [stop_regex_max_len(p) for p in cases.get("patterns", [])],
    }


def routed_experts(cases: list[dict]) -> list[dict]:
    """Per case, SGLang's own routed-expert output path and decoder (`state_capturer/`,
    `DetokenizerManager._b64_encode_per_request`, `extract_routed_experts_from_meta_info`):
    `encoded`: what SGLang answers for a sequence whose prefill routed as `topk` ([seqlen, layers, k])
    with `start_len`; `decoded`: SGLang's decoding of `meta_info` (flat int32 ids)."""
    import_sglang()
    import numpy as np
    import torch
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.state_capturer.base import BaseTopkCapturer
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    # host memory without cudaHostRegister (GPU-only page locking); the capturer is SGLang's otherwise
    common.ALLOC_MEMORY_FUNCS["cpu"] = lambda dims, dtype, device, pin_memory, allocator, **kw: allocator.allocate(
        dims, dtype=dtype, device=device
    )
    out = []
    for case in cases:
        topk = torch.tensor(case["topk"], dtype=torch.int32)
        seqlen, layers, k = topk.shape
        cap = BaseTopkCapturer(
            num_tokens=seqlen,
            max_batch_size=seqlen,
            num_layers=layers,
            topk_size=k,
            device="cpu",
            name="routed_experts",
        )
        for layer_id in range(layers):  # one prefill forward of the whole sequence, as the MoE layers capture
            cap.capture(layer_id, topk[:, layer_id])
        loc = torch.arange(seqlen)
        cap.on_forward_end(types.SimpleNamespace(out_cache_loc=loc, out_cache_loc_virtual=None), False, None)
        pool = types.SimpleNamespace(req_to_token=loc.unsqueeze(0))
        rows = cap.get_topk(req_pool_idx=0, seqlen=seqlen, req_to_token_pool=pool, start_len=case["start_len"])
        (encoded,) = DetokenizerManager._b64_encode_per_request([rows])
        decoded = extract_routed_experts_from_meta_info({"meta_info": case["meta_info"]})
        out.append({"encoded": encoded, "decoded": np.asarray(decoded).tolist()})
    return out


# ---- SGLang's FP8 block path ----------------------------------------------------------------------
def fp8_block(in_path: str, out_path: str) -> None:
    """SGLang's own FP8 block code on the tensors in `in_path` (torch.save of a dict), written to `out_path`:

    - `quantized[name]`: (weight, scale) from SGLang's block quantizer with float32 scales,
      `mxfp8_block_convert.bf16_to_block_fp8_128` (the DeepSeek-V3 / Qwen3-FP8 contract), of each
      `bf16[name]`; `ue8m0[name]`: from `fp8_utils.per_block_cast_to_fp8` (DeepGEMM's power-of-two scales).
    - `layers[prefix]`: for each linear of `linears` ({prefix: {"kind": qkv|merged|row, "shapes": ...,
      "first": ..., "shards": {shard_id: (weight, scale)}}}), SGLang's `Fp8Config.from_config(quantization_config)`
      builds the layer (QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear, TP 1), its weight
      loaders take each shard's weight and `weight_scale_inv` of `first` (a server start), then of `shards` (an
      online update: `restore_weights_before_loading`, the loaders), `process_weights_after_loading` runs after
      each (the CUDA path with DeepGEMM off: neither this machine's CPU engine nor DeepGEMM is selected), and SGLang's
      `block_quant_dequant` gives the layer's dequantized weight (float32), beside its weight and scales.
    Not run: the layer's forward (`apply`: the w8a8 block GEMM is a Triton / CUDA kernel)."""
    import_sglang()
    import torch
    import torch.distributed as dist

    from megatron_dapo.runtime.net import LOOPBACK, free_port

    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{free_port()}", rank=0, world_size=1)
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant, per_block_cast_to_fp8
    from sglang.srt.layers.quantization.mxfp8_block_convert import bf16_to_block_fp8_128
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path="megatron-dapo/fp8", device="cpu", skip_tokenizer_init=True))
    group = types.SimpleNamespace(cpu_group=dist.group.WORLD, world_size=1, rank_in_group=0)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, tp_group=group)

    case = torch.load(in_path)
    out: dict = {"quantized": {}, "ue8m0": {}, "layers": {}}
    for name, w in case.get("bf16", {}).items():
        out["quantized"][name] = bf16_to_block_fp8_128(w)
        out["ue8m0"][name] = per_block_cast_to_fp8(w)
    config = Fp8Config.from_config(case["quantization_config"])
    for prefix, spec in case.get("linears", {}).items():
        kind, shapes = spec["kind"], spec["shapes"]
        kw = dict(bias=False, quant_config=config, prefix=prefix, params_dtype=torch.bfloat16)
        if kind == "qkv":  # hidden, head_dim, heads, kv_heads
            layer = QKVParallelLinear(*shapes, **kw)
        elif kind == "merged":  # hidden, [gate, up]
            layer = MergedColumnParallelLinear(shapes[0], shapes[1], **kw)
        else:  # in, out
            layer = RowParallelLinear(*shapes, **kw)
        assert isinstance(layer.quant_method, Fp8LinearMethod), type(layer.quant_method)
        # the server start (`first`: the checkpoint's weights), then an online update as SGLang's weight-update
        # session runs it: begin (restore_weights_before_loading), the weight loaders, end (post-loading step)
        for i, shards in enumerate((spec["first"], spec["shards"])):
            if i:
                layer.quant_method.restore_weights_before_loading(layer)
            for shard_id, (w, s) in shards.items():
                args = () if shard_id is None else (shard_id,)
                layer.weight.weight_loader(layer.weight, w, *args)
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, *args)
            layer.quant_method.process_weights_after_loading(layer)
        w, s = layer.weight.data, layer.weight_scale_inv.data
        out["layers"][prefix] = {
            "weight": w.clone(),
            "scale": s.clone(),
            "dequantized": block_quant_dequant(w, s, config.weight_block_size, torch.float32),
        }
    torch.save(out, out_path)


def _moe_holder(prefix: str, num_experts: int, layer):
    """A module tree that puts `layer` at `prefix` (e.g. model.layers.1.mlp.experts), so that
    `Qwen3MoeForCausalLM.load_weights` finds it by the parameter names it maps checkpoint names to."""
    import torch

    holder = torch.nn.Module()
    holder.config = types.SimpleNamespace(num_experts=num_experts)
    parent = holder
    *path, leaf = prefix.split(".")
    for part in path:
        if not hasattr(parent, part):
            parent.add_module(part, torch.nn.Module())
        parent = getattr(parent, part)
    parent.add_module(leaf, layer)
    return holder


def fp8_moe(in_path: str, out_path: str) -> None:
    """SGLang's own FP8 MoE path on the tensors in `in_path` (torch.save of a dict), written to `out_path`.

    For each `moe[prefix]` ({"shapes": [num_experts, hidden, moe_intermediate, top_k], "ep": [size, rank],
    "first": [(name, tensor)...], "update": [(name, tensor)...]}, names as an HF checkpoint spells them:
    `{prefix}.{e}.gate_proj.weight`, `...weight_scale_inv`), SGLang's `Fp8Config.from_config(quantization_config)`
    picks `Fp8MoEMethod` for SGLang's `FusedMoE` layer (TP 1, expert parallel `ep`), whose `create_weights`
    makes the stacked w13 / w2 weights and block scales; `Qwen3MoeForCausalLM.load_weights` maps the names
    (`FusedMoE.make_expert_params_mapping`) and calls the layer's `weight_loader` per expert and shard, first for
    a server start (`first`, then `DefaultModelLoader.postprocess_weights`), then for an online update as the
    weight updater runs one (`DefaultModelLoader.restore_weights_before_loading`, `load_weights`,
    `postprocess_weights`: `Fp8MoEMethod.process_weights_after_loading`, the CUDA path with DeepGEMM off).
    Out: `moe[prefix]` = {w13_weight, w13_weight_scale_inv, w2_weight, w2_weight_scale_inv, w13_dequantized,
    w2_dequantized (SGLang's `block_quant_dequant` per local expert, float32)} or {"error": str} when SGLang
    refuses the shapes. Not run: the forward (`apply`: the Triton fused-MoE kernel, `fused_experts`)."""
    import_sglang()
    import torch
    import torch.distributed as dist

    from megatron_dapo.runtime.net import LOOPBACK, free_port

    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{free_port()}", rank=0, world_size=1)
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path="megatron-dapo/fp8", device="cpu", skip_tokenizer_init=True))
    group = types.SimpleNamespace(cpu_group=dist.group.WORLD, world_size=1, rank_in_group=0)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, tp_group=group, moe_tp_size=1, moe_tp_rank=0)

    case = torch.load(in_path)
    config = Fp8Config.from_config(case["quantization_config"])
    cpu = torch.device("cpu")
    out: dict = {"moe": {}}
    for prefix, spec in case["moe"].items():
        num_experts, hidden, inter, top_k = spec["shapes"]
        ep_size, ep_rank = spec.get("ep", (1, 0))
        # a rank of a server with TP = EP = ep_size (SGLang's MoE layers are expert parallel within the TP group)
        # (no collective runs on the loading path: the group only has to say its size)
        rank_group = types.SimpleNamespace(cpu_group=dist.group.WORLD, world_size=ep_size, rank_in_group=ep_rank)
        get_parallel().override_permanently(
            tp_size=ep_size,
            tp_rank=ep_rank,
            tp_group=rank_group,
            attn_tp_size=ep_size,
            attn_tp_rank=ep_rank,
            moe_ep_size=ep_size,
            moe_ep_rank=ep_rank,
        )
        layer_id = int(prefix.split(".")[2])
        try:
            layer = FusedMoE(
                num_experts=num_experts,
                hidden_size=hidden,
                intermediate_size=inter,
                layer_id=layer_id,
                top_k=top_k,
                quant_config=config,
                prefix=prefix,
                params_dtype=torch.bfloat16,
            )
        except ValueError as e:  # SGLang refuses these shapes for block FP8
            out["moe"][prefix] = {"error": str(e)}
            continue
        assert isinstance(layer.quant_method, Fp8MoEMethod), type(layer.quant_method)
        model = _moe_holder(prefix, num_experts, layer)
        Qwen3MoeForCausalLM.load_weights(model, iter(spec["first"]))
        DefaultModelLoader.postprocess_weights(model, cpu)
        # the online update, as WeightUpdater.begin_weight_update / end_weight_update run it
        DefaultModelLoader.restore_weights_before_loading(model, cpu)
        Qwen3MoeForCausalLM.load_weights(model, iter(spec["update"]))
        DefaultModelLoader.postprocess_weights(model, cpu)
        stored = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")
        got = {n: getattr(layer, n).data.clone() for n in stored}
        for w in ("w13", "w2"):
            q, s = got[f"{w}_weight"], got[f"{w}_weight_scale_inv"]
            got[f"{w}_dequantized"] = torch.stack(
                [block_quant_dequant(q[e], s[e], config.weight_block_size, torch.float32) for e in range(q.shape[0])]
            )
        got["num_local_experts"] = layer.num_local_experts
        out["moe"][prefix] = got
    torch.save(out, out_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument(
        "--api-key",
        default=os.environ.get("SGLANG_PEER_API_KEY"),
        help="(default: $SGLANG_PEER_API_KEY, kept off the command line)",
    )
    s.add_argument(
        "--running-requests",
        type=int,
        default=0,
        help="placeholder requests in the running batch (as generation in flight would leave)",
    )
    sub.add_parser("install")
    f = sub.add_parser("fp8-block", help="SGLang's FP8 block quantizer and linear method on saved tensors")
    f.add_argument("input")
    f.add_argument("output")
    m = sub.add_parser("fp8-moe", help="SGLang's FP8 MoE method and FusedMoE loaders on saved tensors")
    m.add_argument("input")
    m.add_argument("output")
    sub.add_parser("routed-experts", help="stdin: [case...]; stdout: SGLang's encoding and decoding (JSON)")
    sub.add_parser("stops", help="stdin: {finish: [case...], patterns: [...]}; stdout: SGLang's answers (JSON)")
    args = p.parse_args(argv)
    if args.cmd == "install":
        print(ensure_installed())
    elif args.cmd == "routed-experts":
        print(json.dumps(routed_experts(json.load(sys.stdin))))
    elif args.cmd == "fp8-block":
        fp8_block(args.input, args.output)
    elif args.cmd == "fp8-moe":
        fp8_moe(args.input, args.output)
    elif args.cmd == "stops":
        print(json.dumps(stops(json.load(sys.stdin))))
    else:
        serve(args.port, args.api_key, args.running_requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
