"""The embedded server's generation engine: batched sampling with a transformers model and its KV cache.

One worker thread runs the model. Requests that are waiting when a batch starts are prefilled together
(left-padded; identical sequences, e.g. the n samples of one prompt, are prefilled once and their cache
rows repeated), then decoded one token per step with `past_key_values`. Finished rows leave the batch at
once (their answer is sent), so a group's samples come back as they finish. Requests arriving meanwhile
start with the next batch (`batching="static"`, the default), or, with `batching="continuous"` (as
SGLang schedules), are prefilled between two decode steps and join the running batch (its cache
left-padded to a common length) up to `max_batch` sequences.

Pause modes (in_place, retract, abort) are SGLang's `PauseGenerationReqInput`'s; what each does to running
requests and the KV cache: docs/rollout-and-weight-sync.md, "The session protocol and pause modes". While
paused, new requests wait in the queue. All control methods are thread-safe.

Batch-invariant mode (`batch_invariant=True`, the server's --enable-deterministic-inference, named
after SGLang's flag): every sequence runs its own forward with its own cache, unpadded, so its logits,
hence its logprobs, are the same bits whatever else is being generated (a batched, left-padded
forward changes them in the last float bits). With `sampling_seed` this makes whole samples, logprobs
included, reproducible across runs; it costs one forward per sequence and step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_dapo.embedded_server.load_stats import LoadStats, StepTrace
from megatron_dapo.embedded_server.routed_experts import RoutingCapture
from megatron_dapo.embedded_server.sampling import (
    GREEDY_EPS,
    Penalties,
    apply_penalties,
    effective_temperature,
    logprob_rows,
    sample,
    top_logprobs,
)
from megatron_dapo.embedded_server.stops import StopMatcher, trim_stop_text
from megatron_dapo.rollout.payloads import encode_routed_experts

log = logging.getLogger(__name__)

# static: a batch runs until its last sequence ends, requests arriving meanwhile wait for the next one;
# continuous (SGLang's): waiting requests are prefilled and join the running batch between decode steps
BATCHING = ("static", "continuous")


@dataclass
class GenRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    stop_strs: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    sampling_seed: int | None = None  # draws depend on (seed, token position) only; None = engine stream
    # SGLang's cheap sampling features, at their neutral values by default (see sampling.py)
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop_regex: tuple[str, ...] = ()
    top_logprobs_num: int = 0  # with return_logprob: the k most likely tokens at every position
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # the answer text keeps the matched stop string / stop token
    return_routed_experts: bool = False  # meta_info["routed_experts"], as SGLang (see routed_experts.py)
    routed_experts_start_len: int = 0  # the first position returned
    created: float = field(default_factory=time.perf_counter)  # e2e_latency counts from here
    # state, owned by the engine
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list | None = None
    output_top: list = field(default_factory=list)  # per output token: (values, token ids)
    input_top: list | None = None  # per input position from logprob_start_len: (values, ids), or None
    finish: dict | None = None
    stops: StopMatcher | None = None  # built at the first check, from stop_strs and stop_regex
    abort_msg: str | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)
    num_retractions: int = 0
    # with return_routed_experts: the expert ids of every position fed to the model so far, in chunks of
    # [positions, layers, top_k]; a prefill (again, after a retraction) starts them over
    routing: list[torch.Tensor] = field(default_factory=list)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now (see `Engine.load_report`)."""

    running: int
    waiting: int
    resident_tokens: int  # KV tokens of the running sequences (prompt + generated so far)
    waiting_tokens: int  # tokens the waiting requests will prefill
    capacity: int  # most KV tokens the engine holds: max_total_tokens, else max_batch x max_context
    paused: int  # running requests held by an in_place pause
    retracted: int  # waiting requests that were retracted (to be prefilled again)


class _Batch:
    def __init__(self, reqs, cache, mask, next_pos, last_tokens):
        self.reqs, self.cache, self.mask, self.next_pos, self.last_tokens = reqs, cache, mask, next_pos, last_tokens


class Engine:
    def __init__(
        self,
        model,
        tokenizer=None,
        max_batch: int = 64,
        seed: int = 0,
        weight_version: str = "default",
        max_context: int | None = None,
        batch_invariant: bool = False,
        step_trace: StepTrace | None = None,
        batching: str = "static",
        max_total_tokens: int | None = None,
        return_routed_experts: bool = False,
        speed: float = 1.0,
        step_clock: Callable[[], float] = time.perf_counter,
    ):
        if not 0 < speed <= 1:  # also refuses NaN
            raise ValueError(f"speed must be in (0, 1], got {speed}")
        # the serve flag --slowdown: each step is stretched to 1 / speed of its own time (a slower engine)
        self.speed = speed
        # times each step for the counters and the trace; a test on a loaded machine passes time.thread_time
        # (with one torch thread) so a step's time is the engine thread's own work, not the scheduler's
        self.step_clock = step_clock
        self.model = model.eval().requires_grad_(False)  # inference only; weights are written in place
        self._cache_kw = kv_cache_keyword(self.model)
        # SGLang's --enable-return-routed-experts: hooks on the routers (raises for a model without experts)
        self.routing = RoutingCapture(model) if return_routed_experts else None
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.batch_invariant = batch_invariant
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
        self.batching = batching
        self.weight_version = str(weight_version)
        cfg = model.config
        self.max_context = max_context or getattr(cfg, "max_position_embeddings", None) or 1 << 30
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        # SGLang's --max-total-tokens: the KV pool. Admission and decode keep the running sequences within it.
        self.capacity = max_total_tokens or self.max_batch * self.max_context
        self.vocab_size = cfg.vocab_size
        eos = getattr(cfg, "eos_token_id", None)
        gen_cfg = getattr(model, "generation_config", None)
        if eos is None and gen_cfg is not None:
            eos = gen_cfg.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        # SGLang stops on the tokenizer's EOS too, even where the model's config names none
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_eos_ids = self.eos_ids | ({tok_eos} if isinstance(tok_eos, int) else set())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

        self._qlock = threading.Condition()  # guards the waiting queue and the pause flag
        self._waiting: deque[GenRequest] = deque()
        self._paused = False
        self._held = False  # memory released (/release_memory_occupation): no step starts until resumed
        self._stop = False
        self.step_lock = threading.RLock()  # held around every forward step and every weight load
        self._batch: _Batch | None = None
        self.stats = LoadStats()
        self.step_trace = step_trace  # None: no per-step lines (the default; the counters above are kept)
        self._held_answers: list | None = None  # during a step: answers to send once it is counted
        self._in_step: list[GenRequest] = []  # the requests of the step running now
        self._active: dict[str, GenRequest] = {}  # rid -> request, until its answer is sent
        self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
        self._thread.start()

    # ---- public, thread-safe -------------------------------------------------------------------
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[GenRequest]) -> list[concurrent.futures.Future]:
        """Queue `reqs` together: the worker never starts a batch with only part of them (the samples
        of one /generate run in one batch)."""
        with self._qlock:
            seen: set[str] = set()
            for r in reqs:
                if r.rid in self._active or r.rid in seen:
                    raise ValueError(f"rid {r.rid!r} is already in flight")
                seen.add(r.rid)
            for r in reqs:
                self._active[r.rid] = r
                self._waiting.append(r)
            self._qlock.notify_all()
        return [r.future for r in reqs]

    def in_flight(self) -> int:
        return len(self._active)

    def load_report(self) -> EngineLoad:
        """Requests and KV tokens held now, for /v1/loads and /server_info (read while the worker runs:
        each list is copied once, and a length read is atomic)."""
        batch = self._batch
        running = list(batch.reqs) if batch is not None else []
        with self._qlock:
            waiting = list(self._waiting)
            paused = self._paused
        return EngineLoad(
            running=len(running),
            waiting=len(waiting),
            resident_tokens=sum(map(_seq_len, running)),
            waiting_tokens=sum(map(_seq_len, waiting)),
            capacity=self.capacity,
            paused=len(running) if paused else 0,
            retracted=sum(r.num_retractions > 0 for r in waiting),
        )

    def is_paused(self) -> bool:
        return self._paused

    def is_idle(self) -> bool:
        """SGLang's test before flushing its cache (`Scheduler.is_fully_idle(ignore_waiting=paused)`):
        nothing running, and nothing queued unless paused (a paused queue holds no KV yet)."""
        with self._qlock:
            return self._batch is None and (self._paused or not self._waiting)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted by request") -> int:
        """Mark requests aborted; they finish at the next step boundary (at once when idle or paused)."""
        with self._qlock:
            active = dict(self._active)  # one atomic copy: the worker retires requests concurrently
            targets = (
                list(active.values())
                if abort_all
                else (
                    [active[rid]]
                    if rid in active
                    else [r for k, r in active.items() if rid and k.startswith(f"{rid}_")]
                )
            )
            for r in targets:
                r.abort_msg = message
            self._qlock.notify_all()
        with self.step_lock:  # the worker may be mid-step; reap once it has stopped
            self._reap_aborted()
        return len(targets)

    def pause(self, mode: str = "abort") -> None:
        with self._qlock:
            self._paused = True
        with self.step_lock:  # returns once the current step is over
            if mode == "abort":
                with self._qlock:
                    for r in self._active.values():
                        r.abort_msg = "Aborted by pause_generation"
                self._reap_aborted()
            elif mode == "retract":
                self._retract()
            elif mode != "in_place":
                raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")

    def resume(self) -> None:
        with self._qlock:
            self._paused = False
            self._qlock.notify_all()

    def hold(self, held: bool) -> None:
        """While held (the server's memory released), the worker starts no step: queued requests wait."""
        with self._qlock:
            self._held = held
            self._qlock.notify_all()

    def is_held(self) -> bool:
        return self._held

    def set_weight_version(self, version: str) -> None:
        """Call with step_lock held, right after new weights were loaded."""
        version = str(version)
        if version == self.weight_version:
            return
        for r in list(self._active.values()):
            if r.output:
                r.version_events.append((self.weight_version, len(r.output)))
        self.weight_version = version

    def close(self) -> None:
        with self._qlock:
            self._stop = True
            self._qlock.notify_all()
        self._thread.join(timeout=10)
        self.abort(abort_all=True, message="server shutting down")
        if self.step_trace is not None and not self._thread.is_alive():  # a stuck worker may still write
            self.step_trace.close()

    # ---- worker --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._qlock:
                while not self._stop and (self._paused or self._held or (not self._waiting and self._batch is None)):
                    self._qlock.wait()
                if self._stop:
                    return
            try:
                with self.step_lock:
                    if self._paused or self._held:
                        continue
                    self._reap_aborted()
                    self._step()
            except Exception as e:  # never let one bad step kill the server: fail its requests, go on
                log.exception("generation step failed")
                self._fail_step(e)

    def _step(self) -> None:
        """Prefill the waiting requests there is room for (none beside a static batch), else decode."""
        running = self._batch.reqs if self._batch is not None else []
        resident = sum(map(_seq_len, running))  # KV tokens held now
        reqs = self._admit(len(running), resident) if not running or self.batching == "continuous" else []
        if reqs:
            self._in_step = reqs  # a failed prefill fails these; the running batch goes on
            joined = self._timed(self._prefill, reqs, prefill=True)
            self._in_step = reqs + (self._batch.reqs if self._batch is not None else [])
            self._batch = self._merge(self._batch, joined)
        elif self._batch is not None:
            self._make_room(resident)
            if self._batch is not None:
                self._in_step = list(self._batch.reqs)
                self._timed(self._decode, self._in_step, prefill=False)
        self._in_step = []

    def _admit(self, running: int, resident: int) -> list[GenRequest]:
        """Take waiting requests, first come first served, while the batch has room for them: at most
        max_batch sequences whose KV, with one more token each, fits the pool (the test `_make_room`
        retracts by). A request that could never fit is aborted."""
        taken: list[GenRequest] = []
        with self._qlock:
            while self._waiting and running + len(taken) < self.max_batch:
                r = self._waiting[0]
                if _seq_len(r) + 1 > self.capacity:
                    self._waiting.popleft()
                    r.finish = {
                        "type": "abort",
                        "status_code": 400,
                        "err_type": None,
                        "message": (
                            f"{_seq_len(r)} tokens do not fit the KV pool of {self.capacity} (--max-total-tokens)"
                        ),
                    }
                    self._send(r)
                    continue
                if resident + _seq_len(r) + running + len(taken) + 1 > self.capacity:
                    break
                resident += _seq_len(self._waiting.popleft())
                taken.append(r)
        return taken

    def _make_room(self, resident: int) -> None:
        """Before a decode step: retract running sequences until every one can add its token to the KV
        pool, as SGLang's retract_decode orders them (fewest output tokens first, then longest prompt);
        the last one is never retracted, it is aborted if even it does not fit."""
        b = self._batch
        if resident + len(b.reqs) <= self.capacity:
            return
        keep = sorted(range(len(b.reqs)), key=lambda i: (len(b.reqs[i].output), -len(b.reqs[i].prompt)))
        retracted = []
        while len(keep) > 1 and resident + len(keep) > self.capacity:
            i = keep.pop(0)
            resident -= _seq_len(b.reqs[i])
            retracted.append(b.reqs[i])
        if resident + len(keep) > self.capacity:
            r = b.reqs[keep[0]]
            r.finish = {
                "type": "abort",
                "status_code": 500,
                "err_type": None,
                "message": ("Out of memory even after retracting all other requests in the decode batch"),
            }
        self._batch = self._select(b, sorted(keep))
        # the last one retracted goes first: it cannot come back before a sequence has left, and admission
        # takes no one past it, so nothing retracted is prefilled only to be retracted again
        self._requeue(retracted[::-1])
        if self._batch is not None:
            self._batch = self._retire_finished(self._batch)

    def _timed(self, step, reqs: list[GenRequest], prefill: bool):
        """Run one prefill or decode step over `reqs`, count it in `self.stats`; returns what `step` does."""
        before = sum(len(r.output) for r in reqs)
        # identical sequences are prefilled once, except in batch-invariant mode
        seqs = [tuple(r.prompt + r.output) for r in reqs] if prefill else []
        # resident KV before the step, as load_report counts it (only when traced: O(batch) per step)
        kv = 0 if prefill or self.step_trace is None else sum(map(_seq_len, reqs))
        self._held_answers = []  # answered once the step is counted: a client then sees it in /v1/loads
        try:
            start = self.step_clock()
            out = step(reqs) if prefill else step()
            end = self._stretched(start, self.step_clock())
            generated = sum(len(r.output) for r in reqs) - before
            if prefill:
                uncached = sum(map(len, seqs if self.batch_invariant else set(seqs)))
                self.stats.prefill_step(uncached, start, end, generated)
            else:
                self.stats.decode_step(len(reqs), start, end, generated)
            if self.step_trace is not None:
                self.step_trace.step(
                    "prefill" if prefill else "decode", len(reqs), kv, end - start, uncached if prefill else 0
                )
            return out
        finally:
            held, self._held_answers = self._held_answers, None
            for future, answer in held:
                if not future.done():
                    future.set_result(answer)

    def _stretched(self, start: float, end: float) -> float:
        """At speed < 1, sleep until the step has taken 1 / speed of its own time; its accounted end (what
        the load report and the trace see, as from a slower engine)."""
        if self.speed == 1.0:
            return end
        stretched = start + (end - start) / self.speed
        time.sleep(stretched - end)
        return stretched

    @torch.inference_mode()
    def _forward(self, ids, mask, pos, cache, logits_to_keep=1):
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kw: cache},
        )
        if self.routing is not None:
            self._routed = self.routing.take(*ids.shape)
        return out.logits.float(), getattr(out, self._cache_kw)

    def _input_logprobs(self, r: GenRequest, s: tuple, logits: torch.Tensor) -> None:
        """`logits`: the rows of sequence `s` (len(s) x vocab)."""
        lp = torch.log_softmax(logits[:-1] / effective_temperature(r.temperature), dim=-1)
        vals = lp.gather(-1, torch.tensor(s[1:], device=lp.device).unsqueeze(-1)).squeeze(-1).tolist()
        full = [None] + vals
        start = min(r.logprob_start_len, len(s))
        r.input_logprobs = [(full[t], s[t], None) for t in range(start, len(s))]
        if r.top_logprobs_num > 0:
            # position t is predicted by row t - 1; position 0 has no prediction (None, as SGLang)
            top = [None] + list(zip(*top_logprobs(lp, r.top_logprobs_num)))
            r.input_top = top[start:]

    @staticmethod
    def _wants_input_logprobs(r: GenRequest) -> bool:
        return r.return_logprob and r.logprob_start_len >= 0 and not r.output

    def _start_batch(self, reqs, cache, mask, lengths, last) -> _Batch | None:
        batch = _Batch(list(reqs), cache, mask, lengths, None)
        done = [self._budget(r) <= 0 for r in reqs]
        for r, d in zip(reqs, done):
            if d:
                r.finish = {"type": "length", "length": r.max_new_tokens}
        return self._sample_and_advance(batch, last, skip=done)

    def _merge(self, running: _Batch | None, joined: _Batch | None) -> _Batch | None:
        """One batch of `running` and the just-prefilled `joined` (continuous batching). Each padded cache
        loses the columns no row attends to any more; the narrower one is then left-padded to the other."""
        if running is None or joined is None:
            return running or joined
        if isinstance(running.cache, list):  # batch-invariant mode: one cache per sequence
            cache, mask = running.cache + joined.cache, None
        else:
            masks = [_trim_padding(b) for b in (running, joined)]
            width = max(m.shape[1] for m in masks)
            for a, b in zip(running.cache.layers, joined.cache.layers):
                a.keys = torch.cat([_left_pad(a.keys, width, -2), _left_pad(b.keys, width, -2)])
                a.values = torch.cat([_left_pad(a.values, width, -2), _left_pad(b.values, width, -2)])
            cache, mask = running.cache, torch.cat([_left_pad(m, width, -1) for m in masks])
        return _Batch(
            running.reqs + joined.reqs,
            cache,
            mask,
            torch.cat([running.next_pos, joined.next_pos]),
            torch.cat([running.last_tokens, joined.last_tokens]),
        )

    def _prefill_one_request_at_a_time(self, reqs: list[GenRequest]) -> _Batch | None:
        from transformers import DynamicCache

        caches, lasts = [], []
        for r in reqs:
            s = tuple(r.prompt + r.output)
            ids = torch.tensor([s], device=self.device)
            pos = torch.arange(len(s), device=self.device).unsqueeze(0)
            want = self._wants_input_logprobs(r)
            logits, cache = self._forward(
                ids, torch.ones_like(ids), pos, DynamicCache(), logits_to_keep=0 if want else 1
            )
            if want:
                self._input_logprobs(r, s, logits[0])
            self._keep_routing(r, 0)
            caches.append(cache)
            lasts.append(logits[0, -1])
        lengths = torch.tensor([len(r.prompt) + len(r.output) for r in reqs], device=self.device)
        return self._start_batch(reqs, caches, None, lengths, torch.stack(lasts))

    def _prefill(self, reqs: list[GenRequest]) -> _Batch | None:
        from transformers import DynamicCache

        if self.batch_invariant:
            return self._prefill_one_request_at_a_time(reqs)
        seqs = [tuple(r.prompt + r.output) for r in reqs]
        uniq = list(dict.fromkeys(seqs))
        row_of = {s: i for i, s in enumerate(uniq)}
        L = max(len(s) for s in uniq)
        ids = torch.zeros(len(uniq), L, dtype=torch.long)
        mask = torch.zeros(len(uniq), L, dtype=torch.long)
        for i, s in enumerate(uniq):
            ids[i, L - len(s) :] = torch.tensor(s)
            mask[i, L - len(s) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        want_input = any(self._wants_input_logprobs(r) for r in reqs)
        logits, cache = self._forward(ids, mask, pos, DynamicCache(), logits_to_keep=0 if want_input else 1)

        for r, s in zip(reqs, seqs):
            if self._wants_input_logprobs(r):
                self._input_logprobs(r, s, logits[row_of[s], L - len(s) :])
            self._keep_routing(r, (row_of[s], slice(L - len(s), None)))

        index = torch.tensor([row_of[s] for s in seqs], device=self.device)
        last = logits[:, -1][index]
        cache.batch_select_indices(index)
        lengths = torch.tensor([len(s) for s in seqs], device=self.device)
        return self._start_batch(reqs, cache, mask[index], lengths, last)

    def _decode(self) -> None:
        b = self._batch
        if self.batch_invariant:  # one cache per sequence, no padding: see the module doc
            rows = []
            for i in range(len(b.reqs)):
                n = int(b.next_pos[i])
                logits, b.cache[i] = self._forward(
                    b.last_tokens[i : i + 1].unsqueeze(-1),
                    torch.ones(1, n + 1, dtype=torch.long, device=self.device),
                    b.next_pos[i : i + 1].unsqueeze(-1),
                    b.cache[i],
                )
                self._keep_routing(b.reqs[i], 0, more=True)
                rows.append(logits[0, -1])
            b.next_pos = b.next_pos + 1
            self._batch = self._sample_and_advance(b, torch.stack(rows))
            return
        ids = b.last_tokens.unsqueeze(-1)
        b.mask = torch.cat([b.mask, torch.ones_like(b.mask[:, :1])], dim=-1)
        logits, b.cache = self._forward(ids, b.mask, b.next_pos.unsqueeze(-1), b.cache)
        for i, r in enumerate(b.reqs):
            self._keep_routing(r, i, more=True)
        b.next_pos = b.next_pos + 1
        self._batch = self._sample_and_advance(b, logits[:, -1])

    def _keep_routing(self, r: GenRequest, index, more: bool = False) -> None:
        """Keep the last forward's expert ids at `index` (the positions `r` just fed) if `r` asked for them:
        after the ones kept so far (`more`, a decode step) or instead of them (a prefill recomputes them all)."""
        if r.return_routed_experts:
            rows = self._routed[index].clone()  # a copy: the batch's array is not kept alive by it
            r.routing = [*r.routing, rows] if more else [rows]

    def _budget(self, r: GenRequest) -> int:
        return min(r.max_new_tokens - len(r.output), self.max_context - len(r.prompt) - len(r.output))

    def _sample_and_advance(
        self, b: _Batch, last_logits: torch.Tensor, skip: list[bool] | None = None
    ) -> _Batch | None:
        """Draw each row's next token; returns the batch of the rows still running (None: none)."""
        dev = last_logits.device
        temp = torch.tensor([r.temperature for r in b.reqs], device=dev)
        top_p = torch.tensor([r.top_p for r in b.reqs], device=dev)
        top_k = torch.tensor([r.top_k for r in b.reqs], device=dev)
        min_p = torch.tensor([r.min_p for r in b.reqs], device=dev) if any(r.min_p > 0 for r in b.reqs) else None
        seeds = [r.sampling_seed for r in b.reqs]
        positions = [len(r.prompt) + len(r.output) for r in b.reqs]  # where the drawn token will sit
        logits = apply_penalties(last_logits, [r.output for r in b.reqs], [self._penalties(r) for r in b.reqs])
        tokens, lps = sample(logits, temp, top_p, top_k, self.generator, seeds=seeds, positions=positions, min_p=min_p)
        k = max((r.top_logprobs_num for r in b.reqs if r.return_logprob), default=0)
        top = top_logprobs(logprob_rows(logits, temp), k) if k > 0 else None
        b.last_tokens = tokens
        for i, (r, tok, lp) in enumerate(zip(b.reqs, tokens.tolist(), lps.tolist())):
            if skip is not None and skip[i]:
                continue
            r.output.append(tok)
            r.logprobs.append(lp)
            if top is not None and r.top_logprobs_num > 0:
                r.output_top.append((top[0][i][: r.top_logprobs_num], top[1][i][: r.top_logprobs_num]))
            r.finish = self._finish_reason(r, tok)
        return self._retire_finished(b)

    def _penalties(self, r: GenRequest) -> Penalties:
        stop_ids = frozenset()
        if r.min_new_tokens > len(r.output):  # SGLang blocks stop_token_ids, the model's and tokenizer's EOS
            stop_ids = r.stop_token_ids | self.stop_eos_ids
        return Penalties(r.frequency_penalty, r.presence_penalty, r.repetition_penalty, r.min_new_tokens, stop_ids)

    def _finish_reason(self, r: GenRequest, tok: int) -> dict | None:
        # SGLang's order (Req.update_finish_state): stop strings and regexes, then stop tokens, then length
        if (r.stop_strs or r.stop_regex) and self.tokenizer is not None:
            if r.stops is None:
                r.stops = StopMatcher(self.tokenizer, r.stop_strs, r.stop_regex)
            if (matched := r.stops.matched(r.output)) is not None:
                return {"type": "stop", "matched": matched}
        # as in SGLang, ignore_eos ignores the request's stop_token_ids too
        if not r.ignore_eos and (tok in r.stop_token_ids or tok in self.stop_eos_ids):
            return {"type": "stop", "matched": tok}
        if self._budget(r) <= 0:
            return {"type": "length", "length": r.max_new_tokens}
        return None

    def _retire_finished(self, b: _Batch) -> _Batch | None:
        keep = [i for i, r in enumerate(b.reqs) if r.finish is None]
        for r in b.reqs:
            if r.finish is not None:
                self._send(r)
        return self._select(b, keep)

    @staticmethod
    def _select(b: _Batch, keep: list[int]) -> _Batch | None:
        """`b` with only its rows `keep` (None: no rows)."""
        if not keep:
            return None
        if len(keep) < len(b.reqs):
            idx = torch.tensor(keep, device=b.next_pos.device)
            if isinstance(b.cache, list):  # batch-invariant mode: one cache per sequence
                b.cache = [b.cache[i] for i in keep]
            else:
                b.cache.batch_select_indices(idx)
                b.mask = b.mask[idx]
            b.reqs = [b.reqs[i] for i in keep]
            b.next_pos, b.last_tokens = b.next_pos[idx], b.last_tokens[idx]
        return b

    def _reap_aborted(self) -> None:
        with self._qlock:
            for r in [r for r in self._waiting if r.abort_msg]:
                self._waiting.remove(r)
                r.finish = {"type": "abort", "message": r.abort_msg, "status_code": None, "err_type": None}
                self._send(r)
        if self._batch is not None:
            for r in self._batch.reqs:
                if r.abort_msg and r.finish is None:
                    r.finish = {"type": "abort", "message": r.abort_msg, "status_code": None, "err_type": None}
            self._batch = self._retire_finished(self._batch)

    def _retract(self) -> None:
        if self._batch is None:
            return
        reqs, self._batch = self._batch.reqs, None
        self._requeue(reqs)

    def _requeue(self, reqs: list[GenRequest]) -> None:
        """Put retracted `reqs` back at the front of the queue, in this order, keeping their tokens."""
        with self._qlock:
            for r in reversed(reqs):
                r.num_retractions += 1
                self._waiting.appendleft(r)

    def _fail_step(self, e: Exception) -> None:
        """Fail the requests of the step that raised (the batch too, if it was in it)."""
        with self.step_lock:
            reqs, self._in_step = self._in_step, []
            if self._batch is not None and {id(r) for r in reqs} & {id(r) for r in self._batch.reqs}:
                self._batch = None
            for r in reqs:
                self._active.pop(r.rid, None)
                if not r.future.done():
                    r.future.set_exception(e)

    def _send(self, r: GenRequest) -> None:
        self._active.pop(r.rid, None)
        if self._held_answers is not None:
            self._held_answers.append((r.future, self.answer(r)))
        elif not r.future.done():
            r.future.set_result(self.answer(r))

    def _token_text(self, r: GenRequest, tok: int) -> str | None:
        if not r.return_text_in_logprobs or self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok])

    def _top_entries(self, r: GenRequest, rows: list) -> list:
        # SGLang's shape: per position a list of (logprob, token_id, text), or None where there is none
        return [None if row is None else [(v, t, self._token_text(r, t)) for v, t in zip(*row)] for row in rows]

    def answer(self, r: GenRequest) -> dict:
        """The /generate answer for a finished request, shaped as SGLang's (tokenizer_manager.py)."""
        meta = {
            "id": r.rid,
            "finish_reason": r.finish,
            "prompt_tokens": len(r.prompt),
            "weight_version": self.weight_version,
            "num_retractions": r.num_retractions,
            "completion_tokens": len(r.output),
            "cached_tokens": 0,  # no prefix cache outlives a batch here
        }
        meta["weight_versions"] = weight_version_spans(r.version_events, self.weight_version, len(r.output))
        if r.return_logprob:
            text_of = self._token_text
            meta["input_token_logprobs"] = [(lp, tok, text_of(r, tok)) for lp, tok, _ in r.input_logprobs or []]
            meta["output_token_logprobs"] = [(lp, tok, text_of(r, tok)) for lp, tok in zip(r.logprobs, r.output)]
            meta["output_token_logprobs_length"] = len(r.output)
            if r.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self._top_entries(r, r.input_top or [])
                meta["output_top_logprobs"] = self._top_entries(r, r.output_top)
        if r.return_routed_experts:
            meta["routed_experts"] = self._routed_experts(r)
        meta["e2e_latency"] = time.perf_counter() - r.created
        return {"text": self._answer_text(r), "output_ids": list(r.output), "meta_info": meta}

    def _routed_experts(self, r: GenRequest) -> str:
        """SGLang's rows `[routed_experts_start_len, seqlen - 1)`, encoded as SGLang encodes them."""
        seqlen = len(r.prompt) + len(r.output)
        start = min(r.routed_experts_start_len, max(seqlen - 1, 0))
        shape = (0, self.routing.num_layers, self.routing.top_k)
        rows = torch.cat(r.routing) if r.routing else torch.zeros(shape, dtype=torch.int32)
        return encode_routed_experts(rows[start : seqlen - 1])

    def _answer_text(self, r: GenRequest) -> str:
        """The output's text without the stop that ended it, as SGLang's detokenizer trims it."""
        if self.tokenizer is None:
            return ""
        matched = (r.finish or {}).get("matched")
        ids = r.output[:-1] if isinstance(matched, int) and not r.no_stop_trim else r.output
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=r.skip_special_tokens,
            spaces_between_special_tokens=r.spaces_between_special_tokens,
        )
        return trim_stop_text(text, matched, r.no_stop_trim)


def kv_cache_keyword(model) -> str:
    """The name of the KV cache in `model`'s forward (argument and output field): `cache` from transformers
    5.24 on, `past_key_values` before (5.19.0 is SGLang 0.5.23's pin, so GPU nodes run it). An older name
    passed to a newer forward would land in its **kwargs unused, each decode step starting from nothing."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _seq_len(r: GenRequest) -> int:
    """KV tokens of `r` once prefilled: its prompt and what it generated so far."""
    return len(r.prompt) + len(r.output)


def _trim_padding(b: _Batch) -> torch.Tensor:
    """Cut the cache columns no row attends to (the left padding of rows that have left the batch);
    returns the mask without them."""
    first = int(b.mask.any(0).int().argmax())  # the first column some row attends to
    if first:
        for layer in b.cache.layers:
            layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
    return b.mask[:, first:]


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros in front along `dim` (-1 or -2) up to `width`."""
    missing = width - t.shape[dim]
    return torch.nn.functional.pad(t, (missing, 0) if dim == -1 else (0, 0, missing, 0))


def weight_version_spans(events: list[tuple[str, int]], current: str, n_tokens: int) -> list[dict]:
    """Which weight version produced which output tokens, as SGLang reports it for every finished
    request (`utils/weight_versions.py`): `events` are (old version, tokens generated by then)."""
    spans: list[dict] = []
    for version, end in events + [(current, n_tokens)]:
        end = min(end, n_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < n_tokens or s["start"] == 0]


def greedy(temperature: float) -> bool:
    return temperature < GREEDY_EPS
