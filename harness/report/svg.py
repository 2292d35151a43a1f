"""A small SVG chart builder (line charts with log/linear axes) built on xml.etree, for inline charts.

    chart = LineChart("tok/s vs length", x_label="tokens", y_label="tok/s", log_x=True)
    chart.add_series("triton", [(256, 1.2e6), (1024, 3.4e6)])
    svg_text = chart.to_svg()   # an <svg> element as a string, safe to inline in HTML
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
DASHES = ("", "6 3", "2 3", "8 3 2 3")


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
        self.series: list[tuple[str, list[tuple[float, float]]]] = []
        self.margin = dict(left=64, right=16, top=30, bottom=44)

    def add_series(self, name: str, points) -> "LineChart":
        pts = sorted((float(x), float(y)) for x, y in points
                     if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
                     and (not self.log_x or float(x) > 0) and (not self.log_y or float(y) > 0))
        if pts:
            self.series.append((name, pts))
        return self

    def __bool__(self) -> bool:
        return bool(self.series)

    # -- scales
    def _tx(self, v):
        return math.log2(v) if self.log_x else v

    def _ty(self, v):
        return math.log10(v) if self.log_y else v

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
        xs = [x for _, pts in self.series for x, _ in pts]
        ys = [y for _, pts in self.series for _, y in pts]
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
        yticks = _nice_ticks(y_lo, y_hi * 1.05 if y_hi > 0 else y_hi + 1)
        y_lo, y_hi = yticks[0], yticks[-1]
        tx_lo, tx_hi = self._tx(x_lo), self._tx(x_hi)
        if tx_hi == tx_lo:
            tx_lo, tx_hi = tx_lo - 1, tx_hi + 1

        def px(x):
            return m["left"] + (self._tx(x) - tx_lo) / (tx_hi - tx_lo) * pw

        def py(y):
            return m["top"] + ph - (y - y_lo) / ((y_hi - y_lo) or 1) * ph

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
        yl.text = self.y_label
        for i, (name, pts) in enumerate(self.series):
            color = PALETTE[i % len(PALETTE)]
            dash = DASHES[(i // len(PALETTE)) % len(DASHES)]
            g = ET.SubElement(svg, "g", attrib={"class": "series"})
            ET.SubElement(g, "title").text = name
            attrs = {"fill": "none", "stroke": color, "stroke-width": "2"}
            if dash:
                attrs["stroke-dasharray"] = dash
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
