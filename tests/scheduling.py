"""How `make test`'s two pytest-xdist workers share the suite (`-n 2 --dist loadfile
--no-loadscope-reorder`; tests/conftest.py takes these hooks).

Each module's tests stay together on one worker, so that a module's fixtures are built once; the
modules that read SmolLM2 through transformers share one worker, so that its load (tens of
seconds) happens once. The groups are the scheduler's own (`pytest_xdist_make_scheduler`):
xdist's `--dist loadgroup` renames node ids to group them, which pytest 9 no longer allows, and
it then spread a module's tests over both workers without a word. Without xdist, unused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

_TRANSFORMERS_SMOLLM2 = "smollm2-transformers"


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]  # the test file's path, relative to the root directory


@functools.cache
def _reads_smollm2_through_transformers(path: Path) -> bool:
    return "smollm2_hf" in path.read_text(encoding="utf-8")  # either fixture's name


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown (and unused) without xdist
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        """A work unit per test module; one for all modules naming the `smollm2_hf` fixtures."""

        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            reads = _reads_smollm2_through_transformers(config.rootpath / module)
            return _TRANSFORMERS_SMOLLM2 if reads else module

    return ByModule(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The longest work first, so that neither worker is left with it at the end: the modules
    that read SmolLM2 through transformers, then those with a test marked slow, then the rest,
    each in collection order (a module's tests keep theirs). The workers' scheduler takes the
    modules in this order (`--no-loadscope-reorder`)."""
    modules = list(dict.fromkeys(_module(item.nodeid) for item in items))
    smollm2 = {_module(i.nodeid) for i in items if _reads_smollm2_through_transformers(i.path)}
    slow = {_module(item.nodeid) for item in items if item.get_closest_marker("slow")}
    rank = {m: (m not in smollm2, m not in slow, n) for n, m in enumerate(modules)}
    items.sort(key=lambda item: rank[_module(item.nodeid)])
