"""What attention and models cost: the planner of `qkv cost` (parameters, FLOPs, KV-cache and
activation memory, on paper), the complexity benchmark of `qkv bench complexity` (time and
peak memory, measured) and the HBM traffic of standard attention and FlashAttention (`flash_io`:
Dao et al. 2022, Theorem 2, and qkv's tiled loop, exactly)."""
