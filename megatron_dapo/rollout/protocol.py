"""The slice of SGLang 0.5.23's HTTP protocol this project speaks, and a checker for it.

Extracted from SGLang 0.5.23's own source (`pip download sglang==0.5.23 --no-deps`):
request classes from `sglang/srt/managers/io_struct.py`, sampling parameters from
`sglang/srt/sampling/sampling_params.py`, routes and answers from
`sglang/srt/entrypoints/http_server.py`, server flags from `sglang/srt/arg_groups/fields/*.py`.
`tests/fixtures/sglang_0.5.23_fields.json` is the snapshot `python -m megatron_dapo.rollout.protocol
--sglang-src DIR` writes; the conformance test compares the client's payloads against it and,
where SGLang's source is present, re-extracts it first.

| route (method)                          | body class                           | fields the client sends                              | answer                                |
|-----------------------------------------|--------------------------------------|------------------------------------------------------|---------------------------------------|
| /generate (POST)                        | GenerateReqInput                     | rid, input_ids, sampling_params, return_logprob, logprob_start_len, return_routed_experts, routed_experts_start_len | one dict, or a list when n > 1: `output_ids`, `text`, `meta_info` {id, finish_reason {type: stop/length/abort, ...}, prompt_tokens, completion_tokens, cached_tokens, e2e_latency, weight_version, weight_versions, output_token_logprobs [(logprob, token_id, text)], input_token_logprobs, routed_experts (base64 int32)} |
| /health, /health_generate (GET)         | -                                    | -                                                    | 200 / 503, never needs the api key    |
| /get_model_info, /model_info (GET)      | -                                    | -                                                    | {model_path, weight_version, ...}     |
| /flush_cache (GET, POST)                | query `timeout`                      | -                                                    | 200 text, or 400 while busy           |
| /abort_request (POST)                   | AbortReq                             | rid, abort_all                                       | 200, empty body                       |
| /pause_generation (POST)                | PauseGenerationReqInput              | mode: abort / retract / in_place                     | {"message", "status": "ok"}           |
| /continue_generation (POST)             | ContinueGenerationReqInput           | torch_empty_cache                                    | {"message", "status": "ok"}           |
| /release_memory_occupation (GET, POST)  | ReleaseMemoryOccupationReqInput      | tags                                                 | 200, JSON `null`                      |
| /resume_memory_occupation (GET, POST)   | ResumeMemoryOccupationReqInput       | tags                                                 | 200, JSON `null`                      |
| /init_weights_update_group (POST)       | InitWeightsUpdateGroupReqInput       | master_address, master_port, rank_offset, world_size, group_name, backend | {success, message}; 400 on failure |
| /destroy_weights_update_group (POST)    | DestroyWeightsUpdateGroupReqInput    | group_name                                           | {success, message}                    |
| /begin_weight_update (POST)             | BeginWeightUpdateReqInput            | selector: all / target / draft                       | {success, message}; 400 if a session is open |
| /end_weight_update (POST)               | EndWeightUpdateReqInput              | - (empty body)                                       | {success, message}; 400 if none is open |
| /update_weights_from_distributed (POST) | UpdateWeightsFromDistributedReqInput | names, dtypes, shapes, group_name, flush_cache, abort_all_requests, weight_version, load_format | {success, message}; 400 on failure |
| /update_weights_from_tensor (POST)      | UpdateWeightsFromTensorReqInput      | serialized_named_tensors (base64), load_format, flush_cache, abort_all_requests, weight_version | {success, message} |
| /update_weight_version (POST)           | UpdateWeightVersionReqInput          | new_version, abort_all_requests                      | {success, message, new_version}       |

Protocol facts that matter downstream (all from the 0.5.23 source):
- `/update_weights_from_distributed` and `/update_weights_from_tensor` answer 400 unless a weight-update
  session is open (`/begin_weight_update` before, `/end_weight_update` after;
  `srt/managers/scheduler_components/weight_updater.py`). `flush_cache=True` on an update fails the call
  ("Weights were updated, but the cache was not flushed ...") while requests are running or queued
  (queued ones do not count while paused); `/flush_cache` answers 400 then.
- Validation errors answer 400 (SGLang overrides FastAPI's 422) with `{"object": "error", "message", "type",
  "code"}`; other failures `{"error": {"message": ...}}`.
- With an api key, `Authorization: Bearer <key>` is required everywhere except `/health*`, `/ready` and
  `/metrics`; a wrong or missing key answers 401 `{"error": "Unauthorized"}` (`srt/utils/auth.py`).
- `update_weights_from_distributed` with `load_format="flattened_bucket"` receives ONE broadcast of a
  uint8 buffer holding the listed tensors back to back at byte offsets (each offset a multiple of its
  dtype's itemsize), `srt/weight_sync/tensor_bucket.py:FlattenedTensorBucket.empty`; otherwise one
  broadcast per name in order. The trainer is group rank 0, a server's TP rank i is rank_offset + i; the
  group is rendezvoused at tcp://master_address:master_port under a PrefixStore named group_name.
- Sampled-token logprobs are log_softmax(logits / temperature) BEFORE top-p / top-k filtering
  (`srt/layers/sampler.py`: `logprobs = log(probs)` of the temperature-scaled softmax, which is computed
  before `_sample_from_probs` filters); temperature < 1e-6 means greedy, reported as log_softmax(logits).
- `meta_info.weight_version` is the version when the answer was built; `meta_info.weight_versions`
  lists {version, start, end} spans of output tokens, on every finished request (one span when the
  weights did not change mid-request; `utils/weight_versions.py`).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.23"

# The request classes this project sends (route -> class in io_struct.py).
ROUTE_CLASSES: dict[str, str] = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}
SAMPLING_PARAMS_CLASS = "SamplingParams"
FLATTENED_BUCKET = "flattened_bucket"

# Where each piece lives inside an unpacked sglang package directory.
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
SERVER_ARG_FIELDS = "sglang/srt/arg_groups/fields"

DEFAULT_SNAPSHOT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / f"sglang_{SGLANG_VERSION}_fields.json"


@dataclass(frozen=True)
class ClassFields:
    """The fields of one SGLang request class: all of them, and those without a default."""

    fields: tuple[str, ...]
    required: tuple[str, ...]

    def check_payload(self, payload: dict, what: str) -> list[str]:
        """Problems with `payload` as a body of this class (empty list: it conforms)."""
        problems = [f"{what}: {k!r} is not a field of SGLang's class" for k in payload if k not in self.fields]
        problems += [f"{what}: required field {k!r} missing" for k in self.required if k not in payload]
        return problems


def _class_fields(tree: ast.Module) -> dict[str, ClassFields]:
    """Annotated class attributes per class, with fields inherited from classes of the same module."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    out: dict[str, ClassFields] = {}

    def resolve(name: str) -> ClassFields:
        if name in out:
            return out[name]
        node = classes[name]
        fields: list[str] = []
        required: list[str] = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                inherited = resolve(base.id)
                fields += [f for f in inherited.fields if f not in fields]
                required += [f for f in inherited.required if f not in required]
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.target.id.startswith("_"):
                    continue
                if stmt.target.id not in fields:
                    fields.append(stmt.target.id)
                if stmt.value is None and stmt.target.id not in required:
                    required.append(stmt.target.id)
                elif stmt.value is not None and stmt.target.id in required:
                    required.remove(stmt.target.id)
        out[name] = ClassFields(tuple(fields), tuple(required))
        return out[name]

    for name in classes:
        resolve(name)
    return out


def extract_sglang_fields(sglang_root: str | Path) -> dict:
    """Parse SGLang's source under `sglang_root` (the directory holding `sglang/`) into a snapshot dict."""
    root = Path(sglang_root)
    io_classes = _class_fields(ast.parse((root / IO_STRUCT).read_text()))
    sp_classes = _class_fields(ast.parse((root / SAMPLING_PARAMS).read_text()))
    missing = [c for c in ROUTE_CLASSES.values() if c not in io_classes]
    if missing:
        raise ValueError(f"{root / IO_STRUCT}: classes {missing} not found (not SGLang {SGLANG_VERSION}?)")
    server_args: list[str] = []
    for path in sorted((root / SERVER_ARG_FIELDS).glob("*.py")):
        for cls in _class_fields(ast.parse(path.read_text())).values():
            server_args += [f for f in cls.fields if f not in server_args]
    return {
        "source": f"sglang=={SGLANG_VERSION}: {IO_STRUCT}, {SAMPLING_PARAMS}, {SERVER_ARG_FIELDS}/*.py",
        "generated_by": "python -m megatron_dapo.rollout.protocol --sglang-src DIR",
        "classes": {
            name: {"fields": list(io_classes[name].fields), "required": list(io_classes[name].required)}
            for name in sorted(set(ROUTE_CLASSES.values()))
        },
        SAMPLING_PARAMS_CLASS: {"fields": list(sp_classes[SAMPLING_PARAMS_CLASS].fields), "required": []},
        "server_args": sorted(server_args),
    }


def load_snapshot(path: str | Path = DEFAULT_SNAPSHOT) -> dict:
    return json.loads(Path(path).read_text())


def class_fields(snapshot: dict, class_name: str) -> ClassFields:
    entry = snapshot[SAMPLING_PARAMS_CLASS] if class_name == SAMPLING_PARAMS_CLASS else snapshot["classes"][class_name]
    return ClassFields(tuple(entry["fields"]), tuple(entry["required"]))


def check_request(snapshot: dict, route: str, payload: dict) -> list[str]:
    """Problems with `payload` as the body SGLang expects on `route` (sampling params checked too)."""
    problems = class_fields(snapshot, ROUTE_CLASSES[route]).check_payload(payload, route)
    sp = payload.get("sampling_params") if route == "/generate" else None
    for i, one in enumerate(sp if isinstance(sp, list) else [sp]):  # a batch has one dict per prompt
        if isinstance(one, dict):
            where = f"{route} sampling_params" + (f"[{i}]" if isinstance(sp, list) else "")
            problems += class_fields(snapshot, SAMPLING_PARAMS_CLASS).check_payload(one, where)
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Extract SGLang request fields into a JSON snapshot.")
    p.add_argument("--sglang-src", required=True, help="directory holding the unpacked `sglang/` package")
    p.add_argument("--out", default=str(DEFAULT_SNAPSHOT))
    args = p.parse_args(argv)
    snap = extract_sglang_fields(args.sglang_src)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(snap, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
