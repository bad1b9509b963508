"""A catalogue of hostile model folders: each is refused at once with one clear error (a
ValueError naming the file, the value seen and what was expected), never a traceback from deep
inside, never minutes of allocation, never a model that loads with weights or a config that
are not the ones saved.

The reference folders are written by transformers (LlamaForCausalLM, GPT2LMHeadModel and
BertModel from small configs, seed 0) and by qkv's own `save` (a tiny encoder-decoder, a tiny
GPT); each case copies one, damages it and loads it the way the library or the CLI does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import qkv.models as models
from qkv.applications.embed import SentenceEncoder
from qkv.generation.text import load_for_generation

HUGE = 10**9  # layers, widths: tens of thousands of GiB at any width, on any machine
TOO_BIG = r"~[\d,.]+ GiB .*more than the [\d,.]+ GiB of memory"


def _write_references(root: Path) -> None:
    torch.manual_seed(0)
    sizes = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    llama = transformers.LlamaConfig(**sizes, num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    gpt2 = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    bert = transformers.BertConfig(**sizes, num_attention_heads=4, max_position_embeddings=64)
    transformers.BertModel(bert).save_pretrained(root / "bert")
    tiny = models.TransformerConfig.from_name("transformer-tiny")
    models.save(models.Transformer(tiny), root / "qkv")
    models.save(models.GPT(models.GPTConfig.from_name("tiny-gpt2")), root / "qkv-gpt")
    (root / "qkv-gpt" / "tokenizer.json").write_text("{}")  # replaced by each case


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("references")
    _write_references(root)
    return root


# ---------------------------------------------------------------- how folders are damaged


def edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite the JSON file `name` with change(document) applied in place."""

    def damage(folder: Path) -> None:
        document = json.loads((folder / name).read_text())
        change(document)
        (folder / name).write_text(json.dumps(document))

    return damage


def edit_config(**fields: object) -> Callable[[Path], None]:
    return edit_json("config.json", lambda document: document.update(fields))


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)

    return damage


def checkpoint_sha256(document: dict) -> str:
    """The hash qkv's `save` records: SHA-256 of config.json's other fields as compact,
    key-sorted JSON (weights_sha256 among them, so the weights are covered too)."""
    fields = {k: v for k, v in document.items() if k != "checkpoint_sha256"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def edit_qkv_config(change: Callable[[dict], object], *, rehash: bool) -> Callable[[Path], None]:
    """Edit qkv's config.json; with rehash, record the hash of the edited document, as someone
    who knows the format can (the hash guards against accidents, it is no signature)."""

    def apply(document: dict) -> None:
        change(document)
        if rehash:
            document["checkpoint_sha256"] = checkpoint_sha256(document)

    return edit_json("config.json", apply)


def stray_zeros(folder: Path) -> None:
    """An all-zeros copy of the weights, as a forgotten backup would be, beside the real file."""
    tensors = load_file(folder / "model.safetensors")
    zeros = {k: torch.zeros_like(t) for k, t in tensors.items()}
    save_file(zeros, folder / "model_old_backup.safetensors", metadata={"format": "pt"})


def shard(folder: Path, index: dict | None = None, *, drop: str | None = None) -> None:
    """Split model.safetensors in two shards and write the index transformers writes (or
    `index`); `drop` removes one tensor from the shard the index names for it."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2]}
    files["model-00002-of-00002.safetensors"] = names[1::2]
    for file, keys in files.items():
        kept = {k: tensors[k] for k in keys if k != drop}
        save_file(kept, folder / file, metadata={"format": "pt"})
    weight_map = {key: file for file, keys in files.items() for key in keys}
    document = {"metadata": {}, "weight_map": weight_map} if index is None else index
    (folder / "model.safetensors.index.json").write_text(json.dumps(document))


def rename(old: str, new: str) -> Callable[[Path], None]:
    return lambda folder: (folder / old).rename(folder / new)


# ---------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Case:
    description: str
    reference: str  # which reference folder is copied
    damage: Callable[[Path], None]
    load: Callable[[Path], object]
    error: type[Exception]
    pattern: str


HF, QKV = models.from_pretrained, models.load
BAD = models.CheckpointError
INDEX = "model.safetensors.index.json"

CASES = [
    # --- config.json of a Hugging Face folder that is not a config
    Case("HF config.json is a JSON list", "llama", write("config.json", "[1, 2]"), HF, BAD,
         r"config\.json: expected a JSON object .*got list"),
    Case("HF config.json is a JSON string", "gpt2", write("config.json", '"gpt2"'), HF, BAD,
         r"config\.json: expected a JSON object .*got str"),
    Case("HF config.json is not UTF-8", "bert", write("config.json", b"\xff\xfe{\x00"), HF, BAD,
         r"config\.json is not valid JSON"),
    Case("HF config.json is cut short", "llama", write("config.json", '{"vocab_size": 1'), HF,
         BAD, r"config\.json is not valid JSON"),
    Case("architectures holds a list", "llama", edit_config(architectures=[["Llama"]]), HF, BAD,
         r"architectures is \[\['Llama'\]\]; expected a list of class names"),
    # --- sizes that would exhaust memory before any tensor is compared
    Case("num_hidden_layers=10**9 (Llama)", "llama", edit_config(num_hidden_layers=HUGE), HF,
         BAD, rf"config\.json: num_layers=1000000000 .*{TOO_BIG}"),
    Case("vocab_size=10**12 (GPT-2)", "gpt2", edit_config(vocab_size=10**12), HF, BAD,
         rf"config\.json: vocab_size=1000000000000 .*{TOO_BIG}"),
    Case("hidden_size=10**9 (Llama)", "llama", edit_config(hidden_size=HUGE, head_dim=None), HF,
         BAD, rf"embed_dim=1000000000.*{TOO_BIG}"),
    Case("num_hidden_layers=10**9 (BERT)", "bert", edit_config(num_hidden_layers=HUGE), HF, BAD,
         rf"num_layers=1000000000 .*{TOO_BIG}"),
    Case("num_labels=10**12 (BERT classifier)", "bert",
         edit_config(architectures=["BertForSequenceClassification"], num_labels=10**12), HF,
         BAD, rf"num_labels=1000000000000 .*{TOO_BIG}"),
    # --- values of the wrong type
    Case("hidden_size is a string (Llama)", "llama", edit_config(hidden_size="32"), HF, BAD,
         r"config\.json: hidden_size is '32' \(str\); expected an int"),
    Case("n_embd is a string (GPT-2)", "gpt2", edit_config(n_embd="32"), HF, BAD,
         r"config\.json: n_embd is '32' \(str\); expected an int"),
    Case("num_hidden_layers is 2.0 (Llama)", "llama", edit_config(num_hidden_layers=2.0), HF,
         BAD, r"num_hidden_layers is 2\.0 \(float\); expected an int"),
    Case("tie_word_embeddings is 'false' (GPT-2)", "gpt2",
         edit_config(tie_word_embeddings="false"), HF, BAD,
         r"tie_word_embeddings is 'false' \(str\); expected a bool"),
    Case("rope_parameters is a list (Llama)", "llama", edit_config(rope_parameters=[1]), HF,
         BAD, r"rope_parameters is \[1\] \(list\); expected an object"),
    Case("num_hidden_layers is negative (BERT)", "bert", edit_config(num_hidden_layers=-1), HF,
         BAD, r"config\.json: num_hidden_layers: expected a positive int, got -1"),
    Case("id2label keys are not numbers (BERT classifier)", "bert",
         edit_config(architectures=["BertForSequenceClassification"], id2label={"a": "x"}), HF,
         BAD, r"id2label is \{'a': 'x'\}; expected an object from label ids"),
    # --- which weight files are the model's
    Case("a stray all-zeros model_old_backup.safetensors", "llama", stray_zeros, HF, BAD,
         r"model\.safetensors, model_old_backup\.safetensors and no model\.safetensors\.index"),
    Case("shards without their index", "llama", lambda f: shard(f, None) or (f / INDEX).unlink(),
         HF, BAD, r"model-00001-of-00002\.safetensors, model-00002-of-00002\.safetensors and no"),
    Case("a lone weight file of another name", "gpt2",
         rename("model.safetensors", "model-v2.safetensors"), HF, BAD,
         r"holds model-v2\.safetensors; expected model\.safetensors"),
    Case("the index names a shard that is not there", "llama",
         lambda f: shard(f) or (f / "model-00002-of-00002.safetensors").unlink(), HF, BAD,
         r"names model-00002-of-00002\.safetensors, which does not exist"),
    Case("the index names a file outside the folder", "llama",
         lambda f: shard(f, {"weight_map": {"lm_head.weight": "../model.safetensors"}}), HF, BAD,
         r"names '\.\./model\.safetensors'; expected a \.safetensors file name in the folder"),
    Case("the index has no weight_map", "llama", lambda f: shard(f, {"metadata": {}}), HF, BAD,
         r"index\.json: expected a \"weight_map\" object"),
    Case("the index is a JSON list", "llama", lambda f: shard(f, [1]), HF, BAD,
         r"index\.json: expected a \"weight_map\" object"),
    Case("the index maps a tensor to a shard without it", "llama",
         lambda f: shard(f, drop="model.norm.weight"), HF, BAD,
         r"maps model\.norm\.weight to model-0000\d-of-00002\.safetensors, which does not hold"),
    # --- qkv's own checkpoints: config and weights are covered by the hash
    Case("qkv config.json edited (norm_first)", "qkv",
         edit_qkv_config(lambda d: d["config"].update(norm_first=True), rehash=False), QKV, BAD,
         r"config\.json does not match its checkpoint_sha256"),
    Case("qkv checkpoint_sha256 deleted", "qkv",
         edit_qkv_config(lambda d: d.pop("checkpoint_sha256"), rehash=False), QKV, BAD,
         r"config\.json has no checkpoint_sha256; .*verify=False"),
    Case("qkv weights_sha256 deleted (hash recomputed)", "qkv",
         edit_qkv_config(lambda d: d.pop("weights_sha256"), rehash=True), QKV, BAD,
         r"config\.json has no weights_sha256; .*verify=False"),
    Case("qkv weights_sha256 is a number", "qkv",
         edit_qkv_config(lambda d: d.update(weights_sha256=1), rehash=True), QKV, BAD,
         r"weights_sha256 is 1; expected 64 hexadecimal digits"),
    Case("qkv num_encoder_layers=10**9 (hash recomputed)", "qkv",
         edit_qkv_config(lambda d: d["config"].update(num_encoder_layers=HUGE), rehash=True),
         QKV, BAD, rf"config\.json: num_encoder_layers=1000000000 .*{TOO_BIG}"),
    Case("qkv embed_dim=10**9 (hash recomputed)", "qkv",
         edit_qkv_config(lambda d: d["config"].update(embed_dim=HUGE), rehash=True), QKV, BAD,
         rf"config\.json: .*embed_dim=1000000000.*{TOO_BIG}"),
    Case("qkv embed_dim is a string (hash recomputed)", "qkv",
         edit_qkv_config(lambda d: d["config"].update(embed_dim="32"), rehash=True), QKV, BAD,
         r"invalid TransformerConfig: embed_dim: expected a positive int, got str '32'"),
    Case("qkv config.json is a JSON list", "qkv", write("config.json", "[]"), QKV, BAD,
         r"is not a qkv checkpoint"),
    # --- tokenizer.json beside the model (qkv generate, qkv embed)
    Case("malformed tokenizer.json for qkv generate", "qkv-gpt",
         write("tokenizer.json", '{"model": ['), load_for_generation, BAD,
         r"tokenizer\.json is not a valid tokenizer\.json"),
    Case("tokenizer.json is a JSON list for qkv generate", "qkv-gpt",
         write("tokenizer.json", "[]"), load_for_generation, BAD,
         r"tokenizer\.json is not a valid tokenizer\.json"),
    Case("malformed tokenizer.json for qkv embed", "bert", write("tokenizer.json", "{"),
         SentenceEncoder.from_pretrained, BAD, r"tokenizer\.json is not a valid tokenizer\.json"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case.description for case in CASES])
def test_a_hostile_folder_is_refused_with_a_clear_error(case, references, tmp_path):
    folder = tmp_path / case.reference
    shutil.copytree(references / case.reference, folder)
    case.damage(folder)
    with pytest.raises(case.error, match=case.pattern):
        case.load(folder)


def test_the_catalogue_is_long_enough_and_its_references_load(references):
    """The control: every reference folder loads undamaged, so each case fails for its damage."""
    assert len(CASES) >= 15
    for name in ("llama", "gpt2", "bert"):
        assert isinstance(HF(references / name), torch.nn.Module)
    assert isinstance(QKV(references / "qkv"), models.Transformer)
    assert isinstance(QKV(references / "qkv-gpt"), models.GPT)
