"""What `qkv train` prints and writes once a run is done, per task."""

from __future__ import annotations

import json
from pathlib import Path

# German numbers whose English word order differs, shown after training: the units come first
# in German ("zwölf" = twelve after "dreihundert"; "einundzwanzig" = one-and-twenty).
_SHOWCASE = ("dreihundertzwölf", "einundzwanzig", "siebentausendvierhundertneunundachtzig")


def report(task, result, out_dir: Path, *, seconds: float) -> None:
    reporters = {"translate": _translate}
    summary = reporters.get(task.name, _generic)(task, result, out_dir)
    summary = {"task": task.name, "steps": result.step, "seconds": round(seconds, 1), **summary}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out_dir / 'summary.json'}")


def _generic(task, result, out_dir: Path) -> dict:
    model_dir = task.save(result.model, out_dir / "model")
    for name, value in result.metrics.items():
        print(f"{name}: {value:.4f}")
    print(f"model saved to {model_dir}")
    return {"metrics": result.metrics}


def _translate(task, result, out_dir: Path) -> dict:
    from qkv.training.tasks.translate import translate

    model = result.model
    metrics = {**result.metrics, **task.evaluate(model, split="test")}
    exact = metrics["test_exact_match"]
    print(f"test exact match: {exact:.1%} of {len(task.test_set)} held-out numbers")
    sources = [*_SHOWCASE, *(source for source, _ in task.pairs.test[:3])]
    for source, output in zip(sources, translate(model, task.tokenizer, sources), strict=True):
        print(f"  {source}  ->  {output}")
    model_dir = task.save(model, out_dir / "model")
    print(f"model saved to {model_dir}  (try: qkv translate {_SHOWCASE[0]} --model {model_dir})")
    heat_map = _cross_attention_png(task, model, _SHOWCASE[0], out_dir / "cross_attention.png")
    return {"metrics": metrics, "model": str(model_dir), "heat_map": heat_map}


def _cross_attention_png(task, model, source: str, path: Path) -> str | None:
    """The decoder's cross-attention over the source for one example, as a PNG."""
    try:
        from qkv.analysis.plots import save_figure
        from qkv.analysis.plots.translation import cross_attention_figure
    except ImportError as error:  # matplotlib is optional
        print(f"no heat map: {error}")
        return None
    figure = cross_attention_figure(model, task.tokenizer, source)
    save_figure(figure, path)
    print(f"cross-attention heat map of {source!r} written to {path}")
    return str(path)
