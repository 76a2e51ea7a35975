"""Generation with a key/value cache: the decoding loop behind `GPT.generate` and its helpers.

The cache (`KVCache`) keeps the keys and values of positions already run, so each new token costs one
position's work instead of a pass over the whole context. Prompts of different lengths are left-padded and
masked (`attention_mask`); the loop bans repeated n-grams and filters the logits (top-k, top-p) before
sampling.

The loop and the model meet at one method, `GPT.next_token_logits(idx)`: `generate` hands it the whole context
at every step, and what else it needs (the left padding, the cache) waits for it in `GPT.decoding`, a
`DecodingState`, for the duration of the call.

Shapes in comments use B = batch size, T = sequence length, nh = n_head, hs = head size and V = padded
vocabulary size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from lowmem.errors import ConfigError
from lowmem.model.kv_cache import KVCache

if TYPE_CHECKING:  # only for annotations: lowmem.model.gpt imports this module
    from lowmem.model.gpt import GPT


@dataclass
class DecodingState:
    """What `GPT.next_token_logits` needs besides the tokens while `GPT.generate` runs.

    It waits in `GPT.decoding` for the duration of `generate` rather than being passed along, so that
    `next_token_logits(idx)` keeps one argument: tests and tools replace that method on an instance to script
    the logits.
    """

    # (B,) left-padding tokens at the start of each prompt row; None when no row is padded.
    n_pad: torch.Tensor | None = None
    # None when not caching, and from the step at which the context outgrows the model's (`context_len`).
    cache: KVCache | None = None


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Sequence[int] | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    pad_id: int | None = None,
    *,
    use_cache: bool = True,
    prompt_lengths: torch.Tensor | None = None,
    no_repeat_ngram_size: int = 0,
    stop_together: Callable[[bool], bool] | None = None,
) -> torch.Tensor:
    """Continue each sequence in `idx` by up to `max_new_tokens` tokens; `GPT.generate` is this function.

    The model runs in eval mode (no dropout) for the duration and is put back in its previous mode
    afterwards. Contexts longer than the model's (`GPTConfig.context_len`: `max_seq_len`, or a transformers source's
    context) are cropped to their last tokens.

    With `use_cache`, the keys and values of every position are kept, so each step runs only the new
    token; the chosen tokens are those of the uncached path (up to float rounding in near-ties). The
    cache covers contexts up to the model's. Once the context outgrows it, the position of every
    kept token changes with each step (positions count from the window's start), so the cache is dropped and
    each further step recomputes the last `context_len` tokens, as the uncached path does.

    Args:
        model: the GPT; while it runs, `model.decoding` holds the left padding and the key/value cache that
            `model.next_token_logits` reads.
        idx: prompt token ids, LongTensor (B, T) with T >= 1; left-padded when `prompt_lengths` is given.
        max_new_tokens: the most tokens to append.
        temperature: divides the logits before sampling; below 1 sharpens, above 1 flattens.
            0 means greedy.
        top_k: sample only among the k most likely tokens.
        top_p: sample only among the most likely tokens whose probabilities sum to at least top_p
            (nucleus sampling), in (0, 1].
        eos_id: stop a sequence once it produces this id (or one of these ids: a chat model's end of turn and its
            end of text); generation ends early when all have.
        greedy: take the most likely token instead of sampling (ignores temperature, top_k, top_p).
        generator: random generator for reproducible sampling; must be on the model's device.
        pad_id: what finished sequences emit while others continue; defaults to `eos_id` (the first).
        use_cache: keep a key/value cache (much faster for long generations); False recomputes the
            whole context at every step.
        no_repeat_ngram_size: with n > 0, never produce a token that would repeat an n-gram already in
            the row's answer (the prompt is not counted).
        prompt_lengths: (B,) number of real tokens in each row of `idx`, for a batch of prompts of
            different lengths: row b's prompt is its last `prompt_lengths[b]` tokens and whatever
            precedes them is padding (any ids), never attended to. Each row then gets the tokens it
            would get alone. None means every row is a full prompt.
        stop_together: for a model sharded over processes, where each step is a collective that every process
            takes part in: given whether this process's rows have all finished, says whether every process's have
            (`lowmem.distributed.fsdp_units.all_ranks_finished`); the loop ends only then, and rows that finished
            keep emitting padding meanwhile.

    Returns:
        LongTensor (B, T + n) holding the prompt (padding included) followed by the n <= max_new_tokens
        new tokens. Ids are always < `config.vocab_size`: the padding rows of the vocabulary are never
        chosen.

    Raises:
        ValueError: if `idx` is not (B, T) with T >= 1, or `prompt_lengths` is not B lengths in [1, T].
        ConfigError: if a sampling setting is out of range.
    """
    _check_settings(idx, max_new_tokens, temperature, top_k, top_p)
    sampling = _Sampling(model.config.vocab_size, greedy or temperature == 0, temperature, top_k, top_p,
                         no_repeat_ngram_size, generator)
    state = _decoding_state(model, idx, max_new_tokens, use_cache, prompt_lengths)
    with _decoding(model, state):
        return _decode(model, idx, max_new_tokens, sampling, eos_id, pad_id, stop_together)


def _check_settings(idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                    top_p: float | None) -> None:
    """Refuse a prompt that is not (B, T) with T >= 1 (ValueError) and sampling settings out of range
    (ConfigError), before the model is touched."""
    if idx.dim() != 2 or idx.size(1) < 1:
        raise ValueError(f"idx must have shape (batch, seq_len) with seq_len >= 1, got {tuple(idx.shape)}.")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 means greedy), got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1 or None (no limit), got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1] or None (no limit), got {top_p}.")


def _decoding_state(model: GPT, idx: torch.Tensor, max_new_tokens: int, use_cache: bool,
                    prompt_lengths: torch.Tensor | None) -> DecodingState:
    """The left padding of the prompt `idx` (B, T) and, with `use_cache`, an empty cache long enough for the
    whole generation (at most the model's context, `GPTConfig.context_len`)."""
    B, T = idx.shape
    max_len = model.config.context_len
    n_pad = _left_padding(prompt_lengths, B, T, idx.device)  # (B,) or None
    # A prompt that already fills the context would use the cache for its first step only.
    cache = KVCache(model.config.n_layer, min(T + max_new_tokens, max_len)) if use_cache and T < max_len else None
    return DecodingState(n_pad=n_pad, cache=cache)


@contextlib.contextmanager
def _decoding(model: GPT, state: DecodingState) -> Iterator[None]:
    """Eval mode and `model.decoding = state` for the duration of a generation; both undone afterwards, on an
    error too, so that neither dropout stays off nor the cache outlives the call."""
    was_training = model.training
    model.eval()
    model.decoding = state
    try:
        yield
    finally:
        model.decoding = None  # also frees the cache
        model.train(was_training)


def _decode(model: GPT, idx: torch.Tensor, max_new_tokens: int, sampling: _Sampling,
            eos_id: int | Sequence[int] | None, pad_id: int | None,
            stop_together: Callable[[bool], bool] | None = None) -> torch.Tensor:
    """The decoding loop: `idx` (B, T) followed by up to `max_new_tokens` tokens, one per step (see `generate`)."""
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,)
    answer_start = idx.size(1)
    stop = None if eos_id is None else torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id),
                                                    dtype=torch.long, device=idx.device)  # (S,)
    for _ in range(max_new_tokens):
        # The whole context: `next_token_logits` crops it, or runs only what the cache lacks.
        next_id = sampling.choose(model.next_token_logits(idx), idx[:, answer_start:])  # (B, 1)
        if stop is not None:
            next_id, finished = _pad_finished_rows(next_id, finished, stop, pad_id)
        idx = torch.cat([idx, next_id], dim=1)  # (B, T + 1)
        done = stop is not None and bool(finished.all())
        if stop_together is not None:
            done = stop_together(done)
        if done:
            break
    return idx


@dataclass(frozen=True)
class _Sampling:
    """How `generate` picks each next token from the model's logits: its sampling settings, once
    `_check_settings` has accepted them."""

    vocab_size: int  # the real vocabulary; the rows past it only pad the embedding
    greedy: bool  # also when the temperature is 0
    temperature: float
    top_k: int | None
    top_p: float | None
    no_repeat_ngram_size: int
    generator: torch.Generator | None

    def choose(self, logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        """The next token (B, 1) from the last position's logits (B, V), given the answer so far (B, t).

        The logits are changed in place when they already are float32, as the loop never reads them again.
        """
        logits = logits.float()  # (B, V)
        # The padding rows of the vocabulary are not tokens the tokenizer can decode.
        logits[:, self.vocab_size :] = float("-inf")
        if self.no_repeat_ngram_size > 0:
            _ban_repeated_ngrams(logits, answer, self.no_repeat_ngram_size)
        if self.greedy:
            return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        probs = F.softmax(_filter_logits(logits / self.temperature, self.top_k, self.top_p), dim=-1)  # (B, V)
        return torch.multinomial(probs, num_samples=1, generator=self.generator)  # (B, 1)


def _pad_finished_rows(next_id: torch.Tensor, finished: torch.Tensor, stop: torch.Tensor,
                       pad_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen tokens (B, 1) with padding (`pad_id`, else the first stop id) in rows that have finished, and the
    rows finished (B,) once these tokens are added (a row finishes on any of the `stop` ids (S,))."""
    fill = stop[:1] if pad_id is None else torch.full_like(stop[:1], pad_id)  # (1,)
    # Finished rows keep emitting padding so the batch stays rectangular.
    next_id = torch.where(finished.unsqueeze(1), fill.expand_as(next_id), next_id)  # (B, 1)
    return next_id, finished | torch.isin(next_id.squeeze(1), stop)  # (B, 1), (B,)


def _left_padding(prompt_lengths: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor | None:
    """Left-padding tokens per row (B,) from the prompt lengths, or None when no row is padded.

    Raises:
        ValueError: if `prompt_lengths` is not B lengths in [1, T].
    """
    if prompt_lengths is None:
        return None
    lengths = torch.as_tensor(prompt_lengths, device=device)
    if lengths.shape != (B,) or lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(
            f"prompt_lengths must be {B} integers (one per row of idx), got shape {tuple(lengths.shape)} "
            f"and dtype {lengths.dtype}."
        )
    if bool((lengths < 1).any()) or bool((lengths > T).any()):
        raise ValueError(f"prompt_lengths must lie in [1, {T}] (the width of idx), got {lengths.tolist()}.")
    n_pad = T - lengths.long()  # (B,)
    # Without padding the plain causal path is exact and faster.
    return n_pad if bool(n_pad.any()) else None


def attention_mask(Tq: int, Tk: int, n_pad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Boolean attention mask (B or 1, 1, Tq, Tk), True where a query may attend to a key.

    The Tq queries are the last Tq of the Tk key positions. A query sees itself and earlier keys, except
    the first n_pad[b] (left padding) of its row. A padding query still sees itself so that no row of the
    softmax has every key masked: some SDPA kernels return NaN for such a row, and the NaN would reach real
    positions through the values of the next layer (a zero attention weight times NaN is NaN).
    """
    q_pos = torch.arange(Tk - Tq, Tk, device=device).unsqueeze(1)  # (Tq, 1)
    k_pos = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    mask = k_pos <= q_pos  # (Tq, Tk), causal
    if n_pad is not None:
        real_key = k_pos >= n_pad.view(-1, 1, 1)  # (B, 1, Tk)
        mask = (mask & real_key) | (k_pos == q_pos)  # (B, Tq, Tk)
    return mask.view(-1, 1, Tq, Tk)  # (B or 1, 1, Tq, Tk), broadcast over heads


def _ban_repeated_ngrams(logits: torch.Tensor, answer: torch.Tensor, n: int) -> None:
    """Set to -inf, in place, each token that would repeat an n-gram already in the row's answer (B, t).

    A small model's greedy answers fall into loops of one phrase; forbidding repeated n-grams within the
    answer (not the prompt, which a continuation may echo) is the usual remedy.
    """
    for row, tokens in enumerate(answer.tolist()):
        if len(tokens) < n:
            continue
        prefix = tokens[len(tokens) - n + 1:]  # the n-1 tokens a new token would extend
        banned = {tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tokens[i:i + n - 1] == prefix}
        logits[row, list(banned)] = float("-inf")


def _filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set to -inf the logits (B, V) outside the top-k and outside the top-p nucleus."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1), the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        sorted_probs = F.softmax(sorted_logits, dim=-1)
        # Drop a token when the more likely tokens before it already reach top_p; the most likely token
        # is always kept because nothing precedes it.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)  # back to vocabulary order
    return logits
