"""Generation: KV-cached decoding for decoder-only and encoder-decoder models, one loop in which
greedy search, sampling and beam search are strategies (its options in one `DecodeOptions`),
attention sinks, text in and out."""

from qkv.generation.beam import beam_search, greedy_decode
from qkv.generation.filters import filter_top_k, filter_top_p
from qkv.generation.generate import DecodeStep, generate, make_cache
from qkv.generation.options import DecodeOptions
from qkv.generation.prompt_cache import PromptCache
from qkv.generation.sampling import next_token
from qkv.generation.streaming import decode_steps, stream

__all__ = [
    "DecodeOptions",
    "DecodeStep",
    "PromptCache",
    "beam_search",
    "decode_steps",
    "filter_top_k",
    "filter_top_p",
    "generate",
    "greedy_decode",
    "make_cache",
    "next_token",
    "stream",
]
