"""Latency against request rate from a ``sensenova_load.py`` result: p50 and p99 for each side,
a panel for all requests and one per kind.

    python3 benchmarks/plot_load.py OUT/sensenova-load.json [OUT.png]

``sensenova_load.py`` draws it after its runs (``latency-vs-rate.png`` beside the JSON); this
redraws it from the file. Drawn with Pillow (which diffusers already needs). A run without a
trace (a server that did not start) has no point; a kind a run answered none of has none at
that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PNG = "latency-vs-rate.png"
PANELS = (("all", "all requests"), ("text", "text answers"),
          ("think_image", "think text-to-image"), ("image", "text-to-image, think off"))
SIDE_ORDER = ("release", "request", "step")
COLOURS = {"release": "#8a8a8a", "request": "#e08a2c", "step": "#266eb4"}


def series(record: dict) -> dict:
    """{kind: {side: {"rates": [...], "p50_ms": [...], "p99_ms": [...]}}}, rates ascending, from
    ``record["runs"][side][rate]["summary"]["kinds"]``; a side with no point for a kind is left
    out of that kind."""
    out: dict[str, dict] = {}
    runs = record.get("runs") or {}
    sides = [s for s in SIDE_ORDER if s in runs] + [s for s in runs if s not in SIDE_ORDER]
    for kind, _ in PANELS:
        for side in sides:
            points = []
            for rate, run in runs[side].items():
                figures = ((run.get("summary") or {}).get("kinds") or {}).get(kind) or {}
                if "p50_ms" in figures:
                    points.append((float(rate), figures["p50_ms"], figures["p99_ms"]))
            if points:
                points.sort()
                out.setdefault(kind, {})[side] = {"rates": [p[0] for p in points],
                                                  "p50_ms": [p[1] for p in points],
                                                  "p99_ms": [p[2] for p in points]}
    return out


def title(record: dict) -> str:
    trace = record.get("trace") or {}
    gpu = (record.get("environment") or {}).get("gpu") or "no GPU recorded"
    return (f"SenseNova-U1 over HTTP, Poisson arrivals: {trace.get('n')} requests a rate, seed "
            f"{trace.get('seed')}, images {trace.get('size')}px {trace.get('steps')} steps "
            f"({gpu})")


PANEL_W, PANEL_H, MARGIN_L, MARGIN_B, TOP = 380, 300, 64, 46, 58
INK, GREY, GRID = "#222222", "#777777", "#e4e4e4"


def _log_axis(values: list[float]) -> tuple[float, float, list[float]]:
    """(lowest, highest, ticks) of a log-scaled seconds axis covering ``values``: decades and
    their 2x and 5x steps."""
    import math

    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    ticks = [m * 10 ** e for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10 ** e <= hi]
    return lo, hi, ticks


def draw(lines: dict, path: str, heading: str = "") -> None:
    """``series``' lines into a PNG at ``path``: seconds on a log scale against requests a
    second, p50 solid and p99 dashed, one colour a side, a panel per kind. Drawn with Pillow,
    which diffusers already needs (as ``plot_requests.py``): no plotting library."""
    import math

    from PIL import Image, ImageDraw, ImageFont

    font, small = ImageFont.load_default(size=13), ImageFont.load_default(size=11)
    bold = ImageFont.load_default(size=14)
    panels = [(kind, name) for kind, name in PANELS if kind in lines]
    sides = list(dict.fromkeys(side for kind, _ in panels for side in lines[kind]))
    width = 20 + len(panels) * (PANEL_W + 20)
    height = TOP + PANEL_H + MARGIN_B + 22 * len(sides) + 30
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((20, 10), heading, font=bold, fill=INK)
    d.text((20, 32), "end-to-end latency (s, log scale) against request rate (requests/s); "
                     "p50 solid, p99 dashed", font=small, fill=GREY)
    for n, (kind, name) in enumerate(panels):
        x0 = 20 + n * (PANEL_W + 20) + MARGIN_L
        x1, y0, y1 = x0 + PANEL_W - MARGIN_L - 10, TOP + 18, TOP + PANEL_H
        values = [ms / 1000 for line in lines[kind].values()
                  for ms in line["p50_ms"] + line["p99_ms"] if ms > 0]
        rates = sorted({r for line in lines[kind].values() for r in line["rates"]})
        if not values:
            continue
        lo, hi, ticks = _log_axis(values)
        r_lo, r_hi = rates[0], rates[-1]

        def xy(rate, seconds):
            fx = 0.5 if r_hi == r_lo else (rate - r_lo) / (r_hi - r_lo)
            fy = (math.log10(seconds) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
            return x0 + 10 + fx * (x1 - x0 - 20), y1 - fy * (y1 - y0)

        d.text((x0, TOP), name, font=font, fill=INK)
        d.rectangle((x0, y0, x1, y1), outline=GREY)
        for t in ticks:
            _, y = xy(r_lo, t)
            d.line((x0, y, x1, y), fill=GRID)
            d.text((x0 - 44, y - 6), f"{t:g}", font=small, fill=GREY)
        for rate in rates:
            x, _ = xy(rate, lo)
            d.text((x - 12, y1 + 6), f"{rate:g}", font=small, fill=GREY)
        for side, line in lines[kind].items():
            colour = COLOURS.get(side, INK)
            for key, dashed in (("p50_ms", False), ("p99_ms", True)):
                points = [xy(r, ms / 1000) for r, ms in zip(line["rates"], line[key]) if ms > 0]
                for a, b in zip(points, points[1:]):
                    if not dashed:
                        d.line((*a, *b), fill=colour, width=2)
                        continue
                    for k in range(0, 20, 2):  # ten dashes a segment
                        p = (a[0] + (b[0] - a[0]) * k / 20, a[1] + (b[1] - a[1]) * k / 20)
                        q = (a[0] + (b[0] - a[0]) * (k + 1) / 20,
                             a[1] + (b[1] - a[1]) * (k + 1) / 20)
                        d.line((*p, *q), fill=colour, width=2)
                for x, y in points:
                    box = (x - 3, y - 3, x + 3, y + 3)
                    d.rectangle(box, fill=colour) if dashed else d.ellipse(box, fill=colour)
    for i, side in enumerate(sides):
        y = TOP + PANEL_H + MARGIN_B + 22 * i
        d.line((20, y + 7, 50, y + 7), fill=COLOURS.get(side, INK), width=3)
        d.text((58, y), side, font=font, fill=INK)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path, format="PNG")


def plot(record: dict, path: str) -> dict:
    """The picture of ``record`` at ``path``: {"png": path}, or {"skipped": why} (no point to
    draw), which is also printed on stderr."""
    lines = series(record)
    if lines:
        draw(lines, path, title(record))
        return {"png": path}
    why = "no run has latencies to draw"
    print(f"WARNING: plot_load: {path} not drawn: {why}", file=sys.stderr, flush=True)
    return {"skipped": why}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a sensenova_load.py result (sensenova-load.json)")
    ap.add_argument("out", nargs="?", default=None,
                    help=f"the PNG (default: {PNG} beside the file)")
    args = ap.parse_args(argv)
    with open(args.file) as f:
        record = json.load(f)
    done = plot(record, args.out or os.path.join(os.path.dirname(args.file), PNG))
    print(json.dumps(done))
    return 0 if "png" in done else 1


if __name__ == "__main__":
    sys.exit(main())
