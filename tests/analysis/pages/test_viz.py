"""`qkv viz`: the page holds the recorded weights, loads nothing from outside, and works in a
real browser. The browser is Debian's chromium (`apt-get install chromium`) driven by Playwright
(`pip install playwright`; its own browser download is not used): the page must load without a
console error, switching layer, head or stack must change what is drawn, the drawn opacities
must be the recorded weights, and a screenshot must not be blank."""

from __future__ import annotations

import argparse
import json
import re
import struct
import zlib
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

from qkv.analysis.inspection.attention_maps import AttentionMap, record_attention
from qkv.analysis.pages.viz import attention_view_html, view_data
from qkv.commands import viz as viz_command
from qkv.models import Transformer, TransformerConfig, save

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
WORDS = ["<pad>", "<s>", "</s>", "[UNK]", "drei", "und", "zwanzig", "katzen", "twenty", "three"]
WORDS += ["cats"]


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    viz_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["viz", *argv])
    return args.run(args)


def _page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def browser():
    """Headless chromium; missing pieces fail (never skip) with how to install them."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install playwright (no `playwright install`)")
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def _open(browser, path: Path):
    """(page, problems): every console error and uncaught exception is collected."""
    page = browser.new_page(viewport={"width": 900, "height": 600})
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else 0)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(path.as_uri())
    return page, problems


def _drawn(page) -> list[tuple[int, int, int, float]]:
    """(head, row, key, opacity) of every line drawn."""
    return page.evaluate(
        """() => Array.from(document.querySelectorAll('#lines line')).map(l => [
            Number(l.dataset.head), Number(l.dataset.row), Number(l.dataset.key),
            Number(l.getAttribute('stroke-opacity'))])"""
    )


@pytest.fixture(scope="module")
def pair_model(tmp_path_factory) -> Path:
    """A small random qkv Transformer saved with a word-level tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("pair-model")
    torch.manual_seed(0)
    save(Transformer(TransformerConfig.from_name("transformer-tiny", dropout=0.0)), folder)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def pair_page(pair_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pages") / "pair.html"
    assert _run_cli("--model", str(pair_model), "--pair", "drei und zwanzig katzen",
                    "twenty three cats", "--out", str(out)) == 0  # fmt: skip
    return out


def test_pair_page_holds_the_three_stacks_and_their_tokens(pair_page):
    data = _page_data(pair_page.read_text())
    source, target = ["drei", "und", "zwanzig", "katzen"], ["<s>", "twenty", "three", "cats"]
    assert [(s["name"], s["tokens_q"], s["tokens_k"]) for s in data["stacks"]] == [
        ("encoder self-attention", source, source),
        ("decoder self-attention", target, target),
        ("decoder cross-attention", target, source),
    ]
    for stack in data["stacks"]:
        assert [layer["heads"] for layer in stack["layers"]] == [[0, 1, 2, 3]] * 2
    causal = data["stacks"][1]["layers"][0]["weights"]  # [head][row][key], thousandths
    assert all(causal[h][i][j] == 0 for h in range(4) for i in range(4) for j in range(i + 1, 4))


def test_page_is_self_contained(pair_page):
    page = pair_page.read_text()
    assert "://" not in page and "http" not in page.lower()
    assert not re.search(r"""(?:src|href)\s*=\s*["'](?!data:)""", page)
    assert len(page) < 60_000


def test_page_in_headless_chromium(browser, pair_page, tmp_path):
    page, problems = _open(browser, pair_page)
    data = _page_data(pair_page.read_text())
    first = _drawn(page)
    assert first and {line[0] for line in first} == {0, 1, 2, 3}  # all heads at first
    weights = data["stacks"][0]["layers"][0]["weights"]
    assert all(abs(w - weights[h][i][j] / 1000) < 1e-9 for h, i, j, w in first)
    box = page.locator("#view").bounding_box()  # the band between the token columns: lines only
    band = {"x": box["x"] + 240, "y": box["y"], "width": 180, "height": box["height"]}
    assert _distinct_pixel_bytes(page.screenshot(clip=band)) > 32, "no line is visible"
    page.select_option("#head", "2")
    one_head = _drawn(page)
    assert one_head and {line[0] for line in one_head} == {2} and one_head != first
    page.select_option("#layer", "1")
    other_layer = _drawn(page)
    assert other_layer != one_head
    weights = data["stacks"][0]["layers"][1]["weights"]
    assert all(abs(w - weights[2][i][j] / 1000) < 1e-9 for _, i, j, w in other_layer)
    page.select_option("#stack", "2")  # decoder cross-attention: target -> source
    left = page.eval_on_selector_all("text.token", "ts => ts.map(t => t.textContent)")
    assert left == ["<s>", "twenty", "three", "cats", "drei", "und", "zwanzig", "katzen"]
    cross = _drawn(page)
    assert cross != other_layer and max(key for _, _, key, _ in cross) <= 3
    page.hover("text.token >> nth=1")  # "twenty": only its row stays
    assert {row for _, row, _, _ in _drawn(page)} == {1}
    assert problems == []


def test_the_view_is_saved_as_svg_and_png_as_drawn(browser, pair_page, tmp_path):
    """The SVG button saves the view as a standalone SVG file (the lines drawn, the tokens, its
    token styles inlined), named by stack, layer and head; the PNG button the same view at
    twice its size, lines visible on white."""
    page, problems = _open(browser, pair_page)
    page.select_option("#stack", "2")
    page.select_option("#head", "1")
    drawn = _drawn(page)
    with page.expect_download() as saving:
        page.click("#save-svg")
    download = saving.value
    name = "attention-decoder-cross-attention-decoder.0.cross-head-1.svg"  # stack, layer, head
    assert download.suggested_filename == name
    root = ElementTree.parse(download.path()).getroot()
    ns = {"svg": "http" + "://www.w3.org/2000/svg"}
    lines = root.findall("svg:g/svg:line", ns)
    assert root.tag == f"{{{ns['svg']}}}svg" and len(lines) == len(drawn) > 0
    assert [float(line.get("stroke-opacity")) for line in lines] == [w for *_, w in drawn]
    tokens = [text.text for text in root.findall("svg:text", ns)]
    assert tokens == ["<s>", "twenty", "three", "cats", "drei", "und", "zwanzig", "katzen"]
    assert "text.token" in root.find("svg:style", ns).text
    with page.expect_download() as saving:
        page.click("#save-png")
    png = Path(saving.value.path()).read_bytes()
    width, height = struct.unpack(">II", png[16:24])  # IHDR, after the signature
    box = page.locator("#view").bounding_box()
    assert (width, height) == (2 * round(box["width"]), 2 * round(box["height"]))
    assert _distinct_pixel_bytes(png) > 32, "no line is visible"
    assert problems == []


def test_a_sink_head_is_marked_in_the_legend_and_the_head_selector(browser, tmp_path):
    L = 12
    weights = torch.zeros(1, 2, L, L)  # (B, H, L, L): head 0 uniform, head 1 a sink (0.8)
    for i in range(L):
        weights[0, 0, i, : i + 1] = 1 / (i + 1)
        weights[0, 1, i, : i + 1] = 0.2 / i if i else 1.0
        weights[0, 1, i, 0] = 0.8 if i else 1.0
    recorded = AttentionMap("blocks.0.self", "blocks.0.attn", "self", 0, (0, 1),
                            tuple(range(L)), weights)  # fmt: skip
    tokens = [f"t{i}" for i in range(L)]
    layer = view_data([recorded], tokens)["stacks"][0]["layers"][0]
    assert layer["sinks"] == [False, True] and layer["first_key"][1] == 800
    path = tmp_path / "sinks.html"
    path.write_text(attention_view_html([recorded], tokens), encoding="utf-8")
    page, problems = _open(browser, path)
    options = page.eval_on_selector_all("#head option", "os => os.map(o => o.textContent)")
    assert options == ["all heads", "head 0",
                       "head 1 (sink: 0.80 of its attention on the first token)"]  # fmt: skip
    classes = page.eval_on_selector_all("#legend span", "ss => ss.map(s => s.className.trim())")
    assert classes == ["", "sink"]
    assert problems == []


def test_text_page_with_the_real_minilm(browser, tmp_path):
    out = tmp_path / "minilm.html"
    assert _run_cli("Attention is all you need.", "--out", str(out)) == 0
    data = _page_data(out.read_text())
    (stack,) = data["stacks"]
    assert stack["name"] == "self-attention" and len(stack["layers"]) == 6
    assert stack["tokens_q"][0] == "[CLS]" and stack["tokens_q"][-1] == "[SEP]"
    rows = torch.tensor(stack["layers"][5]["weights"]).sum(-1)  # (12 heads, L rows)
    assert rows.shape[0] == 12 and (rows - 1000).abs().max() <= len(stack["tokens_q"]) / 2
    page, problems = _open(browser, out)
    assert len(_drawn(page)) > 0 and problems == []


def test_a_long_text_keeps_max_tokens_with_the_tokenizers_own_truncation(tmp_path, capsys):
    """--max-tokens 12 on MiniLM: 12 tokens, [SEP] still last (the tokenizer's truncation, so
    the same ids as transformers' BertTokenizer with max_length=12), and a note saying so; the
    tokenizer's own setting (256) is left as it was."""
    from transformers import BertTokenizerFast

    from qkv.analysis.pages.viz import load_model_and_tokenizers, text_attention_html

    text = "the cat sat on the mat because it was warm and the dog was not " * 4
    out = tmp_path / "long.html"
    assert _run_cli(text, "--max-tokens", "12", "--out", str(out)) == 0
    assert "kept the first 12 of 62 tokens" in capsys.readouterr().err  # 4 x 15 words + 2
    (stack,) = _page_data(out.read_text())["stacks"]
    model, tokenizer, _ = load_model_and_tokenizers(None)
    reference = BertTokenizerFast(tokenizer_object=tokenizer)(text, max_length=12, truncation=True)
    assert stack["tokens_q"] == reference.tokens() and stack["tokens_q"][-1] == "[SEP]"
    before = tokenizer.truncation
    page = text_attention_html(model, tokenizer, text, max_tokens=5)
    assert len(_page_data(page)["stacks"][0]["tokens_q"]) == 5 and tokenizer.truncation == before
    with pytest.raises(ValueError, match="max_tokens: expected None or an int >= 1, got 0"):
        text_attention_html(model, tokenizer, text, max_tokens=0)


def test_tokens_are_shown_as_text_never_as_markup(browser, tmp_path):
    tokens = ["</script><b>x", "a & b", "<img src=x onerror=alert(1)>"]
    weights = torch.softmax(torch.randn(1, 2, 3, 3), dim=-1)
    maps = [
        AttentionMap("layers.0.self", "layers.0.self_attn", "self", 0, (0, 1), (0, 1, 2), weights)
    ]
    out = tmp_path / "tokens.html"
    out.write_text(attention_view_html(maps, tokens, title="<title>"))
    page, problems = _open(browser, out)
    shown = page.eval_on_selector_all("text.token", "ts => ts.map(t => t.textContent)")
    assert shown == tokens * 2 and page.title() == "<title>" and problems == []


def test_view_data_matches_the_recording_and_rejects_wrong_tokens():
    model = Transformer(TransformerConfig.from_name("transformer-tiny", dropout=0.0)).eval()
    source, target = torch.tensor([[4, 5, 6]]), torch.tensor([[1, 8]])
    with record_attention(model, heads=[1], rows=[-1]) as recording, torch.no_grad():
        model(source, decoder_input_ids=target)
    data = view_data(recording.maps, ["<s>", "twenty"], ["drei", "und", "zwanzig"])
    cross = data["stacks"][2]["layers"][1]
    assert cross["heads"] == [1] and cross["rows"] == [1]
    want = (recording["decoder.1.cross"].weights[0] * 1000).round().int().tolist()
    assert cross["weights"] == want
    with pytest.raises(ValueError, match="tokens_k"):
        view_data(recording.maps, ["<s>", "twenty"])
    with pytest.raises(ValueError, match="tokens"):
        view_data(recording.maps, ["<s>", "twenty"], ["drei", "und"])
    with pytest.raises(TypeError, match="tokens_q"):
        view_data(recording.maps, "<s> twenty", ["drei", "und", "zwanzig"])


def test_cli_refuses_a_text_for_a_pair_model_and_both_inputs(pair_model, tmp_path, capsys):
    out = str(tmp_path / "x.html")
    assert _run_cli("a text", "--model", str(pair_model), "--out", out) == 1
    assert "--pair" in capsys.readouterr().err
    assert _run_cli("a text", "--pair", "a", "b", "--out", out) == 2
    assert not Path(out).exists()


def _distinct_pixel_bytes(png: bytes) -> int:
    """Distinct byte values in the PNG's inflated image data: a blank area gives 4 (filter
    bytes and one colour, measured), coloured lines of many opacities over 200."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    position, idat = 8, b""
    while position < len(png):
        (length,) = struct.unpack(">I", png[position : position + 4])
        if png[position + 4 : position + 8] == b"IDAT":
            idat += png[position + 8 : position + 8 + length]
        position += 12 + length
    return len(set(zlib.decompress(idat)))


def test_smollm2_maps_are_transformers_attentions_and_the_page_has_every_head(
    smollm2, smollm2_file, smollm2_hf, monkeypatch
):
    """The real decoder: the weights recorded from qkv's fast path equal transformers' eager
    attentions on the same GGUF file (30 layers x 9 heads), and `qkv viz --model smollm2`
    writes a page with all of them."""
    from qkv.analysis.pages import viz
    from qkv.applications.chat import ChatModel
    from qkv.data import tokenizer_from_metadata

    tokenizer = tokenizer_from_metadata(smollm2_file.metadata)
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = torch.tensor([tokenizer.encode(text).ids])
    with record_attention(smollm2) as recording, torch.inference_mode():
        smollm2(ids)
    monkeypatch.setattr(smollm2_hf.config, "_attn_implementation", "eager")
    with torch.inference_mode():
        theirs = smollm2_hf(ids, output_attentions=True).attentions  # 30 x (1, 9, L, L)
    assert len(recording.maps) == len(theirs) == 30
    for ours, reference in zip(recording.maps, theirs, strict=True):
        torch.testing.assert_close(ours.weights, reference, rtol=0, atol=1e-5)
    loaded = ChatModel(smollm2, tokenizer, None)
    monkeypatch.setattr(viz, "load_chat_model", lambda path, argument, weights: loaded)
    model, got_tokenizer, target = viz.load_model_and_tokenizers("smollm2")
    assert model is smollm2 and got_tokenizer is tokenizer and target is None
    page = viz.text_attention_html(model, tokenizer, text)
    (stack,) = _page_data(page)["stacks"]
    assert len(stack["layers"]) == 30 and len(stack["layers"][0]["heads"]) == 9
    # sink heads, from transformers' weights: mean attention on token 0 over the queries after
    # it, above 0.3 and above twice the uniform causal share (Gu et al. 2024's rule)
    L = ids.shape[1]
    uniform = sum(1 / (i + 1) for i in range(1, L)) / (L - 1)
    expected = [(reference[0, :, 1:, 0].mean(dim=-1) > max(0.3, 2 * uniform)).tolist()
                for reference in theirs]  # fmt: skip
    assert [layer["sinks"] for layer in stack["layers"]] == expected
    marked = sum(map(sum, expected))
    assert 0 < marked < 30 * 9  # a real LLM has sink heads, and other heads
    for layer, reference in zip(stack["layers"], theirs, strict=True):
        masses = (reference[0, :, 1:, 0].mean(dim=-1) * 1000).tolist()
        assert layer["first_key"] == pytest.approx(masses, abs=0.51)  # thousandths, rounded


# --- Long texts: chosen rows, drawn as text ---------------------------------------------------


def _log_opacity(weight: float) -> float:
    """The template's log shade: 1e-4 -> 0.05 (its floor), 1 -> 1."""
    import math

    return min(1.0, max(0.05, 1 + math.log10(weight) / 4)) if weight > 0 else 0.0


def test_a_long_stack_is_drawn_as_text_shaded_by_the_chosen_rows_weights(browser, tmp_path):
    """Over 256 keys the page is the text layout: every key token once, each shaded by the
    chosen row's weight (a head's, or the heads' mean); the row, head and scale selectors and
    a click on a chosen row's token redraw it; the SVG export holds the shading."""
    from qkv.analysis.pages.viz import LINES_TOKENS, text_rows

    L = LINES_TOKENS + 44
    rows = text_rows(L)
    torch.manual_seed(0)
    future = torch.arange(L)[None, :] > torch.tensor(rows)[:, None]  # (R, L): causal
    weights = torch.softmax((torch.randn(1, 2, len(rows), L) * 3).masked_fill(future, -1e9), -1)
    tokens = [f"\u0120t{i}" + ("\u010a" if i % 50 == 49 else "") for i in range(L)]
    maps = [AttentionMap("blocks.0.self", "blocks.0.attn", "self", 0, (0, 1), tuple(rows), weights)]
    (stack,) = view_data(maps, tokens)["stacks"]
    assert stack["layout"] == "text" and stack["layers"][0]["rows"] == rows
    path = tmp_path / "long.html"
    path.write_text(attention_view_html(maps, tokens), encoding="utf-8")
    page, problems = _open(browser, path)
    shown = page.eval_on_selector_all("text.token", "ts => ts.map(t => t.textContent)")
    assert shown == [f" t{i}" + ("\u21b5" if i % 50 == 49 else "") for i in range(L)]

    def shades() -> list[float]:
        return page.eval_on_selector_all(
            "#shades rect", "rs => rs.map(r => Number(r.getAttribute('fill-opacity') || 0))"
        )

    top = stack["layers"][0]["top"]
    for head, row in ((None, len(rows) - 1), (1, len(rows) - 1), (0, 3)):
        if head is not None:
            page.select_option("#head", str(head))
        page.select_option("#row", str(row))
        heads = [0, 1] if head is None else [head]
        expected = [0.0] * L
        for h in heads:
            pairs = top[h][row]
            for key, millionths in zip(pairs[::2], pairs[1::2], strict=True):
                expected[key] += millionths / 1e6 / len(heads)
        assert shades() == pytest.approx([_log_opacity(w) for w in expected], abs=6e-4)
        assert all(s == 0 for s in shades()[rows[row] + 1 :])  # nothing after a causal row
    page.select_option("#scale", "linear")
    assert shades() == pytest.approx([min(1.0, w) for w in expected], abs=6e-4)
    page.click(f"text.token >> nth={rows[5]}")  # a chosen row's token selects that row
    assert page.eval_on_selector("#row", "s => s.value") == "5"
    assert page.eval_on_selector_all("text.token.focus", "ts => ts.length") == 1
    with page.expect_download() as saving:
        page.click("#save-svg")
    root = ElementTree.parse(saving.value.path()).getroot()
    ns = {"svg": "http" + "://www.w3.org/2000/svg"}
    saved = [float(r.get("fill-opacity") or 0) for r in root.findall("svg:g/svg:rect", ns)]
    assert saved == shades() and sum(s > 0 for s in saved) > 10
    assert problems == []


def test_top_keys_are_each_rows_largest_weights_in_key_order():
    from qkv.analysis.pages.viz import LINES_TOKENS, SMALLEST_KEPT, TOP_KEYS

    L = LINES_TOKENS + 1000
    torch.manual_seed(1)
    weights = torch.softmax(torch.randn(1, 2, 3, L) * 4, dim=-1)  # (B, H, R, L)
    recorded = AttentionMap("blocks.0.self", "blocks.0.attn", "self", 0, (0, 1), (5, 9, -1 % L),
                            weights)  # fmt: skip
    layer = view_data([recorded], [f"t{i}" for i in range(L)])["stacks"][0]["layers"][0]
    for h in range(2):
        for r in range(3):
            pairs = layer["top"][h][r]
            keys, millionths = pairs[::2], pairs[1::2]
            assert keys == sorted(keys) and len(keys) <= TOP_KEYS
            exact = weights[0, h, r].double() * 1e6  # float32 weights: 1 millionth of rounding
            assert (exact[keys] - torch.tensor(millionths)).abs().max() <= 1
            assert min(millionths) >= SMALLEST_KEPT
            left_out = exact.clone()
            left_out[keys] = -1
            assert left_out.max() <= min(millionths) + 1  # no larger weight was left out


def test_8000_tokens_are_viewed_from_their_chosen_rows_with_no_l_by_l_tensor(tmp_path):
    """A Llama-style GPT on 8,200 tokens: the page has the text layout's 16 rows, ending with
    the last token, and no operation of the forward pass and the recording made a tensor of
    L x L elements or more (every tensor an op returned is counted)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from torch.utils._python_dispatch import TorchDispatchMode

    from qkv.analysis.pages.viz import text_attention_html, text_rows
    from qkv.models import GPT, GPTConfig

    L = 8200
    words = [f"w{i}" for i in range(100)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(0, 100, (L,)).tolist())
    model = GPT(GPTConfig.from_name("tiny-llama", max_positions=L)).eval()

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return out

    with LargestOutput() as watch:
        page = text_attention_html(model, tokenizer, text)
    assert 0 < watch.largest < L * L // 64
    (stack,) = _page_data(page)["stacks"]
    assert stack["layout"] == "text" and len(stack["tokens_k"]) == L
    assert [layer["rows"] for layer in stack["layers"]] == [text_rows(L)] * 2
    assert text_rows(L)[-1] == L - 1 and len(text_rows(L)) == 16
    assert len(page) < 2_000_000


def test_smollm2_long_page_holds_transformers_weights_for_its_rows(
    smollm2, smollm2_file, smollm2_hf, monkeypatch
):
    """The real decoder on 300 tokens (text layout): each chosen row's top weights are
    transformers' eager attentions on the same file, to their millionth."""
    from qkv.analysis.pages.viz import TOP_KEYS, text_attention_html
    from qkv.data import tokenizer_from_metadata

    tokenizer = tokenizer_from_metadata(smollm2_file.metadata)
    text = "The capital of France is Paris, and the capital of Italy is Rome. " * 20
    ids = torch.tensor([tokenizer.encode(text).ids])
    assert ids.shape[1] > 256
    (stack,) = _page_data(text_attention_html(smollm2, tokenizer, text))["stacks"]
    monkeypatch.setattr(smollm2_hf.config, "_attn_implementation", "eager")
    with torch.inference_mode():
        theirs = smollm2_hf(ids, output_attentions=True).attentions  # 30 x (1, 9, L, L)
    assert stack["layout"] == "text" and len(stack["layers"]) == 30
    for layer, reference in zip(stack["layers"], theirs, strict=True):
        rows = reference[0][:, layer["rows"]].double() * 1e6  # (9, 16, L)
        for h, per_row in enumerate(layer["top"]):
            for r, pairs in enumerate(per_row):
                keys, millionths = pairs[::2], pairs[1::2]
                assert 0 < len(keys) <= TOP_KEYS
                assert (rows[h, r, keys] - torch.tensor(millionths)).abs().max() <= 20


def test_cli_reads_the_text_from_a_file_and_shows_the_rows_asked_for(tmp_path, capsys):
    source = tmp_path / "text.txt"
    source.write_text("Attention is all you need.\nReally.", encoding="utf-8")
    out = tmp_path / "rows.html"
    assert _run_cli("--file", str(source), "--rows", "0,-1", "--out", str(out)) == 0
    (stack,) = _page_data(out.read_text())["stacks"]
    L = len(stack["tokens_q"])
    assert stack["tokens_q"][-3:] == ["really", ".", "[SEP]"] and stack["layout"] == "lines"
    assert all(layer["rows"] == [0, L - 1] for layer in stack["layers"])
    assert _run_cli("--file", str(source), "--rows", "0,last", "--out", str(out)) == 1
    assert "--rows: expected query positions separated by commas" in capsys.readouterr().err
    assert _run_cli("--file", str(source), "--rows", "99", "--out", str(out)) == 1
    assert "rows: expected indices in" in capsys.readouterr().err
    source.write_bytes(b"caf\xe9")
    assert _run_cli("--file", str(source), "--out", str(out)) == 1
    assert f"--file: {source} is not UTF-8 text (byte 0xe9" in capsys.readouterr().err
    assert _run_cli("a text", "--file", str(source), "--out", str(out)) == 2


# --- A ViT: attention over its patch grid ------------------------------------------------------


def test_png_data_uri_decodes_to_the_image_in_pillow():
    import base64
    import io

    import numpy as np
    from PIL import Image

    from qkv.analysis.pages.viz_image import png_data_uri

    torch.manual_seed(0)
    for image in (torch.rand(1, 5, 7), torch.rand(3, 4, 6) * 10 - 3):
        uri = png_data_uri(image)
        assert uri.startswith("data:image/png;base64,")
        decoded = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
        pixels = torch.tensor(np.asarray(decoded), dtype=torch.float64)  # (H, W) or (H, W, 3)
        scaled = (image - image.min()) / (image.max() - image.min()) * 255
        expected = scaled.permute(1, 2, 0).squeeze(-1).double()
        assert decoded.size == (image.shape[2], image.shape[1])
        assert (pixels - expected).abs().max() <= 0.5 + 1e-4


@pytest.fixture(scope="module")
def vit_folder(tmp_path_factory) -> Path:
    """A small random ViT with a [class] token, saved as `qkv train vit` saves its model."""
    from qkv.models import ViT, ViTConfig

    folder = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    save(ViT(ViTConfig.from_name("vit-digits", num_layers=2)), folder)
    return folder


def test_a_vit_page_shades_its_patch_grid_by_the_chosen_querys_weights(
    browser, vit_folder, tmp_path
):
    """`qkv viz --digit 5`: every encoder layer over the 4 x 4 grid of the digit, [class] token
    first; the default query is the [class] token, shaded (row's largest = 0.8) as recorded
    by record_attention on the same image; a click on a patch makes it the query."""
    from qkv.analysis.pages.viz_image import digit_image, load_vit, patch_tokens

    out = tmp_path / "vit.html"
    assert _run_cli("--model", str(vit_folder), "--digit", "5", "--out", str(out)) == 0
    (stack,) = _page_data(out.read_text())["stacks"]
    model = load_vit(vit_folder)
    tokens = patch_tokens(model)
    assert stack["layout"] == "grid" and stack["tokens_q"] == tokens and len(tokens) == 17
    assert stack["grid"]["rows"] == stack["grid"]["cols"] == 4 and stack["grid"]["offset"] == 1
    image, label = digit_image(5)
    with record_attention(model) as recording, torch.no_grad():
        model(image[None])
    page, problems = _open(browser, out)
    assert page.title().startswith(f"digit 5, label {label}: ViT predicts class")

    def shades() -> list[float]:
        return page.eval_on_selector_all(
            "#shades rect", "rs => rs.map(r => Number(r.getAttribute('fill-opacity') || 0))"
        )

    for layer, query in ((0, 0), (1, 0), (1, 6)):
        page.select_option("#layer", str(layer))
        if query:
            page.click(f"#shades rect >> nth={query}")  # patch (1, 1): the query now
            assert page.eval_on_selector("#row", "s => s.value") == str(query)
        weights = recording[f"blocks.{layer}.self"].weights[0, :, query]  # (4 heads, 17 keys)
        mean = (weights * 1000).round().mean(dim=0) / 1000  # they travel in thousandths
        assert shades() == pytest.approx((0.8 * mean / mean.max()).tolist(), abs=6e-4)
    assert problems == []
    assert _run_cli("--model", str(vit_folder), "--digit", "1797", "--out", str(out)) == 1
    assert _run_cli("--digit", "3", "--out", str(out)) == 1


def test_a_latent_pooled_vit_adds_its_latents_cross_attention_over_the_grid():
    from qkv.analysis.pages.viz_image import digit_image, image_attention_html
    from qkv.models import ViT, ViTConfig

    torch.manual_seed(0)
    model = ViT(ViTConfig.from_name("vit-tiny", pooling="latent", num_latents=3)).eval()
    stacks = _page_data(image_attention_html(model, digit_image(0)[0]))["stacks"]
    assert [stack["layout"] for stack in stacks] == ["grid", "grid"]
    own, pooled = stacks
    assert own["grid"]["offset"] == 0 and own["tokens_q"][0] == "patch (0, 0)"
    assert pooled["tokens_q"] == ["latent 0", "latent 1", "latent 2"]
    assert pooled["tokens_k"] == own["tokens_k"] and pooled["grid"]["offset"] == 0
    with pytest.raises(ValueError, match=r"image: expected a tensor of shape \(C, H, W\)"):
        image_attention_html(model, torch.zeros(1, 16, 16))
