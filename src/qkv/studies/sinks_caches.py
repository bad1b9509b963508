"""Cache policies past the training length: the second measurement of the attention-sinks
study (`qkv.studies.sinks`; Xiao et al. 2024, "Efficient Streaming Language Models with
Attention Sinks", Figure 3).

A GPT trained on sequences of L tokens reads held-out streams many times longer (a real LLM
reads a long text: `qkv.studies.sinks_real`), each token's next-token loss computed under four
policies (POLICIES):
   dense        the whole stream as context (RoPE positions past L; identical to decoding with
                a cache of every token, so one causal forward computes it);
   window       `SinkKVCache(num_sinks=0, window=W)`, one token at a time;
   sinks        `SinkKVCache(num_sinks, window=W - num_sinks)`: the same memory, the first
                tokens kept;
   recompute    a fresh forward over the last W tokens for every token (the quality
                reference: no stale keys, positions 0 .. W - 1), or for every stride-th one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers.sink_cache import SinkKVCache
from qkv.training.tasks.gpt import GPTTask

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "cached_losses",
    "dense_losses",
    "recomputed_losses",
    "stream_losses",
    "validation_streams",
]

logger = logging.getLogger(__name__)

POLICIES = ("dense", "window", "sinks", "recompute")
POLICY_NAMES = {
    "dense": "dense (whole context)",
    "window": "window only",
    "sinks": "sinks + window",
    "recompute": "window, recomputed",
}
_RECOMPUTE_CHUNK = 256  # windows per forward pass


def validation_streams(task: GPTTask, settings: dict[str, Any]) -> torch.Tensor:
    """(num_streams, stream_length): consecutive stretches of the held-out token stream."""
    count, length = settings["num_streams"], settings["stream_length"]
    stream = task.valid_blocks.blocks.flatten()
    if len(stream) < count * length:
        raise ValueError(
            f"stream_length: {count} streams of {length} tokens need {count * length} held-out "
            f"tokens, there are {len(stream)}"
        )
    return stream[: count * length].view(count, length)


def stream_losses(
    model: nn.Module, streams: torch.Tensor, *, window: int, num_sinks: int, stride: int = 1
) -> dict[str, torch.Tensor]:
    """Next-token losses (B, N - 1) of every policy (see the module docstring); recompute only
    at every stride-th position past the window (NaN elsewhere, `recomputed_losses`)."""
    logger.info("reading %d streams of %d tokens: dense", *streams.shape)
    losses = {"dense": dense_losses(model, streams)}
    logger.info("window only (%d tokens), one token at a time", window)
    losses["window"] = cached_losses(model, streams, num_sinks=0, window=window)
    logger.info("%d sinks + window of %d, one token at a time", num_sinks, window - num_sinks)
    losses["sinks"] = cached_losses(model, streams, num_sinks=num_sinks, window=window - num_sinks)
    logger.info("recomputing every %d-th token over its last %d tokens", stride, window)
    losses["recompute"] = recomputed_losses(model, streams, window=window, stride=stride)
    return losses


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[target], in fp32: logits (..., V), targets (...) -> (...)."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def dense_losses(model: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """One causal forward over the whole streams (B, N): losses (B, N - 1)."""
    logits = model(streams[:, :-1]).logits  # (B, N - 1, V)
    return _token_losses(logits, streams[:, 1:])


@torch.no_grad()
def cached_losses(
    model: nn.Module, streams: torch.Tensor, *, num_sinks: int, window: int
) -> torch.Tensor:
    """Feed streams (B, N) one token at a time through a `SinkKVCache(num_sinks, window)`:
    losses (B, N - 1), entry t the loss of predicting token t + 1."""
    config = model.config
    cache = SinkKVCache(
        num_layers=config.num_layers, batch=streams.shape[0], num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, num_sinks=num_sinks, window=window,
    )  # fmt: skip
    losses = []
    for t in range(streams.shape[1] - 1):
        output = model(streams[:, t : t + 1], cache=cache, logits_to_keep=1, check_ids=False)
        losses.append(_token_losses(output.logits[:, -1], streams[:, t + 1]))  # (B,)
    return torch.stack(losses, dim=1)  # (B, N - 1)


@torch.no_grad()
def recomputed_losses(
    model: nn.Module, streams: torch.Tensor, *, window: int, stride: int = 1
) -> torch.Tensor:
    """Each token's loss from a fresh forward over its last `window` tokens (positions 0 ..
    window - 1): losses (B, N - 1). Tokens t < window - 1 see their whole prefix, which one
    forward over the first window tokens gives. Past them, with stride > 1, only every
    stride-th entry (t = window - 1, window - 1 + stride, ...) is computed, the others NaN: a
    forward over the window per token is the costly policy on a large model."""
    B, N = streams.shape
    head = dense_losses(model, streams[:, : min(window, N)])[:, : window - 1]  # (B, <= W - 1)
    if window >= N:  # every token sees its whole prefix
        return head
    windows = streams[:, :-1].unfold(1, window, stride)  # (B, n, W): end at t = W - 1 + k * stride
    targets = streams[:, window::stride]  # (B, n)
    flat_windows, flat_targets = windows.reshape(-1, window), targets.reshape(-1)
    tail = []
    for start in range(0, len(flat_windows), _RECOMPUTE_CHUNK):
        chunk = flat_windows[start : start + _RECOMPUTE_CHUNK]  # (C, W)
        logits = model(chunk, logits_to_keep=1, check_ids=False).logits[:, -1]  # (C, V)
        tail.append(_token_losses(logits, flat_targets[start : start + _RECOMPUTE_CHUNK]))
    losses = torch.full(
        (B, N - window), float("nan"), device=streams.device
    )  # entries t = W - 1 .. N - 2
    losses[:, ::stride] = torch.cat(tail).view(B, -1)
    return torch.cat([head, losses], dim=1)  # (B, N - 1)
