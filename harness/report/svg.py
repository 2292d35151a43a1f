"""A small SVG chart builder (line charts with log/linear axes) built on xml.etree, for inline charts.

    chart = LineChart("tok/s vs length", x_label="tokens", y_label="tok/s", log_x=True)
    chart.add_series("triton", [(256, 1.2e6), (1024, 3.4e6)], color=impl_color("triton"),
                     spread=[(256, 1.1e6, 1.3e6), (1024, 3.2e6, 3.5e6)])   # p20-p80 bars
    svg_text = chart.to_svg()   # an <svg> element as a string, safe to inline in HTML
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET
import zlib

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
DASHES = ("", "6 3", "2 3", "8 3 2 3")
# One colour per implementation, the same in every chart of every report.
IMPL_COLORS = {"triton": "#1f77b4", "torch": "#ff7f0e", "reference": "#7f7f7f", "mamba_ssm": "#d62728",
               "mamba_ssm_cuda": "#e377c2", "causal_conv1d": "#2ca02c", "causal_conv1d_cuda": "#17becf",
               "fla": "#8c564b", "vllm": "#9467bd"}
_OTHER_COLORS = ("#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")


def impl_color(impl: str) -> str:
    """The fixed colour of an implementation (a stable hash of its name for ones not listed)."""
    impl = str(impl).split(" ")[0]
    if impl in IMPL_COLORS:
        return IMPL_COLORS[impl]
    return _OTHER_COLORS[zlib.crc32(impl.encode()) % len(_OTHER_COLORS)]


def _fmt_tick(v: float) -> str:
    a = abs(v)
    if a == 0:
        return "0"
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{suf}"
    return f"{v:.3g}"


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [start], start
    while t < hi - step * 1e-9:
        t += step
        ticks.append(round(t, 12))
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    step = max(1, (b - a) // 8 + (1 if (b - a) % 8 else 0)) if b - a > 8 else 1
    return [2.0 ** e for e in range(a, b + 1, step)]


class LineChart:
    def __init__(self, title: str, x_label: str, y_label: str, *, log_x: bool = False, log_y: bool = False,
                 width: int = 560, height: int = 320, y_min: float | None = None, y_max: float | None = None):
        self.title, self.x_label, self.y_label = title, x_label, y_label
        self.log_x, self.log_y = log_x, log_y
        self.width, self.height = width, height
        self.y_min, self.y_max = y_min, y_max
        self.series: list[tuple[str, list[tuple[float, float]], dict]] = []
        self.margin = dict(left=64, right=16, top=30, bottom=44)

    def _ok(self, x, y) -> bool:
        return (x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
                and (not self.log_x or float(x) > 0) and (not self.log_y or float(y) > 0))

    def add_series(self, name: str, points, *, color: str | None = None, dash: str | None = None,
                   spread=None) -> "LineChart":
        """A named line; `color`/`dash` fixed by the caller (else by position); `spread`: (x, lo, hi)
        triples drawn as vertical bars (e.g. the p20-p80 range)."""
        pts = sorted((float(x), float(y)) for x, y in points if self._ok(x, y))
        bars = sorted((float(x), float(lo), float(hi)) for x, lo, hi in (spread or [])
                      if self._ok(x, lo) and self._ok(x, hi))
        if pts:
            self.series.append((name, pts, {"color": color, "dash": dash, "spread": bars}))
        return self

    def __bool__(self) -> bool:
        return bool(self.series)

    # -- scales
    def _tx(self, v):
        return math.log2(v) if self.log_x else v

    def _ty(self, v):
        return math.log10(v) if self.log_y else v

    def _style(self, i: int, opts: dict) -> tuple[str, str]:
        color = opts.get("color") or PALETTE[i % len(PALETTE)]
        dash = opts.get("dash")
        if dash is None:
            dash = DASHES[(i // len(PALETTE)) % len(DASHES)]
        return color, dash

    def to_svg(self) -> str:
        return ET.tostring(self.element(), encoding="unicode")

    def element(self) -> ET.Element:
        m = self.margin
        W, H = self.width, self.height
        pw, ph = W - m["left"] - m["right"], H - m["top"] - m["bottom"]
        legend_h = 16 * len(self.series)
        H_total = H + legend_h + 6
        svg = ET.Element("svg", xmlns="http://www.w3.org/2000/svg", width=str(W), height=str(H_total),
                         viewBox=f"0 0 {W} {H_total}", role="img")
        ET.SubElement(svg, "title").text = self.title
        ET.SubElement(svg, "rect", x="0", y="0", width=str(W), height=str(H_total), fill="#ffffff")
        t = ET.SubElement(svg, "text", x=str(W / 2), y="18", attrib={"text-anchor": "middle", "font-size": "13",
                                                                      "font-weight": "bold"})
        t.text = self.title
        xs = [x for _, pts, _ in self.series for x, _ in pts]
        ys = [y for _, pts, _ in self.series for _, y in pts] + \
             [v for _, _, o in self.series for _, lo, hi in o["spread"] for v in (lo, hi)]
        if not xs:
            e = ET.SubElement(svg, "text", x=str(W / 2), y=str(H / 2), attrib={"text-anchor": "middle"})
            e.text = "no data"
            return svg
        x_lo, x_hi = min(xs), max(xs)
        y_lo = self.y_min if self.y_min is not None else (min(ys) if self.log_y else min(0.0, min(ys)))
        y_hi = self.y_max if self.y_max is not None else max(ys)
        if self.log_x:
            xticks = _log_ticks(x_lo, x_hi)
            x_lo, x_hi = min(xticks[0], x_lo), max(xticks[-1], x_hi)
        else:
            xticks = _nice_ticks(x_lo, x_hi)
            x_lo, x_hi = xticks[0], max(xticks[-1], x_hi)
        if self.log_y:
            a, b = math.floor(math.log10(y_lo)), math.ceil(math.log10(y_hi))
            b = max(b, a + 1)
            yticks = [10.0 ** e for e in range(a, b + 1)]
        else:
            yticks = _nice_ticks(y_lo, y_hi * 1.05 if y_hi > 0 else y_hi + 1)
        y_lo, y_hi = yticks[0], yticks[-1]
        ty_lo, ty_hi = self._ty(y_lo), self._ty(y_hi)
        tx_lo, tx_hi = self._tx(x_lo), self._tx(x_hi)
        if tx_hi == tx_lo:
            tx_lo, tx_hi = tx_lo - 1, tx_hi + 1

        def px(x):
            return m["left"] + (self._tx(x) - tx_lo) / (tx_hi - tx_lo) * pw

        def py(y):
            return m["top"] + ph - (self._ty(y) - ty_lo) / ((ty_hi - ty_lo) or 1) * ph

        axes = ET.SubElement(svg, "g", attrib={"font-size": "10", "fill": "#333"})
        for yt in yticks:
            yy = py(yt)
            ET.SubElement(axes, "line", x1=str(m["left"]), x2=str(m["left"] + pw), y1=f"{yy:.1f}", y2=f"{yy:.1f}",
                          stroke="#e5e5e5")
            lab = ET.SubElement(axes, "text", x=str(m["left"] - 4), y=f"{yy + 3:.1f}", attrib={"text-anchor": "end"})
            lab.text = _fmt_tick(yt)
        for xt in xticks:
            xx = px(xt)
            ET.SubElement(axes, "line", x1=f"{xx:.1f}", x2=f"{xx:.1f}", y1=str(m["top"]), y2=str(m["top"] + ph),
                          stroke="#f0f0f0")
            lab = ET.SubElement(axes, "text", x=f"{xx:.1f}", y=str(m["top"] + ph + 14), attrib={"text-anchor": "middle"})
            lab.text = str(int(xt)) if self.log_x and xt == int(xt) and xt < 1e6 else _fmt_tick(xt)
        ET.SubElement(axes, "rect", x=str(m["left"]), y=str(m["top"]), width=str(pw), height=str(ph),
                      fill="none", stroke="#888")
        xl = ET.SubElement(axes, "text", x=str(m["left"] + pw / 2), y=str(m["top"] + ph + 32),
                           attrib={"text-anchor": "middle", "font-size": "11"})
        xl.text = self.x_label + (" (log scale)" if self.log_x else "")
        yl = ET.SubElement(axes, "text", x="14", y=str(m["top"] + ph / 2),
                           attrib={"text-anchor": "middle", "font-size": "11",
                                   "transform": f"rotate(-90 14 {m['top'] + ph / 2})"})
        yl.text = self.y_label + (" (log scale)" if self.log_y else "")
        for i, (name, pts, opts) in enumerate(self.series):
            color, dash = self._style(i, opts)
            g = ET.SubElement(svg, "g", attrib={"class": "series", "data-color": color})
            ET.SubElement(g, "title").text = name
            attrs = {"fill": "none", "stroke": color, "stroke-width": "2"}
            if dash:
                attrs["stroke-dasharray"] = dash
            for x, lo, hi in opts["spread"]:
                xx = px(x)
                bar = ET.SubElement(g, "g", attrib={"class": "spread", "stroke": color, "stroke-width": "1.2"})
                ET.SubElement(bar, "title").text = f"{name}: p20–p80 {_fmt_tick(min(lo, hi))}–{_fmt_tick(max(lo, hi))}"
                ET.SubElement(bar, "line", x1=f"{xx:.1f}", x2=f"{xx:.1f}", y1=f"{py(lo):.1f}", y2=f"{py(hi):.1f}")
                for v in (lo, hi):
                    ET.SubElement(bar, "line", x1=f"{xx - 4:.1f}", x2=f"{xx + 4:.1f}", y1=f"{py(v):.1f}",
                                  y2=f"{py(v):.1f}")
            ET.SubElement(g, "polyline", points=" ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts), attrib=attrs)
            for x, y in pts:
                c = ET.SubElement(g, "circle", cx=f"{px(x):.1f}", cy=f"{py(y):.1f}", r="3", fill=color)
                ET.SubElement(c, "title").text = f"{name}: x={_fmt_tick(x)}, y={_fmt_tick(y)}"
            ly = H + 4 + 16 * i
            ET.SubElement(svg, "line", x1=str(m["left"]), x2=str(m["left"] + 22), y1=str(ly), y2=str(ly),
                          attrib=attrs)
            lt = ET.SubElement(svg, "text", x=str(m["left"] + 28), y=str(ly + 4), attrib={"font-size": "11"})
            lt.text = name
        return svg
