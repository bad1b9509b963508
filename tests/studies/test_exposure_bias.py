"""The exposure-bias study: its scheduled-sampling loop against the model's own teacher-forced
pass and greedy decoding, the decay and the position counts against hand values, the paired
t-test against SciPy, the seed-by-seed comparison and its wording, and the tiny run end to end
(its summary rows against NumPy)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from qkv.models.rnn_seq2seq import RNNSeq2Seq, RNNSeq2SeqConfig
from qkv.studies import exposure_bias, run_study
from qkv.studies.statistics import paired_t_p_value


def _model(attention: str) -> RNNSeq2Seq:
    torch.manual_seed(0)
    config = RNNSeq2SeqConfig(
        src_vocab_size=13, tgt_vocab_size=13, attention=attention, embed_dim=8, hidden_size=8,
        attention_dim=8, label_smoothing=0.1,
    )  # fmt: skip
    return RNNSeq2Seq(config).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 13, (4, 7), generator=generator)  # (B, S)
    input_ids[1, 5:] = 0
    labels = torch.randint(3, 13, (4, 6), generator=generator)  # (B, L)
    labels[0, 3], labels[0, 4:] = 2, -100
    labels[2, 5] = 2
    return input_ids, input_ids != 0, labels


@pytest.mark.parametrize("attention", ["general", "additive"])
def test_epsilon_one_is_the_models_teacher_forced_pass(attention):
    model = _model(attention)
    input_ids, mask, labels = _batch()
    loss, logits, read = exposure_bias.scheduled_sampling_loss(
        model, input_ids, mask, labels, epsilon=1.0
    )
    reference = model(input_ids, mask, labels=labels)
    torch.testing.assert_close(loss, reference.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, reference.logits, rtol=1e-5, atol=1e-6)
    assert read[:, 0].eq(1).all()
    assert torch.equal(read[:, 1:], labels[:, :-1].clamp(min=0))


def test_epsilon_zero_reads_the_models_greedy_tokens():
    model = _model("general")
    input_ids, mask, labels = _batch()
    L = labels.shape[1]
    with torch.no_grad():
        _, logits, read = exposure_bias.scheduled_sampling_loss(
            model, input_ids, mask, labels, epsilon=0.0
        )
        sequences, _ = model.greedy_decode(input_ids, mask, max_new_tokens=L)  # (B, 1 + T)
        # the logits are those of a teacher-forced pass over the tokens the loop read
        torch.testing.assert_close(logits, model(input_ids, mask, decoder_input_ids=read).logits)
    for row, expected in zip(read.tolist(), sequences.tolist(), strict=True):
        # up to its first [EOS] (inclusive): greedy decoding pads after it, the loop reads on
        end = expected.index(2) + 1 if 2 in expected else len(expected)
        assert row[: min(end, L)] == expected[: min(end, L)]


def test_intermediate_epsilon_reads_either_the_reference_or_the_prediction():
    model = _model("general")
    input_ids, mask, labels = _batch()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        _, logits, read = exposure_bias.scheduled_sampling_loss(
            model, input_ids, mask, labels, epsilon=0.5, generator=generator
        )
    gold, predicted = labels[:, :-1].clamp(min=0), logits[:, :-1].argmax(dim=-1)
    assert ((read[:, 1:] == gold) | (read[:, 1:] == predicted)).all()
    assert (read[:, 1:] != gold).any() and (read[:, 1:] != predicted).any()
    with pytest.raises(ValueError, match="epsilon: expected"):
        exposure_bias.scheduled_sampling_loss(model, input_ids, mask, labels, epsilon=1.5)


def test_inverse_sigmoid_decay_follows_the_formula():
    for k, step in [(1.0, 0), (10.0, 5), (70.0, 300), (70.0, 599)]:
        expected = k / (k + math.exp(step / k))
        assert exposure_bias.inverse_sigmoid_decay(step, k=k) == pytest.approx(expected)
    assert exposure_bias.inverse_sigmoid_decay(10**6, k=1.0) == 0.0
    with pytest.raises(ValueError, match="k: expected"):
        exposure_bias.inverse_sigmoid_decay(0, k=0.5)


def test_position_errors_count_by_hand():
    wrong = [[False, False, False], [False, True, True, False], [True, False]]
    counts = exposure_bias._position_errors(wrong)
    assert counts["count"] == [3, 3, 2, 1] and counts["errors"] == [1, 1, 1, 0]
    assert counts["prefix_right"] == [3, 2, 1, 0] and counts["prefix_errors"] == [1, 1, 0, 0]
    assert counts["first_error"] == [None, 1, 0]
    assert counts["token_error"] == pytest.approx(3 / 9)
    assert counts["exact_match"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "differences",
    [[0.01, 0.02, 0.015, 0.03, 0.005], [0.01, -0.02, 0.015, -0.01, 0.005], [-3.0, -2.5],
     [0.2, 0.0, 0.1, 0.4, 0.3, 0.1, 0.25, 0.05, 0.3, 0.2]],
)  # fmt: skip
def test_paired_t_p_value_equals_scipys_paired_t_test(differences):
    expected = stats.ttest_rel(differences, [0.0] * len(differences)).pvalue
    assert paired_t_p_value(differences) == pytest.approx(expected, abs=1e-6)
    assert paired_t_p_value([0.0, 0.0, 0.0]) == 1.0


def _series(teacher: list[float], scheduled: list[float]) -> dict:
    return {name: [{"exact_match": v, "token_error": 1 - v} for v in values]
            for name, values in (("teacher", teacher), ("scheduled", scheduled))}  # fmt: skip


@pytest.mark.parametrize(
    ("teacher", "scheduled", "wins", "verdict"),
    [
        ([0.90, 0.92, 0.91, 0.93, 0.90], [0.93, 0.94, 0.95, 0.95, 0.93], 5,
         "a consistent difference, scheduled sampling ahead"),
        ([0.93, 0.94, 0.95, 0.95, 0.93], [0.90, 0.92, 0.91, 0.93, 0.90], 0,
         "a consistent difference, teacher forcing ahead"),
        ([0.90, 0.92, 0.91, 0.93, 0.90], [0.91, 0.91, 0.93, 0.92, 0.92], 3, "not consistent"),
        ([0.90] * 7 + [0.92], [0.93] * 7 + [0.91], 7, "scheduled sampling ahead on average"),
        ([0.90, 0.92], [0.99, 0.925], 2, "ahead in every seed, but not clear of the spread"),
        ([0.90, 0.92], [0.90, 0.92], 0, "no difference in any seed"),
    ],
)  # fmt: skip
def test_the_comparison_counts_the_seeds_and_words_the_verdict_from_them(
    teacher, scheduled, wins, verdict
):
    series = _series(teacher, scheduled)
    for key, sign in (("exact_match", 1), ("token_error", -1)):  # higher, lower is better
        text = exposure_bias._comparison(series, key, scale=100, unit="%")
        assert f"{wins} of {len(teacher)} seeds favour scheduled sampling" in text
        assert verdict in text
        differences = sign * 100 * (np.array(scheduled) - np.array(teacher))
        mean = differences.mean() + 0.0  # no "-0.00"
        assert f"{mean:+.2f} ± {differences.std(ddof=1):.2f} on average" in text


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    return run_study("exposure-bias", size="tiny", out=out), out


def test_tiny_run_writes_its_files_and_a_consistent_table(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"exposure-bias.{suffix}").stat().st_size > 0
    record = json.loads((out / "exposure-bias.json").read_text())
    assert record["size"] == "tiny" and record["settings"]["train_steps"] == 3
    assert record["settings"]["seeds"] == 2 and result.series["seeds"] == [0, 1]
    epsilons = result.series["epsilon"]
    assert len(epsilons) == 3 and all(a > b for a, b in zip(epsilons, epsilons[1:], strict=False))
    per_seed, summary = result.rows[:4], result.rows[4:]
    assert [(row["training"], row["seed"]) for row in per_seed] == [
        ("teacher forcing", 0), ("scheduled sampling", 0),
        ("teacher forcing", 1), ("scheduled sampling", 1),
    ]  # fmt: skip
    for row in per_seed:
        part = result.series["teacher" if row["training"] == "teacher forcing" else "scheduled"]
        part = part[row["seed"]]
        assert part["count"][0] == part["prefix_right"][0] == result.settings["num_test"]
        assert row["exact match"] == part["exact_match"] and 16 * part["exact_match"] % 1 == 0
        assert row["token err (free)"] == pytest.approx(sum(part["errors"]) / sum(part["count"]))
        assert all(0.0 <= row[c] <= 1.0 for c in result.columns if c.startswith("err pos"))
        assert row["valid loss (TF)"] > 0 and row["train s"] > 0
    assert [row["training"] for row in summary] == [
        "teacher forcing", "scheduled sampling", "scheduled - teacher"
    ]  # fmt: skip
    for column in ("valid loss (TF)", "token err (free)", "exact match"):
        teacher = np.array([row[column] for row in per_seed[0::2]])
        scheduled = np.array([row[column] for row in per_seed[1::2]])
        for values, row, sign in (
            (teacher, summary[0], ""),
            (scheduled - teacher, summary[2], "+"),
        ):
            expected = f"{values.mean():{sign}.3g} ± {values.std(ddof=1):.2g}"
            assert row[column] == expected
    assert (
        len([f for f in result.findings if not f.startswith("Verdict: ")]) == 5
        and "2 seeds (0 to 1)" in [f for f in result.findings if not f.startswith("Verdict: ")][0]
    )
    # the two seeds start from different weights and read different batches
    assert per_seed[0]["valid loss (TF)"] != per_seed[2]["valid loss (TF)"]


def test_the_two_runs_of_a_seed_share_weights_and_data_order():
    """With eps_i = 1 at every step (k huge) scheduled sampling reads the reference, so the two
    runs of a seed train the same model on the same batches: equal up to float rounding."""
    result = run_study("exposure-bias", size="tiny", out=None, decay_k=1e12)
    for teacher, scheduled in zip(*(result.series[name] for name in exposure_bias.RUNS),
                                  strict=True):  # fmt: skip
        assert scheduled["valid_loss"] == pytest.approx(teacher["valid_loss"], rel=1e-4)
        assert scheduled["errors"] == teacher["errors"]
