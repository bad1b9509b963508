"""Benchmark: a chat's turns with the KV cache kept between answers, against the whole history
run again at every turn, and llama.cpp's chat loop.

    .venv/bin/python benchmarks/chat_turns.py
    .venv/bin/python benchmarks/chat_turns.py --rounds 1   # a smoke run

SmolLM2-135M-Instruct, the Q4_1 file as shipped, batch 1, greedy, 2 threads. One conversation of
four user messages, the first of which carries a passage of CPython's documentation (a chat
about a document), each answer up to 64 tokens and stopped at <|im_end|>:
    qkv kept     `qkv.applications.chat.Chat` as `qkv chat` runs it: the model as
                 `load_chat_model("smollm2")` holds it, the step compiled ahead of time, and the
                 `PromptCache` kept from one answer to the next (only the tokens the history
                 gained go through the model)
    qkv afresh   the same, with a new `PromptCache` at every answer: the whole history each turn
    llama.cpp    llama-cpp-python's `Llama.generate` over the rendered history's tokens, which
                 keeps the longest prefix its context shares with them (its own reuse)
Each candidate keeps its own answers in its history. Per turn: the prompt's tokens and how many
went through the model, the time to the first token of the answer (median over rounds), the
answer's tokens and its time. Written to results/chat_turns.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
from common import log, machine_info, write_json
from load_gguf import smollm2_file

from qkv.acceleration import decoding_steps
from qkv.applications.chat import Chat, load_chat_model
from qkv.generation import PromptCache

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 64
QUESTIONS = [
    "Here is a passage from Python's documentation:\n\n{passage}\n\nWhat is it about?",
    "Give an example of it in a line of code.",
    "What mistake do beginners make with it?",
    "Sum up our conversation in one sentence.",
]


def passage(characters: int) -> str:
    """The start of CPython's documentation of the `with` statement."""
    return topics["with"][:characters]


class QkvChat:
    """qkv's `Chat` over the loaded model; `keep`: the prompt cache stays between answers."""

    def __init__(self, loaded, steps, keep: bool):
        self.loaded, self.steps, self.keep = loaded, steps, keep

    def conversation(self, questions: list[str]) -> list[dict]:
        chat = Chat(self.loaded, max_new_tokens=NEW_TOKENS, steps=self.steps)
        turns = []
        for question in questions:
            chat.add_user(question)
            prompt = len(chat.prompt_ids())
            if not self.keep:
                chat.prompt_cache = PromptCache()
            first = []  # when the first piece of text came

            def on_text(piece: str, first=first) -> None:
                if not first:
                    first.append(time.perf_counter())

            started = time.perf_counter()
            chat.answer(on_text)
            turns.append({
                "prompt_tokens": prompt, "run_tokens": prompt - chat.prompt_cache.reused,
                "first_token_s": first[0] - started, "answer_tokens": chat.generated,
                "answer_s": time.perf_counter() - started,
            })  # fmt: skip
        return turns


class LlamaCppChat:
    """llama-cpp-python's `Llama.generate` over the history qkv's template renders (its
    tokens from qkv's tokenizer, which equals the file's), the context kept between turns."""

    def __init__(self, path: Path, loaded, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=2048, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)  # fmt: skip
        self.loaded = loaded
        self.stop = {loaded.tokenizer.token_to_id("<|im_end|>")}

    def conversation(self, questions: list[str]) -> list[dict]:
        self.llm.reset()
        messages, turns = [], []
        for question in questions:
            messages.append({"role": "user", "content": question})
            text = self.loaded.chat_format.render(messages)
            ids = self.loaded.tokenizer.encode(text, add_special_tokens=False).ids
            cached = os.path.commonprefix([self.llm._input_ids.tolist(), ids[:-1]])
            run = len(ids) - len(cached)
            answer, chosen, first = [], 0, None
            started = time.perf_counter()
            for token in self.llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
                first, chosen = first or time.perf_counter(), chosen + 1
                if token in self.stop:
                    break
                answer.append(token)
                if chosen == NEW_TOKENS:  # as qkv: the last token chosen is not fed
                    break
            elapsed = time.perf_counter() - started
            messages.append({"role": "assistant", "content": self.loaded.tokenizer.decode(answer)})
            turns.append({
                "prompt_tokens": len(ids), "run_tokens": run, "first_token_s": first - started,
                "answer_tokens": chosen, "answer_s": elapsed,
            })  # fmt: skip
        return turns


def turn_row(rows: list[dict]) -> dict:
    """One turn's candidates side by side: tokens run, first-token times (ms), ratios."""
    by = {row["candidate"]: row for row in rows}
    kept, afresh, peer = by["qkv_kept"], by["qkv_afresh"], by["llama_cpp"]
    return {
        "turn": kept["turn"], "prompt_tokens": kept["prompt_tokens"],
        "kept_run_tokens": kept["run_tokens"], "llama_cpp_run_tokens": peer["run_tokens"],
        "kept_first_ms": kept["first_token_s"] * 1e3,
        "afresh_first_ms": afresh["first_token_s"] * 1e3,
        "llama_cpp_first_ms": peer["first_token_s"] * 1e3,
        "afresh_over_kept": afresh["first_token_s"] / kept["first_token_s"],
        "llama_cpp_over_kept": peer["first_token_s"] / kept["first_token_s"],
        "kept_answer_s": kept["answer_s"], "afresh_answer_s": afresh["answer_s"],
        "llama_cpp_answer_s": peer["answer_s"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passage-chars", type=int, default=3000)
    parser.add_argument("--out", default=str(HERE / "results" / "chat_turns.json"))
    args = parser.parse_args()
    import llama_cpp

    threads = torch.get_num_threads()
    path = smollm2_file()
    loaded = load_chat_model("smollm2")
    steps = decoding_steps(loaded.model, "aot")
    questions = [QUESTIONS[0].format(passage=passage(args.passage_chars)), *QUESTIONS[1:]]
    candidates = {"qkv_kept": QkvChat(loaded, steps, keep=True),
                  "qkv_afresh": QkvChat(loaded, steps, keep=False),
                  "llama_cpp": LlamaCppChat(path, loaded, threads)}  # fmt: skip
    candidates["qkv_kept"].conversation(questions[:1])  # compiles (or loads) the step once
    samples = {name: [] for name in candidates}
    for round_index in range(args.rounds):
        names = list(candidates)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in names:
            samples[name].append(candidates[name].conversation(questions))
            log(f"round {round_index}, {name}: first tokens after "
                + ", ".join(f"{t['first_token_s'] * 1e3:.0f}" for t in samples[name][-1])
                + " ms")  # fmt: skip
    rows = []
    for name, conversations in samples.items():
        for turn in range(len(questions)):
            runs = [conversation[turn] for conversation in conversations]
            row = {"candidate": name, "turn": turn + 1, **runs[-1]}
            row["first_token_s"] = statistics.median(r["first_token_s"] for r in runs)
            row["answer_s"] = statistics.median(r["answer_s"] for r in runs)
            row["first_token_samples"] = [r["first_token_s"] for r in runs]
            rows.append(row)
    turns = [turn_row([r for r in rows if r["turn"] == turn + 1]) for turn in range(len(questions))]
    payload = {
        "machine": machine_info("cpu"), "model": path.name, "threads": threads,
        "rounds": args.rounds, "new_tokens": NEW_TOKENS, "passage_chars": args.passage_chars,
        "llama_cpp": {"version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()},
        "loaded": loaded.weights, "turns": turns, "rows": rows,
    }  # fmt: skip
    print(json.dumps(turns, indent=1))
    log(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
