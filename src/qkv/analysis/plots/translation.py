"""Where the decoder looks while it translates: cross-attention of one translated sentence.

In encoder-decoder attention (Vaswani et al. 2017, s3.2.3) the decoder's queries attend over
the encoder's output, so while it writes each target token the weights show which source tokens it
reads. For German -> English numbers the picture is not a diagonal: writing "twelve" in
"three hundred and twelve" reads "zwölf" at the end of "dreihundertzwölf", and "twenty" in
"twenty-one" reads "zwanzig" after "einund".

The model first translates greedily; then one teacher-forced pass over [BOS] + its own output
records the exact weights (`record_attention`, any backend). Row i is the step that wrote target
token i + 1, so rows are labelled with the token written.
"""

from __future__ import annotations

import torch

from qkv.analysis.inspection.attention_maps import record_attention
from qkv.analysis.plots.attention import attention_heatmaps
from qkv.generation.beam import greedy_decode

__all__ = ["cross_attention", "cross_attention_figure"]


@torch.no_grad()
def cross_attention(model, tokenizer, source: str, *, layer: int = -1):
    """(weights (H, L_tgt, L_src), source tokens, written tokens) of decoder layer `layer`.

    model: a `qkv.models.Transformer`; tokenizer: its `tokenizers.Tokenizer` (one vocabulary
    for source and target, as the translate task trains)."""
    config = model.config
    num_layers = config.num_decoder_layers
    if not -num_layers <= layer < num_layers:
        raise ValueError(f"layer: expected an index in [{-num_layers}, {num_layers}), got {layer}")
    encoded = tokenizer.encode(source)
    if not encoded.ids:
        raise ValueError(f"source: {source!r} has no tokens; expected some text")
    input_ids = torch.tensor([encoded.ids])  # (1, L_src)
    written, _ = greedy_decode(model, input_ids, max_new_tokens=config.max_positions - 1)
    written = written[:, : _end(written[0].tolist(), config.eos_token_id)]  # [bos, ..., eos]
    with record_attention(model, layers=f"decoder.{layer % num_layers}.cross") as recording:
        model(input_ids, decoder_input_ids=written[:, :-1])
    (only,) = recording.maps
    targets = [tokenizer.id_to_token(i) for i in written[0, 1:].tolist()]
    return only.weights[0], list(encoded.tokens), targets


def cross_attention_figure(model, tokenizer, source: str, *, layer: int = -1):
    """A matplotlib Figure: one heat map per head of decoder layer `layer`'s cross-attention,
    queries (target tokens written) down, keys (source tokens) across."""
    weights, source_tokens, target_tokens = cross_attention(model, tokenizer, source, layer=layer)
    figure = attention_heatmaps(
        weights, tokens=source_tokens, query_tokens=target_tokens,
        title=f"cross-attention, decoder layer {layer % model.config.num_decoder_layers}",
    )  # fmt: skip
    figure.suptitle(f"{source}  ->  {tokenizer.decode(_ids(tokenizer, target_tokens))}")
    return figure


def _end(ids: list[int], eos: int) -> int:
    """Length of [bos, ..., eos] (all of it if no eos was written)."""
    return ids.index(eos, 1) + 1 if eos in ids[1:] else len(ids)


def _ids(tokenizer, tokens: list[str]) -> list[int]:
    return [tokenizer.token_to_id(token) for token in tokens]
