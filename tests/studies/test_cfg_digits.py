"""The cfg-digits study end to end at its tiny size: files, record, table, the figure's series
and determinism; its default settings are `qkv train diffusion`'s and `qkv train vit`'s."""

import dataclasses
import itertools
import json

import pytest
import torch

from qkv.studies import cfg_digits, run_study
from qkv.training.tasks import DiffusionOptions, DiffusionTask, VitOptions, VitTask


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("studies")
    return run_study("cfg-digits", size="tiny", out=out), out


def test_writes_json_markdown_figure_and_index(written):
    result, out = written
    for suffix in ("json", "md", "png"):
        assert (out / f"cfg-digits.{suffix}").stat().st_size > 0
    assert "cfg-digits.md" in (out / "README.md").read_text()
    record = json.loads((out / "cfg-digits.json").read_text())
    assert record["seed"] == 0 and record["size"] == "tiny" and record["machine"]["torch"]


def test_one_row_per_guidance_then_the_real_digits(written):
    result, _ = written
    settings = result.settings
    assert [row["guidance"] for row in result.rows] == [*settings["guidances"], "real test digits"]
    for row in result.rows[:-1]:
        assert row["samples"] == 10 * settings["samples_per_prompt"]
        assert 0 <= row["ViT accuracy"] <= 1 and 0 < row["ViT probability"] < 1
        assert row["pairwise distance"] > 0
    assert len([f for f in result.findings if not f.startswith("Verdict: ")]) == 5


def test_series_hold_the_grids_and_the_word_attention_through_the_steps(written):
    result, _ = written
    settings, series = result.settings, result.series
    for images in series["grids"].values():
        assert torch.tensor(images).shape == (10 * settings["grid_columns"], 8, 8)
    attention = series["attention"]
    assert attention["token"] == "seven" and attention["tokens"][3] == "seven"
    shown = settings["steps_shown"]
    steps = attention["steps"]
    assert len(steps) == shown and steps[0] == settings["diffusion"]["num_timesteps"] - 1
    assert steps[-1] == 0 and steps == sorted(steps, reverse=True)
    maps = torch.tensor(attention["maps"])
    assert maps.shape == (shown, 2, 2) and torch.all((maps >= 0) & (maps <= 1))
    assert len(attention["word_share"]) == settings["sampling_steps"]
    assert torch.tensor(attention["x0"]).shape == (shown, 8, 8)


def test_the_digit_word_share_per_block_and_head_and_the_head_drawn(written):
    result, _ = written
    settings, attention = result.settings, result.series["attention"]
    blocks, heads = settings["diffusion"]["num_layers"], settings["diffusion"]["num_heads"]
    per_head = torch.tensor(attention["head_shares"])
    assert per_head.shape == (blocks, heads) and torch.all((per_head > 0) & (per_head < 1))
    # the mean over blocks and heads is the mean of the per-step shares of the mean map
    mean_share = torch.tensor(attention["word_share"]).mean()
    torch.testing.assert_close(per_head.mean(), mean_share, rtol=1e-5, atol=1e-6)
    block, head = attention["head"]
    digit = settings["attention_digit"]
    assert len(attention["digit_shares"]) == len(attention["digit_head_shares"]) == 10
    assert attention["digit_head_shares"][digit] == pytest.approx(per_head[block, head].item())
    assert attention["digit_shares"][digit] == pytest.approx(mean_share.item(), rel=1e-5)
    assert torch.tensor(attention["head_maps"]).shape == torch.tensor(attention["maps"]).shape
    findings = [finding for finding in result.findings if not finding.startswith("Verdict: ")]
    assert f"block {block + 1} of {blocks}, head {head + 1} of {heads}" in findings[3]


def test_word_weights_pick_each_prompts_digit_word_from_the_conditional_rows():
    steps, B, blocks, H, N, S = 3, 2, 2, 2, 4, 5
    recorded = [[torch.rand(2 * B, H, N, S) for _ in range(blocks)] for _ in range(steps)]
    positions = [3, 1]
    picked = cfg_digits._word_weights(recorded, positions)
    assert picked.shape == (steps, B, blocks, H, N)
    for step, block, prompt in itertools.product(range(steps), range(blocks), range(B)):
        expected = recorded[step][block][prompt, :, :, positions[prompt]]  # (H, N)
        assert torch.equal(picked[step, prompt, block], expected)


def test_the_measures_are_accuracy_and_mean_pairwise_distance():
    images = torch.zeros((4, 1, 8, 8))
    images[1] += 1  # prompt 0: an all-black and an all-white image, 8 apart
    labels = torch.tensor([0, 0, 1, 1])

    class Reader(torch.nn.Module):
        def forward(self, x):
            logits = torch.zeros((len(x), 10))
            logits[:, 0] = 10.0  # reads every image as a 0
            return type("Output", (), {"logits": logits})()

    measured = cfg_digits.measure_samples(Reader(), images, labels, 2)
    assert measured["ViT accuracy"] == 0.5 and measured["samples"] == 4
    assert measured["pairwise distance"] == pytest.approx((8.0 + 0.0) / 2)


def test_default_settings_are_the_train_commands_defaults():
    default = cfg_digits.SIZES["default"]
    assert default["diffusion"] == dataclasses.asdict(DiffusionOptions())
    assert default["diffusion"]["text_layers"] == 0  # the digit word's key is its own
    assert default["diffusion_training"] == DiffusionTask.training_defaults
    assert default["vit"] == dataclasses.asdict(VitOptions())
    assert default["vit_training"] == VitTask.training_defaults
    assert default["guidances"] == [0, 1, 3, 7] and default["sampler"] == "ddim"


def test_same_seed_same_numbers(written):
    result, _ = written
    again = run_study("cfg-digits", size="tiny", out=None)
    assert again.rows == result.rows
    assert again.series["attention"]["maps"] == result.series["attention"]["maps"]
