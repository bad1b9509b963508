"""`compile="auto"`, the default of `qkv.generate`: compiled decoding steps whenever they pay.

The compiled steps it switches to are compile="aot"'s (qkv.acceleration.exported: the step
compiled ahead of time by AOTInductor, with compile=True's steps, qkv.acceleration.compiled, for
the calls it does not serve). They cost seconds once: tens for a first compilation on a
machine, a few to load a library an earlier process stored (qkv.acceleration.compile_store),
none once the model's library is in memory; then each step is faster (benchmarks/decode.py: several
times the eager steps of its 55M Llama on 2 CPU cores). Whether that pays depends on how much
decoding follows, which a call knows only in part. `AutoSteps` runs the first steps eagerly,
times them, and switches to the compiled steps once the eager time they would save covers what
they cost:

    (eager decoding seconds this model has already spent in this process
     + the steps left in this call x the median eager step) x SAVED_FRACTION  >=  cost

This is the rent-or-buy rule (Karlin et al. 1988, "Competitive snoopy caching"): counting what
was already spent keeps a program that decodes the same model again and again within about
twice the time of the best choice in hindsight, and counting the steps left makes a long call
switch early. The cost is `exported.compile_seconds` (0 with a library in memory: it is used
from the first step; LOAD_SECONDS with one stored; the compilation measured for this model on
this machine), or COMPILE_SECONDS where nothing is known.

The eager steps are used where compiled ones do not serve the call: an encoder-decoder, beam
search, a StreamingLLM cache (`generate` decides those), a model off the CPU (timing a step
there needs a device sync), or a torch.compile without a C++ compiler here. That last one is
asked only once the rule chose to switch: asking imports torch.compile's machinery (about a
second), which a call that stays eager should not pay.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Callable

from torch import nn

from qkv import capabilities
from qkv.acceleration import exported

__all__ = ["COMPILE_SECONDS", "PROBE_STEPS", "SAVED_FRACTION", "AutoSteps", "auto_steps"]

logger = logging.getLogger(__name__)

# The share of an eager step that a compiled one saves, as the rule counts it: a lower bound
# (benchmarks/decode.py measures compiled steps at 3-4x the eager ones' speed).
SAVED_FRACTION = 0.5
# What a first compilation is taken to cost where nothing was measured for the model: about
# three times the 15-20 s measured for the 55M Llama on 2 cores, for larger models.
COMPILE_SECONDS = 60.0
# Eager steps timed before a decision that has a cost to weigh.
PROBE_STEPS = 3

# Eager decoding seconds each model has spent in this process (weak: gone with the model).
_SPENT: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


def auto_steps(model: nn.Module, steps: int) -> AutoSteps | nn.Module:
    """What runs a decoder-only model's `steps` decoding steps after its prefill under
    compile="auto": `AutoSteps`, or the model itself off the CPU."""
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type != "cpu":
        return model
    return AutoSteps(model, steps)


class AutoSteps:
    """The steps of one call: eager and timed until the rule above chooses the compiled ones
    (at most once per call; `cost` and `compile` are what it asks, replaceable for tests)."""

    def __init__(
        self,
        model: nn.Module,
        steps: int,
        cost: Callable[[nn.Module], float | None] = exported.compile_seconds,
        compile: Callable[[nn.Module], Callable] = exported.exported_steps,
    ) -> None:
        self.model, self.left, self.compile = model, steps, compile
        self.cost = cost(model)
        self.eager_seconds: list[float] = []  # of this call's eager steps
        self.compiled: Callable | None = None
        self.decided = self.cost == 0.0
        if self.decided:  # a library in memory: nothing to weigh
            self._switch("the model's compiled step is in memory")

    def __call__(self, *args, **kwargs):
        self._decide_once_probed()
        self.left -= 1
        if self.compiled is not None:
            return self.compiled(*args, **kwargs)
        started = time.perf_counter()
        output = self.model(*args, **kwargs)
        seconds = time.perf_counter() - started
        self.eager_seconds.append(seconds)
        _SPENT[self.model] = _SPENT.get(self.model, 0.0) + seconds
        return output

    def greedy(self, input_ids, position_ids, cache) -> tuple | None:
        """The compiled steps' `greedy` step (see `ExportedSteps.greedy`) once switched to
        them; None while the steps are eager (the caller then calls these steps instead)."""
        self._decide_once_probed()
        greedy = getattr(self.compiled, "greedy", None)
        chosen = None if greedy is None else greedy(input_ids, position_ids, cache)
        if chosen is not None:
            self.left -= 1
        return chosen

    def _decide_once_probed(self) -> None:
        if not self.decided and len(self.eager_seconds) == PROBE_STEPS:
            self._decide()

    def _decide(self) -> None:
        self.decided = True
        cost = COMPILE_SECONDS if self.cost is None else self.cost
        step = statistics.median(self.eager_seconds)
        expected = _SPENT.get(self.model, 0.0) + self.left * step
        if expected * SAVED_FRACTION >= cost:
            self._switch(
                f"{expected:.1f} s of eager decoding expected (steps of {1e3 * step:.1f} ms), "
                f"against {cost:.1f} s to compile or load"
            )

    def _switch(self, reason: str) -> None:
        """The compiled steps from here on, where this machine can compile; else eager ones."""
        if not capabilities.compiler():
            return
        logger.info("compile='auto': compiled decoding steps from here on (%s)", reason)
        self.compiled = self.compile(self.model)
