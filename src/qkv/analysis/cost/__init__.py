"""What attention and models cost: the planner of `qkv cost` (parameters, FLOPs, KV-cache and
activation memory, on paper) and the complexity benchmark of `qkv bench complexity` (time and
peak memory, measured)."""
