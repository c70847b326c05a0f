"""Text on plots that neither collides nor runs off the axes.

matplotlib draws an annotation where it is told, over whatever is there: two points close together get
overlapping labels, and the label of the last point runs past the axes' edge. `label_points` measures
each label as the renderer draws it and tries offsets around its point, nearest first, keeping the first
that lies inside the axes and clear of every text, legend, line and marker already there. Points that
coincide on screen get one label. `fit_tick_labels` turns category names that would overlap.

`label_points` measures the figure as it stands: call it after the layout (`tight_layout`) and
before saving, and change no axes afterwards (it freezes the limits it measured). `fit_tick_labels`
goes before the layout, which then makes room for the turned names.
"""

from __future__ import annotations

from typing import Optional, Sequence

# Offsets in points tried around a point, nearest ring first; beyond the first ring a thin leader line
# joins the label to its point. Eight directions per ring: the text grows away from its point.
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1), (0, -1), (1, 0), (-1, 0))
_RINGS = (5, 12, 22, 34, 48, 64, 84, 108)
_GAP_PX = 1.5          # clear space kept between a label and anything else
_MARKER_PT = 3.0       # half-size of the marker box a label keeps off (a default marker is 6 points)
_SAME_PX = 3.0         # points closer than this on screen are one place


def _renderer(fig):
    fig.canvas.draw()   # settles tick labels, autoscaled limits and legend positions before measuring
    return fig.canvas.get_renderer()


def _clear(box, boxes, gap: float) -> bool:
    return not any(box.x0 < b.x1 + gap and b.x0 < box.x1 + gap and box.y0 < b.y1 + gap and b.y0 < box.y1 + gap
                   for b in boxes)


def _overlap_area(box, boxes) -> float:
    return sum(max(0.0, min(box.x1, b.x1) - max(box.x0, b.x0))
               * max(0.0, min(box.y1, b.y1) - max(box.y0, b.y0)) for b in boxes)


def _occupied(fig, renderer) -> list:
    """Window extents of what a label must not cover: every visible non-empty text (ticks out of view
    too: they lie outside the axes, where no label goes) and every legend."""
    from matplotlib.text import Text
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    legends = [leg for leg in [ax.get_legend() for ax in fig.axes] + list(fig.legends)
               if leg is not None and leg.get_visible()]
    return ([Text.get_window_extent(t, renderer) for t in texts]
            + [leg.get_window_extent(renderer) for leg in legends])


def _line_boxes(ax) -> list:
    """Small boxes along every drawn line of `ax`, a few pixels apart: a label set across a curve
    hides where it goes."""
    import numpy as np
    from matplotlib.transforms import Bbox
    boxes = []
    for line in ax.get_lines():
        if line.get_linestyle() in ("None", "", " ") or not line.get_visible():
            continue
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        half = max(1.0, line.get_linewidth() * ax.figure.dpi / 72 / 2)
        for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:]):
            steps = max(1, int(np.hypot(x1 - x0, y1 - y0) // 3))
            for t in np.linspace(0.0, 1.0, steps + 1):
                x, y = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                boxes.append(Bbox.from_extents(x - half, y - half, x + half, y + half))
    return boxes


def _merged(ax, points: Sequence[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """One label per place: points within _SAME_PX on screen share it, their distinct texts joined."""
    places: list[tuple[float, float, list[str], tuple[float, float]]] = []
    for x, y, text in points:
        sx, sy = ax.transData.transform((x, y))
        for _, _, texts, (qx, qy) in places:
            if abs(sx - qx) <= _SAME_PX and abs(sy - qy) <= _SAME_PX:
                if text not in texts:
                    texts.append(text)
                break
        else:
            places.append((x, y, [text], (sx, sy)))
    return [(x, y, ", ".join(texts)) for x, y, texts, _ in places]


def _text_extent(note, renderer):
    """The annotation's text alone: its own extent would take in the leader line, which starts at the
    point and so always meets the point's marker."""
    from matplotlib.text import Text
    note.update_positions(renderer)
    return Text.get_window_extent(note, renderer)


def _candidates():
    """(offset in points, horizontal and vertical alignment, leader line) around a point, nearest first."""
    for ring in _RINGS:
        for dx, dy in _DIRECTIONS:
            yield ((dx * ring, dy * ring), {1: "left", -1: "right", 0: "center"}[dx],
                   {1: "bottom", -1: "top", 0: "center"}[dy], ring != _RINGS[0])


def label_points(ax, points: Sequence[tuple[float, float, str]], avoid: Sequence[tuple[float, float]] = (),
                 fontsize: float = 8, color: Optional[str] = None) -> list:
    """Annotate each (x, y, text) in data coordinates inside `ax`, clear of every text and legend on the
    figure, of the lines drawn in `ax`, of the labelled points' markers and of the markers at `avoid`
    (other data points, in data coordinates). Where no offset is clear (a crowd no ring escapes), the
    label goes where it covers least. Returns the annotations."""
    from matplotlib.transforms import Bbox
    fig = ax.figure
    renderer = _renderer(fig)
    ax.set_xlim(ax.get_xlim())   # freeze what was measured: no later artist may move the points
    ax.set_ylim(ax.get_ylim())
    frame = ax.get_window_extent(renderer).padded(-_GAP_PX)
    half = _MARKER_PT * fig.dpi / 72
    taken = _occupied(fig, renderer) + _line_boxes(ax)
    for x, y in [*((x, y) for x, y, _ in points), *avoid]:
        sx, sy = ax.transData.transform((x, y))
        taken.append(Bbox.from_extents(sx - half, sy - half, sx + half, sy + half))
    placed = []
    for x, y, text in _merged(ax, points):
        best = None   # (cost, annotation, extent) of the least bad offset so far
        for offset, ha, va, leader in _candidates():
            note = ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", fontsize=fontsize,
                               color=color, ha=ha, va=va, annotation_clip=False,
                               arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.6, "shrinkA": 1,
                                           "shrinkB": 3} if leader else None)
            box = _text_extent(note, renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            cost = (not inside, 0.0 if _clear(box, taken, _GAP_PX) else 1.0, _overlap_area(box, taken))
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, note, box)
            else:
                note.remove()
            if cost == (False, 0.0, 0.0):
                break
        taken.append(best[2])
        placed.append(best[1])
    return placed


def fit_tick_labels(ax) -> None:
    """Stand the x tick labels upright where they would overlap level (a slanted label's box still
    reaches over its neighbour's)."""
    renderer = _renderer(ax.figure)
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text().strip()]
    if any(not _clear(box, boxes[i + 1:], _GAP_PX) for i, box in enumerate(boxes)):
        for t in ax.get_xticklabels():
            t.set(rotation=90)
