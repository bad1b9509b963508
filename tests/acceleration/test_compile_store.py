"""The compile store (qkv.acceleration.compile_store): what a library was compiled for that its
inputs do not show changes the key; a damaged file is compiled again, and a file someone else
could have written is never loaded. (A library serving later models of the architecture, here
and in a new process: tests/acceleration/test_exported.py.)"""

import logging
import os

import pytest
import torch

from qkv.acceleration import exported, packed_linears
from qkv.acceleration.compile_store import make_folder, model_key, store_directory, untrusted
from qkv.generation import generate
from qkv.models.safetensors_io import write_atomically
from tests.generation.reference_models import qkv_model, redraw

OPTIONS = {"option": 1}


def _prompt():
    return torch.arange(3, 9).unsqueeze(0)  # (1, 6)


def test_what_the_inputs_do_not_show_changes_the_key():
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


def test_a_damaged_library_is_compiled_again_with_a_warning(tmp_path, monkeypatch, caplog):
    """Cut short, say: the library is not loaded, the step is compiled again (here: a stand-in
    compiler that fails, so the caller decodes elsewhere), and the warning names the file."""
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path))
    model = qkv_model("tiny-llama")
    key = (model_key(model, OPTIONS), 1, torch.int64, torch.int64, False, None)  # fp32 cache
    folder = make_folder(tmp_path / key[0])
    (folder / "exported-b1-int64-int64.pt2").write_bytes(b"PK not a whole package")

    def no_compiler(*args):
        raise RuntimeError("compiler stand-in")

    monkeypatch.setattr(exported, "_compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger="qkv.acceleration.exported"):
        runner = exported._load_or_compile(model, key, OPTIONS, None, {})
    assert isinstance(runner, str) and "compiler stand-in" in runner
    assert "exported-b1-int64-int64.pt2 not loaded (compiling again)" in caplog.text


def test_the_store_can_be_switched_off_and_says_where_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_COMPILE_CACHE", "off")
    assert store_directory() is None
    monkeypatch.setenv("QKV_COMPILE_CACHE", str(tmp_path / "graphs"))
    assert store_directory() == tmp_path / "graphs"
    monkeypatch.delenv("QKV_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store_directory() == tmp_path / "qkv" / "compiled"


def test_a_library_in_a_folder_others_can_write_is_refused_unread(tmp_path):
    """A store folder that group or others can write (a shared /tmp folder, say): a planted
    library is refused before it is opened, and the reason says why."""
    folder = tmp_path / "key"
    folder.mkdir()
    folder.chmod(0o777)
    planted = folder / "exported-b1-int64-int64.pt2"
    planted.write_bytes(b"planted")
    assert "can be written by its group or others (mode 777)" in untrusted(planted, tmp_path)


def test_a_file_of_another_user_is_refused(tmp_path, monkeypatch):
    """Files and folders that belong to someone else (as this process sees them: another uid)
    are not loaded; this user's own, writable by no one else, are."""
    folder = tmp_path / "key"
    folder.mkdir()
    graph = folder / "exported-b1-int64-int64.pt2"
    graph.write_bytes(b"library")
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
