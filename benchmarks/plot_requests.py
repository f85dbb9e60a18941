"""Time per request on the release users install, without and with the plugin, as one picture.

    python3 benchmarks/plot_requests.py [--out docs/requests-0.30.png] [--batch FILE ...]

Reads the committed whole-request results below (fixed paths, default settings on both sides),
draws one pair of bars per request into ``--out`` and prints the figures it drew as JSON on
stdout, so what the picture shows can be checked against the files (``tests/test_plot_requests.py``
does). Drawn with Pillow, which diffusers already needs: no plotting library.

- SenseNova-U1 on vllm-omni 0.30: the release's default path (its in-tree paged decode, eager
  denoising) against the plugin's defaults (`defer`, denoising graphs), one request through
  ``SenseNovaU1Pipeline.forward`` (``benchmarks/sensenova_request.py``).
- Qwen-Image-2.1 is in no vllm-omni release: vllm-omni serves it through its diffusers adapter,
  which runs diffusers' ``QwenImage21Pipeline``; the bars are that pipeline alone against it with
  the plugin's default fast mode (``benchmarks/qwen_image.py``). That run had vllm 0.26.0 +
  vllm-omni 0.26.0 installed (the plugin's FlashAttention 3 comes from vllm's build); no
  whole-image run on the 0.30 stack is committed.

``--batch FILE`` (repeatable) adds the concurrent-request rows of a ``sensenova_batch.py`` result
(``{"cases": [...]}`` or a list): each row with ``requests`` (N) as well as ``eager_ms`` (the
release serving the N in turn) and ``ours_ms`` (the plugin's one ``forward`` for all N) is drawn
per request, both figures divided by N (throughput: the batch's wall time shared by its requests,
not one request's latency), labelled "N concurrent think requests (per request)" or "... text
requests ..." unless the row has a ``"label"`` (optional ``"model"``, ``"release"``; without them
a SenseNova-U1 request on vllm-omni 0.30). The plugin's side is wired as for a server started
with ``--max-num-seqs N`` and ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH=auto`` (the default), whose
batched decode replaces vllm-omni 0.30's in-tree decode context. A row without ``requests`` (the
decode-step rows: ms per token or per step) is not a request: it is left out and listed under
``skipped``. The README's picture is::

    python3 benchmarks/plot_requests.py \
        --batch benchmarks/results/h200-2026-12-01e/batch-0.30/sensenova-batch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("docs", "requests-0.30.png")
SENSENOVA_FILE = "benchmarks/results/h200-2026-12-01b/request-0.30.json"
QWEN_FILE = "benchmarks/results/h200-2026-11-30c/qwen-image.json"
SENSENOVA_RELEASE = "vllm-omni 0.30"
QWEN_RELEASE = "diffusers 0.42.1"


@dataclasses.dataclass(frozen=True)
class Source:
    model: str
    request: str
    file: str  # relative to the repository root
    case: str
    release: str  # what the plugin is compared against


SOURCES = (
    Source("SenseNova-U1", "text-to-image, CFG 4, think off", SENSENOVA_FILE, "sensenova_t2i_1024",
           SENSENOVA_RELEASE),
    Source("SenseNova-U1", "CFG 4, think on (1,024 tokens)", SENSENOVA_FILE,
           "sensenova_t2i_think_1024", SENSENOVA_RELEASE),
    Source("Qwen-Image-2.1", "text-to-image, CFG 1", QWEN_FILE,
           "qwen_image_21_image_t2i_1024_50steps", QWEN_RELEASE),
    Source("Qwen-Image-2.1", "text-to-image, true CFG 4", QWEN_FILE,
           "qwen_image_21_image_t2i_1024_50steps_cfg4", QWEN_RELEASE),
)


def _cases(path: str) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    return doc["cases"] if isinstance(doc, dict) else doc


def _row(model, request, file, case, release, found: dict, requests: int = 1) -> dict:
    release_ms = float(found["eager_ms"]) / requests
    plugin_ms = float(found["ours_ms"]) / requests
    row = {"model": model, "request": request, "file": file, "case": case, "release": release,
           "release_ms": release_ms, "plugin_ms": plugin_ms,
           "speedup": round(release_ms / plugin_ms, 2)}
    if requests > 1:
        row.update(requests=requests, release_total_ms=float(found["eager_ms"]),
                   plugin_total_ms=float(found["ours_ms"]))
    return row


def batch_label(case: dict, requests: int) -> str:
    """``N concurrent think requests (per request)``, or the row's own ``label``."""
    if "label" in case:
        return case["label"]
    kind = "think" if "think" in case["case"] else "text" if "text" in case["case"] else ""
    return f"{requests} concurrent {kind + ' ' if kind else ''}requests (per request)"


def _open(path: str, root: str) -> str:
    """A ``--batch`` path as given (relative to the working directory), else under ``root``."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(root, path)


def read_rows(root: str = ROOT, batches: tuple[str, ...] = ()) -> tuple[list[dict], list[dict]]:
    """The figures to draw (the committed sources, then every ``--batch`` file's request rows,
    per request), and the ``--batch`` rows left out (no ``requests``)."""
    rows, skipped = [], []
    for src in SOURCES:
        by_case = {c.get("case"): c for c in _cases(os.path.join(root, src.file))}
        if src.case not in by_case:
            raise SystemExit(f"{src.file} has no case {src.case!r}")
        rows.append(_row(src.model, src.request, src.file, src.case, src.release,
                         by_case[src.case]))
    for path in batches:
        for c in _cases(_open(path, root)):
            n = c.get("requests")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                skipped.append({"file": path, "case": c.get("case"),
                                "why": "no requests count: not a whole-request row"})
                continue
            rows.append(_row(c.get("model", "SenseNova-U1"), batch_label(c, n), path, c["case"],
                             c.get("release", SENSENOVA_RELEASE), c, n))
    return rows, skipped


# -- drawing ---------------------------------------------------------------------------------

WIDTH, LEFT, RIGHT, BAR, GAP = 1040, 330, 250, 18, 4
RELEASE_FILL, PLUGIN_FILL, INK, GREY = (170, 170, 170), (38, 110, 180), (20, 20, 20), (95, 95, 95)


def _footer(rows: list[dict]) -> list[str]:
    """The source files, a few to a line; a note when per-request rows are drawn."""
    files = [os.path.relpath(f, ROOT) if os.path.isabs(f) else f
             for f in dict.fromkeys(r["file"] for r in rows)]
    lines, line = [], "from "
    for i, f in enumerate(files):
        piece = f + (", " if i < len(files) - 1 else "")
        if len(line) + len(piece) > 120 and line.strip() != "from":
            lines.append(line.rstrip())
            line = "     "
        line += piece
    lines.append(line)
    if any(r.get("requests", 1) > 1 for r in rows):
        lines.insert(0, "concurrent rows: the release serves the N requests one at a time, the "
                        "plugin in one batch (--max-num-seqs N); each bar is that total / N")
    return lines


def draw(rows: list[dict], path: str) -> None:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=15)
    small = ImageFont.load_default(size=13)
    bold = ImageFont.load_default(size=17)
    models = list(dict.fromkeys(r["model"] for r in rows))
    footer = _footer(rows)
    height = 72 + sum(34 + (2 * BAR + GAP + 16) * sum(r["model"] == m for r in rows)
                      for m in models) + 10 + 18 * len(footer)
    img = Image.new("RGB", (WIDTH, height), "white")
    d = ImageDraw.Draw(img)
    d.text((20, 14), "Time per request on one H200 (seconds; shorter is faster)", font=bold,
           fill=INK)
    d.text((20, 40), "random weights at the released shapes; default settings on both sides; "
                     "images 1024x1024, 50 steps", font=small, fill=GREY)
    scale = (WIDTH - LEFT - RIGHT) / max(max(r["release_ms"], r["plugin_ms"]) for r in rows)
    y = 72
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        d.text((20, y), model, font=bold, fill=INK)
        y += 28
        for r in mine:
            d.text((20, y + BAR - 8), r["request"], font=font, fill=INK)
            for k, (key, fill, name) in enumerate((("release_ms", RELEASE_FILL, r["release"]),
                                                   ("plugin_ms", PLUGIN_FILL, "with the plugin"))):
                top = y + k * (BAR + GAP)
                end = LEFT + max(1, round(r[key] * scale))
                d.rectangle((LEFT, top, end, top + BAR), fill=fill)
                d.text((end + 6, top + 2), f"{r[key] / 1000:.2f} s  {name}", font=small,
                       fill=INK if k else GREY)
            d.text((WIDTH - 70, y + BAR - 8), f"{r['speedup']:.2f}x", font=font, fill=PLUGIN_FILL)
            y += 2 * BAR + GAP + 16
        y += 6
    for i, line in enumerate(footer):
        d.text((20, height - 10 - 18 * (len(footer) - i)), line, font=small, fill=GREY)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path, format="PNG")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, DEFAULT_OUT))
    ap.add_argument("--batch", action="append", default=[], metavar="FILE",
                    help="sensenova_batch.py results: rows {case, requests, eager_ms, ours_ms} are "
                         "drawn per request (ms / requests)")
    args = ap.parse_args(argv)
    rows, skipped = read_rows(ROOT, tuple(args.batch))
    draw(rows, args.out)
    print(json.dumps({"png": args.out, "rows": rows, "skipped": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
