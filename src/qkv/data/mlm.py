"""BERT's masked-language-model corruption and the batches for `BertForPreTraining`.

About 15% of the input tokens are selected at random; of those, 80% become [MASK], 10% a random
token and 10% stay unchanged (Devlin et al. 2019, section 3.1 "Task #1: Masked LM" and appendix
A.1). The model predicts the original token at every selected position, and only there (labels -100
elsewhere).

Masking happens per batch, when the batch is built (`PretrainingCollator`), not once when the
data is made: each epoch sees the same pairs masked differently (the reference duplicated the
data 10 times with different masks; RoBERTa's "dynamic masking" does it per batch, as here),
yet deterministically: one torch.Generator, seeded once, whose state can be saved for resume.

The sentence pairs themselves (next-sentence prediction) are built by `qkv.data.nsp`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qkv.data.nsp import NspExample
from qkv.data.tokenizers import BertSpecialIds
from qkv.validation import check_positive_int

__all__ = ["IGNORE_INDEX", "PretrainingCollator", "mask_tokens", "pad_examples"]

IGNORE_INDEX = -100  # label of unselected positions: F.cross_entropy's and BertForPreTraining's


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    special_ids: Sequence[int],
    vocab_size: int,
    mask_token_id: int,
    generator: torch.Generator,
    special_mask: torch.Tensor | None = None,
    probability: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's 80/10/10 corruption: input_ids (any shape, e.g. (B, L)) -> (masked ids, labels).

    1. Select each position independently with `probability` (0.15), except the tokens in
       `special_ids` ([CLS], [SEP], [PAD], [MASK]) and the positions where `special_mask` is
       True (e.g. padding): those are never selected.
    2. Of the selected: `mask_fraction` (80%) become mask_token_id, `random_fraction` (10%) a
       random token, the rest (10%) keep their id.
    labels: the original id where selected, -100 elsewhere. The inputs are not modified.

    Two choices, both documented departures from a literal copy of a reference:
    - Selection is a Bernoulli draw per token (as transformers' DataCollatorForLanguageModeling
      and RoBERTa do), so a sequence of n tokens gets 0.15 n selections on average; Google's
      create_pretraining_data.py picks exactly round(0.15 n) (at most max_predictions_per_seq).
      The proportions are the paper's either way.
    - The random token is drawn uniformly from the vocabulary WITHOUT `special_ids`; both the
      reference and transformers draw from the whole vocabulary, which now and then writes a
      [PAD] under an attention mask of 1, a [CLS] or [SEP] in mid-sentence, or a [MASK] (which
      quietly moves a "random" case into the 80%). Excluding them keeps 80/10/10 exact and the
      input well-formed; with a 30k vocabulary the two differ by 4 tokens in 30,522.
    """
    _check_mask_arguments(input_ids, vocab_size, probability, mask_fraction, random_fraction)
    device = generator.device
    special = torch.as_tensor(list(special_ids), dtype=input_ids.dtype, device=input_ids.device)
    candidates = ~torch.isin(input_ids, special)
    if special_mask is not None:
        if special_mask.shape != input_ids.shape:
            raise ValueError(
                f"special_mask: expected shape {tuple(input_ids.shape)} (that of input_ids), "
                f"got {tuple(special_mask.shape)}"
            )
        candidates &= ~special_mask.bool()
    shape = input_ids.shape
    draw = torch.rand(shape, generator=generator, device=device).to(input_ids.device)
    selected = candidates & (draw < probability)
    labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
    action = torch.rand(shape, generator=generator, device=device).to(input_ids.device)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    pool = _replacement_pool(vocab_size, special_ids).to(device)  # (V - specials,)
    picks = torch.randint(len(pool), shape, generator=generator, device=device)
    random_ids = pool[picks].to(input_ids.device, input_ids.dtype)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


def pad_examples(examples: Sequence[NspExample], *, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad sentence pairs into a batch for `BertForPreTraining.forward`:
    input_ids (B, L) with pad_id on padding, attention_mask (B, L) 1 on real tokens,
    token_type_ids (B, L) 0 on [CLS] A [SEP] (and padding), 1 on B [SEP], and
    next_sentence_label (B,) 0 = B follows A, 1 = random B. L is the longest example."""
    if not examples:
        raise ValueError("examples: expected at least one example, got none")
    B, L = len(examples), max(len(example.input_ids) for example in examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((B, L), dtype=torch.long)  # (B, L)
    token_type_ids = torch.zeros((B, L), dtype=torch.long)  # (B, L)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention_mask[row, :n] = 1
        token_type_ids[row, :n] = torch.tensor(example.token_type_ids)
    next_sentence_label = torch.tensor([e.next_sentence_label for e in examples])  # (B,)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "next_sentence_label": next_sentence_label,
    }


class PretrainingCollator:
    """collate_fn for BERT pre-training: pads NspExamples (`pad_examples`) and masks the batch
    (`mask_tokens`) with its own seeded generator, so every call masks differently and a run
    from the same seed masks the same way. Returns input_ids, attention_mask, token_type_ids,
    labels, next_sentence_label: `model(**batch)` for a `BertForPreTraining`.

    Use it in the process that trains (DataLoader num_workers=0): worker processes would each
    copy the generator and repeat one another's masks. `state_dict()` / `load_state_dict()`
    save and restore the generator, so a resumed run goes on with the masks it would have made.
    """

    def __init__(
        self,
        special: BertSpecialIds,
        *,
        vocab_size: int,
        seed: int = 0,
        probability: float = 0.15,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
    ) -> None:
        if not isinstance(special, BertSpecialIds):
            raise TypeError(f"special: expected BertSpecialIds, got {type(special).__name__}")
        self.special = special
        self.vocab_size = vocab_size
        self.probability = probability
        self.mask_fraction = mask_fraction
        self.random_fraction = random_fraction
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, examples: Sequence[NspExample]) -> dict[str, torch.Tensor]:
        batch = pad_examples(examples, pad_id=self.special.pad)
        batch["input_ids"], batch["labels"] = mask_tokens(
            batch["input_ids"],
            special_ids=self.special.never_selected,
            special_mask=batch["attention_mask"] == 0,
            vocab_size=self.vocab_size,
            mask_token_id=self.special.mask,
            generator=self.generator,
            probability=self.probability,
            mask_fraction=self.mask_fraction,
            random_fraction=self.random_fraction,
        )
        return batch

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def _replacement_pool(vocab_size: int, special_ids: Sequence[int]) -> torch.Tensor:
    """The ids a random replacement may take: 0 .. V - 1 without the special ids."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)  # (V,)
    allowed[[i for i in special_ids if 0 <= i < vocab_size]] = False
    pool = allowed.nonzero().flatten()
    if len(pool) == 0:
        raise ValueError(f"special_ids: cover the whole vocabulary of {vocab_size}; none left")
    return pool


def _check_mask_arguments(
    input_ids: object,
    vocab_size: object,
    probability: float,
    mask_fraction: float,
    random_fraction: float,
) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point():
        raise TypeError(f"input_ids: expected an integer tensor, got {input_ids!r:.80}")
    check_positive_int("vocab_size", vocab_size)
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab_size:
        raise ValueError(
            f"input_ids: expected ids in [0, {vocab_size}) (vocab_size), got "
            f"[{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability: expected (0, 1), got {probability}")
    for name, value in (("mask_fraction", mask_fraction), ("random_fraction", random_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: expected [0, 1], got {value}")
    if mask_fraction + random_fraction > 1.0:
        raise ValueError(
            f"mask_fraction + random_fraction: expected at most 1, got "
            f"{mask_fraction} + {random_fraction}"
        )
