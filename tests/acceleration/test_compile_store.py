"""The compile store (qkv.acceleration.compile_store): a graph compiled once serves later models
of the same architecture, in this process and in a new one, with their own weights; anything
its guards do not check changes the key; a damaged file is compiled again, and a file someone
else could have written is never loaded."""

import logging
import os

import pytest
import torch

from qkv.acceleration import compiled, packed_linears
from qkv.acceleration.compile_store import (
    GraphStore,
    make_folder,
    model_key,
    store_directory,
    untrusted,
)
from qkv.generation import generate
from qkv.models.safetensors_io import write_atomically
from tests.acceleration.new_process import decodes_from_the_store
from tests.generation.reference_models import qkv_model, redraw

NEW_TOKENS = 8
OPTIONS = {"option": 1}


@pytest.fixture
def store(monkeypatch, tmp_path):
    """An empty store of this test's own, and a count of the compilations."""
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path))
    compilations = []
    real = compiled.compile_forward

    def counted(model, args, kwargs):
        compilations.append(model)
        return real(model, args, kwargs)

    monkeypatch.setattr(compiled, "compile_forward", counted)
    return tmp_path, compilations


def _prompt():
    return torch.arange(3, 9).unsqueeze(0)  # (1, 6)


def test_a_stored_graph_serves_other_models_of_the_architecture_here_and_in_a_new_process(
    store,
):
    """Compiled once, for one model: a new model of the same architecture with other weights
    loads the graph and gets its own eager tokens, in this process and in a subprocess whose
    compile_forward raises."""
    directory, compilations = store
    generate(qkv_model("tiny-llama"), _prompt(), max_new_tokens=NEW_TOKENS, compile=True)
    assert len(compilations) == 1 and len(list(directory.rglob("*.graph"))) == 1
    other = redraw(qkv_model("tiny-llama"), seed=7)  # a new model: nothing in memory
    expected = generate(other, _prompt(), max_new_tokens=NEW_TOKENS)
    assert torch.equal(generate(other, _prompt(), max_new_tokens=NEW_TOKENS, compile=True),
                       expected)  # fmt: skip
    assert len(compilations) == 1  # loaded, not compiled

    decodes_from_the_store(
        directory, refused="compiled.compile_forward", compile=True, new_tokens=NEW_TOKENS
    )


def test_what_guards_do_not_check_changes_the_key():
    model = qkv_model("tiny-llama")
    key = model_key(model, OPTIONS)
    assert model_key(redraw(qkv_model("tiny-llama"), seed=2), OPTIONS) == key  # weights: no
    assert model_key(qkv_model("tiny-llama", num_layers=3), OPTIONS) != key
    assert model_key(qkv_model("tiny-llama").to(torch.bfloat16), OPTIONS) != key
    assert model_key(model, {"option": 2}) != key
    with packed_linears(model):
        packed = model_key(model, OPTIONS)
        assert packed != key
        generate(model, _prompt(), max_new_tokens=2)  # packs at the first call
        assert model_key(model, OPTIONS) == packed  # a process's first call looks it up
    assert model_key(model, OPTIONS) == key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert model_key(model, OPTIONS) != key
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_graph_is_skipped_with_a_warning(tmp_path, caplog):
    """Cut short, say: the store loads nothing (the caller compiles again) and says which."""
    folder = tmp_path / "key"
    folder.mkdir()
    (folder / "cut.graph").write_bytes(b"\x80\x05 not a whole graph")
    with caplog.at_level(logging.WARNING, logger="qkv.acceleration.compile_store"):
        assert GraphStore(tmp_path).load("key", {}) == []
    assert "cut.graph not loaded (compiling again)" in caplog.text


def test_the_store_can_be_switched_off_and_says_where_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_COMPILE_CACHE", "off")
    assert store_directory() is None
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path / "graphs"))
    assert store_directory() == tmp_path / "graphs"
    monkeypatch.delenv("QKV_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store_directory() == tmp_path / "qkv" / "compiled"
    assert GraphStore(tmp_path / "none").load("key", {}) == []  # nothing stored: nothing loaded


class _Planted:
    """A pickle that, once loaded, would create `marker`: what another user could plant."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_graph_in_a_folder_others_can_write_is_refused_unread(tmp_path, caplog):
    """A store folder that group or others can write (a shared /tmp folder, say): a planted
    pickle is never unpickled, and the warning says why."""
    import pickle

    folder = tmp_path / "key"
    folder.mkdir()
    folder.chmod(0o777)
    marker = tmp_path / "ran"
    (folder / "planted.graph").write_bytes(pickle.dumps(_Planted(marker)))
    with caplog.at_level(logging.WARNING, logger="qkv.acceleration.compile_store"):
        assert GraphStore(tmp_path).load("key", {}) == []
    assert not marker.exists()
    assert "can be written by its group or others (mode 777)" in caplog.text


def test_a_file_of_another_user_is_refused(tmp_path, monkeypatch):
    """Files and folders that belong to someone else (as this process sees them: another uid)
    are not loaded; this user's own, writable by no one else, are."""
    folder = tmp_path / "key"
    folder.mkdir()
    graph = folder / "g.graph"
    graph.write_bytes(b"graph")
    graph.chmod(0o644)
    assert untrusted(graph, tmp_path) is None
    monkeypatch.setattr(os, "getuid", lambda: graph.stat().st_uid + 1)
    assert "belongs to user id" in untrusted(graph, tmp_path)


def test_folders_the_store_makes_are_the_users_alone_and_leave_no_temporary(tmp_path):
    folder = make_folder(tmp_path / "a" / "b")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a").stat().st_mode & 0o022 == 0  # above it: the default, by umask
    in_the_way = folder / "step.pt2"
    in_the_way.mkdir()  # the library's path is a folder: the rename fails
    with pytest.raises(OSError):
        write_atomically(in_the_way, lambda partial: partial.write_bytes(b"x"), suffix=".pt2")
    assert sorted(p.name for p in folder.iterdir()) == ["step.pt2"]
