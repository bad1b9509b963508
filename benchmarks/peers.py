"""The peers of benchmarks/decode.py: llama.cpp and transformers' static cache + torch.compile.

llama.cpp (through llama-cpp-python) decodes the same weights, written here as a GGUF file with
the `gguf` package: Hugging Face's Llama keeps each head's rotary pairs as (first half, second
half) of its rows (`rotate_half`), llama.cpp's "normal" RoPE rotates adjacent rows (2i, 2i + 1),
so the rows of q_proj and k_proj are interleaved per head before writing. Norm weights stay fp32
(llama.cpp keeps 1-D tensors in fp32 in every file type); matrices are fp32 or bf16. The file
declares no vocabulary (tokenizer model "no_vocab"): the harness feeds token ids and reads
logits, greedy by argmax, as qkv and transformers are timed.

Both are optional: installing llama-cpp-python compiles llama.cpp from source (minutes to tens of
minutes on 2 cores), so `make bench-peers` installs it, and `missing()` says how when absent.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

INSTALL = "make bench-peers (pip install llama-cpp-python gguf; compiles llama.cpp)"


def missing() -> str | None:
    """None when llama.cpp can run here, else what is missing and how to install it."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama.cpp skipped: {error.name} is not installed; {INSTALL}"
    return None


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(num_heads * D, E) rows ordered [h][half][i] -> [h][i][half]: head h's row i of the first
    half and row i of the second half become rows 2i and 2i + 1 (llama.cpp's RoPE pairs)."""
    rows, columns = weight.shape
    D = rows // num_heads
    return weight.reshape(num_heads, 2, D // 2, columns).transpose(1, 2).reshape(rows, columns)


def write_gguf(model: nn.Module, path: Path, dtype: str) -> Path:
    """A transformers LlamaForCausalLM as a llama.cpp GGUF file; dtype "fp32" or "bf16"."""
    import gguf

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("no_vocab")
    file_type = gguf.LlamaFileType.ALL_F32 if dtype == "fp32" else gguf.LlamaFileType.MOSTLY_BF16
    writer.add_file_type(file_type)
    for name, tensor in _gguf_tensors(model.state_dict(), config, heads, kv_heads):
        if tensor.dim() == 1 or dtype == "fp32":
            writer.add_tensor(name, tensor.float().numpy())
        else:
            bits = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(state: dict, config, heads: int, kv_heads: int):
    """(GGUF name, tensor) for every weight of a Hugging Face Llama state dict."""
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    yield "output.weight", state["lm_head.weight"]
    names = {
        "input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        q = state[prefix + "self_attn.q_proj.weight"]
        k = state[prefix + "self_attn.k_proj.weight"]
        yield f"blk.{layer}.attn_q.weight", interleave_rope_rows(q, heads)
        yield f"blk.{layer}.attn_k.weight", interleave_rope_rows(k, kv_heads)
        for theirs, ours in names.items():
            yield f"blk.{layer}.{ours}.weight", state[f"{prefix}{theirs}.weight"]


class LlamaCpp:
    """Greedy decoding of a GGUF file by llama.cpp, batch 1: the prompt in one call, then one
    token per call, each chosen by argmax over the last logits (as `generate` chooses)."""

    def __init__(self, path: Path, *, context: int, threads: int) -> None:
        import llama_cpp

        self._api = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=context, n_batch=context, n_threads=threads,
            n_threads_batch=threads, logits_all=False, verbose=False,
        )  # fmt: skip
        self.vocab = self.llm.n_vocab()
        self.version = llama_cpp.__version__

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """ids (1, L) -> (1, L + new_tokens), as `qkv.generate` returns them."""
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        chosen = []
        for step in range(new_tokens):
            pointer = self._api.llama_get_logits_ith(self.llm.ctx, -1)
            logits = np.ctypeslib.as_array(pointer, shape=(self.vocab,))
            chosen.append(int(logits.argmax()))
            if step + 1 < new_tokens:
                self.llm.eval([chosen[-1]])
        return torch.cat([ids, torch.tensor([chosen], dtype=ids.dtype)], dim=1)


class LlamaCppBatched:
    """Greedy decoding of B sequences at once by llama.cpp, through its C API (the high-level
    `Llama` class decodes one sequence): a context with B sequence slots, every prompt in one
    `llama_decode` call, then one call per step holding each sequence's new token, as
    llama.cpp's own batched example decodes."""

    def __init__(self, path: Path, *, sequences: int, context: int, threads: int) -> None:
        import llama_cpp as api
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's log: errors only, as Llama(verbose=False) sets it
        self.api, self.sequences = api, sequences
        api.llama_backend_init()
        self.model = api.llama_model_load_from_file(
            str(path).encode(), api.llama_model_default_params()
        )
        params = api.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = sequences * context
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = api.llama_init_from_model(self.model, params)
        if not self.model or not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {path} with {sequences} sequences")
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        self.batch = api.llama_batch_init(sequences * context, 0, 1)
        self.version = api.__version__

    def generate(self, ids: torch.Tensor, new_tokens: int, mask=None) -> torch.Tensor:
        """ids (B, L) -> (B, L + new_tokens), B = the sequences it was built for; `mask` (B, L)
        bool, True on real tokens, for left-padded prompts (each row's real tokens only are
        decoded, at positions 0 .. its length - 1)."""
        B, L = ids.shape
        if ids.shape[0] != self.sequences:
            raise ValueError(f"ids: expected {self.sequences} sequences, got {B}")
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
        rows = [row[real].tolist() for row, real in zip(ids, mask, strict=True)]
        lengths = [len(row) for row in rows]
        entries = [(s, p, token, p == lengths[s] - 1)
                   for s, row in enumerate(rows) for p, token in enumerate(row)]  # fmt: skip
        outputs = self._decode(entries)  # the batch index of each sequence's last logits
        chosen: list[list[int]] = [[] for _ in range(B)]
        for step in range(new_tokens):
            for s in range(B):
                pointer = self.api.llama_get_logits_ith(self.ctx, outputs[s])
                logits = np.ctypeslib.as_array(pointer, shape=(self.vocab,))
                chosen[s].append(int(logits.argmax()))
            if step + 1 < new_tokens:
                entries = [(s, lengths[s] + step, chosen[s][-1], True) for s in range(B)]
                outputs = self._decode(entries)
        return torch.cat([ids, torch.tensor(chosen, dtype=ids.dtype)], dim=1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (sequence, position, token, wants logits) entries; returns the
        batch index of each logit-bearing entry, in order."""
        batch = self.batch
        for i, (sequence, position, token, logits) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, position
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, sequence
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        status = self.api.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        return [i for i, entry in enumerate(entries) if entry[3]]

    def close(self) -> None:
        self.api.llama_batch_free(self.batch)
        self.api.llama_free(self.ctx)
        self.api.llama_model_free(self.model)


def transformers_compiled(model: nn.Module) -> nn.Module:
    """A copy of a transformers causal LM as its documentation speeds up generation: a static
    cache (fixed shapes) and its forward compiled by torch.compile (fullgraph)."""
    compiled = copy.deepcopy(model)
    compiled.generation_config.cache_implementation = "static"
    compiled.forward = torch.compile(compiled.forward, fullgraph=True)
    return compiled


def peer_calls(theirs: nn.Module, dtype: str, ids: torch.Tensor, n: int, directory: Path):
    """The peers' calls for one row of decode.py, each returning (1, L + n) tokens, and what
    preparing them cost: ({name: call}, {"hf_compile_s": ..., "llama_cpp": ... or a note})."""
    compiled = transformers_compiled(theirs)
    calls = {
        "transformers_compiled": lambda: compiled.generate(
            ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None
        )
    }
    start = time.perf_counter()
    calls["transformers_compiled"]()  # the first call compiles
    info = {"hf_compile_s": time.perf_counter() - start}
    absent = missing()
    if absent is not None:
        info["llama_cpp"] = absent
        return calls, info
    path = write_gguf(theirs, directory / f"model-{dtype}.gguf", dtype)
    llama = LlamaCpp(path, context=ids.shape[1] + n, threads=torch.get_num_threads())
    calls["llama_cpp"] = lambda: llama.generate(ids, n)
    info["llama_cpp"] = {"version": llama.version, "gguf_bytes": path.stat().st_size}
    return calls, info
