"""A GPT (decoder-only transformer) in plain PyTorch, in two architectures: the modules and the forward pass.

The model is deliberately small and explicit: token embeddings, a stack of pre-norm blocks (norm ->
causal self-attention -> residual, norm -> MLP -> residual), a final norm and a language-model head that
shares its weight with the token embedding. `GPTConfig.architecture` chooses the parts: gpt2 (learned
positions, LayerNorm, GELU MLP) or llama (rotary positions, RMSNorm, SwiGLU); see `lowmem.model.config`.

Both keep the same module names where the parts play the same role (`tok_emb`, `blocks.i.attn.qkv`,
`blocks.i.mlp.out_proj`, `ln_f`, ...), so memory savers, FSDP units, compile and checkpoints treat them alike.

Attention (and the masks of packed rows) lives in `lowmem.model.attention`; generation (`GPT.generate`) and its
key/value cache in `lowmem.model.generation`.

Shapes in comments use B = batch size, T = sequence length, C = n_embd, nh = n_head, hs = C // nh and
V = padded vocabulary size.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterable, cast

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lowmem.errors import ConfigError
from lowmem.model import generation, preference
# ARCHITECTURES is re-exported: the architectures this module builds, defined with the config that checks them.
from lowmem.model.config import ARCHITECTURES as ARCHITECTURES
from lowmem.model.attention import CausalSelfAttention, Rotary, segment_mask, segment_positions
from lowmem.model.ends import OutputHead, TokenEmbedding
from lowmem.model.mlp import MLP, SwiGLU
from lowmem.model.norm import RMSNorm
from lowmem.model.config import GPTConfig
from lowmem.model.flex import document_block_mask
from lowmem.model.generation import DecodingState, attention_mask
from lowmem.model.kv_cache import KVCache, LayerKVCache
from lowmem.model.loss import IGNORE_INDEX, chunked_token_loss_sum, head_logits, plain_token_losses
from lowmem.model.rotary import rotary_angles

def _norm(config: GPTConfig) -> nn.Module:
    """The normalisation layer of `config.architecture`: LayerNorm (gpt2) or RMSNorm (llama, no mean, no bias)."""
    if config.architecture == "llama":
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """One pre-norm transformer block.

    Normalising the input of each branch (rather than the sum) leaves the residual stream an identity path
    from embeddings to the head, which is what makes deep stacks train without warm-up tricks.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _norm(config)
        self.mlp = SwiGLU(config) if config.architecture == "llama" else MLP(config)
        # Set by `GPT.use_memory_savers`: keep only the block's input for the backward pass and run the
        # block again there, instead of keeping every intermediate activation.
        self.checkpoint_activations = False

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: LayerKVCache | None = None,
        rotary: Rotary = None,
    ) -> torch.Tensor:
        """(B, T, C) -> (B, T, C). `attn_mask`, `cache` and `rotary` as in `CausalSelfAttention.forward`.

        With `checkpoint_activations`, training forwards keep only `x` and recompute the block in the
        backward pass. The checkpoint sits inside the block's own forward so that a wrapper around the block
        (an FSDP unit) has gathered the weights before the recomputation needs them; dropout draws the same
        masks again (the random state is saved with the input).
        """
        if self.checkpoint_activations and self.training and cache is None and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attn_mask, None, rotary, use_reentrant=False)
        return self._forward(x, attn_mask, cache, rotary)

    def _forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None,
                 cache: LayerKVCache | None, rotary: Rotary) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask, cache, rotary)  # positions exchange information
        x = x + self.mlp(self.ln_2(x))  # each position computes on its own
        return x


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Args:
        config: the model sizes; see `GPTConfig`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        V = config.padded_vocab_size
        self.tok_emb = TokenEmbedding(V, config.n_embd)
        # Learned absolute positions (gpt2); the llama architecture rotates queries and keys instead.
        self.pos_emb = nn.Embedding(config.max_seq_len, config.n_embd) if config.architecture == "gpt2" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = _norm(config)
        self.lm_head = OutputHead(config.n_embd, V, bias=False)
        self.tie_weights()

        self.apply(self._init_weights)
        # Each block adds two branches to the residual stream; shrinking their output projections keeps
        # the variance of the stream roughly constant with depth (GPT-2's 1/sqrt(2 * n_layer)).
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        # nn.ModuleList is typed as holding any Module; these are the Blocks built above.
        for block in cast("Iterable[Block]", self.blocks):
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.out_proj.weight, mean=0.0, std=residual_std)
        # The left padding and key/value cache `next_token_logits` reads; set only while `generate` runs.
        self.decoding: DecodingState | None = None
        # Tokens per chunk of the loss (see `use_memory_savers`); 0 computes the whole logits at once.
        self.loss_chunk_tokens = 0
        # The kernel for attention within packed rows (see `use_attention`).
        self.packed_attention = "sdpa"
        # The tied head computed through the embedding module, which alone holds the weight (`head_through_embedding`).
        self.head_in_embedding = False

    def tie_weights(self) -> None:
        """Make the output layer's weight the token embedding's (unless `config.tie_embeddings` is False).

        Weight tying: reading a token and predicting it use the same vectors. It saves V * C parameters (a large
        share of a small model) and tends to help. Both names refer to one Parameter, so `parameters()`, `.to()`
        and the optimizer see it once. A model started from an untied source keeps its own output layer. Called
        again after anything that replaces the Parameters (`to_empty` gives each name a new one).
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def head_through_embedding(self) -> None:
        """Compute the tied head through the embedding module, and give `lm_head` no parameter of its own.

        For FSDP2, where each parameter belongs to one unit and a unit gathers it around its module's calls: the
        embedding's unit then gathers the shared weight for the lookup and again for the head, and releases it
        between them, instead of holding it whole from the first layer to the last. What the model computes does not
        change; only the head's parameter name leaves the module tree (files keep writing the plain model's names).
        """
        if not self.config.tie_embeddings or self.head_in_embedding:
            return
        self.lm_head.register_parameter("weight", None)
        self.head_in_embedding = True

    def head(self, through: Callable[[torch.Tensor], Any]) -> Any:
        """`through(weight)` of the language-model head's weight (V, C), inside the call of the module that holds it
        (see `OutputHead`)."""
        module = self.tok_emb if self.head_in_embedding else self.lm_head
        return module(None, through=through)

    def use_attention(self, kind: str) -> GPT:
        """Choose the kernel for attention within packed rows (`segment_ids`); what it computes does not change.

        Args:
            kind: "sdpa" (PyTorch's scaled_dot_product_attention with a boolean mask) or "flex" (FlexAttention with a
                block mask built once per forward pass, `lowmem.model.flex`; fast on long sequences, no dropout,
                no backward on the CPU). Unpacked rows and generation always use SDPA.

        Returns:
            The model itself.
        """
        if kind not in ("sdpa", "flex"):
            raise ConfigError(f"The attention kernel must be sdpa or flex, got {kind!r}.")
        self.packed_attention = kind
        return self

    def use_memory_savers(self, loss_chunk_tokens: int = 0, checkpoint_activations: bool = False) -> GPT:
        """Choose how training trades compute for memory; what the model computes does not change.

        Args:
            loss_chunk_tokens: with targets and no logits asked for, run the head and the cross-entropy
                over this many tokens at a time (see `lowmem.model.loss`): the (B, T, V) logits never exist.
                0 computes them whole.
            checkpoint_activations: recompute each block's activations in the backward pass instead of
                keeping them (about one more forward pass of the blocks per step).

        Returns:
            The model itself.
        """
        if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 0:
            raise ConfigError("loss_chunk_tokens must be a whole number >= 0 (0 = no chunks), "
                              f"got {loss_chunk_tokens!r}.")
        self.loss_chunk_tokens = loss_chunk_tokens
        for block in cast("Iterable[Block]", self.blocks):  # nn.ModuleList is typed as holding any Module
            block.checkpoint_activations = bool(checkpoint_activations)
        return self

    @property
    def memory_savers(self) -> dict[str, Any]:
        """The `use_memory_savers` arguments in force, to give a replica of this model the same."""
        return {"loss_chunk_tokens": self.loss_chunk_tokens,
                "checkpoint_activations": bool(self.blocks) and self.blocks[0].checkpoint_activations}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2 initialisation: N(0, 0.02) for Linear and Embedding weights, zeros for biases.

        LayerNorms keep PyTorch's default (weight 1, bias 0).
        """
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ----------------------------------------------------------------------------------------------------
    # Sizes

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, counting the tied embedding / head weight once.

        Args:
            exclude_embeddings: leave out the token and position embeddings (the usual "model size" in
                scaling-law papers, and what grows with depth and width rather than with the vocabulary).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel() + self._position_table_size()
        return n

    def _position_table_size(self) -> int:
        """Parameters of the learned position table (0 with rotary positions)."""
        return 0 if self.pos_emb is None else self.pos_emb.weight.numel()

    def estimate_flops_per_token(self, seq_len: int | None = None) -> int:
        """Floating-point operations to train on one token (forward + backward), for MFU.

        Follows the PaLM appendix B estimate: 6 * N + 12 * n_layer * n_embd * T, where

        - N counts the parameters that take part in a matmul: every parameter except the position
          embedding (a lookup, no arithmetic; the llama architecture has none). The token embedding counts
          because, tied to `lm_head`, it is the weight of the logits matmul. Each such weight costs 2 FLOPs
          per token forward and 4 backward.
        - 12 * n_layer * (n_head x head size) * T is attention itself: q @ k^T and att @ v are 2 * T * n_embd
          FLOPs each per token and layer forward (n_head x head size is n_embd unless a source model says
          otherwise), times 3 for forward + backward. The causal mask is ignored, as in the usual convention
          (kernels that skip the masked half do less work).

        Args:
            seq_len: sequence length T; defaults to `config.max_seq_len`.
        """
        T = self.config.max_seq_len if seq_len is None else seq_len
        return self.matmul_flops_per_token() + self.attention_flops_per_pair() * T

    def matmul_flops_per_token(self) -> int:
        """The training FLOPs per token of the matmuls with weights: 6 x the parameters that take part in one (all
        but a learned position table; see `estimate_flops_per_token`), 4 x a frozen one's (adapters train, the base
        does not: its weights get no gradient, only their inputs do)."""
        flops = sum((6 if parameter.requires_grad else 4) * parameter.numel() for parameter in self.parameters())
        if self.pos_emb is not None:
            flops -= (6 if self.pos_emb.weight.requires_grad else 4) * self._position_table_size()
        return flops

    def attention_flops_per_pair(self) -> int:
        """The training FLOPs of attention per (query, key) pair of a sequence, all layers: q @ k^T and att @ v are
        2 x (n_head x head size) FLOPs each per pair and layer forward, x 3 for forward + backward. A sequence of L
        tokens has L x L pairs (the causal half counted, as in the usual convention), so rows packed side by side
        cost the sum of their L^2, not the squared width of the sequence they share."""
        cfg = self.config
        return 12 * cfg.n_layer * cfg.n_head * cfg.head_dim

    # ----------------------------------------------------------------------------------------------------
    # Forward and loss

    def hidden_states(
        self,
        idx: torch.Tensor,
        n_pad: torch.Tensor | None = None,
        cache: KVCache | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normalised hidden states for token ids `idx` (B, T) -> (B, T, C), before the language-model head.

        `forward` and `next_token_logits` apply the head to all positions or to the last one; with a cache, a
        prompt can be run in pieces here and give the hidden states of one pass over the whole.

        Args:
            idx: token ids; with a cache, those of the positions after the cached ones.
            n_pad: (B,) number of left-padding tokens each row starts with, counted from the first
                position (the cached ones included); None when no row is padded.
            cache: keys and values of the earlier positions; idx's are appended to it.
            segment_ids: (B, T) ids of the packed rows each sequence holds (contiguous runs, 0 for padding):
                positions restart at 0 with each segment, and attention stays inside it.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, seq_len), got {tuple(idx.shape)}.")
        B, T = idx.shape
        start = 0 if cache is None else cache.length  # positions before idx
        if start + T > self.config.context_len:
            raise ValueError(
                f"Sequence length {start + T} exceeds the model's context of {self.config.context_len} tokens; "
                "truncate the input (the collate function's max length) or build the model with a larger max_seq_len."
            )
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        attn_mask = None  # plain causal attention: the fast path for training
        if segment_ids is not None and self.packed_attention == "flex":
            pos = segment_positions(segment_ids)  # (B, T)
            attn_mask = document_block_mask(segment_ids)  # built once, used by every block
        elif segment_ids is not None:
            pos, attn_mask = segment_positions(segment_ids), segment_mask(segment_ids)  # (B, T), (B, 1, T, T)
        elif n_pad is not None:
            # Each row's first real token gets position 0, as if its prompt had been given alone; padding
            # (hidden from every real position by the mask) clamps to 0 to stay a valid index.
            pos = (pos - n_pad.unsqueeze(1)).clamp_min(0)  # (B, T)
            attn_mask = attention_mask(T, start + T, n_pad, idx.device)  # (B, 1, T, start + T)
        elif start > 0 and T > 1:
            # Several new queries after cached ones: SDPA's `is_causal` aligns the mask to the first key,
            # not the last, so it would be wrong here.
            attn_mask = attention_mask(T, start + T, None, idx.device)  # (1, 1, T, start + T)
        x = self.tok_emb(idx)  # (B, T, C)
        rotary = None
        if self.pos_emb is None:
            # each (B or 1, 1, T, hs)
            rotary = rotary_angles(pos, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)
        else:
            x = x + self.pos_emb(pos)  # (B, T, C) + (T, C) or (B, T, C)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, None if cache is None else cache.layers[i], rotary)  # (B, T, C)
        return self.ln_f(x)  # (B, T, C)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
        reference_logps: torch.Tensor | None = None,
        dpo_beta: float = 0.0,
        pair_weights: torch.Tensor | None = None,
        answer_logps: bool = False,
        n_pad: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_logits: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits for every position without `targets`; the mean next-token loss with them; in preference training
        the DPO loss (`reference_logps`) or each answer's log-probability (`answer_logps`).

        Args:
            idx: token ids, LongTensor (B, T) with T <= max_seq_len.
            targets: the id each position should predict, LongTensor (B, T); positions holding -100
                (`IGNORE_INDEX`) do not count.
            loss_mask: optional (B, T) weights, usually 0/1 or bool: 0 leaves a position out of the loss
                (e.g. prompt tokens), 1 counts it. Combined with `IGNORE_INDEX` (a position counts only if
                both allow it).
            segment_ids: optional (B, T) ids of rows packed side by side (see `TokenizingCollate(pack=True)`):
                each row then gets the positions and attention it would have alone.
            return_logits: with `targets`, return the logits too. Off by default: under mixed precision
                accelerate copies every tensor the wrapped model returns to float32, and a (B, T, V) copy
                the training step throws away would stay alive into the next micro-batch.
            reference_logps: (2P,) with `targets` of 2P unpacked rows, the P chosen answers first: the DPO loss
                against these reference log-probabilities (`lowmem.model.preference.dpo_loss`), with `dpo_beta`
                and `pair_weights` (P,). float32, or its bits as int32: FSDP2's mixed precision casts every
                floating-point input to bf16, whose spacing at -300 nats is 2 nats. Computed here, inside the
                wrapped model's forward, so that DDP's and FSDP's hooks see it as any loss.
            answer_logps: with `targets`, each row's answer log-probability (B,), without gradients: the
                reference's side of the DPO loss.
            n_pad, cache: a step of generation (`next_token_logits`): as in `hidden_states`.
            last_logits: return the logits of the last position only (B, V), without targets: what a step of
                generation needs. Generation runs through `forward` so that a wrapper's hooks (FSDP2 gathering
                the weights) run around each of its steps as around a training forward.

        Returns:
            (logits, loss): logits (B, T, padded_vocab_size), or None when `targets` is given without
            `return_logits` (then, with `loss_chunk_tokens` set, no (B, T, V) tensor exists at all); loss is
            a float32 scalar, the weighted mean over counted positions (0.0 when no position counts, so a
            fully masked batch cannot turn the loss or the gradients into NaN), or None without targets.
            With `reference_logps`: (the DPO terms' sums, `DPOTerms.sums`, the surrogate whose gradient is the
            loss's); with `answer_logps`: (the rows' log-probabilities, None); with `last_logits`: ((B, V), None).
        """
        x = self.hidden_states(idx, n_pad, cache, segment_ids)  # (B, T, C)
        if last_logits:
            # Only the last position is needed: skip the (B, T, V) logits tensor.
            return self.head(lambda head: head_logits(x[:, -1, :], head)), None  # (B, V)
        if targets is None:
            return self.head(lambda head: head_logits(x, head)), None  # (B, T, V)
        if answer_logps:
            return self.head(lambda head: preference.answer_log_probs(x, head, targets, self.loss_chunk_tokens)), None
        if reference_logps is not None:
            if reference_logps.dtype == torch.int32:  # float32 bits (`PreferenceLoss`): no wrapper casts them
                reference_logps = reference_logps.view(torch.float32)
            surrogate, terms = self.head(lambda head: preference.dpo_loss(
                x, head, targets, reference_logps, dpo_beta, self.loss_chunk_tokens, pair_weights))
            return terms.sums(), surrogate

        if targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}.")
        weights = (targets.reshape(-1) != IGNORE_INDEX).float()  # (B*T,)
        if loss_mask is not None:
            if loss_mask.shape != targets.shape:
                raise ValueError(
                    f"loss_mask shape {tuple(loss_mask.shape)} must equal targets shape {tuple(targets.shape)}."
                )
            weights = weights * loss_mask.reshape(-1).float()
        logits = None
        if self.loss_chunk_tokens and not return_logits:
            loss_sum = self.head(lambda head: chunked_token_loss_sum(
                x.reshape(-1, x.size(-1)), head, targets.reshape(-1), weights, self.loss_chunk_tokens))
        else:
            logits = self.head(lambda head: head_logits(x, head))  # (B, T, V)
            per_token = plain_token_losses(logits.view(-1, logits.size(-1)), targets.reshape(-1))  # (B*T,)
            loss_sum = (per_token * weights).sum()
        # Clamping the denominator (not the result) keeps 0 / 0 at 0 with a finite gradient.
        denom = weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
        return (logits if return_logits else None), loss_sum / denom

    # ----------------------------------------------------------------------------------------------------
    # Training

    def configure_optimizer(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple[float, float] = (0.9, 0.95),
        device_type: str = "cpu",
        fused: bool = True,
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices and embeddings only.

        Decay pulls weights towards zero; that regularises the matrices (dim >= 2) but would only fight the
        scale and shift that biases and LayerNorm parameters (dim 1) exist to learn.

        Args:
            weight_decay: decay for parameters with dim >= 2.
            learning_rate: the (peak) learning rate; a scheduler may change it later.
            betas: Adam's moment coefficients.
            device_type: where the parameters live: on "cuda" and "cpu" the fused AdamW kernel is used, which
                updates all parameters in a few launches instead of several per tensor and can skip a step on the
                device (`lowmem.train.step.step_if_finite`).
            fused: False keeps torch's default kernel (for an optimizer another library replaces).
        """
        params = [p for p in self.parameters() if p.requires_grad]  # tied weight appears once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        fused = fused and device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters
        extra: dict[str, Any] = {"fused": True} if fused else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

    # ----------------------------------------------------------------------------------------------------
    # Generation

    def next_token_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for the token after `idx` (B, T) -> (B, V), over the padded vocabulary: one step of `generate`.

        Contexts longer than the model's (`GPTConfig.context_len`) are cropped to their last tokens. While
        `generate` runs, `self.decoding` says how many left-padding tokens each row starts with and holds
        the key/value cache; with a cache only the positions it has not seen yet are run. Outside `generate`
        every row is a full prompt, run whole.

        `generate` calls this method and nothing else of the model at each step, always with the one argument:
        replacing it on an instance scripts the logits of a generation.

        Args:
            idx: the whole context so far, LongTensor (B, T); left-padded as the generation's prompt was.
        """
        state = self.decoding if self.decoding is not None else DecodingState()
        n_pad, cache = state.n_pad, state.cache
        max_len = self.config.context_len
        if cache is not None and idx.size(1) > max_len:
            # The window is about to slide. Positions count from the window's start, so every kept token
            # moves to a new position and all cached keys and values go stale (rotated keys included: the
            # token that leaves the window changes what every later one attended to): from here on each
            # step recomputes the window, exactly as without a cache.
            state.cache = cache = None
        if cache is not None:
            idx = idx[:, cache.length :]  # the whole prompt on the first step, then only the token chosen last
        elif idx.size(1) > max_len:
            cut = idx.size(1) - max_len
            idx = idx[:, cut:]  # (B, context_len)
            if n_pad is not None:
                n_pad = (n_pad - cut).clamp_min(0)  # (B,), the padding that is still in the window
        logits, _ = self(idx, n_pad=n_pad, cache=cache, last_logits=True)  # through forward: see its last_logits
        return logits  # (B, V)

    # Generation with a KV cache lives in lowmem.model.generation; as a method, `model.generate(idx, ...)`.
    generate = generation.generate
