"""Looking inside a model: exact attention maps from any backend, head importance and pruning
(Michel et al. 2019), and the sanity checks of `qkv check`."""
