"""transformers `generate` on the trainer's own module: the CPU default. Weights need no transfer."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo import dist, vision
from grpo.moe import routing
from grpo.errors import ConfigError
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.rollout.engine_memory import MIN_PROMPT_TOKENS, model_context
from grpo.weights import WeightBuckets


def base_model(model):
    """The transformers model under a peft wrapper (whose `generate` runs the base model's)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stop_token_ids(eos_id: int, folder_config) -> list[int]:
    """The tokenizer's EOS, then any further ones the model folder's generation_config.json lists
    (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), as vLLM stops on both."""
    extra = getattr(folder_config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return [eos_id] + [t for t in extra if t != eos_id]


def folder_stop_ids(eos_id: int, model_path: str) -> list[int]:
    """`stop_token_ids` of the model folder the engines load (its generation_config.json, as vLLM reads it;
    a folder without one: the tokenizer's EOS alone)."""
    try:
        config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        config = None
    return stop_token_ids(eos_id, config)


def generation_config(sampling: Sampling, pad_id: int, stop_ids: list[int]) -> GenerationConfig:
    """Sampling or greedy with no processing of its own: temperature, top-k and top-p come from
    `logits_processors`, last in the chain the recorder of the sampled tokens' logprobs; every
    other logits processor stays off (see `folder_defaults_off`)."""
    sample = sampling.temperature != 0
    # the sampling fields only when sampling: transformers warns that they "are not valid" in greedy
    # decoding (the eval's), which read as something wrong on every run
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0} if sample else {}  # top_k 0 = off (default 50)
    return GenerationConfig(
        do_sample=sample,
        **neutral,
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=stop_ids,
        return_dict_in_generate=True,
    )


class SampledLogprobs(LogitsProcessor):
    """Last in the chain: the logprob of each sampled token under the distribution it was drawn
    from. The token drawn at step t is in `input_ids` at step t + 1, so one B x V row of logprobs
    is held at a time; `output_scores=True` kept every step's, B x T x V (at 512 x 512 tokens and a
    152k vocabulary, 160 GB)."""

    def __init__(self):
        self.columns: list[torch.Tensor] = []
        self.last_BV: torch.Tensor | None = None

    def __call__(self, input_ids_BL: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
        if self.last_BV is not None:
            self.columns.append(self.last_BV.gather(-1, input_ids_BL[:, -1:]).squeeze(-1).cpu())
        self.last_BV = torch.log_softmax(scores_BV.float(), dim=-1)
        return scores_BV

    def logprobs(self, new_BT: torch.Tensor) -> torch.Tensor:
        """logprobs_BT of the generated tokens `new_BT` (the last step's taken here)."""
        columns = list(self.columns)
        if self.last_BV is not None:
            columns.append(self.last_BV.gather(-1, new_BT[:, -1:].to(self.last_BV.device)).squeeze(-1).cpu())
        return torch.stack(columns, dim=1) if columns else torch.zeros(new_BT.shape)


def logits_processors(sampling: Sampling, recorder: SampledLogprobs) -> LogitsProcessorList:
    """transformers' own warpers, in its own order (temperature, top-k, top-p), then the recorder:
    the sampled distribution is exactly softmax(filtered logits / temperature)."""
    chain = []
    if sampling.temperature != 0:
        if sampling.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            chain.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p=sampling.top_p))
    return LogitsProcessorList(chain + [recorder])


def completion_budgets(prompt_lens: list[int], max_new_tokens: int, max_context: int | None) -> list[int]:
    """Each prompt's most completion tokens: `max_new_tokens`, or what the model's context (its
    max_position_embeddings) leaves after the prompt where that is less. vLLM stops a sequence at
    max_model_len and marks it 'length'; transformers would generate on at positions the model never
    trained. A prompt that leaves no room is refused, as vLLM refuses it."""
    if max_context is None:
        return [max_new_tokens] * len(prompt_lens)
    too_long = [n for n in prompt_lens if n >= max_context]
    if too_long:
        raise ConfigError(f"a prompt of {too_long[0]} tokens leaves no room for a completion in the model's context of "
                          f"{max_context} tokens (max_position_embeddings); shorten the task's prompts.")
    return [min(max_new_tokens, max_context - n) for n in prompt_lens]


def compute_precision(model: torch.nn.Module, dtype: str):
    """Generation under the trainer's autocast: a bf16/fp16 run keeps fp32 master weights and
    scores under autocast (grpo/parallel/single.py), so the sampler does the same; an fp32 run, or
    weights already in the low precision (ZeRO), need none."""
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    param = next(model.parameters())
    if low is None or param.dtype == low:
        return contextlib.nullcontext()
    return torch.autocast(device_type=param.device.type, dtype=low)


@contextlib.contextmanager
def folder_defaults_off(model):
    """transformers (5.19, `_prepare_generation_config`) fills every field a GenerationConfig leaves
    unset from the model folder's generation_config.json: a hub model's repetition_penalty, min_p,
    no_repeat_ngram_size... would reshape the sampler's distribution away from the one the trainer
    scores. For the call, the model's own defaults are transformers' neutral ones."""
    target = base_model(model)
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = saved


def shared_prefill(model, ids_PL: torch.Tensor, mask_PL: torch.Tensor, n: int):
    """Each prompt's keys and values once, then repeated for its n samples: `generate` continues
    from them with the prompt's last token, so the prompt's forward runs once per prompt, not n
    times. Left-padded prompts all end in the last column; every column but that one is cached, with
    the position ids `generate` gives them (from the mask). None where the model keeps no cache."""
    position_PL = (mask_PL.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=ids_PL[:, :-1], attention_mask=mask_PL[:, :-1], position_ids=position_PL[:, :-1],
                use_cache=True, logits_to_keep=1)
    cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None
    cache.batch_repeat_interleave(n)
    return cache


def check_images_on_every_rank(mine: bool) -> None:
    """ZeRO-3's generate with a vision-language model: the vision tower's parameters are gathered in
    the prefill of the ranks whose prompts have images; a rank without any would not join those
    gathers and the ranks would hang or mismatch. Every rank raises the same error instead."""
    some, none_ = dist.all_reduce_max([float(mine), float(not mine)])
    if some and none_:
        raise RuntimeError(
            "parallel=zero3 with rollout=hf: some ranks had image prompts to generate from and others none (text-only "
            "prompts, or fewer evaluation prompts than ranks), so ZeRO-3's gathers of the vision tower would not match. "
            "Use a task whose every prompt carries an image with task.eval_size >= the number of ranks, rollout=colocated, "
            "or parallel=zero2.")


def generated_routes(rec: "routing.Recording", rows: int, prefill_rows: int, width: int, prompt_lens: list[int],
                     completion_lens: list[int]) -> list[torch.Tensor]:
    """Each completion's routed experts from `generate`'s recorded forwards: the prefill (of `prefill_rows`
    prompts, each repeated to its `rows // prefill_rows` samples: `shared_prefill`), then one call per
    token; cut to the sequence's own P + C - 1 rows (its left padding and anything after it dropped)."""
    calls = rec.calls
    first = calls[0].reshape(prefill_rows, -1, *calls[0].shape[1:]).repeat_interleave(rows // prefill_rows, dim=0)
    routes = torch.cat([first, *(c.reshape(rows, -1, *c.shape[1:]) for c in calls[1:])], dim=1)
    return [routes[i, width - p: width + c - 1] for i, (p, c) in enumerate(zip(prompt_lens, completion_lens))]


class HFBackend(RolloutBackend):
    returns_routes = True

    @classmethod
    def check_context(cls, cfg, model_config: dict) -> None:
        """transformers generates past the model's context without a word (positions it never trained)."""
        context = model_context(model_config)
        if context is not None and context < MIN_PROMPT_TOKENS + cfg.max_new_tokens:
            raise ConfigError(f"rollout.max_new_tokens={cfg.max_new_tokens} does not fit the model's context of {context} "
                              f"tokens (max_position_embeddings in its config.json) beside a prompt: set it to at most "
                              f"{context - MIN_PROMPT_TOKENS} less the prompt's tokens.")

    def __init__(self, cfg, model: torch.nn.Module, tokenizer, model_path: str | None = None, lockstep: bool = False,
                 dtype: str = "float32", **_):
        self.model, self.tokenizer, self.dtype = model, tokenizer, dtype
        self.record_routes = cfg is not None and routing.wants_routes(cfg)  # replayed or only observed by the update
        routing.check_policy(base_model(model), cfg)
        self.lockstep = lockstep
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer.eos_token_id, base_model(model).generation_config)
        self.weight_version = 0
        self.max_context = getattr(base_model(model).config, "max_position_embeddings", None)
        self.generate_is_collective = lockstep and dist.world_size() > 1  # ZeRO-3's synced generate

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        # at least 2 columns: shared_prefill caches all but the last, and every rank of a synced generate
        # must run it alike
        if not prompt_ids:  # a rank with nothing to generate (evaluation with fewer prompts than ranks)
            if not self.generate_is_collective:
                return Rollouts([], [], [], self.weight_version)
            self.generate([[self.pad_id, self.pad_id]], n, sampling)  # joins the others' synced forwards
            return Rollouts([], [], [], self.weight_version)
        width = max(2, max(len(p) for p in prompt_ids))
        rows = [p for p in prompt_ids for _ in range(n)]
        budgets = completion_budgets([len(p) for p in rows], sampling.max_new_tokens, self.max_context)
        sampling = dataclasses.replace(sampling, max_new_tokens=max(budgets))  # no row runs longer
        ids_BL = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in rows])
        mask_BL = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        was_training = self.model.training
        self.model.eval()
        gen_cfg = generation_config(sampling, self.pad_id, self.stop_ids)
        device = next(self.model.parameters()).device
        # ZeRO-3 parameters are gathered during each forward, a collective: every rank keeps
        # stepping until all ranks are done (transformers' synced_gpus)
        synced = self.lockstep and dist.world_size() > 1
        recorder = SampledLogprobs()
        # image prompts (grpo/vision.py): their pixels go in whole; the prompt is not prefilled once per
        # group (the vision tower and M-RoPE positions are the model's own generate's business)
        images = vision.generate_inputs(rows)
        if synced and vision.is_vision_model(base_model(self.model)):
            check_images_on_every_rank(bool(images))
        if images:
            images["mm_token_type_ids"] = (ids_BL == vision.image_token_id(base_model(self.model).config)).int()
        record = routing.record(base_model(self.model)) if self.record_routes else contextlib.nullcontext()
        with folder_defaults_off(self.model), compute_precision(self.model, self.dtype), record as rec:
            cache = (shared_prefill(self.model, ids_BL[::n].to(device), mask_BL[::n].to(device), n)
                     if n > 1 and not images else None)
            out = self.model.generate(input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device),
                                      generation_config=gen_cfg, logits_processor=logits_processors(sampling, recorder),
                                      synced_gpus=synced, **({"past_key_values": cache} if cache is not None else {}),
                                      **{k: v.to(device) for k, v in images.items()})
        self.model.train(was_training)
        new_BT = out.sequences[:, width:].cpu()
        logprobs_BT = recorder.logprobs(new_BT)
        completions, logprobs, reasons = [], [], []
        for tokens, lps, budget in zip(new_BT.tolist(), logprobs_BT.tolist(), budgets):
            tokens, lps = tokens[:budget], lps[:budget]  # a row whose prompt leaves less of the context
            end = next((t + 1 for t, token in enumerate(tokens) if token in self.stop_ids), None)
            if end is not None:
                completions.append(tokens[:end])
                logprobs.append(lps[:end])
                reasons.append("stop")
            else:
                completions.append(tokens)
                logprobs.append(lps)
                reasons.append("length")
        routes = None
        if rec is not None:
            routes = generated_routes(rec, len(rows), len(rows) // n if cache is not None else len(rows), width,
                                      [len(p) for p in rows], [len(c) for c in completions])
        return Rollouts(completions, logprobs, reasons, self.weight_version, routed_experts=routes)

    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        self.weight_version = version  # the module is the trainer's own: nothing to copy
