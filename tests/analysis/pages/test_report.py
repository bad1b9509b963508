"""`qkv report`: one page, self-contained, well formed, with one figure per plot asked for, the
cost table's parameter count equal to PyTorch's count of the model transformers builds, and the
attention data equal to transformers' eager attention weights. The model is a small random
Hugging Face BERT saved with `save_pretrained` and a word-level tokenizer.json."""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

import qkv.analysis
from qkv.analysis.pages.report import build_report
from qkv.analysis.pages.viz import load_model_and_tokenizers
from qkv.commands import report as report_command
from qkv.layers.attention import MultiHeadAttention
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig, save

pytest.importorskip("matplotlib")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "food", "was", "great", "but", "service"]
WORDS += ["terrible", "."]
TEXT = "the food was great but the service was terrible ."
CLASSIC_FIGURES = [
    "bidirectional_vs_causal",
    "mask_gallery",
    "softmax_scaling",
    "softmax_saturation",
    "scaling_comparison",
    "rope_vs_sinusoidal_decay",
    "alibi_biases",
    "permutation_equivariance",
    "gelu_vs_relu",
]  # fmt: skip  (the figures of the "figures" section, in page order)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOID_TAGS = {"meta", "link", "img", "br", "hr", "input", "col", "area", "base", "wbr", "source"}


def _word_tokenizer(*, special: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if special:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    return tokenizer


@pytest.fixture(scope="module")
def hf_bert(tmp_path_factory) -> tuple[Path, transformers.BertModel]:
    """A random 2-layer, 4-head transformers BertModel (eager attention) saved with its
    tokenizer.json; weights drawn wide (std 0.2) so the attention maps are far from flat."""
    folder = tmp_path_factory.mktemp("hf-bert")
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=24, initializer_range=0.2,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(folder)
    _word_tokenizer(special=True).save(str(folder / "tokenizer.json"))
    return folder, model


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    report_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["report", *argv])
    return args.run(args)


@pytest.fixture(scope="module")
def page(hf_bert, tmp_path_factory) -> str:
    """The page `qkv report --model FOLDER --text TEXT --out ... --no-complexity` writes (no
    study results: --studies names a folder that does not exist)."""
    out_folder = tmp_path_factory.mktemp("report")
    out = out_folder / "report.html"
    assert _run_cli("--model", str(hf_bert[0]), "--text", TEXT, "--out", str(out),
                    "--no-complexity", "--studies", str(out_folder / "none")) == 0  # fmt: skip
    assert list(out_folder.iterdir()) == [out]  # one file, nothing beside it
    return out.read_text(encoding="utf-8")


class _Structure(HTMLParser):
    """Collects start/end tag mismatches, <h2> texts, element ids and src/href values."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack, self.problems, self.headings, self.ids, self.links = [], [], [], [], []
        self._heading: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.ids += [attributes["id"]] if "id" in attributes else []
        self.links += [value for name, value in attrs if name in ("src", "href")]
        if tag not in VOID_TAGS:
            self.stack.append(tag)
        if tag == "h2":
            self._heading = []

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()
        if tag == "h2":
            self.headings.append("".join(self._heading))
            self._heading = None

    def handle_data(self, data):
        if self._heading is not None:
            self._heading.append(data)


def _parse(page: str) -> _Structure:
    parser = _Structure()
    parser.feed(page)
    parser.close()
    return parser


def _section(page: str, name: str) -> str:
    return re.search(rf'<section id="{name}">(.*?)</section>', page, re.S).group(1)


def test_the_page_is_one_self_contained_file(page):
    assert "://" not in page and not re.search("https?:", page, re.I)  # ":" is not base64
    links = _parse(page).links
    assert links and all(link.startswith(("data:", "#")) for link in links), links
    assert not re.search(r"""\b(?:src|href)\s*=\s*["'](?!data:|#)""", page)


def test_the_page_parses_balanced_with_every_section_and_its_contents_entry(page):
    parsed = _parse(page)
    assert parsed.problems == [] and parsed.stack == []
    expected = ["Model", "Attention maps", "Attention viewer", "Cost", "Classic figures"]
    assert parsed.headings == ["Contents", *expected]  # --no-complexity: no Complexity
    anchors = [link[1:] for link in parsed.links if link.startswith("#")]
    assert anchors == ["model", "attention", "viewer", "cost", "figures"]
    assert set(anchors) <= set(parsed.ids)


def test_study_results_become_the_last_section(hf_bert, tmp_path):
    """`qkv report --studies DIR` gathers the results `qkv study` wrote there."""
    from qkv.studies.record import StudyResult, write_result

    result = StudyResult(name="demo", title="A demo study", claim="Claimed (A et al. 2020).",
                         columns=["what", "value"], rows=[{"what": "x", "value": 0.5}])  # fmt: skip
    write_result(result, tmp_path / "studies")
    out = tmp_path / "report.html"
    assert _run_cli("--model", str(hf_bert[0]), "--text", TEXT, "--out", str(out),
                    "--no-complexity", "--studies", str(tmp_path / "studies")) == 0  # fmt: skip
    parsed = _parse(out.read_text(encoding="utf-8"))
    assert parsed.problems == [] and parsed.headings[-1] == "Studies"
    assert "studies" in parsed.ids and "#studies" in parsed.links


def test_one_embedded_png_per_plot_asked_for(page):
    figures = re.findall(r'<figure id="([^"]+)"><img alt="[^"]*" src="data:image/png;base64,'
                         r'([A-Za-z0-9+/=]+)"', page)  # fmt: skip
    expected = ["fig-attention-layers.0.self", "fig-attention-layers.1.self"]  # layers 0, -1
    expected += [f"fig-figures-{name}" for name in CLASSIC_FIGURES]
    assert [figure_id for figure_id, _ in figures] == expected
    assert page.count("<img") == len(expected)
    assert all(base64.b64decode(data).startswith(PNG_MAGIC) for _, data in figures)


def test_cost_table_counts_the_parameters_pytorch_counts(page, hf_bert):
    cost = _section(page, "cost")
    count = re.search(r'<th scope="row">parameters</th><td>([\d,]+) ', cost).group(1)
    theirs = sum(p.numel() for p in hf_bert[1].parameters())
    ours, _, _ = load_model_and_tokenizers(hf_bert[0])
    assert int(count.replace(",", "")) == theirs == sum(p.numel() for p in ours.parameters())


def test_attention_data_equals_transformers_eager_attention(page, hf_bert):
    payload = re.search(
        r'<script type="application/json" id="qkv-attention-data">(.*?)</script>', page, re.S
    )
    data = json.loads(payload.group(1))
    encoding = _word_tokenizer(special=True).encode(TEXT)
    assert data["tokens"] == ["[CLS]", *TEXT.split(), "[SEP]"] == encoding.tokens
    with torch.no_grad():
        expected = hf_bert[1](torch.tensor([encoding.ids]), output_attentions=True).attentions
    assert [m["name"] for m in data["maps"]] == ["layers.0.self", "layers.1.self"]
    for layer, recorded in enumerate(data["maps"]):
        assert recorded["heads"] == [0, 1, 2, 3]
        got = torch.tensor(recorded["weights"], dtype=torch.float32)  # (H, L, L)
        torch.testing.assert_close(got, expected[layer][0], rtol=0, atol=2e-6)
    assert float(expected[0][0].max()) > 0.5  # not flat: a wrong row or head would show


def test_complexity_section_at_the_models_shape(hf_bert):
    model, tokenizer, _ = load_model_and_tokenizers(hf_bert[0])
    lengths = (16, 32)
    page = build_report(model, tokenizer, TEXT, model_name="tiny", sections=("complexity",),
                        complexity_lengths=lengths)  # fmt: skip
    parsed = _parse(page)
    assert parsed.problems == [] and parsed.headings == ["Contents", "Complexity"]
    rows = re.findall(r"<tr><td>(\w+)</td><td>(\d+)</td>.*<td>([\d.]+)</td></tr>", page)
    # the score formula, computed here: B * H * L * L * 4 bytes for 4 heads, fp32, in MB
    assert rows == [
        (backend, str(length), f"{4 * length * length * 4 / 1e6:.2f}")
        for backend in ("naive", "sdpa", "tiled")
        for length in lengths
    ]
    assert page.count('src="data:image/png;base64,') == 1
    skipped = build_report(model, tokenizer, TEXT, model_name="tiny",
                           sections=("complexity", "model"), complexity=False)  # fmt: skip
    assert _parse(skipped).headings == ["Contents", "Model"]


def test_encoder_decoder_checkpoint_maps_equal_the_reference_backend(tmp_path):
    """A qkv checkpoint (`qkv.models.save`): the text is the encoder's source; its maps must
    be the weights qkv's eager reference backend returns (itself tested against PyTorch)."""
    torch.manual_seed(0)
    save(Transformer(TransformerConfig.from_name("transformer-tiny", dropout=0.0)), tmp_path)
    _word_tokenizer(special=False).save(str(tmp_path / "tokenizer.json"))
    model, tokenizer, _ = load_model_and_tokenizers(tmp_path)
    page = build_report(model, tokenizer, TEXT, model_name="pair", sections=("attention",),
                        layers=(-1,), heads=(2,))  # fmt: skip
    data = json.loads(re.search(r'id="qkv-attention-data">(.*?)</script>', page).group(1))
    assert [(m["name"], m["heads"]) for m in data["maps"]] == [("encoder.1.self", [2])]
    attention = model.encoder.blocks[1].self_attn
    assert isinstance(attention, MultiHeadAttention)
    captured = []

    def forward(*args, **kwargs):
        output, weights = MultiHeadAttention.forward(
            attention, *args, return_weights=True, **kwargs
        )
        captured.append(weights)
        return output

    attention.backend, attention.forward = "reference", forward
    ids = torch.tensor([tokenizer.encode(TEXT).ids])
    with torch.no_grad():
        model(ids, decoder_input_ids=torch.tensor([[model.config.bos_token_id]]))
    got = torch.tensor(data["maps"][0]["weights"], dtype=torch.float32)  # (1, L, L)
    torch.testing.assert_close(got, captured[0][0, 2:3], rtol=0, atol=2e-6)


def test_heads_section_importance_is_the_gradient_of_each_heads_share(tmp_path):
    """For a GPT: the embedded importance equals |dL/d xi_h| computed here from plain autograd,
    sum over the head's D inputs of out_proj of (input * its gradient), which is what scaling
    head h by xi_h differentiates to at xi_h = 1 (Michel et al. 2019, eq. 2), normalised by
    layer; the cosine table equals F.cosine_similarity of each attention's input and output."""
    torch.manual_seed(0)
    save(GPT(GPTConfig.from_name("tiny-gpt2")), tmp_path)
    _word_tokenizer(special=False).save(str(tmp_path / "tokenizer.json"))
    model, tokenizer, _ = load_model_and_tokenizers(tmp_path)
    page = build_report(model, tokenizer, TEXT, model_name="gpt", sections=("heads",))
    data = json.loads(re.search(r'id="qkv-head-importance">(.*?)</script>', page).group(1))
    assert data["names"] == ["blocks.0.self", "blocks.1.self"]
    assert page.count('src="data:image/png;base64,') == 1
    shares, similarities = [], []

    def keep_share(module, args, output):  # out_proj's input: the concatenated heads
        args[0].retain_grad()
        shares.append(args[0])  # (1, L, H * D)

    for block in model.blocks:
        block.self_attn.out_proj.register_forward_hook(keep_share)
        block.self_attn.register_forward_hook(
            lambda module, args, output: similarities.append(
                F.cosine_similarity(args[0], output, dim=-1).mean().item()
            )
        )
    ids = torch.tensor([tokenizer.encode(TEXT).ids])  # (1, L)
    loss = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:])
    loss.backward()
    for layer, share in enumerate(shares):
        per_head = (share * share.grad).unflatten(-1, (4, -1))  # (1, L, H, D)
        gradient = per_head.sum(dim=(0, 1, 3)).abs()  # (H,)
        expected = gradient / gradient.norm()
        got = torch.tensor(data["importance"][layer])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    rows = re.findall(r"<tr><td>(blocks\.\d\.self)</td><td>([-\d.]+)</td>", page)
    assert rows == [(f"blocks.{i}.self", f"{value:.3f}") for i, value in enumerate(similarities)]


def test_heads_section_of_an_encoder_says_importance_needs_a_loss(hf_bert):
    model, tokenizer, _ = load_model_and_tokenizers(hf_bert[0])
    page = build_report(model, tokenizer, TEXT, model_name="bert", sections=("heads",))
    assert _parse(page).headings == ["Contents", "Heads"]
    assert "needs a loss" in page and "<img" not in page
    assert len(re.findall(r"<tr><td>layers\.\d\.self</td>", page)) == 2


def test_bad_arguments_fail_with_the_argument_named(hf_bert):
    model, tokenizer, _ = load_model_and_tokenizers(hf_bert[0])
    with pytest.raises(ValueError, match="sections"):
        build_report(model, tokenizer, TEXT, model_name="x", sections=("cost", "nope"))
    with pytest.raises(ValueError, match="text"):
        build_report(model, tokenizer, "  ", model_name="x", sections=("attention",))
    with pytest.raises(ValueError, match="layers"):
        build_report(model, tokenizer, TEXT, model_name="x", sections=("attention",), layers=(2,))
    with pytest.raises(ValueError, match="heads"):
        build_report(model, tokenizer, TEXT, model_name="x", sections=("attention",), heads=(4,))


def test_without_matplotlib_the_error_says_how_to_get_it(hf_bert, monkeypatch, capsys, tmp_path):
    monkeypatch.delattr(qkv.analysis, "plots", raising=False)
    monkeypatch.setitem(sys.modules, "qkv.analysis.plots", None)
    model, tokenizer, _ = load_model_and_tokenizers(hf_bert[0])
    with pytest.raises(ImportError, match="pip install matplotlib"):
        build_report(model, tokenizer, TEXT, model_name="x", sections=("cost",))
    assert _run_cli("--model", str(hf_bert[0]), "--out", str(tmp_path / "r.html")) == 1
    assert not (tmp_path / "r.html").exists()
    assert "pip install matplotlib" in capsys.readouterr().err
