"""Exact speculation inside transformers' continuous batching: its scheduler, request states, paged cache and input
builder, with one step per flat batch (see docs/serving.md):

1. draft: every decoding request's draft model runs up to k flat passes on the draft's own paged cache;
2. schedule: transformers' scheduler packs new requests' prefill chunks and every decoding request's block
   ``[last, d1 .. dk]`` into one flat pass (a block the budget or the cache cannot hold is cut, never split);
3. verify: one target pass, with logits at every block position;
4. accept: per request, `hf_spec.rejection` with the request's own processor chain and random stream; the tokens
   go through transformers' own stop rule (``RequestState.update_and_check_completion``);
5. roll back: each request's target and draft caches keep what was accepted (`hf_spec.compat.truncate_paged_request`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StopStringCriteria

from hf_spec.checks import is_int_at_least
from hf_spec.compat import (
    attention_implementation,
    continuous_batching,
    decoding_chain,
    next_request_id,
    truncate_paged_request,
)
from hf_spec.rejection import accept_greedy, sample_from_weights
from hf_spec.sizing.batch import MAX_BATCH_DRAFT_TOKENS, BatchDraftLengths
from hf_spec.sizing.estimates import DecayedMean
from hf_spec.timing.probe import synchronize
from hf_spec.verification import Verification, resolve_verification
from logits_processors import check_processors, process_block, process_step

_CB = continuous_batching()

#: Per-request settings `add_request` takes beside transformers' own arguments (any other is refused by name).
REQUEST_SETTINGS = frozenset({"do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                              "no_repeat_ngram_size", "min_new_tokens", "suppress_tokens", "bad_words_ids", "seed",
                              "num_assistant_tokens", "stop_strings", "tokenizer"})


@dataclasses.dataclass
class RequestSpeculation:
    """One request's speculative state: its chain, its random stream, its draft cache's mirror, its counts."""

    sequence: list[int]  # prompt and every committed token
    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator
    num_assistant_tokens: int | str  # k, or "auto": chosen each step (`hf_spec.sizing.batch`)
    acceptance: DecayedMean  # accepted / reached drafts, forgetting (for "auto")
    draft_state: Any  # a transformers RequestState for the draft's paged cache: its position_offset = len(draft_fed)
    stop: StopStringCriteria | None = None  # `stop_strings`, as generate() applies them
    draft_fed: list[int] = dataclasses.field(default_factory=list)  # the tokens the draft cache holds, in order
    drafts: list[int] = dataclasses.field(default_factory=list)  # this step's draft tokens
    draft_probs: list[torch.Tensor] = dataclasses.field(default_factory=list)  # q of each, [vocab] (sampling only)
    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0
    cancelled: bool = False  # cancel_request() was called: its state may go once the request is not live

    def stats(self) -> dict[str, float | int]:
        """The counts a server reports as the response's ``speculative`` field."""
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        return {"num_steps": self.num_steps, "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
                "acceptance_rate": round(rate, 4)}


@dataclasses.dataclass
class _Verified:
    """Where a scheduled request's logits sit in the flat pass and what they verify."""

    state: Any
    speculation: RequestSpeculation
    first_logit: int  # row of the pass's kept logits
    num_drafts: int  # drafts in the block (0: one token, the first after a prefill or a block cut to its last token)


class SpeculativeBatchProcessor(_CB.Processor):
    """transformers' batch processor with a draft step before scheduling and the acceptance rule after the pass."""

    @classmethod
    def adopt(cls, base, manager: SpeculativeBatchingManager) -> SpeculativeBatchProcessor:
        """This class over a processor transformers built (same fields), with the draft's paged cache beside it."""
        processor = cls.__new__(cls)
        processor.__dict__.update(base.__dict__)
        if processor.model_runner.pad_inputs or processor.use_async_batching:
            raise ValueError("Speculative continuous batching runs eager, synchronous steps: leave `use_cuda_graph`, "
                             "`varlen_compile_config`, `decode_compile_config` and `use_async_batching` unset in "
                             "`continuous_batching_config`.")
        processor.manager = manager
        draft_config = copy.deepcopy(processor.cb_config)
        processor.draft_cache = _CB.PagedAttentionCache(
            config=manager.draft.config.get_text_config(), continuous_batching_config=draft_config,
            device=manager.draft.device, distributed_helper=processor.distributed_helper, dtype=manager.draft.dtype)
        processor.draft_io = _CB.IOs(cache=processor.draft_cache, config=manager.draft.config.get_text_config(),
                                     continuous_batching_config=draft_config, device=manager.draft.device,
                                     model_dtype=manager.draft.dtype, logit_processor=processor.logit_processor)
        processor.verified, processor.pass_tokens = [], 0
        return processor

    def reset(self) -> None:
        super().reset()
        self.draft_cache.free_all_requests()
        self.verified = []

    # -- the step: prepare (draft, schedule), forward (verify), update (accept, roll back) -------------------------

    def prepare_next_batch(self) -> bool:
        self._draft()  # 1. draft
        prepared = super().prepare_next_batch()  # 2. schedule: transformers' scheduler and input builder
        self._forget_finished()
        self.verified = self._locate_logits() if prepared else []
        return prepared

    @torch.no_grad()
    def _generation_step(self, model) -> None:
        # 3. verify: one flat target pass, logits kept at the rows `_locate_logits` listed.
        batch_data = self.inputs_and_outputs.get_model_kwargs(use_padding=False)
        rows = [v.first_logit + i for v in self.verified for i in range(v.num_drafts + 1)]
        batch_data["logits_to_keep"] = torch.tensor(rows, dtype=torch.int64, device=self.model_device)
        started = time.perf_counter()
        self.target_logits = model(**batch_data).logits[0].float()  # [rows, vocab]
        synchronize(self.target_logits.device)
        self.manager.sizer.add_target_pass(self.pass_tokens, time.perf_counter() - started)

    def update_batch(self) -> None:
        pending_outputs, row, observed = [], 0, False
        for verified in self.verified:
            state, speculation = verified.state, verified.speculation
            logits = self.target_logits[row: row + verified.num_drafts + 1]  # [n + 1, vocab]
            row += verified.num_drafts + 1
            emitted, num_accepted = self._accept(speculation, verified.num_drafts, logits)  # 4. accept
            was_decoding = state.generated_len() > 0
            if not was_decoding:
                state.status = _CB.RequestStatus.DECODING
            is_finished = False
            for token in emitted:
                speculation.sequence.append(token)
                is_finished = state.update_and_check_completion(token, None)
                if not is_finished and speculation.stop is not None and bool(
                        speculation.stop(torch.tensor([speculation.sequence]), None)[0]):
                    state.status, is_finished = _CB.RequestStatus.FINISHED, True
                if is_finished:
                    break
            speculation.num_steps += 1
            speculation.num_drafted += verified.num_drafts
            speculation.num_accepted += num_accepted
            if was_decoding:  # not the first token after a prefill
                self.manager.sizer.observe(speculation.acceptance, verified.num_drafts, num_accepted)
                observed = observed or verified.num_drafts > 0
            if is_finished:
                self.scheduler.finish_request(state.request_id)
                self.scheduler.block_new_requests = False
            else:  # 5. roll back: the target cache holds the committed tokens but the last
                state.position_offset = len(speculation.sequence) - 1
                truncate_paged_request(self.cache, state.request_id, state.position_offset)
            if state.streaming or is_finished:
                output = state.to_generation_output()
                output.speculative_stats = speculation.stats()
                pending_outputs.append(output)
        self.manager.sizer.end_step(observed)
        self._forget_finished()
        if pending_outputs:
            self.output_router.deliver_batch(pending_outputs)

    # -- 1. drafting ----------------------------------------------------------------------------------------------

    def _decoding(self) -> list[tuple[Any, RequestSpeculation]]:
        """The active requests past their first token, with their speculative state."""
        return [(state, self.manager.speculation(state.request_id))
                for state in self.scheduler.active_requests.values()
                if state.status == _CB.RequestStatus.DECODING and state.generated_tokens]

    @torch.no_grad()
    def _draft(self) -> None:
        """Draft each decoding request's block in flat draft passes; then offer ``[last] + drafts`` to the scheduler
        (cut to ``[last]`` when its cache could not hold the block)."""
        decoding = self._decoding()
        for _, speculation in decoding:
            self._roll_back_draft(speculation)
            speculation.drafts, speculation.draft_probs = [], []
        wanted = self._draft_lengths(decoding)
        while True:
            batch = self._draft_pass_batch(decoding, wanted)
            if not batch:
                break
            self._draft_pass(batch)
        for state, speculation in decoding:
            block = [speculation.sequence[-1], *speculation.drafts]
            if not self.cache.can_store_request_tokens(state, len(block), dry_run=True):
                speculation.drafts, speculation.draft_probs = [], []
                block = block[:1]
            state.tokens_to_process = block

    def _draft_lengths(self, decoding) -> dict[str, int]:
        """Each decoding request's k this step: its own, or for "auto" the sizer's choice over the batch (the other
        requests' blocks and the prefills waiting count as the pass's fixed tokens)."""
        wanted, auto = {}, []
        for state, speculation in decoding:
            cap = max(0, state.max_new_tokens - state.generated_len() - 1  # the block's last token is the target's
                      if state.max_new_tokens is not None else MAX_BATCH_DRAFT_TOKENS)
            if speculation.num_assistant_tokens == "auto":
                auto.append((state.request_id, speculation.acceptance, cap))
            else:
                wanted[state.request_id] = min(cap, speculation.num_assistant_tokens)
        if auto:
            fixed = sum(k + 1 for k in wanted.values()) + self._prefill_tokens_waiting()
            request_ids, records, caps = zip(*auto, strict=True)
            lengths = self.manager.sizer.lengths(records, caps, min(fixed, self.cache.max_batch_tokens))
            wanted.update(zip(request_ids, lengths, strict=True))
        return wanted

    def _prefill_tokens_waiting(self) -> int:
        """Prompt tokens the scheduler may add to this step's pass (those of requests still prefilling or waiting)."""
        prefilling = sum(len(state.remaining_prefill_tokens) for state in self.scheduler.active_requests.values()
                         if not state.generated_tokens)
        return prefilling + sum(len(state.initial_tokens) for state in self.scheduler.waiting_requests.values())

    def _roll_back_draft(self, speculation: RequestSpeculation) -> None:
        """The draft cache keeps its longest prefix that agrees with the committed tokens (all but the last)."""
        committed = speculation.sequence[:-1]
        keep = 0
        for fed, token in zip(speculation.draft_fed, committed, strict=False):
            if fed != token:
                break
            keep += 1
        del speculation.draft_fed[keep:]
        speculation.draft_state.position_offset = keep
        truncate_paged_request(self.draft_cache, speculation.draft_state.request_id, keep)

    def _draft_pass_batch(self, decoding, wanted: dict[str, int]) -> list[tuple[RequestSpeculation, list[int], bool]]:
        """The next draft pass: each request still drafting feeds what its draft cache lacks, within the pass's
        token budget; ``True`` where that reaches its last token (a draft token comes out)."""
        batch, budget = [], self.draft_cache.max_batch_tokens
        for state, speculation in decoding:
            if len(speculation.drafts) >= wanted[state.request_id] or budget == 0:
                continue
            pending = [*speculation.sequence, *speculation.drafts][len(speculation.draft_fed):]
            feed = pending[:budget]
            if not self.draft_cache.can_store_request_tokens(speculation.draft_state, len(feed)):
                wanted[state.request_id] = len(speculation.drafts)  # no room: the block stops here
                continue
            batch.append((speculation, feed, len(feed) == len(pending)))
            budget -= len(feed)
        return batch

    def _draft_pass(self, batch: list[tuple[RequestSpeculation, list[int], bool]]) -> None:
        """One flat draft pass; every request whose feed reached its end draws its next draft token from q."""
        futures, rows, start = [], [], 0
        for speculation, feed, has_token in batch:
            speculation.draft_state.tokens_to_process = feed
            futures.append(_CB.FutureRequestState(speculation.draft_state, has_token, {}, len(feed)))
            start += len(feed)
            if has_token:
                rows.append(start - 1)
        past = sum(s.draft_state.position_offset for s, _, _ in batch)
        self.draft_io.prepare_batch_tensors(futures, self.logit_processor, False, start, past, use_padding=False)
        kwargs = self.draft_io.get_model_kwargs(use_padding=False)
        kwargs["logits_to_keep"] = torch.tensor(rows, dtype=torch.int64, device=self.manager.draft.device)
        started = time.perf_counter()
        logits = self.manager.draft(**kwargs).logits[0].float()  # [rows, vocab]
        synchronize(logits.device)
        self.manager.sizer.add_draft_pass(start, time.perf_counter() - started)
        row = 0
        for speculation, feed, has_token in batch:
            speculation.draft_fed.extend(feed)
            if not has_token:
                continue
            prefix = torch.tensor([[*speculation.sequence, *speculation.drafts]], device=logits.device)
            scores = process_step(speculation.processors, prefix, logits[row: row + 1])  # [1, vocab]
            row += 1
            if speculation.do_sample:
                q = torch.softmax(scores, dim=-1)
                speculation.drafts.append(int(sample_from_weights(q, speculation.generator)))
                speculation.draft_probs.append(q[0])
            else:
                speculation.drafts.append(int(scores.argmax()))

    # -- 2. where the verify pass's logits sit ----------------------------------------------------------------------

    def _locate_logits(self) -> list[_Verified]:
        """For each scheduled request that gets tokens this step, its rows in the flat pass; a decoding block the
        scheduler cut (token budget) keeps its first drafts only, never a split."""
        verified, start = [], 0
        for future in self.inputs_and_outputs.requests_in_batch:
            state, length = future.state, future.query_length
            if state.generated_tokens:  # a decoding block [last, d1 .. dm]
                speculation = self.manager.speculation(state.request_id)
                state.remaining_prefill_tokens = []
                del speculation.drafts[length - 1:], speculation.draft_probs[length - 1:]
                verified.append(_Verified(state, speculation, start, length - 1))
            elif future.has_new_token:  # a prefill that ends here: the request's first token
                verified.append(_Verified(state, self.manager.speculation(state.request_id), start + length - 1, 0))
            start += length
        self.pass_tokens = start
        return verified

    # -- 4. acceptance ---------------------------------------------------------------------------------------------

    def _accept(self, speculation: RequestSpeculation, num_drafts: int,
                logits: torch.Tensor) -> tuple[list[int], int]:
        """The emitted tokens (accepted drafts, then one recovered or bonus token) and how many drafts were kept."""
        prefix = torch.tensor([speculation.sequence], device=logits.device)  # [1, len]
        drafts = torch.tensor([speculation.drafts[:num_drafts]], dtype=torch.int64, device=logits.device)  # [1, n]
        scores = process_block(speculation.processors, prefix, drafts, logits[None])  # [1, n + 1, vocab]
        if not speculation.do_sample:
            output_ids, num_accepted = accept_greedy(drafts, scores)
        else:
            target_probs = torch.softmax(scores, dim=-1)
            draft_probs = (torch.stack(speculation.draft_probs[:num_drafts])[None] if num_drafts
                           else target_probs[:, :0])  # [1, n, vocab]
            output_ids, num_accepted = self.manager.verification.chain(drafts, draft_probs, target_probs,
                                                                       speculation.generator)
        count = int(num_accepted[0])
        return output_ids[0, : count + 1].tolist(), count

    def _forget_finished(self) -> None:
        """Free the draft cache of requests that left (finished, cancelled, failed)."""
        for request_id in self.manager.forget_inactive(set(self.scheduler.active_requests)
                                                       | set(self.scheduler.waiting_requests)):
            self.draft_cache.free_blocks(request_id)


class SpeculativeBatchingManager(_CB.Manager):
    """transformers' `ContinuousBatchingManager` whose steps speculate with a draft model (same tokenizer)."""

    def __init__(self, model: PreTrainedModel, draft: PreTrainedModel, generation_config: GenerationConfig,
                 continuous_batching_config, workload_hints=None, num_assistant_tokens: int = 4,
                 verification: Verification | str | None = None) -> None:
        check_speculative_batching(model, draft, generation_config, continuous_batching_config, num_assistant_tokens)
        self.verification = resolve_verification(verification)  # the rule on sampled blocks (hf_spec.verification)
        config = copy.deepcopy(continuous_batching_config)
        config.allow_block_sharing = False  # blocks may hold drafted tokens: no prefix sharing (docs/serving.md)
        config.use_async_batching = False
        config.max_blocks_per_request = 0  # one varlen path: blocks are longer than one token
        self.draft = draft.eval()
        self.num_assistant_tokens = num_assistant_tokens
        self.sizer = BatchDraftLengths()  # the steps' pass costs and acceptance, for requests with k = "auto"
        self._draft_attn = attention_implementation(draft)
        if self._draft_attn == "eager":
            draft.set_attn_implementation("paged|eager")
        self._speculations: dict[str, RequestSpeculation] = {}
        self._speculations_lock = threading.Lock()
        super().__init__(model, generation_config, config, workload_hints)

    def _create_batch_processor(self):
        processor = super()._create_batch_processor()
        if isinstance(processor, SpeculativeBatchProcessor):
            return processor
        return SpeculativeBatchProcessor.adopt(processor, self)

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    **settings: Any) -> str | None:
        """transformers' `add_request`, plus per-request sampling settings (`REQUEST_SETTINGS`), checked here."""
        unknown = sorted(set(settings) - REQUEST_SETTINGS)
        if unknown:
            raise ValueError(f"add_request() got settings speculative continuous batching does not know: {unknown}; "
                             f"it takes {sorted(REQUEST_SETTINGS)}.")
        if request_id is None:
            request_id = next_request_id(self)
        max_new_tokens = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        speculation = self._new_speculation(request_id, list(input_ids), max_new_tokens, eos_token_id, settings)
        with self._speculations_lock:
            if request_id in self._speculations:
                raise ValueError(f"`request_id` {request_id!r} is already in use.")
            self._speculations[request_id] = speculation
        try:
            return super().add_request(input_ids, request_id, max_new_tokens, streaming, record_timestamps,
                                       eos_token_id)
        except BaseException:
            with self._speculations_lock:
                self._speculations.pop(request_id, None)
            raise

    def _new_speculation(self, request_id: str, input_ids: list[int], max_new_tokens: int, eos_token_id,
                         settings: dict) -> RequestSpeculation:
        settings = dict(settings)
        seed = settings.pop("seed", None)
        stop = stop_criteria(settings.pop("stop_strings", None), settings.pop("tokenizer", None))
        k = settings.pop("num_assistant_tokens", self.num_assistant_tokens)
        check_draft_length(k)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"`seed` must be an int, got {seed!r}.")
        chain_settings = {**self.generation_config.to_diff_dict(), **settings, "max_new_tokens": max_new_tokens}
        if eos_token_id is not None:
            chain_settings["eos_token_id"] = eos_token_id
        chain_settings.pop("transformers_version", None)
        if chain_settings.get("eos_token_id") in (-1, [-1]):  # transformers' continuous batching: no EOS
            chain_settings.pop("eos_token_id")
        generation_config = GenerationConfig(**chain_settings)
        processors = decoding_chain(self.model, chain_settings, torch.tensor([input_ids]))
        check_processors(processors)
        generator = torch.Generator(device=self.draft.device)
        generator.manual_seed(seed) if seed is not None else generator.seed()
        draft_state = _CB.RequestState(request_id=request_id, initial_tokens=[])
        return RequestSpeculation(list(input_ids), processors, bool(generation_config.do_sample), generator, k,
                                  BatchDraftLengths.new_request(), draft_state, stop=stop)

    def speculation(self, request_id: str) -> RequestSpeculation:
        with self._speculations_lock:
            return self._speculations[request_id]

    def forget_inactive(self, live: set[str]) -> list[str]:
        """Drop the speculative state of requests that have run, or were cancelled, and are no longer live; their ids
        (a request still in the input queue has not run; one cancelled there is drained with its cancellation, and
        never scheduled)."""
        with self._speculations_lock:
            gone = [request_id for request_id, speculation in self._speculations.items()
                    if request_id not in live and (speculation.num_steps > 0 or speculation.cancelled)]
            for request_id in gone:
                del self._speculations[request_id]
        return gone

    def cancel_request(self, request_id: str) -> None:
        super().cancel_request(request_id)  # queued first: the state goes only once the cancellation is on its way
        with self._speculations_lock:
            if request_id in self._speculations:
                self._speculations[request_id].cancelled = True

    def stop(self, *args, **kwargs) -> None:
        super().stop(*args, **kwargs)
        if attention_implementation(self.draft) != self._draft_attn:
            self.draft.set_attn_implementation(self._draft_attn)


def check_speculative_batching(model: PreTrainedModel, draft: Any, generation_config: GenerationConfig,
                               continuous_batching_config, num_assistant_tokens: Any) -> None:
    """Refuse, by name and before any work, what speculative continuous batching cannot run exactly."""
    if not isinstance(draft, PreTrainedModel):
        raise TypeError(f"`assistant_model` must be a transformers model sharing the model's tokenizer, got "
                        f"{type(draft).__name__}.")
    if model.config.is_encoder_decoder or draft.config.is_encoder_decoder:
        raise ValueError("Speculative continuous batching runs decoder-only models; `assistant_model` "
                         f"{type(draft).__name__} with model {type(model).__name__} is not.")
    target_vocab = model.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(f"`assistant_model` has a vocabulary of {draft_vocab} tokens and the model {target_vocab}: "
                         "speculative continuous batching needs one tokenizer and one vocabulary size.")
    for name, one in (("model", model), ("assistant_model", draft)):
        layer_types = set(getattr(one.config.get_text_config(), "layer_types", None) or [_CB.FULL_ATTENTION])
        if layer_types != {_CB.FULL_ATTENTION}:
            raise ValueError(f"`{name}` ({type(one).__name__}) has {sorted(layer_types)} layers: speculative "
                             "continuous batching rolls back full-attention paged caches only.")
    check_draft_length(num_assistant_tokens)
    if (generation_config.num_return_sequences or 1) > 1 or (generation_config.num_beams or 1) > 1:
        raise ValueError("Speculative continuous batching returns one sequence per request: `num_return_sequences` "
                         f"= {generation_config.num_return_sequences} and `num_beams` = {generation_config.num_beams} "
                         "must be 1.")
    if continuous_batching_config.return_logprobs:
        raise ValueError("`continuous_batching_config.return_logprobs=True` is not supported with an "
                         "`assistant_model` yet.")
    if continuous_batching_config.use_async_batching:
        raise ValueError("`continuous_batching_config.use_async_batching=True` cannot speculate: each step needs the "
                         "previous step's accepted tokens to draft.")


def check_draft_length(k: Any) -> None:
    if k != "auto" and not is_int_at_least(k, 0):
        raise ValueError(f"`num_assistant_tokens` must be an int >= 0 or 'auto', got {k!r}.")


def stop_criteria(stop_strings: Any, tokenizer: Any) -> StopStringCriteria | None:
    """``stop_strings`` as `generate()` takes them (a string or a list, with the ``tokenizer``), or ``None``."""
    if stop_strings is None:
        return None
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(x, str) and x for x in strings):
        raise ValueError(f"`stop_strings` must be a non-empty string or a list of them, got {stop_strings!r}.")
    if tokenizer is None:
        raise ValueError("`stop_strings` needs the `tokenizer` too (as in generate()): add_request(..., "
                         "stop_strings=..., tokenizer=tokenizer).")
    return StopStringCriteria(tokenizer, list(strings))
