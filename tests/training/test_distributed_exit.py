"""A process that joined torchrun's process group leaves it at exit, while the interpreter is
whole: left to finalisation, gloo's worker threads can abort a run that ended well (SIGABRT,
"terminate called without an active exception", seen on a 2-process FSDP run)."""

from __future__ import annotations

import atexit

import torch.distributed as dist

from qkv.training import distributed


def test_joining_the_group_registers_its_destruction_at_exit(monkeypatch):
    joined, calls, registered = [False], [], []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: joined[0])
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def init_process_group(backend):
        joined[0] = True
        calls.append(f"init {backend}")

    def destroy_process_group():
        joined[0] = False
        calls.append("destroy")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    monkeypatch.setattr(atexit, "register", registered.append)
    context = distributed.setup_distributed("cpu")
    assert (context.rank, context.world_size) == (1, 2) and calls == ["init gloo"]
    assert len(registered) == 1
    distributed.setup_distributed("cpu")  # joined already: nothing joined or registered again
    assert calls == ["init gloo"] and len(registered) == 1
    registered[0]()  # at exit
    registered[0]()  # destroyed already (by the caller, say): nothing more
    assert calls == ["init gloo", "destroy"]
