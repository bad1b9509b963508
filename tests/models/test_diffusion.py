"""The diffusion model against the papers' equations and PyTorch: the linear schedule of Ho et
al. 2020 written out, the posterior (eq. 6-7) in float64 and from Bayes' rule, the closed form
q(x_t | x_0) against the iterated chain (statistically), the samplers against Algorithm 2 and
against the data they should reproduce, classifier-free guidance at s = 0 and 1, the prompt's
cross-attention against torch.nn.MultiheadAttention with its padding masked, and in-context
conditioning against torch.nn.TransformerEncoderLayer over the concatenated tokens."""

import math

import pytest
import torch
from torch import nn

from qkv.models import DiffusionConfig, DiffusionTransformer, load, save
from qkv.models.ddpm import (
    NoiseSchedule,
    ddim_sample,
    ddim_timesteps,
    ddpm_sample,
    ddpm_step,
    linear_betas,
    q_posterior,
    q_sample,
    q_step,
)
from qkv.models.diffusion import (
    classifier_free_guidance,
    guided_noise,
    recording_cross_attention,
)

T = 1000


@pytest.fixture(scope="module")
def schedule():
    return NoiseSchedule.linear()


def _tiny_model(conditioning: str = "adaln_zero", *, seed: int = 0) -> DiffusionTransformer:
    torch.manual_seed(seed)
    config = DiffusionConfig.from_name("diffusion-tiny", vocab_size=40, conditioning=conditioning)
    model = DiffusionTransformer(config).eval()
    with torch.no_grad():  # leave the zero initialisation: a model that predicts something
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return model


def test_schedule_is_the_papers_linear_betas(schedule):
    # Ho et al. 2020, s4: "beta_1 = 1e-4 to beta_T = 0.02", linear, T = 1000
    expected = torch.tensor([1e-4 + (0.02 - 1e-4) * i / (T - 1) for i in range(T)],
                            dtype=torch.float64)  # fmt: skip
    assert schedule.betas.dtype == torch.float64 and schedule.num_timesteps == T
    torch.testing.assert_close(schedule.betas, expected, rtol=0, atol=1e-15)
    assert schedule.betas[0].item() == 1e-4 and schedule.betas[-1].item() == pytest.approx(0.02)
    with pytest.raises(ValueError, match="beta_end"):
        linear_betas(10, beta_start=0.1, beta_end=0.05)


def test_posterior_coefficients_are_eq_7_in_float64(schedule):
    alpha_bar, previous = 1.0, 1.0
    for t in range(T):
        beta = 1e-4 + (0.02 - 1e-4) * t / (T - 1)
        previous, alpha_bar = alpha_bar, alpha_bar * (1 - beta)
        assert schedule.alphas_cumprod[t].item() == pytest.approx(alpha_bar, rel=1e-12)
        coef_x0 = math.sqrt(previous) * beta / (1 - alpha_bar)
        coef_xt = math.sqrt(1 - beta) * (1 - previous) / (1 - alpha_bar)
        variance = (1 - previous) / (1 - alpha_bar) * beta
        assert schedule.posterior_coef_x0[t].item() == pytest.approx(coef_x0, rel=1e-10)
        assert schedule.posterior_coef_xt[t].item() == pytest.approx(coef_xt, rel=1e-10, abs=1e-300)
        assert schedule.posterior_variance[t].item() == pytest.approx(
            variance, rel=1e-10, abs=1e-300
        )


def test_posterior_is_bayes_rule(schedule):
    # q(x_{t-1} | x_t, x_0) ∝ q(x_t | x_{t-1}) q(x_{t-1} | x_0): a product of two Gaussians in
    # x_{t-1}, whose precisions add and whose precision-weighted means add
    generator = torch.Generator().manual_seed(0)
    t = torch.tensor([1, 10, 250, 999])
    x0 = torch.rand((4, 3), generator=generator, dtype=torch.float64) * 2 - 1
    x_t = torch.randn((4, 3), generator=generator, dtype=torch.float64)
    beta = schedule.betas[t, None]
    alpha_bar_prev = schedule.alphas_cumprod_prev[t, None]
    precision = (1 - beta) / beta + 1 / (1 - alpha_bar_prev)
    mean = (
        (1 - beta).sqrt() * x_t / beta + alpha_bar_prev.sqrt() * x0 / (1 - alpha_bar_prev)
    ) / precision
    got_mean, got_variance = q_posterior(schedule, x0, x_t, t)
    torch.testing.assert_close(got_mean, mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_variance, 1 / precision, rtol=1e-10, atol=0)


def test_closed_form_is_the_iterated_chain(schedule):
    """x_t drawn by t + 1 steps of q(x_s | x_{s-1}) has the mean and variance of eq. 4."""
    n = 8000
    generator = torch.Generator().manual_seed(1)
    x0 = torch.tensor([-1.0, 0.3, 0.9], dtype=torch.float64).expand(n, 3)
    x = x0.clone()
    for t in range(300):
        x = q_step(schedule, x, torch.full((n,), t), torch.randn(x.shape, generator=generator,
                                                                  dtype=torch.float64))  # fmt: skip
        if t in (0, 9, 99, 299):
            steps = torch.full((n,), t)
            mean = q_sample(schedule, x0, steps, torch.zeros_like(x0))[0]
            std = q_sample(schedule, x0, steps, torch.ones_like(x0))[0] - mean
            variance = std**2
            # five standard errors of the sample mean and of the sample variance
            assert torch.all((x.mean(0) - mean).abs() < 5 * (variance / n).sqrt()), t
            assert torch.all((x.var(0) - variance).abs() < 5 * variance * math.sqrt(2 / (n - 1))), t
            if t == 299:  # and a draw of eq. 4 itself has those moments
                noise = torch.randn(x.shape, generator=generator, dtype=torch.float64)
                direct = q_sample(schedule, x0, steps, noise)
                assert torch.all((direct.mean(0) - mean).abs() < 5 * (variance / n).sqrt())


def test_ddpm_step_without_clipping_is_algorithm_2(schedule):
    generator = torch.Generator().manual_seed(2)
    t = torch.tensor([0, 5, 500, 999])
    x_t, eps, z = (torch.randn((4, 1, 2, 2), generator=generator, dtype=torch.float64)
                   for _ in range(3))  # fmt: skip
    got = ddpm_step(schedule, x_t, t, eps, z, clip_denoised=False)
    for row, step in enumerate(t.tolist()):
        beta = 1e-4 + (0.02 - 1e-4) * step / (T - 1)
        alpha_bar = math.prod(1 - (1e-4 + (0.02 - 1e-4) * s / (T - 1)) for s in range(step + 1))
        previous = alpha_bar / (1 - beta)
        sigma = math.sqrt((1 - previous) / (1 - alpha_bar) * beta)
        expected = (x_t[row] - beta / math.sqrt(1 - alpha_bar) * eps[row]) / math.sqrt(1 - beta)
        torch.testing.assert_close(got[row], expected + sigma * z[row], rtol=1e-9, atol=1e-9)


def _gaussian_data_noise(schedule, mean: float, std: float):
    """The exact E[eps | x_t] for data x_0 ~ N(mean, std^2): the best noise predictor."""

    def predict(x_t, t):
        alpha_bar = schedule.at(schedule.alphas_cumprod, t, x_t)
        variance = alpha_bar * std**2 + 1 - alpha_bar
        return (1 - alpha_bar).sqrt() * (x_t - alpha_bar.sqrt() * mean) / variance

    return predict


def test_ddpm_sampling_with_the_exact_noise_draws_the_data_distribution(schedule):
    n, mean, std = 4000, 0.3, 0.5
    generator = torch.Generator().manual_seed(3)
    predict = _gaussian_data_noise(schedule, mean, std)
    samples = ddpm_sample(predict, schedule, (n, 1), generator=generator, clip_denoised=False,
                          dtype=torch.float64)  # fmt: skip
    assert abs(samples.mean().item() - mean) < 5 * std / math.sqrt(n)
    assert abs(samples.var().item() - std**2) < 5 * std**2 * math.sqrt(2 / (n - 1))


def test_samplers_with_a_perfect_denoiser_of_one_point_return_it(schedule):
    point = torch.tensor([[-0.5, 0.25, 0.75]], dtype=torch.float64)

    def predict(x_t, t):  # the data is one point: eq. 4 solved for the noise
        alpha_bar = schedule.at(schedule.alphas_cumprod, t, x_t)
        return (x_t - alpha_bar.sqrt() * point) / (1 - alpha_bar).sqrt()

    generator = torch.Generator().manual_seed(4)
    shape = (5, 3)
    for eta in (0.0, 1.0):
        got = ddim_sample(predict, schedule, shape, steps=20, eta=eta, generator=generator,
                          dtype=torch.float64)  # fmt: skip
        torch.testing.assert_close(got, point.expand(shape), rtol=0, atol=1e-6)
    got = ddpm_sample(predict, schedule, shape, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(got, point.expand(shape), rtol=0, atol=1e-6)


def test_ddim_timesteps():
    assert ddim_timesteps(1000, 50)[:3] == [999, 979, 958] and ddim_timesteps(1000, 50)[-1] == 0
    assert len(set(ddim_timesteps(1000, 50))) == 50
    assert ddim_timesteps(10, 10) == list(range(9, -1, -1))
    with pytest.raises(ValueError, match="steps"):
        ddim_timesteps(10, 11)


def test_guidance_at_0_and_1_is_exactly_one_prediction_and_linear_beyond():
    generator = torch.Generator().manual_seed(5)
    eps_c, eps_u = (torch.randn((3, 1, 8, 8), generator=generator) * 1e3 for _ in range(2))
    assert torch.equal(classifier_free_guidance(eps_c, eps_u, 0.0), eps_u)
    assert torch.equal(classifier_free_guidance(eps_c, eps_u, 1.0), eps_c)
    expected = eps_u.double() + 7 * (eps_c.double() - eps_u.double())
    torch.testing.assert_close(classifier_free_guidance(eps_c, eps_u, 7.0).double(), expected,
                               rtol=1e-6, atol=1e-2)  # fmt: skip
    with pytest.raises(ValueError, match="scale"):
        classifier_free_guidance(eps_c, eps_u, -1.0)


def test_guided_sampling_equals_sampling_each_model_with_the_same_noise():
    model = _tiny_model()
    ids = torch.tensor([[2, 7, 9, 3], [2, 11, 3, 0]])
    mask = ids != 0
    mask[0, 3] = True
    null = torch.tensor([[2, 3, 0, 0]] * 2)
    null_mask = null != 0
    null_mask[:, :2] = True
    shape = (2, 1, 8, 8)

    def draw(predict):
        generator = torch.Generator().manual_seed(6)
        return ddim_sample(predict, model.schedule, shape, steps=5, generator=generator)

    with torch.no_grad():
        unconditional = draw(lambda x, t: model(x, t, null, null_mask))
        conditional = draw(lambda x, t: model(x, t, ids, mask))
        assert torch.equal(draw(guided_noise(model, ids, mask, null, null_mask, guidance=0)),
                           unconditional)  # fmt: skip
        assert torch.equal(draw(guided_noise(model, ids, mask, null, null_mask, guidance=1)),
                           conditional)  # fmt: skip
        assert not torch.allclose(unconditional, conditional)
        # at s = 3 the one doubled batch equals two separate passes combined by hand
        x, t = torch.randn(shape), torch.tensor([3, 40])
        eps_c, eps_u = model(x, t, ids, mask).double(), model(x, t, null, null_mask).double()
        guided = guided_noise(model, ids, mask, null, null_mask, guidance=3)(x, t)
        torch.testing.assert_close(guided.double(), eps_u + 3 * (eps_c - eps_u), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("conditioning", ["adaln_zero", "add"])
def test_cross_attention_is_torchs_with_the_prompt_padding_masked(conditioning):
    model = _tiny_model(conditioning)
    layer = model.blocks[0].cross_attn
    E, H = layer.embed_dim, layer.num_heads
    reference = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight,
                                                  layer.v_proj.weight]))  # fmt: skip
        reference.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias,
                                                layer.v_proj.bias]))  # fmt: skip
        reference.out_proj.weight.copy_(layer.out_proj.weight)
        reference.out_proj.bias.copy_(layer.out_proj.bias)
    generator = torch.Generator().manual_seed(7)
    queries = torch.randn((2, model.config.num_patches, E), generator=generator)
    context = torch.randn((2, 5, E), generator=generator)
    lengths = torch.tensor([5, 2])
    keep = torch.arange(5) < lengths[:, None]  # (2, 5), True on the prompt's tokens
    with torch.no_grad():
        got = layer(queries, context, mask=keep[:, None, None, :])
        expected, _ = reference(queries, context, context, key_padding_mask=~keep)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("conditioning", ["adaln_zero", "add", "in_context"])
def test_padding_of_the_prompt_changes_nothing(conditioning):
    model = _tiny_model(conditioning)
    x, t = torch.randn((2, 1, 8, 8)), torch.tensor([0, 17])
    ids = torch.tensor([[2, 7, 3], [2, 9, 3]])
    padded = torch.tensor([[2, 7, 3, 0, 0], [2, 9, 3, 31, 12]])  # any ids under the padding
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, padded, mask), model(x, t, ids), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
    if conditioning == "in_context":  # no cross-attention to record
        return
    recorded = []
    with torch.no_grad(), recording_cross_attention(model, recorded):
        model(x, t, padded, mask)
    assert len(recorded) == 1 and len(recorded[0]) == model.config.num_layers
    weights = recorded[0][0]  # (B, H, N, S)
    assert weights.shape == (2, 2, model.config.num_patches, 5)
    assert torch.all(weights[..., 3:] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


def _torch_encoder_layer(block: nn.Module) -> nn.TransformerEncoderLayer:
    """torch's pre-norm encoder layer holding an `EncoderBlock`'s weights."""
    attention, ffn = block.self_attn, block.ffn
    E = attention.embed_dim
    layer = nn.TransformerEncoderLayer(E, attention.num_heads, ffn.up_proj.out_features,
                                       dropout=0.0, activation="gelu", layer_norm_eps=1e-6,
                                       batch_first=True, norm_first=True).eval()  # fmt: skip
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(torch.cat([attention.q_proj.weight,
                                                        attention.k_proj.weight,
                                                        attention.v_proj.weight]))  # fmt: skip
        layer.self_attn.in_proj_bias.copy_(torch.cat([attention.q_proj.bias,
                                                      attention.k_proj.bias,
                                                      attention.v_proj.bias]))  # fmt: skip
        layer.self_attn.out_proj.load_state_dict(attention.out_proj.state_dict())
        layer.linear1.load_state_dict(ffn.up_proj.state_dict())
        layer.linear2.load_state_dict(ffn.down_proj.state_dict())
        layer.norm1.load_state_dict(block.norm1.state_dict())
        layer.norm2.load_state_dict(block.norm2.state_dict())
    return layer


def test_in_context_conditioning_is_torchs_encoder_over_the_concatenated_tokens():
    """DiT's in-context conditioning (Peebles & Xie 2023, s3.2): [c, prompt, image tokens]
    through torch's encoder layers (the prompt's padding as key_padding_mask), the image tokens
    kept, normalised and mapped to patches; no block has a cross-attention."""
    model = _tiny_model("in_context")
    assert not any(hasattr(block, "cross_attn") for block in model.blocks)
    x, t = torch.randn((2, 1, 8, 8)), torch.tensor([3, 41])
    ids, mask = torch.tensor([[2, 7, 3, 0], [2, 9, 31, 3]]), torch.tensor([[1, 1, 1, 0], [1] * 4])
    with torch.no_grad():
        got = model(x, t, ids, mask)
        cond = model.time_mlp(model.time_embedding(t))  # (B, E)
        context = model.encode_prompt(ids, mask.bool()[:, None, None, :])  # (B, S, E)
        image = model.patch_embedding(x)
        image = image + model.position_embedding(torch.arange(image.shape[1]))
        sequence = torch.cat((cond[:, None], context, image), dim=1)
        hidden = torch.cat((torch.zeros(2, 1), mask == 0, torch.zeros(image.shape[:2])), dim=1)
        for block in model.blocks:
            sequence = _torch_encoder_layer(block)(sequence, src_key_padding_mask=hidden.bool())
        patches = model.head(model.final_norm(sequence[:, 1 + ids.shape[1] :]))
        P = model.config.patch_size
        expected = nn.functional.fold(patches.transpose(1, 2), (8, 8), kernel_size=P, stride=P)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the noise level reaches the image tokens through attention alone
        assert not torch.allclose(model(x, t + 1, ids, mask), got)
    with (
        pytest.raises(ValueError, match="no cross-attention"),
        recording_cross_attention(model, []),
    ):
        pass


def test_untrained_model_predicts_no_noise_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = DiffusionTransformer(DiffusionConfig.from_name("diffusion-tiny", vocab_size=40))
    out = model(torch.randn((3, 1, 8, 8)), torch.tensor([0, 1, 49]), torch.tensor([[2, 5, 3]] * 3))
    assert out.shape == (3, 1, 8, 8) and torch.equal(out, torch.zeros_like(out))
    trained = _tiny_model("add")
    loaded = load(save(trained, tmp_path / "model"))
    assert isinstance(loaded, DiffusionTransformer) and loaded.config == trained.config
    x, t, ids = torch.randn((1, 1, 8, 8)), torch.tensor([7]), torch.tensor([[2, 5, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(x, t, ids), trained(x, t, ids))


def test_bad_inputs_are_clear_errors():
    model = _tiny_model()
    x, ids = torch.randn((1, 1, 8, 8)), torch.tensor([[2, 5, 3]])
    with pytest.raises(ValueError, match=r"t: expected timesteps in \[0, 50\)"):
        model(x, torch.tensor([50]), ids)
    with pytest.raises(ValueError, match="prompt_mask: a row masks every token"):
        model(x, torch.tensor([1]), ids, torch.zeros((1, 3)))
    with pytest.raises(ValueError, match="max_prompt_length"):
        model(x, torch.tensor([1]), torch.ones((1, 17), dtype=torch.long))
    with pytest.raises(ValueError, match="conditioning"):
        DiffusionConfig.from_name("diffusion-tiny", conditioning="concat")
