"""qkv checkpoints (config.json + model.safetensors): round trips, tied weights, bad files.

The outside references are the file formats' own readers: `safetensors.torch.load_file` must
read back exactly the model's tensors, `json` the config; and a loaded model must compute what
the saved one computed, bit for bit.
"""

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qkv.models import serialization
from qkv.models.encoder_decoder import Transformer, TransformerConfig
from qkv.models.serialization import CheckpointError, load, register_model_class, save

TIED = "source_embedding.weight"  # the name a shared embedding is stored under


def _model(**overrides):
    torch.manual_seed(0)
    config = TransformerConfig.from_name("transformer-tiny", dropout=0.0, **overrides)
    return Transformer(config).eval()


def _inputs():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 128, (2, 6), generator=generator)
    labels = torch.randint(3, 128, (2, 5), generator=generator)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    return input_ids, attention_mask, labels


def _assert_same_model(loaded, model):
    assert type(loaded) is type(model) and loaded.config == model.config and not loaded.training
    saved_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert list(loaded_state) == list(saved_state)
    for key, tensor in saved_state.items():
        assert loaded_state[key].dtype == tensor.dtype, key
        assert torch.equal(loaded_state[key], tensor), key
    input_ids, attention_mask, labels = _inputs()
    with torch.no_grad():
        expected = model(input_ids, attention_mask, labels=labels)
        output = loaded(input_ids, attention_mask, labels=labels)
    assert torch.equal(output.logits, expected.logits) and torch.equal(output.loss, expected.loss)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"share_embeddings": False, "tie_output": False, "norm_first": True}],
    ids=["shared-embeddings", "untied-pre-norm"],
)
def test_round_trip_gives_identical_state_and_outputs(tmp_path, overrides):
    model = _model(**overrides)
    assert save(model, tmp_path / "checkpoint") == tmp_path / "checkpoint"
    loaded = load(tmp_path / "checkpoint")
    _assert_same_model(loaded, model)
    shared = model.config.share_embeddings
    assert (loaded.lm_head.weight is loaded.source_embedding.weight) == shared
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # no temporary file left behind


def test_files_are_plain_safetensors_and_json_with_tied_tensors_stored_once(tmp_path):
    model = _model()
    save(model, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    state = model.state_dict()
    assert set(stored) == set(state) - {"target_embedding.weight", "lm_head.weight"}
    assert all(torch.equal(stored[key], state[key]) for key in stored)
    document = json.loads((tmp_path / "config.json").read_text())
    assert document["model_class"] == "Transformer"
    assert document["config_class"] == "TransformerConfig"
    assert document["config"] == dataclasses.asdict(model.config)
    assert document["tied_weights"] == {"target_embedding.weight": TIED, "lm_head.weight": TIED}
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert document["weights_sha256"] == digest


def test_dtype_and_device_of_the_saved_weights(tmp_path):
    model = _model().to(torch.bfloat16)
    save(model, tmp_path)
    loaded = load(tmp_path, map_location=torch.device("cpu"))
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.lm_head.weight is loaded.target_embedding.weight
    _assert_same_model(loaded, model)


def test_saving_again_replaces_the_checkpoint(tmp_path):
    save(_model(), tmp_path)
    other = _model(norm_first=True)
    save(other, tmp_path)
    _assert_same_model(load(tmp_path), other)


def test_interrupted_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    model = _model()
    save(model, tmp_path)

    def crash(tensors, path):
        path.write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(serialization, "_save_tensors", crash)
    with pytest.raises(OSError, match="disk full"):
        save(_model(norm_first=True), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_model(load(tmp_path), model)


# ---------------------------------------------------------------- bad checkpoints


def _rewrite_weights(directory, change):
    """Rewrite model.safetensors with change(tensors) and record the new file's SHA-256, as a
    consistent but wrong checkpoint would be."""
    weights = directory / "model.safetensors"
    tensors = change(load_file(str(weights)))
    save_file(tensors, str(weights))
    _edit_config(directory, lambda document: document.update(
        weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest()
    ))  # fmt: skip


def _edit_config(directory, change):
    """Rewrite config.json with change(document) and record its new checkpoint_sha256: the
    hash catches accidents, so these tests of the checks behind it edit as one who knows."""
    document = json.loads((directory / "config.json").read_text())
    change(document)
    document["checkpoint_sha256"] = serialization.checkpoint_sha256(document)
    (directory / "config.json").write_text(json.dumps(document))


def test_truncated_weights_raise_a_clear_error(tmp_path):
    save(_model(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a readable safetensors"):
        load(tmp_path)


def test_corrupted_weights_are_caught_by_the_checksum(tmp_path):
    save(_model(), tmp_path)
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes: still a well-formed safetensors file
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"does not match the SHA-256 .* corrupted"):
        load(tmp_path)


def test_missing_unexpected_and_misshaped_tensors_are_listed(tmp_path):
    save(_model(), tmp_path)

    def damage(tensors):
        del tensors["decoder.norm.weight"]
        tensors["encoder.blocks.0.ffn.up_proj.bias"] = torch.zeros(65)
        tensors["extra.weight"] = torch.zeros(1)
        return tensors

    _rewrite_weights(tmp_path, damage)
    with pytest.raises(CheckpointError) as error:
        load(tmp_path)
    message = str(error.value)
    assert "missing (1):\n    decoder.norm.weight" in message
    assert "unexpected (1):\n    extra.weight" in message
    assert "encoder.blocks.0.ffn.up_proj.bias: file (65,), model (64,)" in message


def test_a_tie_the_config_does_not_build_is_refused(tmp_path):
    save(_model(), tmp_path)
    # the file still stores one embedding
    _edit_config(tmp_path, lambda document: document["config"].update(share_embeddings=False))
    with pytest.raises(CheckpointError, match=r"tied_weights .* differ from the ties"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda d: d.update(format="hf"), r"is not a qkv checkpoint"),
        (lambda d: d.update(format_version=99), r"format_version 99; this qkv reads version 1"),
        (lambda d: d.update(model_class="Nope"), r"model_class 'Nope' is not a registered"),
        (lambda d: d.update(config_class="GPTConfig"), r"config_class 'GPTConfig' does not go"),
        (lambda d: d["config"].update(d_model=4), r"fields \['d_model'\] are not fields of"),
        (lambda d: d["config"].update(num_heads=5), r"invalid TransformerConfig: embed_dim"),
    ],
)
def test_bad_config_json_raises_a_clear_error(tmp_path, edit, pattern):
    save(_model(), tmp_path)
    _edit_config(tmp_path, edit)
    with pytest.raises(CheckpointError, match=pattern):
        load(tmp_path)


def test_missing_files_raise_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        load(tmp_path)
    save(_model(), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors does not exist"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        load(tmp_path)


# ---------------------------------------------------------------- other model classes


@dataclasses.dataclass(frozen=True)
class _ProbeConfig:
    widths: tuple[int, ...] = (3, 4)
    name: str = "probe"


class _Probe(nn.Module):
    """A small non-Transformer model with a tuple in its config and a persistent buffer."""

    def __init__(self, config: _ProbeConfig) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(*config.widths)
        self.register_buffer("running", torch.arange(config.widths[1], dtype=torch.float32))


def test_any_registered_frozen_dataclass_model_round_trips(tmp_path):
    register_model_class(_Probe, _ProbeConfig)
    register_model_class(_Probe, _ProbeConfig)  # the same pair again is fine
    model = _Probe(_ProbeConfig(widths=(5, 2), name="x"))
    save(model, tmp_path)
    loaded = load(tmp_path)
    assert loaded.config == model.config and isinstance(loaded.config.widths, tuple)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_registration_and_save_errors(tmp_path):
    class Unregistered(_Probe):
        pass

    with pytest.raises(ValueError, match=r"Unregistered with _ProbeConfig is not registered"):
        save(Unregistered(_ProbeConfig()), tmp_path)
    with pytest.raises(ValueError, match=r"the name 'Transformer' is already registered"):
        register_model_class(type("Transformer", (nn.Module,), {}), _ProbeConfig)
    with pytest.raises(TypeError, match=r"config_class: expected a frozen dataclass type"):
        register_model_class(_Probe, dict)
    with pytest.raises(TypeError, match=r"model: expected a `.config` that is a frozen dataclass"):
        save(nn.Linear(2, 2), tmp_path)
    register_model_class(_Probe, _ProbeConfig)
    with pytest.raises(TypeError, match=r"config.name: expected a JSON value .* torch.float32"):
        save(_Probe(_ProbeConfig(name=torch.float32)), tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_a_config_edited_by_hand_loads_only_with_verify_false(tmp_path):
    """The hash covers config.json: an edit (here, one that changes what the model computes)
    is refused; verify=False loads the folder as it is, for an edit made on purpose."""
    save(_model(), tmp_path)
    document = json.loads((tmp_path / "config.json").read_text())
    document["config"]["norm_first"] = not document["config"]["norm_first"]
    (tmp_path / "config.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=r"does not match its checkpoint_sha256"):
        load(tmp_path)
    assert load(tmp_path, verify=False).config.norm_first == document["config"]["norm_first"]
