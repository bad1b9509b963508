"""The diffusion task: its prompts and tokenizer, its draws (the null prompt 10% of the time,
uniform timesteps, standard noise: tested statistically, and the same whatever the batch),
its loss against Ho et al. 2020's eq. 4 and 14 written out, its evaluation, and a resumed run
that ends where an uninterrupted one does."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.data.prompts import (
    DIGIT_WORDS,
    NULL_PROMPT,
    digit_prompts,
    encode_prompts,
    prompt_corpus,
)
from qkv.training import TrainingConfig, train
from qkv.training.tasks import TASKS, DiffusionOptions, DiffusionTask

TINY = DiffusionOptions(patch_size=4, embed_dim=16, num_layers=1, num_heads=2, ffn_dim=32,
                        text_layers=1, num_timesteps=50)  # fmt: skip


@pytest.fixture(scope="module")
def task():
    return DiffusionTask(TINY)


def test_registered_as_diffusion():
    assert TASKS["diffusion"] == (DiffusionTask, DiffusionOptions)


def test_prompts_are_several_phrasings_and_each_digit_word_is_one_token(task):
    tokenizer = task.tokenizer
    assert len(prompt_corpus()) == 10 * len(digit_prompts(0)) and len(set(prompt_corpus())) == 80
    assert digit_prompts(7)[0] == "a handwritten seven" and "number 7" in digit_prompts(7)
    assert "an eight" in digit_prompts(8) and "a one" in digit_prompts(1)
    for digit, word in enumerate(DIGIT_WORDS):
        assert tokenizer.encode(f"a handwritten {word}").tokens == ["[CLS]", "a", "handwritten",
                                                                     word, "[SEP]"]  # fmt: skip
        assert tokenizer.encode(f"number {digit}").tokens == ["[CLS]", "number", str(digit),
                                                              "[SEP]"]  # fmt: skip
    assert tokenizer.encode(NULL_PROMPT).tokens == ["[CLS]", "[SEP]"]
    ids, mask = encode_prompts(tokenizer, ["a seven", NULL_PROMPT])
    assert ids.shape == (2, 4) and mask.tolist() == [[True] * 4, [True, True, False, False]]
    assert ids[1, 2:].tolist() == [0, 0]  # [PAD]
    with pytest.raises(ValueError, match="at most 3"):
        encode_prompts(tokenizer, ["a seven"], max_length=3)


def test_collate_draws_depend_on_the_example_and_step_only(task):
    batch = task.collate([5, 9, 11], step=4)
    assert batch["images"].shape == (3, 1, 8, 8) and batch["noise"].shape == (3, 1, 8, 8)
    torch.testing.assert_close(batch["images"], task.train_set.images[[5, 9, 11]] * 2 - 1)
    alone = task.collate([9], step=4)  # another micro-batch or process: the same draws
    assert torch.equal(alone["noise"][0], batch["noise"][1])
    assert alone["timesteps"].item() == batch["timesteps"][1].item()
    length = int(alone["prompt_mask"].sum())
    assert torch.equal(alone["prompt_ids"][0, :length], batch["prompt_ids"][1, :length])
    assert not torch.equal(task.collate([9], step=5)["noise"], alone["noise"])


def test_draws_null_prompts_ten_percent_uniform_timesteps_standard_noise(task):
    n, null, timesteps, noise = 0, 0, [], []
    indices = list(range(len(task)))
    for step in range(2):
        batch = task.collate(indices, step=step)
        texts = task.tokenizer.decode_batch(batch["prompt_ids"].tolist())
        for text, label in zip(texts, task.train_set.labels.tolist(), strict=True):
            n += 1
            null += text == NULL_PROMPT
            assert text == NULL_PROMPT or text in digit_prompts(label)
        timesteps.append(batch["timesteps"])
        noise.append(batch["noise"])
    p = TINY.condition_dropout
    assert abs(null / n - p) < 5 * math.sqrt(p * (1 - p) / n)
    t = torch.cat(timesteps).double()
    T = TINY.num_timesteps
    assert int(t.min()) >= 0 and int(t.max()) == T - 1
    assert abs(t.mean().item() - (T - 1) / 2) < 5 * math.sqrt((T**2 - 1) / 12 / len(t))
    values = torch.cat(noise).flatten()
    assert abs(values.mean().item()) < 5 / math.sqrt(len(values))
    assert abs(values.var().item() - 1) < 5 * math.sqrt(2 / len(values))


def test_loss_is_the_mean_squared_noise_error_of_eq_14(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    batch = task.collate([0, 3, 7, 11], step=2)
    T = TINY.num_timesteps
    betas = [1e-4 + (0.02 - 1e-4) * i / (T - 1) for i in range(T)]  # Ho et al. 2020, s4
    alpha_bar = torch.tensor([math.prod(1 - b for b in betas[: t + 1])
                              for t in batch["timesteps"].tolist()])  # fmt: skip
    alpha_bar = alpha_bar[:, None, None, None]  # (B, 1, 1, 1)
    noisy = alpha_bar.sqrt() * batch["images"] + (1 - alpha_bar).sqrt() * batch["noise"]
    with torch.no_grad():
        predicted = model(noisy, batch["timesteps"], batch["prompt_ids"], batch["prompt_mask"])
        expected = F.mse_loss(predicted, batch["noise"])
        got = task.loss_sums(model, batch)["images"] / task.counts(batch)["images"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert task.num_tokens(batch) == 4 * 4  # 2 x 2 patches of 4 x 4 pixels


def test_evaluation_of_a_model_that_predicts_no_noise_is_the_noise_power(task):
    torch.manual_seed(0)
    model = task.build_model().eval()  # the head starts at zero: eps_theta = 0
    metrics = task.evaluate(model)
    generator = torch.Generator().manual_seed(TINY.data_seed)
    torch.randint(TINY.num_timesteps, (len(task.valid_set),), generator=generator)
    noise = torch.randn(task.valid_set.images.shape, generator=generator)
    power = float((noise**2).mean())
    assert metrics["valid_loss"] == pytest.approx(power, rel=1e-5)
    assert metrics["valid_loss_null"] == pytest.approx(power, rel=1e-5)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="conditioning: expected one of"):
        DiffusionTask(DiffusionOptions(conditioning="concat"))
    with pytest.raises(ValueError, match="condition_dropout"):
        DiffusionTask(DiffusionOptions(condition_dropout=1.5))


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(task, tmp_path):
    config = TrainingConfig(steps=4, batch_size=8, checkpoint_every=2, log_every=1,
                            learning_rate=1e-3, warmup_steps=0)  # fmt: skip

    def stop_at_three(record):
        if record["kind"] == "train" and record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(task, config, out_dir=tmp_path / "resumed", on_log=stop_at_three)
    resumed = train(task, config, out_dir=tmp_path / "resumed", resume=True)
    straight = train(task, config, out_dir=tmp_path / "straight")
    assert resumed.resumed_from == 2 and straight.resumed_from is None
    expected = straight.model.state_dict()
    for name, got in resumed.model.state_dict().items():
        assert torch.equal(got, expected[name]), name
