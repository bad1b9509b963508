"""The circuits study on the real SmolLM2-135M-Instruct: head-role scores on hand-made maps and
against transformers' own eager attention weights on the same file, and the tiny size end to
end (Olsson et al. 2022's in-context drop of loss on a repeat included)."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.analysis.inspection.head_roles import (
    ROLES,
    repeated_random_tokens,
    role_heads,
    role_scores,
    role_scores_of_weights,
)
from qkv.data import tokenizer_from_metadata
from qkv.studies import circuits, run_study, sinks_real


def test_each_role_reads_its_own_key_on_hand_made_maps():
    """Head 0 attends to the first token, 1 to the previous one, 2 to the earlier copy of its
    token, 3 to the token after that copy: each role's score is 1 on its head, 0 elsewhere."""
    n = 5
    weights = torch.zeros(2, 4, n, 2 * n)  # (B, H, rows t = n..2n-1, keys)
    for row, t in enumerate(range(n, 2 * n)):
        for head, key in enumerate((0, t - 1, t - n, t - n + 1)):
            weights[:, head, row, key] = 1.0
    scores = role_scores_of_weights(weights, n)
    for head, role in enumerate(ROLES):
        expected = torch.zeros(4)
        expected[head] = 1.0
        if role == "duplicate":  # the copy of token n (row 0) is token 0: the sink's key too
            expected[0] = 1 / n
        if role == "sink":
            expected[2] = 1 / n
        torch.testing.assert_close(scores[role], expected, msg=role)


def test_role_heads_apply_the_stated_thresholds():
    table = torch.tensor([[0.2, 0.35], [0.5, 0.1]])  # (layers, H)
    found = role_heads({"sink": table, "induction": table})
    assert found["sink"] == [(1, 0, 0.5), (0, 1, pytest.approx(0.35))]  # > 0.3
    assert found["induction"] == [(1, 0, 0.5)]  # > 0.4


@pytest.mark.parametrize(
    ("options", "message"),
    [({"n": 1, "batch": 1, "vocab": (0, 9)}, "n: expected at least 2"),
     ({"n": 3, "batch": 0, "vocab": (0, 9)}, "batch: expected at least 1"),
     ({"n": 3, "batch": 1, "vocab": (9, 9)}, "vocab: expected 0 <= low < high")],
)  # fmt: skip
def test_bad_probes_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        repeated_random_tokens(**options)


def test_a_sequence_that_does_not_repeat_is_refused(smollm2):
    with pytest.raises(ValueError, match="input_ids: expected n tokens then the same n"):
        role_scores(smollm2, torch.arange(100, 108).view(1, 8))


def test_smollm2_role_scores_equal_those_of_transformers_eager_attention(
    smollm2, smollm2_hf, monkeypatch
):
    ids = repeated_random_tokens(6, batch=2, vocab=(100, 49152),
                                 generator=torch.Generator().manual_seed(3))  # fmt: skip
    ours = role_scores(smollm2, ids)
    monkeypatch.setattr(smollm2_hf.config, "_attn_implementation", "eager")
    with torch.no_grad():
        attentions = smollm2_hf(ids, output_attentions=True).attentions  # 30 x (B, H, 12, 12)
    theirs = [role_scores_of_weights(layer[:, :, 6:], 6) for layer in attentions]
    for role in ROLES:
        expected = torch.stack([scores[role] for scores in theirs])  # (30, 9)
        torch.testing.assert_close(ours[role], expected, rtol=0, atol=1e-5, msg=role)


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory, smollm2, smollm2_file):
    """The tiny size; the test run's loaded SmolLM2 stands in for a second load."""
    out = tmp_path_factory.mktemp("studies")
    loaded = (smollm2, tokenizer_from_metadata(smollm2_file.metadata))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sinks_real, "load_smollm2", lambda: loaded)
        return run_study("circuits", size="tiny", seed=0, out=out), out


def test_tiny_study_writes_its_record(tiny_result):
    result, out = tiny_result
    for suffix in ("json", "md", "png"):
        assert (out / f"circuits.{suffix}").stat().st_size > 0
    record = json.loads((out / "circuits.json").read_text())
    assert record["size"] == "tiny" and len(record["rows"]) == 9
    assert list(record["rows"][0]) == record["columns"] and len(record["verdicts"]) == 3


def test_tiny_study_finds_induction_heads_that_the_repeat_needs(tiny_result):
    """Even at 8 tokens repeated twice, SmolLM2 has induction heads; the repeat's loss is far
    below the random first pass, and ablating those heads raises it more than random heads."""
    result, _ = tiny_result
    series = result.series
    assert series["heads"]["induction"] and series["heads"]["previous"]
    halves = series["losses"]["halves"]
    assert halves["clean"]["repeat"] < halves["clean"]["first"] / 2
    induction, chance = halves["induction heads ablated"], halves["random heads ablated"]
    assert induction["repeat"] > chance["repeat"] > 0
    rho = torch.tensor(series["rho"])
    assert rho.shape == (30,) and ((rho >= -1) & (rho <= 1)).all()


def _rows(ablated: float, rho: float, induction: list) -> list:
    series = {
        "heads": {"sink": [], "previous": [[1, 2, 0.9]], "duplicate": [[3, 0, 0.5]],
                  "induction": induction},
        "losses": {"halves": {"clean": {"first": 10.0, "repeat": 2.0},
                              "induction heads ablated": {"first": 10.0, "repeat": ablated},
                              "random heads ablated": {"first": 10.0, "repeat": 2.5}}},
        "rho": [rho - 0.1, rho + 0.1],
    }  # fmt: skip
    return circuits._rows(series)


@pytest.mark.parametrize(
    ("ablated", "rho", "induction", "expected"),
    [(7.0, 0.3, [[17, 4, 0.8]], ["supported", "supported", "supported"]),  # 62% given back
     (4.0, 0.3, [[17, 4, 0.8]], ["supported", "mixed", "supported"]),  # 25%, random 6%
     (3.0, 0.7, [], ["mixed", "not supported", "not supported"])],  # 12%, rho 0.7
)  # fmt: skip
def test_verdicts_follow_their_stated_rules(ablated, rho, induction, expected):
    found = circuits.verdicts(_rows(ablated, rho, induction))
    assert [verdict.verdict for verdict in found] == expected


def test_the_roles_are_exactly_the_heads_of_an_induction_circuit_set_by_hand():
    """A 2-layer GPT whose weights are set by hand to hold one induction circuit (Elhage et al.
    2021; Olsson et al. 2022): the residual stream holds the token (dims 0-15), the position
    (16-47) and, written by layer 0's head 0, the previous token (48-63). Layer 0 head 0 attends
    from position i to i - 1 and copies that token; layer 1 head 0 attends to where the
    previous token equals the query's own token. The other heads and every FFN are zero. On n
    distinct tokens repeated, the probe must find exactly (0, 0) as the previous-token head and
    (1, 0) as the induction head, nothing else."""
    from qkv.models import GPT, GPTConfig

    V, P, c = 16, 32, 3.0
    config = GPTConfig(vocab_size=V, embed_dim=64, num_layers=2, num_heads=2, ffn_dim=8,
                       max_positions=P, position="learned", norm="rmsnorm",
                       ffn="gelu_tanh")  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in (model.blocks[0].attn_norm, model.blocks[1].attn_norm, model.final_norm):
            norm.weight.fill_(1.0)
        tokens, positions = torch.arange(V), torch.arange(P)
        model.token_embedding.weight[tokens, tokens] = 1.0  # token t -> e_t
        model.position_embedding.weight[positions, V + positions] = 1.0  # position p -> e_{16+p}
        first, second = model.blocks[0].self_attn, model.blocks[1].self_attn  # head 0: rows 0-31
        first.q_proj.weight[positions, V + positions] = c  # query: its own position
        first.k_proj.weight[positions[1:], V + positions[:-1]] = c  # key j: position j + 1
        first.v_proj.weight[tokens, tokens] = 1.0  # value: the key's token
        first.out_proj.weight[48 + tokens, tokens] = 1.0  # -> the previous-token dims
        second.q_proj.weight[tokens, tokens] = c  # query: its own token
        second.k_proj.weight[tokens, 48 + tokens] = c  # key: the token before it
    n = 10
    generator = torch.Generator().manual_seed(0)
    first_half = torch.stack([torch.randperm(V, generator=generator)[:n] for _ in range(4)])
    ids = torch.cat([first_half, first_half], dim=1)  # (4, 2n): n distinct tokens, twice
    found = role_heads(role_scores(model, ids))
    assert [(layer, head) for layer, head, _ in found["previous"]] == [(0, 0)]
    assert [(layer, head) for layer, head, _ in found["induction"]] == [(1, 0)]
    assert found["duplicate"] == [] and found["sink"] == []
    assert found["previous"][0][2] > 0.95 and found["induction"][0][2] > 0.9
