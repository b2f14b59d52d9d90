"""A CPU (or single-GPU) engine on plain transformers `generate`: static micro-batches.

One background thread takes submitted micro-batches off a queue, in order, and runs each as
batched `model.generate` calls with left padding. Within a micro-batch, requests are grouped by
their sampling settings (greedy, or temperature/top_p/top_k, seed, penalties, ignore_eos): one
`generate` call per group, so every request runs under exactly its own settings. Each group
generates up to its largest `max_tokens`; a stopping criterion retires every row at its own
`max_tokens`, and rows are cut at their first EOS and their first stop string afterwards.

Sampling notes:

* `temperature == 0` is greedy; otherwise multinomial sampling with temperature/top_p/top_k
  (unset: 1.0 / 1.0 / off). The model's generation_config defaults are NOT applied here:
  `worker.rendering` already applied them to the `SamplingSpec` (like vLLM's
  `generation_config="auto"`).
* `seed`: `torch.manual_seed(seed)` before the group's `generate`. Only the group's own
  requests share that stream, so a seeded request is reproducible given the same batch-mates.
* presence/frequency penalties: OpenAI semantics over the generated tokens.
* `json_schema`/`json_object`/`choice` (`response_format`, `structured_outputs`) are NOT
  enforced (no guided decoding in transformers); the request runs unconstrained. Use vLLM
  for structured outputs.
* `n`: each request is `n` rows of its group's `generate`, so its choices are independent
  samples (identical under greedy decoding).
* `logprobs`: log-softmax of the raw logits (`output_logits`), before temperature,
  penalties and `logit_bias`, as vLLM's default; the top k alternatives from the same row.
* `min_p`, `repetition_penalty`, `logit_bias`, `allowed_token_ids`, `bad_words`,
  `stop_token_ids`, `include_stop_str_in_output`: transformers' own logits processors and
  stopping, or `worker.engines.hf_processors` where it has none.

Output text is decoded with `skip_special_tokens=False` so `<tool_call>`/`<think>` survive; the
EOS token itself is not part of the text but counts as a completion token (as in vLLM).

torch and the model classes are imported lazily, so importing this module needs no torch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from worker.engines.base import (
    Engine,
    EngineOutput,
    EngineRequest,
    EngineSample,
    EngineStats,
    OnDone,
    SamplingSpec,
    TokenLogprob,
)
from worker.engines.hf_processors import BiasAndMask, OpenAIPenalties, PerRowMaxTokens

if TYPE_CHECKING:
    from worker.config import WorkerSettings

__all__ = ["TransformersEngine"]

log = structlog.get_logger("qbatch.engine.transformers")

_STOP = object()
_GroupKey = tuple[Any, ...]


def _group_key(spec: SamplingSpec) -> _GroupKey:
    greedy = spec.temperature is not None and spec.temperature <= 0.0
    if greedy:
        sampling: tuple[Any, ...] = ("greedy",)
    else:
        top_k = spec.top_k if spec.top_k is not None and spec.top_k > 0 else 0
        sampling = ("sample", spec.temperature or 1.0, spec.top_p or 1.0, top_k, spec.seed)
    return (
        *sampling,
        spec.presence_penalty or 0.0,
        spec.frequency_penalty or 0.0,
        spec.ignore_eos,
        spec.min_p or 0.0,
        spec.repetition_penalty or 1.0,
        spec.logit_bias,
        spec.allowed_token_ids,
        spec.bad_words,
        spec.stop_token_ids,
        spec.logprobs is not None,
    )


class TransformersEngine(Engine):
    name = "transformers"
    mode = "static"

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        served_name: str | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.model_path = model_path
        self.dtype = dtype
        self.device = device
        self._served_name = served_name or Path(model_path).name
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._tokenizer.padding_side = "left"
        config = AutoConfig.from_pretrained(model_path)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._config, self._text_config = config, text_config
        native = getattr(text_config, "max_position_embeddings", None)
        self._max_model_len = int(max_model_len or native or 2048)

        eos: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(model_path)
            eos.update(_as_ids(gen.eos_token_id))
        except OSError:
            pass
        eos.update(_as_ids(getattr(text_config, "eos_token_id", None)))
        eos.update(_as_ids(self._tokenizer.eos_token_id))
        self._eos_ids = sorted(eos)
        from worker.rendering import load_generation_defaults

        self._generation_defaults = load_generation_defaults(model_path)
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else (self._eos_ids[0] if self._eos_ids else 0))

        self._model: Any = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> TransformersEngine:
        if not settings.model:
            raise ValueError("--model is required for engine transformers")
        return cls(
            settings.model,
            max_model_len=settings.max_model_len,
            served_name=settings.served_name(),
        )

    # ------------------------------------------------------------------ Engine API

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            if self._closed:
                raise RuntimeError("engine is closed")
            model: Any = self._model_class().from_pretrained(self.model_path, dtype=self.dtype)
            model.to(self.device).eval()
            self._prepare(model)
            self._model = model
            self._thread = threading.Thread(target=self._loop, name="transformers", daemon=True)
            self._thread.start()

    def _model_class(self) -> Any:
        """What loads the weights: the causal LM, head included (generation)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def _prepare(self, model: Any) -> None:
        """Neutral generation defaults: the SamplingSpec already carries the model's."""
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(
            eos_token_id=self._eos_ids or None,
            pad_token_id=self._pad_id,
            bos_token_id=getattr(model.generation_config, "bos_token_id", None),
        )

    def submit(self, batch: Sequence[EngineRequest], on_done: OnDone) -> None:
        batch = list(batch)
        if not batch:
            return
        with self._lock:
            refused = "engine is closed" if self._closed else None
            if refused is None and self._thread is None:
                refused = "engine is not started"
            if refused is None:
                self._waiting += len(batch)
                self._queue.put((batch, on_done))
                return
        for request in batch:
            _deliver(on_done, _error(request, refused, prompt_tokens=0))

    def stats(self) -> EngineStats:
        return EngineStats(running=self._running, waiting=self._waiting)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout=60)
        # Anything still queued is answered, so every request gets exactly one on_done.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                continue
            batch, on_done = item
            for request in batch:
                _deliver(on_done, _abort(request))

    # ------------------------------------------------------------------ worker thread

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch, on_done = item
            with self._lock:
                self._waiting -= len(batch)
                self._running = len(batch)
            delivered: set[str] = set()

            def once(
                output: EngineOutput,
                _on_done: OnDone = on_done,
                _delivered: set[str] = delivered,
            ) -> None:
                _delivered.add(output.key)
                _on_done(output)

            try:
                self._run_batch(batch, once)
            except BaseException as exc:  # never let the thread die
                log.exception("transformers_batch_failed")
                for request in batch:
                    if request.key not in delivered:
                        _deliver(on_done, _error(request, f"{type(exc).__name__}: {exc}"))
            finally:
                with self._lock:
                    self._running = 0

    def _run_batch(self, batch: list[EngineRequest], on_done: OnDone) -> None:
        groups: dict[_GroupKey, list[tuple[EngineRequest, list[int]]]] = {}
        for request in batch:
            try:
                ids = self._prompt_ids(request)
            except Exception as exc:
                _deliver(on_done, _error(request, f"{type(exc).__name__}: {exc}"))
                continue
            problem = self._admission_problem(request, ids)
            if problem is not None:
                _deliver(on_done, _error(request, problem, prompt_tokens=len(ids)))
                continue
            groups.setdefault(_group_key(request.sampling), []).append((request, ids))
        for key, members in groups.items():
            try:
                outputs = self._generate(key, members)
            except Exception as exc:
                log.exception("transformers_generate_failed", size=len(members))
                message = f"{type(exc).__name__}: {exc}"
                outputs = [_error(req, message, prompt_tokens=len(ids)) for req, ids in members]
            for output in outputs:
                _deliver(on_done, output)

    def _generate(
        self, key: _GroupKey, members: list[tuple[EngineRequest, list[int]]]
    ) -> list[EngineOutput]:
        """One `generate` over the group, each request as `n` rows; rows -> choices."""
        rows = [member for member in members for _ in range(member[0].sampling.n)]
        samples = self._generate_rows(key, rows)
        outputs, at = [], 0
        for request, ids in members:
            mine = samples[at : at + request.sampling.n]
            at += request.sampling.n
            outputs.append(EngineOutput.of_samples(request.key, mine, prompt_tokens=len(ids)))
        return outputs

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return list(self._tokenizer.encode(request.prompt, add_special_tokens=False))

    def _admission_problem(self, request: EngineRequest, ids: list[int]) -> str | None:
        if not ids:
            return "empty prompt"
        if request.sampling.max_tokens < 1:
            return "max_tokens must be at least 1"
        total = len(ids) + request.sampling.max_tokens
        if total > self._max_model_len:
            return (
                f"prompt ({len(ids)} tokens) + max_tokens ({request.sampling.max_tokens}) = "
                f"{total} > max_model_len {self._max_model_len}"
            )
        return None

    def _generate_rows(
        self, key: _GroupKey, members: list[tuple[EngineRequest, list[int]]]
    ) -> list[EngineSample]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        spec = members[0][0].sampling
        width = max(len(ids) for _, ids in members)
        input_ids = torch.full((len(members), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(members), width), dtype=torch.long)
        for row, (_, ids) in enumerate(members):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[row, width - len(ids) :] = 1
        limits = [req.sampling.max_tokens for req, _ in members]
        greedy = key[0] == "greedy"
        stops = sorted(self._stop_ids(spec))
        config = GenerationConfig(
            max_new_tokens=max(limits),
            do_sample=not greedy,
            pad_token_id=self._pad_id,
            eos_token_id=stops or None,
        )
        if spec.repetition_penalty and spec.repetition_penalty != 1.0:
            config.repetition_penalty = float(spec.repetition_penalty)
        if spec.bad_words:
            config.bad_words_ids = self._bad_words_ids(spec.bad_words)
        if not greedy:
            _, temperature, top_p, top_k, seed = key[:5]
            config.temperature = float(temperature)
            config.top_p = float(top_p)
            config.top_k = int(top_k)
            if spec.min_p:
                config.min_p = float(spec.min_p)
            if seed is not None:
                torch.manual_seed(int(seed))
        processors = LogitsProcessorList()
        if spec.logit_bias or spec.allowed_token_ids is not None:
            processors.append(BiasAndMask(spec.logit_bias, spec.allowed_token_ids))
        presence, frequency = spec.presence_penalty or 0.0, spec.frequency_penalty or 0.0
        if presence or frequency:
            processors.append(OpenAIPenalties(width, presence, frequency))
        criteria = StoppingCriteriaList([PerRowMaxTokens(width, limits)])
        wants_logprobs = spec.logprobs is not None
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=criteria,
                output_logits=wants_logprobs,
                return_dict_in_generate=True,
            )
        generated = out.sequences[:, width:].tolist()
        raw = None
        if wants_logprobs:
            # Raw logits, before temperature, penalties and bias: vLLM's default logprobs.
            raw = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        samples = []
        for row, (req, _) in enumerate(members):
            tokens = generated[row]
            logprobs = None
            if raw is not None and req.sampling.logprobs is not None:
                logprobs = self._logprobs(raw[row], tokens, req.sampling.logprobs)
            samples.append(self._finish(req, tokens, logprobs))
        return samples

    def _logprobs(self, scores: Any, tokens: list[int], k: int) -> list[TokenLogprob]:
        import torch

        steps = min(len(tokens), scores.shape[0])
        chosen = scores[torch.arange(steps), torch.tensor(tokens[:steps])].tolist()
        top_values, top_ids = torch.topk(scores[:steps], k, dim=-1) if k else (None, None)
        out = []
        for step in range(steps):
            top: tuple[tuple[int, str, float], ...] = ()
            if top_ids is not None and top_values is not None:
                top = tuple(
                    (int(tid), self._decode([int(tid)]), float(value))
                    for tid, value in zip(
                        top_ids[step].tolist(), top_values[step].tolist(), strict=True
                    )
                )
            token_id = tokens[step]
            out.append(TokenLogprob(token_id, self._decode([token_id]), float(chosen[step]), top))
        return out

    def _stop_ids(self, spec: SamplingSpec) -> set[int]:
        """Token ids that end a row: the request's `stop_token_ids`, and EOS unless ignored."""
        return set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self._eos_ids))

    def _bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word with and without a leading space, as vLLM bans them."""
        ids: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                encoded = list(self._tokenizer.encode(variant, add_special_tokens=False))
                if encoded and encoded not in ids:
                    ids.append(encoded)
        return ids

    def _finish(
        self, request: EngineRequest, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> EngineSample:
        spec = request.sampling
        tokens = tokens[: spec.max_tokens]
        finish = "length" if len(tokens) >= spec.max_tokens else "stop"
        stops = self._stop_ids(spec)
        cut = next((i for i, t in enumerate(tokens) if t in stops), None)
        if cut is not None:
            text = self._decode(tokens[:cut])
            tokens, finish = tokens[: cut + 1], "stop"
            return self._with_stops(request, tokens, text, finish, logprobs, eos_cut=True)
        return self._with_stops(
            request, tokens, self._decode(tokens), finish, logprobs, eos_cut=False
        )

    def _with_stops(
        self,
        request: EngineRequest,
        tokens: list[int],
        text: str,
        finish: str,
        logprobs: list[TokenLogprob] | None,
        *,
        eos_cut: bool,
    ) -> EngineSample:
        hits = [(text.find(s), s) for s in request.sampling.stop if s and s in text]
        completion = len(tokens)
        if hits:
            at, stop = min(hits)
            text = (
                text[: at + len(stop)] if request.sampling.include_stop_str_in_output else text[:at]
            )
            finish = "stop"
            body = tokens[:-1] if eos_cut else tokens
            completion = self._tokens_until(body, stop)
        tokens = tokens[:completion]
        return EngineSample(
            text=text,
            completion_tokens=completion,
            finish="length" if finish == "length" else "stop",
            token_ids=tokens,
            logprobs=logprobs[:completion] if logprobs is not None else None,
        )

    def _decode(self, tokens: list[int]) -> str:
        return str(self._tokenizer.decode(tokens, skip_special_tokens=False))

    def _tokens_until(self, tokens: list[int], stop: str) -> int:
        """The fewest leading tokens whose text contains `stop` (what vLLM would have run)."""
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in self._decode(tokens[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return hi


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _error(request: EngineRequest, message: str, *, prompt_tokens: int = 0) -> EngineOutput:
    return EngineOutput(
        key=request.key,
        text="",
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        finish="error",
        error=message,
    )


def _abort(request: EngineRequest) -> EngineOutput:
    return EngineOutput(
        key=request.key, text="", prompt_tokens=0, completion_tokens=0, finish="abort"
    )


def _deliver(on_done: OnDone, output: EngineOutput) -> None:
    try:
        on_done(output)
    except Exception:
        log.exception("transformers_on_done_failed", key=output.key)
