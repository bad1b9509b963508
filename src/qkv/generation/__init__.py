"""Generation: KV-cached decoding, sampling, beam search, attention sinks."""

from qkv.generation.generate import generate, stream
from qkv.generation.sampling import filter_top_k, filter_top_p, next_token

__all__ = ["filter_top_k", "filter_top_p", "generate", "next_token", "stream"]
