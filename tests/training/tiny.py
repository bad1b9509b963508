"""A translate task small enough to train in a second: the numbers up to 999, a 1-layer model."""

from __future__ import annotations

from qkv.training.tasks import TranslateOptions

TINY = TranslateOptions(
    max_number=999, num_train=400, num_valid=40, num_test=40, vocab_size=60,
    embed_dim=32, num_heads=2, num_layers=1, ffn_dim=64, dropout=0.1,
)  # fmt: skip

# The same options as command-line flags, for the subprocess tests (`qkv train translate`).
TINY_FLAGS = [
    "--max-number", "999", "--num-train", "400", "--num-valid", "40", "--num-test", "40",
    "--vocab-size", "60", "--embed-dim", "32", "--num-heads", "2", "--num-layers", "1",
    "--ffn-dim", "64", "--threads", "1",
]  # fmt: skip
