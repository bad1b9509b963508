"""`qkv generate PATH PROMPT ...` (or `--prompt PROMPT`) end to end, through `qkv.cli.main` and
capsys: the prompt, then its continuation on stdout; the tokens and their rate on stderr.

The checkpoint is a transformers GPT-2 (or Llama) saved with save_pretrained, with a WordLevel
`tokenizer.json` trained here with the `tokenizers` library; the printed text must be the
tokenizer's decoding of transformers' own greedy tokens. The same weights saved in qkv's own
format must print the same. Incremental decoding is checked against `tokenizers`' decode of
the whole id list, with a byte-level BPE whose tokens split multi-byte characters.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import qkv.models
from qkv.acceleration.compile_store import store_directory
from qkv.cli import main
from qkv.generation import generate
from qkv.generation.text import incremental_text, load_for_generation, stream_text
from tests.generation.reference_models import redraw

SENTENCES = [
    "the cat sat on the mat and the dog sat on the rug",
    "a bird sang in the old tree while the sun rose over the quiet hill",
    "we read a long book about ships rivers and distant cities",
    "my friend drew a small red house with a green door",
]
PROMPT = "the old cat sat on"
NEW_TOKENS = 12


def _word_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False)
    tokenizer.train_from_iterator(SENTENCES, trainer)
    return tokenizer


def _hf_model(kind: str, vocab_size: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    return redraw(model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(Hugging Face GPT-2 directory with tokenizer.json, transformers model, tokenizer)."""
    tokenizer = _word_tokenizer()
    reference = _hf_model("gpt2", tokenizer.get_vocab_size())
    path = tmp_path_factory.mktemp("gpt2")
    reference.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path, reference, tokenizer


def _transformers_text(reference, tokenizer) -> str:
    prompt = torch.tensor([tokenizer.encode(PROMPT).ids])
    with torch.no_grad():
        output = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
            max_new_tokens=NEW_TOKENS, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    top2 = torch.stack(output.logits, dim=1).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3  # no near-tie a rounding could flip
    return tokenizer.decode(output.sequences[0, prompt.shape[1] :].tolist())


def _run(capsys, *arguments: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what set-up printed (transformers' save progress bar)
    status = main(["generate", *arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _speed(err: str) -> int:
    """The number of tokens of stderr's last line "N tokens in S s (R tokens/s)" (before it, at
    most the line saying that the steps are eager and what --compile gives)."""
    *before, last = err.splitlines(keepends=True)
    assert all("eager decoding steps; --compile builds" in line for line in before), err
    match = re.fullmatch(r"(\d+) tokens in (\d+\.\d\d) s \((\d+) tokens/s\)\n", last)
    assert match, err
    tokens, seconds, rate = int(match[1]), float(match[2]), int(match[3])
    # the rate of the unrounded time: within what rounding S to 2 decimals leaves open
    assert tokens / (seconds + 0.005) <= rate + 1
    assert seconds <= 0.005 or rate <= tokens / (seconds - 0.005) + 1
    return tokens


@pytest.mark.parametrize(
    "pack", ["--pack", "--no-pack", pytest.param("--compile", marks=pytest.mark.slow)]
)
def test_prints_the_decoded_greedy_tokens_of_transformers(checkpoint, capsys, pack):
    """With oneDNN-packed linears (the default), without, and packed and compiled."""
    path, reference, tokenizer = checkpoint
    expected = _transformers_text(reference, tokenizer)
    libraries_before = _libraries()
    status, out, err = _run(
        capsys, str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), pack
    )
    assert (status, _speed(err)) == (0, NEW_TOKENS)
    assert len(expected.split()) == NEW_TOKENS
    assert out == PROMPT + " " + expected + "\n"  # WordLevel's decode joins words with spaces
    if pack == "--compile":  # the flag reached generate: the step was compiled and stored
        assert _libraries() > libraries_before


def _libraries() -> set:
    """The compiled steps in the compile store (the test run's own: tests/conftest.py)."""
    return set(store_directory().glob("*/exported-*.pt2"))


def test_qkv_own_checkpoint_prints_the_same(checkpoint, capsys, tmp_path):
    path, reference, tokenizer = checkpoint
    qkv.models.save(qkv.models.GPT.from_pretrained(path), tmp_path)
    shutil.copy(path / "tokenizer.json", tmp_path / "tokenizer.json")
    status, out, err = _run(
        capsys, str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)
    )
    assert (status, _speed(err)) == (0, NEW_TOKENS)
    assert out == PROMPT + " " + _transformers_text(reference, tokenizer) + "\n"


def test_sampling_and_sinks_flags_reach_generate(tmp_path, capsys):
    """Llama (RoPE) with --sinks past its context of 64, sampling with a seed: the text of the
    library call with the same arguments."""
    tokenizer = _word_tokenizer()
    _hf_model("llama", tokenizer.get_vocab_size()).save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    flags = ["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]
    status, out, err = _run(capsys, str(tmp_path), "--prompt", PROMPT,
                            "--max-new-tokens", "70", "--sinks", "2", "10", *flags)  # fmt: skip
    assert (status, _speed(err)) == (0, 70)
    model = qkv.models.GPT.from_pretrained(tmp_path)
    prompt = torch.tensor([tokenizer.encode(PROMPT).ids])
    tokens = generate(model, prompt, max_new_tokens=70, temperature=0.8, top_k=5, top_p=0.9,
                      seed=3, sinks=(2, 10))  # fmt: skip
    assert out == PROMPT + " " + tokenizer.decode(tokens[0, prompt.shape[1] :].tolist()) + "\n"


def test_text_streams_as_the_tokens_come(checkpoint):
    """After the first piece of text, the model has run once (the prefill): nothing waits for
    the whole generation."""
    path, _, _ = checkpoint
    model, tokenizer = load_for_generation(path)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    pieces = stream_text(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS)
    assert calls == []
    first = next(pieces)
    assert len(calls) == 1
    rest = list(pieces)
    assert len(calls) == NEW_TOKENS  # prefill + one per token but the last, never fed back
    assert len(rest) == NEW_TOKENS - 1  # WordLevel: one piece per token
    assert first == first.strip() and all(piece.startswith(" ") for piece in rest)


def test_incremental_text_holds_back_split_characters():
    """A byte-level BPE with no merges: every byte is a token, so 'é' (2 bytes) and the emoji
    (4) are split across tokens; no piece may show a half character (U+FFFD)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    text = "héllo wörld 🙂!"
    tokenizer.train_from_iterator([text], trainer)
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert "\ufffd" in tokenizer.decode(ids[:2])  # the split really shows up in a decode
    pieces = list(incremental_text(tokenizer, ids))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[-2:] == ["🙂", "!"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--top-p", "1.5"], "top_p: expected a probability in (0, 1]"),
        (["--max-new-tokens", "-2"], "max_new_tokens: expected an int >= 0, got -2"),
        (["--max-new-tokens", "100"], "exceed the model's context of 64"),
        (["--sinks", "2", "10"], "sinks: StreamingLLM caches give keys their position"),
    ],
)
def test_bad_arguments_print_one_error_line_and_exit_1(checkpoint, capsys, arguments, message):
    path, _, _ = checkpoint
    status, out, err = _run(capsys, str(path), "--prompt", PROMPT, *arguments)
    assert (status, out) == (1, "")
    assert err.startswith("qkv generate: error: ") and message in err


def test_a_folder_without_tokenizer_json(checkpoint, capsys, tmp_path):
    path, _, _ = checkpoint
    shutil.copy(path / "config.json", tmp_path / "config.json")
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    status, out, err = _run(capsys, str(tmp_path), "--prompt", PROMPT)
    assert (status, out) == (1, "")
    assert f"path: {tmp_path} has no tokenizer.json" in err


def test_a_folder_without_a_checkpoint(capsys, tmp_path):
    _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    status, _, err = _run(capsys, str(tmp_path), "--prompt", PROMPT)
    assert status == 1 and "has no config.json" in err


def test_a_prompt_with_no_tokens(checkpoint, capsys):
    path, _, _ = checkpoint
    status, _, err = _run(capsys, str(path), "--prompt", "   ")
    assert status == 1 and "prompt: '   ' encodes to no tokens" in err


def test_the_prompt_as_a_positional_argument(checkpoint, capsys):
    """`qkv generate PATH PROMPT` prints what `--prompt PROMPT` prints; both, if the same."""
    path, reference, tokenizer = checkpoint
    expected = PROMPT + " " + _transformers_text(reference, tokenizer) + "\n"
    flags = ["--max-new-tokens", str(NEW_TOKENS), "--no-pack"]
    status, out, err = _run(capsys, str(path), PROMPT, *flags)
    assert (status, out, _speed(err)) == (0, expected, NEW_TOKENS)
    status, out, _ = _run(capsys, str(path), PROMPT, "--prompt", PROMPT, *flags)
    assert (status, out) == (0, expected)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "PROMPT: missing; expected the text to continue, as PROMPT or --prompt"),
        (
            ["the cat", "--prompt", "a dog"],
            "PROMPT: 'the cat' and --prompt 'a dog' differ; expected one",
        ),
    ],
)
def test_no_prompt_or_two_prompts(checkpoint, capsys, arguments, message):
    path, _, _ = checkpoint
    status, out, err = _run(capsys, str(path), *arguments)
    assert (status, out, err) == (2, "", f"qkv generate: error: {message}\n")


def test_a_continuation_that_starts_a_word_is_not_glued_to_the_prompt(tmp_path, capsys):
    """A Llama-style (Metaspace) decoder drops the space of a text's first word: decoded
    alone, the new tokens would start without their space; after the echoed prompt they
    must read as `tokenizer.decode(prompt + new)` does. Every token here is a word with its
    space ("\u2581cat"), so the continuation starts a word."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False)
    tokenizer.train_from_iterator(SENTENCES, trainer)
    _hf_model("llama", tokenizer.get_vocab_size()).save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    status, out, err = _run(capsys, str(tmp_path), PROMPT, "--max-new-tokens", "8")
    assert status == 0 and _speed(err) == 8
    model = qkv.models.GPT.from_pretrained(tmp_path)
    ids = tokenizer.encode(PROMPT).ids
    tokens = generate(model, torch.tensor([ids]), max_new_tokens=8)[0].tolist()
    whole, prompt_text = tokenizer.decode(tokens), tokenizer.decode(ids)
    assert prompt_text == PROMPT and whole.startswith(PROMPT + " ")  # a new word comes first
    assert not tokenizer.decode(tokens[len(ids) :]).startswith(" ")  # its space, lost alone
    assert out == whole + "\n"


def test_a_hub_name_says_that_nothing_is_downloaded(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder "gpt2" here
    status, out, err = _run(capsys, "gpt2", PROMPT)
    assert (status, out) == (1, "")
    assert err.startswith('qkv generate: error: path: there is no folder "gpt2" here')
    assert 'AutoModelForCausalLM.from_pretrained("gpt2").save_pretrained("gpt2-local")' in err
    assert 'AutoTokenizer.from_pretrained("gpt2").save_pretrained("gpt2-local")' in err
