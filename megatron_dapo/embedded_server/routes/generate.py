"""/generate: one prompt or a batch of prompts, with SGLang 0.5.23's fields and answers.

A malformed body answers 400 with a message naming the field (`sampling_params[i].top_p`, `input_ids[i]`,
...). `text` is tokenized off the event loop. While generation is paused a request waits; otherwise it
holds the update gate shared, so that an unpaused weight update waits for it to finish. While memory is
released (/release_memory_occupation) a request waits for the resume, at most --release-wait-timeout-s.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from megatron_dapo.embedded_server import schemas as S
from megatron_dapo.embedded_server.engine import Engine, GenRequest
from megatron_dapo.embedded_server.limits import sampling_range_problem
from megatron_dapo.embedded_server.state import ServerState, StateDep

router = APIRouter()


def field_message(exc: RequestValidationError | ValidationError, prefix: str = "") -> str:
    """The 400 message of a validation error: each field's path (under `prefix`) and what is wrong with it."""
    parts = []
    for err in exc.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in err.get("loc", ()) if p != "body"])
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "not a field this server accepts (unknown to SGLang or not implemented here)"
        parts.append(f"{loc or 'body'}: {msg}")
    return "; ".join(parts)


def _bad(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: S.GenerateIn, st: StateDep):
    reqs = make_requests(st, await _tokenized(st, body))
    if isinstance(reqs, str):
        return _bad(reqs)
    if (released := await st.wait_resident()) is not None:
        return _bad(released, 503)
    while st.engine.is_paused():
        await asyncio.sleep(0.01)
    await st.gate.acquire_read()
    try:
        futures = [asyncio.wrap_future(f) for f in st.engine.submit_many(reqs)]
        answers = await asyncio.gather(*futures)
    except ValueError as e:
        return _bad(str(e))
    finally:
        await st.gate.release_read()
    return answers[0] if len(answers) == 1 and not body.is_batch else answers


async def _tokenized(st: ServerState, body: S.GenerateIn) -> S.GenerateIn:
    """`body` with its `text` tokenized (off the event loop: a long text takes seconds)."""
    if body.text is None or body.input_ids is not None or st.engine.tokenizer is None:
        return body
    encode = st.engine.tokenizer.encode
    texts = body.text if isinstance(body.text, list) else [body.text]
    ids = await asyncio.get_running_loop().run_in_executor(st.tokenize_pool, lambda: [encode(t) for t in texts])
    return body.model_copy(update={"input_ids": ids if isinstance(body.text, list) else ids[0], "text": None})


def make_requests(st: ServerState, body: S.GenerateIn) -> list[GenRequest] | str:
    """The engine requests of a /generate body (one prompt, or a batch of prompts), or a 400 message."""
    if body.text is not None and body.input_ids is not None:
        return "text / input_ids: send one of them, not both (as SGLang)"
    if not body.is_batch:
        if isinstance(body.rid, list) or isinstance(body.sampling_params, list):
            return "rid / sampling_params: a list needs a batch of prompts (input_ids as a list of lists)"
        return _entry_requests(st, body, body.input_ids, body.sampling_params, body.rid, "", body.text)
    prompts = body.input_ids if body.input_ids is not None else body.text
    k = len(prompts)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * k
    if body.rid is None:
        base = uuid.uuid4().hex
        rids = [f"{base}_{i}" for i in range(k)]
    else:
        rids = body.rid if isinstance(body.rid, list) else [f"{body.rid}_{i}" for i in range(k)]
    if len(sps) != k or len(rids) != k:
        return (
            f"sampling_params / rid: {len(sps)} / {len(rids)} entries for a batch of {k} prompts "
            "(need one each, or one sampling_params dict for all)"
        )
    if k > st.limits.max_n:
        return f"input_ids: a batch of {k} prompts is above the limit of {st.limits.max_n} (server flag --max-n)"
    reqs = []
    for i, (prompt, sp, rid) in enumerate(zip(prompts, sps, rids)):
        ids, text = (None, prompt) if isinstance(prompt, str) else (prompt, None)
        entry = _entry_requests(st, body, ids, sp, rid, f"[{i}]", text)
        if isinstance(entry, str):
            return entry
        if len(entry) > 1:
            return f"sampling_params[{i}].n: n > 1 inside a batch is not implemented here; send n prompts"
        reqs += entry
    if len({r.rid for r in reqs}) < len(reqs):
        return "rid: the batch repeats a rid"
    return reqs


def _entry_requests(
    st: ServerState, body: S.GenerateIn, ids, sp_raw, rid, at: str, text=None
) -> list[GenRequest] | str:
    """One prompt's requests (n of them); `at` ("" or "[i]") locates it in a batch for messages."""
    eng = st.engine
    if ids is None:
        if text is None:
            return "input_ids: required (or text, with a tokenizer)"
        if eng.tokenizer is None:
            return "text: this server has no tokenizer; send input_ids"
        ids = eng.tokenizer.encode(text)
    if (problem := _prompt_problem(eng, ids, at)) is not None:
        return problem
    if (problem := _routed_experts_problem(eng, body, len(ids))) is not None:
        return problem
    try:
        sp = S.SamplingParamsIn.model_validate(sp_raw or {})
    except ValidationError as e:
        return field_message(e, prefix=f"sampling_params{at}")
    if (problem := sampling_range_problem(sp, eng.vocab_size, at)) is not None:
        return problem
    if (sp.n or 1) > st.limits.max_n:
        return f"sampling_params{at}.n: {sp.n} is above the limit of {st.limits.max_n} (server flag --max-n)"
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
    return [_gen_request(body, sp, r, ids, stop_strs, stop_regex) for r in rids]


def _prompt_problem(eng: Engine, ids, at: str) -> str | None:
    if not ids:
        return f"input_ids{at}: empty prompt"
    if len(ids) >= eng.max_context:  # first: bounds the per-token check below
        return f"input_ids{at}: prompt of {len(ids)} tokens does not fit the context of {eng.max_context}"
    for i, t in enumerate(ids):
        if not 0 <= t < eng.vocab_size:
            return f"input_ids{at}[{i}]={t} is outside the vocabulary [0, {eng.vocab_size})"
    return None


def _routed_experts_problem(eng: Engine, body: S.GenerateIn, prompt_len: int) -> str | None:
    if not body.return_routed_experts:
        return None
    if eng.routing is None:
        return (
            "return_routed_experts: this server does not capture routed experts (start it with "
            "--enable-return-routed-experts, on a model with MoE layers)"
        )
    if body.routed_experts_start_len > prompt_len:  # SGLang's bound (Scheduler.handle_generate_request)
        return f"routed_experts_start_len: {body.routed_experts_start_len} is above the {prompt_len} prompt tokens"
    return None


def _gen_request(body: S.GenerateIn, sp: S.SamplingParamsIn, rid: str, ids, stop_strs, stop_regex) -> GenRequest:
    """The engine request for `rid`, SGLang's defaults where `sp` or `body` leaves a field unset."""
    return GenRequest(
        rid=rid,
        prompt=list(ids),
        max_new_tokens=128 if sp.max_new_tokens is None else sp.max_new_tokens,
        temperature=1.0 if sp.temperature is None else sp.temperature,
        top_p=1.0 if sp.top_p is None else sp.top_p,
        top_k=-1 if sp.top_k is None else sp.top_k,
        stop_token_ids=frozenset(sp.stop_token_ids or ()),
        stop_strs=stop_strs,
        ignore_eos=bool(sp.ignore_eos),
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
        no_stop_trim=bool(sp.no_stop_trim),
        return_routed_experts=body.return_routed_experts,
        routed_experts_start_len=body.routed_experts_start_len,
    )
