"""`qkv chat` and `qkv generate --model`, through `qkv.cli.main` with standard input replaced,
and the conversation logic behind them (`qkv.applications.chat`).

The real SmolLM2-135M-Instruct answers the questions whose answers are checked; it is the test
run's one loaded copy (tests/conftest.py), handed to the commands in place of
`load_chat_model`, and one test alone loads it through `--model smollm2`. A tiny random GPT with
SmolLM2's tokenizer and template, and a context of 96 tokens, runs what only needs tokens to
flow: the history dropped to fit, /reset, /exit, Ctrl-C.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models

import qkv.applications.chat as chat_module
import qkv.commands.chat as chat_command
from qkv import acceleration
from qkv.acceleration.quantized import QuantizedLinear
from qkv.acceleration.quantized_models import quantized_pays
from qkv.applications.chat import (
    Chat,
    ChatModel,
    folder_chat_format,
    load_chat_model,
    stop_token_ids,
    trim_history,
)
from qkv.cli import main
from qkv.data.gguf_tokenizer import ChatFormat, chat_format_from_metadata, tokenizer_from_metadata
from qkv.models import GPT, GPTConfig

CAPITAL, MUSEUM = "What is the capital of France?", "Name a famous museum there."


@pytest.fixture(scope="module")
def loaded(smollm2, smollm2_file) -> ChatModel:
    tokenizer = tokenizer_from_metadata(smollm2_file.metadata)
    return ChatModel(smollm2, tokenizer, chat_format_from_metadata(smollm2_file.metadata))


@pytest.fixture(scope="module")
def tiny(loaded) -> ChatModel:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=49152, embed_dim=16, num_layers=1, num_heads=2, ffn_dim=32,
                       max_positions=96)  # fmt: skip
    return ChatModel(GPT(config).eval(), loaded.tokenizer, loaded.chat_format)


def _serve(monkeypatch, model: ChatModel) -> list[list[dict]]:
    """The commands get `model` for any spec; returns the history each answer is asked of."""
    monkeypatch.setattr(chat_module, "load_chat_model", lambda spec, argument, weights: model)
    asked, answer = [], Chat.answer

    def recorded(self, on_text):
        asked.append([dict(message) for message in self.messages])
        return answer(self, on_text)

    monkeypatch.setattr(Chat, "answer", recorded)
    return asked


def _chat(capsys, monkeypatch, lines: list[str], *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    capsys.readouterr()
    status = main(["chat", *flags])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_second_answer_reads_the_first(loaded, capsys, monkeypatch):
    """The museum "there" is in Paris only for a model that sees the first answer (asked
    alone, SmolLM2 names MoMA in New York)."""
    asked = _serve(monkeypatch, loaded)
    status, out, _ = _chat(capsys, monkeypatch, [CAPITAL, MUSEUM], "--max-new-tokens", "12")
    assert status == 0
    first, second = out.splitlines()
    assert "Paris" in first
    assert "Paris" in second and "Louvre" in second
    assert asked[1] == [
        {"role": "user", "content": CAPITAL},
        {"role": "assistant", "content": first},
        {"role": "user", "content": MUSEUM},
    ]
    assert first in loaded.chat_format.render(asked[1])  # turn 2's prompt holds turn 1's answer


def test_each_answer_runs_only_what_the_history_gained(loaded):
    """The KV cache stays between answers: the second prompt goes through the model from where
    the tokens it shares with the first turn end (the first answer's, but its last), and the
    answer is the one a chat without that cache gives."""
    chat = Chat(loaded, max_new_tokens=12)
    chat.add_user(CAPITAL)
    first_prompt = chat.prompt_ids()
    chat.answer(lambda piece: None)
    cached = chat.prompt_cache.ids
    assert cached[: len(first_prompt)] == first_prompt and len(cached) > len(first_prompt)
    chat.add_user(MUSEUM)
    second_prompt = chat.prompt_ids()
    afresh = Chat(loaded, max_new_tokens=12)
    afresh.messages = list(chat.messages)
    assert chat.answer(lambda piece: None) == afresh.answer(lambda piece: None)
    shared = os.path.commonprefix([cached, second_prompt])
    assert chat.prompt_cache.reused == len(shared) > len(first_prompt)
    assert afresh.prompt_cache.reused == 0


@pytest.mark.parametrize(("flags", "mode"), [((), "auto"), (("--compile",), "aot"),
                                             (("--no-compile",), "eager")])  # fmt: skip
def test_chat_decodes_with_the_steps_its_compile_flag_names(tiny, capsys, monkeypatch, flags, mode):
    """--compile asks for the step compiled ahead of time, --no-compile for eager steps; neither
    for "auto" (compiled where an earlier run compiled it), as `qkv generate` does."""
    _serve(monkeypatch, tiny)
    modes = []

    def steps(model, asked):
        modes.append(asked)
        return model  # eager steps, whatever was asked: nothing is compiled here

    monkeypatch.setattr(acceleration, "decoding_steps", steps)
    status, out, _ = _chat(capsys, monkeypatch, ["hi"], "--max-new-tokens", "2", *flags)
    assert status == 0 and out and modes == [mode]


def test_generate_chat_answers_one_message(loaded, capsys, monkeypatch):
    _serve(monkeypatch, loaded)
    capsys.readouterr()
    flags = ["--max-new-tokens", "12", "--no-pack"]  # the shared model stays as it is
    status = main(["generate", "--model", "smollm2", "--chat", CAPITAL, *flags])
    captured = capsys.readouterr()
    assert status == 0 and captured.out == "The capital of France is Paris.\n"
    assert captured.err.splitlines()[-1].startswith("8 tokens in ")  # seven and <|im_end|>


def test_generate_loads_the_packaged_model_by_name(capsys, smollm2_path):
    """The one test that loads the GGUF file itself: the raw continuation, no template; its Q4_1
    linears kept quantized where PyTorch's int4pack kernel runs (`quantized_pays`), said on
    stderr."""
    prompt = "The capital of France is"
    status = main(["generate", "--model", "smollm2", prompt, "--max-new-tokens", "6", "--no-pack"])
    captured = capsys.readouterr()
    assert status == 0 and "\n6 tokens in " in "\n" + captured.err
    assert captured.out.startswith(prompt) and len(captured.out) > len(prompt) + 2
    pays = quantized_pays(smollm2_path)
    held = "quantized" if pays else "dequantized to fp32"
    assert f"weights {held}: {pays.reason}" in captured.err


def test_weights_of_a_gguf_file_are_kept_quantized_or_made_fp32_as_asked(smollm2_path):
    quantized = load_chat_model(smollm2_path, weights="quantized")
    assert isinstance(quantized.model.blocks[0].ffn.up_proj, QuantizedLinear)
    assert quantized.weights == "weights quantized, as asked"
    with pytest.raises(ValueError, match="weights: expected one of .*'auto'.*, got 'int4'"):
        load_chat_model(smollm2_path, weights="int4")


@pytest.mark.parametrize("command", [["chat"], ["generate", "The cat"]])
def test_an_unknown_model_names_model_and_the_packaged_ones(capsys, command):
    status = main([*command, "--model", "nonsense"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (1, "")
    message = f"qkv {command[0]}: error: --model: 'nonsense' is neither a packaged model"
    assert message in captured.err
    assert "['smollm2']" in captured.err


def test_generate_refuses_two_models(capsys):
    status = main(["generate", "a-folder", "The cat", "--model", "smollm2"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert "PATH: 'a-folder' and --model 'smollm2' both name a model" in captured.err


def test_help_lists_chat(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "\n    chat " in out and "generate" in out


@pytest.mark.parametrize(("flag", "dtype"), [("fp16", torch.float16), ("model", torch.float32)])
def test_kv_dtype_sets_the_cache_of_the_chat(tiny, capsys, monkeypatch, flag, dtype):
    """--kv-dtype fp16: the conversation's KV cache in fp16 (half the bytes); by default the
    model's own dtype."""
    _serve(monkeypatch, tiny)
    chats = []
    answer = Chat.answer

    def recorded(self, on_text):
        chats.append(self)
        return answer(self, on_text)

    monkeypatch.setattr(Chat, "answer", recorded)
    status, out, _ = _chat(capsys, monkeypatch, ["hi"], "--max-new-tokens", "3", "--no-compile",
                           "--kv-dtype", flag)  # fmt: skip
    assert status == 0 and out
    assert chats[0].prompt_cache.cache.keys[0].dtype == dtype


def test_the_oldest_turns_go_first_and_the_system_message_stays(tiny, capsys, monkeypatch):
    asked = _serve(monkeypatch, tiny)
    lines = ["one", "two", "three", "four", "five"]
    flags = ["--max-new-tokens", "8", "--system", "Be brief."]
    status, out, err = _chat(capsys, monkeypatch, lines, *flags)
    assert status == 0 and len(asked) == len(lines)
    assert "oldest turn(s) dropped to fit the model's context of 96 tokens" in err
    last = asked[-1]
    assert last[0] == {"role": "system", "content": "Be brief."}
    users = [message["content"] for message in last if message["role"] == "user"]
    assert users == lines[-len(users) :] and len(users) < len(lines)
    chat = Chat(tiny, system="Be brief.", max_new_tokens=8)
    assert len(chat.prompt_ids(last)) <= 96 - 8


def test_ctrl_c_stops_the_answer_not_the_chat(tiny, capsys, monkeypatch):
    asked = _serve(monkeypatch, tiny)
    shown = []

    def interrupted(piece: str) -> None:
        shown.append(piece)
        if len(shown) == 3:  # Ctrl-C while the third piece of the first answer prints
            raise KeyboardInterrupt
        print(piece, end="", flush=True)

    monkeypatch.setattr(chat_command, "_show", interrupted)
    status, out, err = _chat(capsys, monkeypatch, ["one", "two"], "--max-new-tokens", "16")
    assert status == 0 and "qkv chat: answer stopped" in err
    assert out == "".join(shown[:2]) + "\n" + "".join(shown[3:]) + "\n"  # the second, whole
    assert asked[1][1] == {"role": "assistant", "content": "".join(shown[:3])}


def test_reset_forgets_the_turns_and_keeps_the_system_message(tiny, capsys, monkeypatch):
    asked = _serve(monkeypatch, tiny)
    lines = ["one", "/reset", "two"]
    flags = ["--max-new-tokens", "4", "--system", "Be brief."]
    status, _, err = _chat(capsys, monkeypatch, lines, *flags)
    assert status == 0 and "qkv chat: history cleared" in err
    system = {"role": "system", "content": "Be brief."}
    assert asked == [[system, {"role": "user", "content": "one"}],
                     [system, {"role": "user", "content": "two"}]]  # fmt: skip


def test_exit_ends_the_chat(tiny, capsys, monkeypatch):
    asked = _serve(monkeypatch, tiny)
    status, out, _ = _chat(capsys, monkeypatch, ["/exit", "one"], "--max-new-tokens", "4")
    assert (status, out, asked) == (0, "", [])


def test_trim_history_drops_whole_turns_oldest_first():
    def message(role: str, content: str) -> dict:
        return {"role": role, "content": content}

    system = message("system", "s")
    turns = [[message("user", f"ask {i}"), message("assistant", f"say {i}")] for i in range(3)]
    history = [system, *turns[0], *turns[1], *turns[2], message("user", "ask 3")]

    def count(messages) -> int:
        return len(messages)  # one token a message

    assert trim_history(history, count, 8) == (history, 0)
    assert trim_history(history, count, 7) == ([system, *turns[1], *turns[2], history[-1]], 1)
    assert trim_history(history, count, 5) == ([system, *turns[2], history[-1]], 2)
    assert trim_history(history, count, 3) == ([system, history[-1]], 3)
    assert trim_history(history[1:], count, 1) == ([history[-1]], 3)  # no system message
    with pytest.raises(ValueError, match=r"messages: the last message is too long: 2 tokens"):
        trim_history(history, count, 1)


def test_an_interrupted_answer_stays_in_the_history(tiny):
    chat = Chat(tiny, max_new_tokens=12)
    chat.add_user("one")
    pieces = []

    def stop_at_three(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.answer(stop_at_three)
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    chat.add_user("two")
    afresh = Chat(tiny, max_new_tokens=12)
    afresh.messages = list(chat.messages)
    answer = chat.answer(lambda piece: None)  # the chat goes on, from the cache it kept
    assert answer and answer == afresh.answer(lambda piece: None)
    assert chat.prompt_cache.reused > 0
    chat.reset()
    assert chat.messages == []


def test_the_end_of_a_turn_stops_the_answer(loaded):
    """SmolLM2 (ChatML): <|im_end|> both ends a turn and is the end-of-text token. A template
    whose turns end with another special token (Llama 3's <|eot_id|>) stops at both."""
    assert stop_token_ids(loaded.tokenizer, loaded.chat_format) == {2}
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tokenizer.add_special_tokens([AddedToken(t) for t in ("<|end_of_text|>", "<|eot_id|>")])
    template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    format = ChatFormat(template, eos_token="<|end_of_text|>")
    assert stop_token_ids(tokenizer, format) == {2, 3}


def test_a_folder_chat_template(tmp_path):
    assert folder_chat_format(tmp_path) is None
    config = {"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
              "bos_token": {"content": "<s>"}, "eos_token": "</s>"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    format = folder_chat_format(tmp_path)
    assert (format.bos_token, format.eos_token) == ("<s>", "</s>")
    assert format.render([{"role": "user", "content": "hi"}]) == "<s>hi"


def test_load_chat_model_refuses_a_spec_that_names_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"^--model: '\S+missing' is neither a packaged model"):
        load_chat_model(tmp_path / "missing", argument="--model")


def test_a_model_without_a_chat_template_cannot_chat(tiny):
    with pytest.raises(ValueError, match=r"^loaded: the model has no chat template"):
        Chat(ChatModel(tiny.model, tiny.tokenizer, None))


CASES = [((), False, True), ((), True, False), (("--no-compile",), False, False)]


@pytest.mark.parametrize(("flags", "ready", "hinted"), CASES)
def test_chat_says_how_to_decode_faster_where_its_steps_are_eager(
    tiny, capsys, monkeypatch, flags, ready, hinted
):
    """With neither flag and no compiled step ready, the steps are eager, and stderr says what
    --compile gives, once for the chat; not where a compiled step is ready, nor when eager
    steps were asked."""
    from qkv.acceleration import decoding

    _serve(monkeypatch, tiny)
    monkeypatch.setattr(decoding, "compiled_ready", lambda model: ready)
    # the steps themselves stay eager: nothing is compiled here, whatever `ready` says
    monkeypatch.setattr(
        decoding.DecodingSteps, "__call__", lambda self, ids, **kw: self.eager(ids, **kw)
    )
    status, out, err = _chat(capsys, monkeypatch, ["hi", "ho"], "--max-new-tokens", "2", *flags)
    assert status == 0 and out
    assert err.count("--compile builds the compiled step once") == (1 if hinted else 0)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("store", ["here", "off"])
def test_an_interactive_chat_compiles_its_step_in_the_background(
    tiny, capsys, monkeypatch, tmp_path, store
):
    """At a terminal, with neither flag and no compiled step ready, the chat answers eagerly and
    starts its compilation in a process of its own: the same chat with --compile, one short
    message on its standard input, its output discarded, at the lowest CPU priority, detached
    from the terminal (a Ctrl-C at the chat does not stop it); said once on stderr. With no
    compile store to keep the step in, nothing is started and the line about --compile is
    said."""
    from qkv.acceleration import decoding

    _serve(monkeypatch, tiny)
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path) if store == "here" else "off")
    monkeypatch.setattr(decoding, "compiled_ready", lambda model: False)
    monkeypatch.setattr(
        decoding.DecodingSteps, "__call__", lambda self, ids, **kw: self.eager(ids, **kw)
    )
    started = []

    class Process:
        def __init__(self, command, **options):
            self.stdin, self.written = self, []
            started.append((command, options, self.written))

        def write(self, data: bytes) -> None:
            self.written.append(data)

        def close(self) -> None:
            pass

    monkeypatch.setattr(chat_command.subprocess, "Popen", Process)
    lines = iter(["hi", "ho"])

    def typed(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    monkeypatch.setattr(sys, "stdin", _Terminal())
    monkeypatch.setattr("builtins.input", typed)
    capsys.readouterr()
    status = main(["chat", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert status == 0
    if store == "off":
        assert started == [] and err.count("--compile builds the compiled step once") == 1
        return
    ((command, options, written),) = started
    chat = [sys.executable, "-m", "qkv.cli", "chat", "--model", "smollm2", "--compile"]
    assert command[-len(chat) - 6 : -6] == chat
    assert command[-6:] == ["--weights", "auto", "--kv-dtype", "model", "--max-new-tokens", "2"]
    if os.name == "posix" and shutil.which("nice"):
        assert command[1:3] == ["-n", "19"]
    assert options["start_new_session"] and options["stdout"] == subprocess.DEVNULL
    assert written == [b"Hello\n"]
    assert err.count("being built in the background") == 1 and "--compile builds" not in err


def test_the_freed_heap_goes_back_after_every_answer_even_a_stopped_one(tiny, capsys, monkeypatch):
    """Between answers the chat returns freed memory to the system (glibc keeps it otherwise):
    once per answer, a stopped one included."""
    from qkv.models import building

    _serve(monkeypatch, tiny)
    released = []
    monkeypatch.setattr(building, "return_freed_heap", lambda: released.append(1))
    status, out, _ = _chat(capsys, monkeypatch, ["hi", "ho"], "--max-new-tokens", "2")
    assert status == 0 and len(released) == 2

    def stopped(self, on_text):
        raise KeyboardInterrupt

    monkeypatch.setattr(Chat, "answer", stopped)
    status, _, err = _chat(capsys, monkeypatch, ["hi"], "--max-new-tokens", "2")
    assert status == 0 and "answer stopped" in err and len(released) == 3
