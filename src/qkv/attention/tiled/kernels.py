"""FlashAttention's two loops in PyTorch: the forward (online softmax) and the backward
(recomputation from the log-sum-exp). Dao et al. 2022; Dao 2023, Algorithms 1 and 2; the online
softmax of Milakov & Gimelshein 2018.

Layout. GQA is served without repeating K/V: the G query heads that share a K/V head are laid
out as extra rows, so queries are (B, H_kv, L_q * G, D) with row r = i * G + g, and a block of
queries [q_start, q_end) is the contiguous row range [q_start * G, q_end * G). One score tile is
then a plain batched matmul, (B, H_kv, bq * G, D) @ (B, H_kv, D, bk), viewed as
(B, H_kv, bq, G, bk) wherever a mask, bias or score_mod needs the query and head apart.

Numbers. Tiles are computed in fp32 (fp64 stays fp64) whatever the input dtype; masked scores
are -inf; a row that has seen no visible key keeps m = -inf, l = 0, and ends with output 0 and
log-sum-exp -inf. The backward's P = exp(s - lse) would carry the rounding of the fp32 lse
into every probability of its row; `forward_with_low` keeps that rounding, and `backward`
takes it out of the row (see `_unround_lse`).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv.attention.tiled.traffic import TileCounter, TileTraffic, active_traffic
from qkv.attention.tiles import Tile, TilePlan, dropout_keep

ScoreMod = Callable[..., torch.Tensor]
LOG2_E = math.log2(math.e)


@dataclass(frozen=True)
class TraceStep:
    """The state of one query block's online softmax after it has folded in one key tile."""

    q_block: int
    k_block: int
    tile: Tile
    running_max: torch.Tensor  # (B, H, bq) m: the largest score seen so far per query
    running_sum: torch.Tensor  # (B, H, bq) l: sum of exp(score - m) so far per query


@dataclass(frozen=True)
class Problem:
    """Everything the loops read: inputs in the row layout (compute dtype) and the masking."""

    q_rows: torch.Tensor  # (B, H_kv, L_q * G, D), already multiplied by the scale
    k: torch.Tensor  # (B, H_kv, L_k, D)
    v: torch.Tensor  # (B, H_kv, L_k, D_v)
    group: int  # G query heads per K/V head
    bias: torch.Tensor | None  # (B|1, H_kv|1, G|1, L_q|1, L_k|1)
    mask: torch.Tensor | None  # bool, same layout as bias
    plan: TilePlan
    softcap: float | None
    score_mod: ScoreMod | None
    dropout_p: float
    seed: int
    captured: tuple[torch.Tensor, ...] = ()  # tensors score_mod reads that need a gradient

    def rows(self, start: int, end: int) -> slice:
        return slice(start * self.group, end * self.group)


def to_rows(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H_kv, L * G, D), row i * G + g holding query head h_kv * G + g."""
    B, H, L, D = x.shape
    grouped = x.view(B, num_kv_heads, H // num_kv_heads, L, D).transpose(2, 3)  # (B,H_kv,L,G,D)
    return grouped.reshape(B, num_kv_heads, L * (H // num_kv_heads), D)


def from_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H_kv, L * G, D) -> (B, H, L, D); the inverse of `to_rows`."""
    B, H_kv, rows, D = x.shape
    grouped = x.view(B, H_kv, rows // group, group, D).transpose(2, 3)  # (B, H_kv, G, L, D)
    return grouped.reshape(B, H_kv * group, rows // group, D)


def tile_of(t: torch.Tensor, q_start: int, q_end: int, k_start: int, k_end: int) -> torch.Tensor:
    """Slice a (B|1, H_kv|1, G|1, L_q|1, L_k|1) tensor to a (.., bq|1, G|1, bk|1) tile view."""
    rows = slice(q_start, q_end) if t.shape[3] > 1 else slice(0, 1)
    cols = slice(k_start, k_end) if t.shape[4] > 1 else slice(0, 1)
    return t[:, :, :, rows, cols].transpose(2, 3)


def _score_mod_indices(problem: Problem, q_start: int, q_end: int, k_start: int, k_end: int):
    """Broadcastable (batch, head, query index, key index) for a (B, H_kv, bq, G, bk) tile."""
    device, H_kv, G = problem.k.device, problem.k.shape[1], problem.group
    batch = torch.arange(problem.k.shape[0], device=device).view(-1, 1, 1, 1, 1)
    head = torch.arange(H_kv, device=device).view(-1, 1) * G + torch.arange(G, device=device)
    q_idx = torch.arange(q_start, q_end, device=device).view(1, 1, -1, 1, 1)
    k_idx = torch.arange(k_start, k_end, device=device).view(1, 1, 1, 1, -1)
    return batch, head.view(1, H_kv, 1, G, 1), q_idx, k_idx


def captured_tensors(score_mod: ScoreMod | None) -> tuple[torch.Tensor, ...]:
    """The tensors a score_mod closes over that need a gradient (a learned bias table), found
    in its closure (or, for a callable object such as `OffsetBias`, its attributes) and in
    those of the functions it holds, as FlexAttention finds the buffers its score_mod
    captures; each once, in the order met."""
    found: dict[int, torch.Tensor] = {}
    pending, seen = [score_mod], set()
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        for value in _held_values(function):
            if isinstance(value, torch.Tensor):
                if value.requires_grad:
                    found.setdefault(id(value), value)
            elif callable(value):
                pending.append(value)
    return tuple(found.values())


def _held_values(function) -> list:
    """What a function's closure cells hold, or a callable object's attributes."""
    if isinstance(function, types.FunctionType):
        values = []
        for cell in function.__closure__ or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
        return values
    return list(getattr(function, "__dict__", {}).values())


TileChainRule = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, tuple]]


def tile_scores(
    problem: Problem,
    q_start: int,
    q_end: int,
    k_start: int,
    k_end: int,
    tile: Tile,
    count: TileCounter | None = None,
) -> tuple[torch.Tensor, TileChainRule]:
    """Scores of one tile, (B, H_kv, bq * G, bk), masked with -inf; and their chain rule.

    The second result maps d(masked scores) to (d(q k^T * scale), d(bias), d(captured)),
    undoing the score_mod (by autograd on the tile, which also gives the gradient of the
    tensors it captured) and the soft-cap (d tanh = 1 - tanh^2). `count`, when given, is told
    every slice of an input the tile reads (`qkv.attention.tiled.traffic`).
    """
    rows = problem.rows(q_start, q_end)
    q_tile, k_tile = problem.q_rows[:, :, rows], problem.k[:, :, k_start:k_end]
    if count is not None:
        count.read("q", q_tile).read("k", k_tile)
    raw = q_tile @ k_tile.transpose(-1, -2)
    B, H_kv, n_rows, bk = raw.shape
    scores = raw.view(B, H_kv, q_end - q_start, problem.group, bk)  # (B, H_kv, bq, G, bk)
    tanh = None
    if problem.softcap is not None:  # Gemma 2: cap * tanh(scores / cap), before any bias
        tanh = torch.tanh(scores / problem.softcap)
        scores = problem.softcap * tanh
    if problem.bias is not None:
        bias_tile = tile_of(problem.bias, q_start, q_end, k_start, k_end)
        scores = scores + bias_tile
        if count is not None:
            count.read("bias", bias_tile)
    modded, before_mod = scores, None
    if problem.score_mod is not None:
        with torch.enable_grad():
            before_mod = scores.detach().requires_grad_()
            modded = problem.score_mod(
                before_mod, *_score_mod_indices(problem, q_start, q_end, k_start, k_end)
            )
    masked = modded.detach() if before_mod is not None else modded
    if tile is Tile.PARTIAL:
        visible = problem.plan.tile_mask(q_start, q_end, k_start, k_end, raw.device)
        if problem.mask is not None:
            mask_tile = tile_of(problem.mask, q_start, q_end, k_start, k_end)
            visible = visible & mask_tile
            if count is not None:
                count.read("mask", mask_tile)
        masked = masked.masked_fill(~visible, float("-inf"))
    masked = masked.reshape(raw.shape)  # (B, H_kv, bq * G, bk)

    def chain_rule(d_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        d_bias = d_scores.view(B, H_kv, q_end - q_start, problem.group, bk)
        d_captured: tuple = ()
        if before_mod is not None:
            inputs = (before_mod, *problem.captured)
            d_bias, *d_captured = torch.autograd.grad(modded, inputs, d_bias, allow_unused=True)
        d_raw = d_bias if tanh is None else d_bias * (1 - tanh * tanh)
        return d_raw.reshape(B, H_kv, n_rows, bk), d_bias, tuple(d_captured)

    return masked, chain_rule


def forward(
    problem: Problem, trace: Callable[[TraceStep], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over key tiles (FlashAttention-2, Algorithm 1).

    Returns out_rows (B, H_kv, L_q * G, D_v) and lse_rows (B, H_kv, L_q * G, 1). Inside
    `count_tile_traffic()` it records each slice it reads from or writes to those buffers and
    the inputs (`qkv.attention.tiled.traffic`).
    """
    out_rows, lse_rows, _ = forward_with_low(problem, trace)
    return out_rows, lse_rows


def forward_with_low(
    problem: Problem, trace: Callable[[TraceStep], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`forward`, plus lse_low (B, H_kv, L_q * G, 1): the true log-sum-exp minus lse_rows.

    lse = m + log(l) is formed in fp64 from the row's running max and sum (O(L_q) work), so
    lse_rows is the correctly rounded lse and lse_low the part its dtype cannot hold (0 on
    rows with no visible key). `backward` uses it to recompute the probabilities as exactly as
    the eager softmax exp(s - m) / l gives them.
    """
    traffic = active_traffic()  # None unless counting: then one test per tile, nothing more
    q_rows, v, plan = problem.q_rows, problem.v, problem.plan
    out_rows = q_rows.new_zeros(*q_rows.shape[:-1], v.shape[-1])
    lse_rows = q_rows.new_full((*q_rows.shape[:-1], 1), float("-inf"))
    lse_low = torch.zeros_like(lse_rows)
    if traffic is not None:
        _count_block(traffic, "write", None, out_rows, lse_rows)
    key_blocks, tiles_by_query_block = plan.key_blocks(), plan.tiles()
    for qi, (q_start, q_end) in enumerate(plan.query_blocks()):
        tiles = tiles_by_query_block[qi]
        rows = problem.rows(q_start, q_end)
        running_max = lse_rows[:, :, rows].clone()  # m = -inf
        running_sum = torch.zeros_like(running_max)  # l = 0
        acc = out_rows[:, :, rows].clone()  # unnormalised output, 0
        if traffic is not None:
            _count_block(traffic, "read", qi, acc, running_max)
        for kj, tile in tiles:  # the computed tiles only
            k_start, k_end = key_blocks[kj]
            count = None if traffic is None else traffic.tile(qi, kj)
            scores, _ = tile_scores(problem, q_start, q_end, k_start, k_end, tile, count)
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            finite_max = new_max.masked_fill(new_max == float("-inf"), 0.0)  # rows seen nothing
            probs = _exp_(scores.sub_(finite_max))  # (B, H_kv, bq * G, bk), in place
            rescale = torch.exp(running_max - finite_max)  # shrinks what was summed before
            running_sum = running_sum * rescale + probs.sum(dim=-1, keepdim=True)
            probs = _dropout(problem, qi, kj, probs)
            acc.mul_(rescale)
            v_tile = v[:, :, k_start:k_end]
            _batched(acc).baddbmm_(_batched(probs), _batched(v_tile))
            if count is not None:
                count.read("v", v_tile)
            running_max = new_max
            if trace is not None:
                trace(_trace_step(problem, qi, kj, tile, running_max, running_sum))
        empty = running_sum == 0  # no visible key: output 0, lse -inf
        out_rows[:, :, rows] = torch.where(empty, 0.0, acc / running_sum.masked_fill(empty, 1.0))
        exact = running_max.double() + torch.log(running_sum.double())
        lse_rows[:, :, rows] = rounded = exact.to(lse_rows.dtype)
        lse_low[:, :, rows] = torch.where(empty, 0.0, exact - rounded).to(lse_low.dtype)
        if traffic is not None:
            _count_block(traffic, "write", qi, out_rows[:, :, rows], lse_rows[:, :, rows])
    return out_rows, lse_rows, lse_low


def _count_block(traffic: TileTraffic, direction: str, qi: int | None, out, lse) -> None:
    """Record a query block's output and log-sum-exp (qi None: the whole buffers)."""
    traffic.record(direction, "o", out, q_block=qi)
    traffic.record(direction, "lse", lse, q_block=qi)


def backward(
    problem: Problem,
    out_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    d_out_rows: torch.Tensor,
    need_bias_grad: bool,
    lse_low: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, list]:
    """Recompute each tile's probabilities from the log-sum-exp (FlashAttention-2, Alg. 2).

    Returns d(q_rows) with respect to the *scaled* queries, dk, dv, d(bias) (or None), and the
    gradients of the score_mod's captured tensors (summed over tiles; None where unused).
    lse_low, from `forward_with_low`, makes the gradients as accurate as the eager softmax's
    (`_unround_lse`); without it P carries the rounding of lse_rows.
    """
    q_rows, k, v, plan = problem.q_rows, problem.k, problem.v, problem.plan
    d_q_rows, d_k, d_v = torch.zeros_like(q_rows), torch.zeros_like(k), torch.zeros_like(v)
    d_bias = torch.zeros_like(problem.bias) if need_bias_grad else None
    d_captured: list[torch.Tensor | None] = [None] * len(problem.captured)
    delta = (d_out_rows * out_rows).sum(dim=-1, keepdim=True)  # D_i = rowsum(dO * O)
    if lse_low is not None:
        d_out_rows, delta = _unround_lse(d_out_rows, delta, lse_low)
    lse_finite = lse_rows.masked_fill(lse_rows == float("-inf"), 0.0)  # empty rows: P = 0
    query_blocks = plan.query_blocks()
    by_key_block = _by_key_block(plan.tiles(), len(plan.key_blocks()))
    for kj, (k_start, k_end) in enumerate(plan.key_blocks()):
        k_tile, v_tile = k[:, :, k_start:k_end], v[:, :, k_start:k_end]
        for qi, tile in by_key_block[kj]:  # the computed tiles only
            q_start, q_end = query_blocks[qi]
            rows = problem.rows(q_start, q_end)
            scores, chain_rule = tile_scores(problem, q_start, q_end, k_start, k_end, tile)
            probs = _exp_(scores - lse_finite[:, :, rows])  # P, exactly the forward's
            d_probs = d_out_rows[:, :, rows] @ v_tile.transpose(-1, -2)  # dP = dO V^T
            kept = _dropout(problem, qi, kj, probs)
            d_v[:, :, k_start:k_end] += kept.transpose(-1, -2) @ d_out_rows[:, :, rows]
            d_probs = _dropout(problem, qi, kj, d_probs)
            d_scores = probs * (d_probs - delta[:, :, rows])  # dS = P * (dP - D)
            d_raw, d_bias_tile, d_captured_tile = chain_rule(d_scores)
            for index, grad in enumerate(d_captured_tile):
                if grad is not None:
                    previous = d_captured[index]
                    d_captured[index] = grad if previous is None else previous + grad
            d_q_rows[:, :, rows] += d_raw @ k_tile
            d_k[:, :, k_start:k_end] += d_raw.transpose(-1, -2) @ q_rows[:, :, rows]
            if d_bias is not None:
                _accumulate(tile_of(d_bias, q_start, q_end, k_start, k_end), d_bias_tile)
    return d_q_rows, d_k, d_v, d_bias, d_captured


def _unround_lse(d_out_rows: torch.Tensor, delta: torch.Tensor, lse_low: torch.Tensor):
    """(dO, D) scaled per row by exp(-lse_low): the tiles' P = exp(s - lse_rows) then gives
    exactly the gradients of the true P = exp(s - lse_rows - lse_low), at O(L_q * D) cost.

    Why: lse_i = m_i + log l_i is a few units (log of the visible keys plus the top score),
    and rounded to fp32 it is off by up to half its ulp, 2.4e-7 at lse = 4. Every probability
    of the row inherits that as a relative error, where the eager softmax exp(s - m) / l has
    about one rounding; dV = P^T dO, dS = P * (dP - D) and through dS dQ and dK get it on
    their largest entries, the keys with the most weight. The port of FlashAttention's tests
    (Dao et al. 2022), which bound qkv's error by twice PyTorch's fp32 error, met it on a call
    with 16 attention sinks (StreamingLLM, Xiao et al. 2024): dK off by 1.67e-6 against a
    bound of 1.19e-6. The sinks only add keys to the row; their gradient is summed like any
    key's, and calls without sinks had the same error. Since exp(-lse_low_i) is one factor
    per row, it goes into the row's dO and D, never into a tile:
    dV = P^T (c dO) and dS = P * ((c dO) V^T - c D), with c = exp(-lse_low).
    """
    scale = torch.exp(-lse_low)  # 1 to within a few ulps
    return d_out_rows * scale, delta * scale


def _by_key_block(tiles: list[list[tuple[int, Tile]]], num_key_blocks: int):
    """`TilePlan.tiles()` turned around: for each key block, its (query block, tile) pairs."""
    columns: list[list[tuple[int, Tile]]] = [[] for _ in range(num_key_blocks)]
    for qi, row in enumerate(tiles):
        for kj, tile in row:
            columns[kj].append((qi, tile))
    return columns


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place, as exp2(x * log2(e)): PyTorch's CPU exp2 kernel is markedly faster than
    its exp, and FlashAttention uses exp2 on GPUs for the same reason."""
    return x.mul_(LOG2_E).exp2_()


def _batched(x: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, rows, cols) -> (B * H_kv, rows, cols) for baddbmm: a view of the accumulator
    (written in place); a copy only for an operand whose batch and head axes do not merge, such
    as the values of `MultiHeadAttention`, a transposed (B, L, H, D) projection."""
    return x.reshape(-1, *x.shape[2:])


def _dropout(problem: Problem, qi: int, kj: int, x: torch.Tensor) -> torch.Tensor:
    """Inverted dropout with the tile's own seeded mask (identical in forward and backward)."""
    if problem.dropout_p == 0.0:
        return x
    keep = dropout_keep(problem.seed, qi, kj, x.shape, problem.dropout_p, x.device)
    return x * keep / (1.0 - problem.dropout_p)


def _accumulate(target: torch.Tensor, update: torch.Tensor) -> None:
    """target += update, summing update over the axes where target broadcasts (size 1)."""
    axes = tuple(i for i, size in enumerate(target.shape) if size == 1 and update.shape[i] != 1)
    target += update.sum(dim=axes, keepdim=True) if axes else update


def _trace_step(problem, qi, kj, tile, running_max, running_sum) -> TraceStep:
    def per_head(x: torch.Tensor) -> torch.Tensor:  # (B, H_kv, bq * G, 1) -> (B, H, bq)
        return from_rows(x, problem.group).squeeze(-1).clone()

    return TraceStep(qi, kj, tile, per_head(running_max), per_head(running_sum))
