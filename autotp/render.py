"""Show a :class:`~autotp.planner.PlanReport` to people: :func:`render_text` (what ``autotp plan``
prints), :func:`render_html` (``autotp plan --html FILE``: one self-contained page, no scripts,
no external assets, inline CSS only) and :func:`render_png` (``autotp plan --png FILE``, with
matplotlib from the ``[plot]`` extra). Both drawings draw :func:`plan_blocks`, computed once.

The text lists every parameter of the first decoder layer and the non-layer ones, then says
which other layers differ from layer 0 (none, for a uniform decoder). The HTML page shows the model as a column of blocks in forward order: the non-layer parameters, then
one card per group of identical decoder layers (layers whose parameters have the same styles and
whose collectives are the same are drawn once, as "layers 0-31"), then the rest. Inside a card,
each parameter is a bar coloured by its style (column-parallel, row-parallel, vocab-parallel,
replicated), with its global and local shapes; each collective of the solution is drawn as a
red marker right after the module whose output it moves. A summary table gives collectives per
forward, of an encoder-decoder's first decode step, and per generated token, and bytes per rank.
"""

from __future__ import annotations

import html
import os
import re
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import Any

from autotp.errors import AutoTPError
from autotp.plan_report import GraphReport, PlanReport, block_in, block_of

__all__ = ["Block", "CollectiveRow", "ParamRow", "plan_blocks", "render_html", "render_png", "render_text"]

#: how both renderings name ``PlanReport.first_decode``, and what sets it apart from later steps
_FIRST_DECODE_TITLE = "collectives of the first decode step"
_FIRST_DECODE_NOTE = "an empty KV cache: cross-attention keys/values computed from the encoder output"
_COLORS = {"colwise": "#2b7bb9", "rowwise": "#e08b1f", "vocab": "#6a3d9a", "replicate": "#9e9e9e"}

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;font-size:13px}
.card{border:1px solid #bbb;border-radius:6px;padding:8px 12px;margin:10px 0;background:#fafafa}
.card h3{font-size:14px;margin:2px 0 6px}
.p{display:flex;align-items:center;margin:2px 0;font-size:12px;font-family:monospace}
.bar{display:inline-block;height:14px;border-radius:3px;margin-right:8px}
.name{width:430px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.shape{color:#555;width:300px}
.coll{margin:3px 0 3px 24px;font-size:12px;color:#b2182b;font-family:monospace}
.legend span{display:inline-block;margin-right:14px;font-size:12px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:middle;margin-right:4px}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _group_key(fqn: str) -> tuple[str, int | None, str]:
    """``(stack, index, name inside the block)`` of a parameter (:func:`~autotp.plan_report.block_in`:
    ``model.layers``, T5's ``encoder.block`` and ``decoder.block``), or ``("", None, fqn)`` outside
    every block."""
    found = block_in(fqn)
    if found is None:
        return "", None, fqn
    stack, idx = found
    return stack, idx, fqn[len(f"{stack}.{idx}."):]


def _param_row(name: str, e: dict[str, Any]) -> str:
    color = _COLORS.get(e["style"], "#1b9e77")
    width = 24 if e["style"] == "replicate" else 24 + int(56 * (1 - _fraction(e)))
    return (
        f'<div class="p"><span class="bar" style="width:{width}px;background:{color}"></span>'
        f'<span class="name" title="{_esc(name)}">{_esc(name)}</span>'
        f'<span class="shape">{_esc(tuple(e["global_shape"]))} &rarr; {_esc(tuple(e["local_shape"]))}</span>'
        f"<span>{_esc(e['style'])}</span></div>"
    )


def _fraction(e: dict[str, Any]) -> float:
    n = 1
    for s in e["local_shape"]:
        n *= s
    return n / max(e["global_numel"], 1)


def _sites_by_module(report: PlanReport) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in report.forward.sites:
        out.setdefault(s["after"], []).append(s)
    return out


def _norm(after: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", after)


@dataclass(frozen=True)
class ParamRow:
    """One parameter of a block: its name inside the block and its plan entry."""

    name: str
    entry: dict[str, Any]


@dataclass(frozen=True)
class CollectiveRow:
    """One collective of the forward's solution, drawn right after the module whose output it moves."""

    module: str
    site: dict[str, Any]


@dataclass(frozen=True)
class Block:
    """One card of the drawing: a non-layer module, or a run of identical decoder layers (``layers``
    lists them; the first is shown). ``rows`` are in forward order: each parameter, then the
    collectives after its module."""

    title: str
    layers: tuple[int, ...]
    rows: tuple[ParamRow | CollectiveRow, ...]


def plan_blocks(report: PlanReport) -> list[Block]:
    """The plan as the drawings show it (``--html`` and ``--png`` both draw these), in forward
    order: one card per parameter outside the blocks, one per run of identical consecutive blocks
    of a stack (same styles and shapes, same collectives: a uniform 32-layer model is one card;
    T5's encoder and decoder blocks are separate runs). Blocks and the collectives each owns are
    :func:`~autotp.plan_report.block_in` and :func:`~autotp.plan_report.block_of`, as in the counts."""
    params = {k: v for k, v in report.parameters.items() if not v.get("tied_to")}
    sites = _sites_by_module(report)
    # a tied parameter's module (T5's encoder.embed_tokens, a tied lm_head) has no card of its own:
    # its collectives are drawn on the card of the parameter it shares
    tied_modules: dict[str, list[str]] = {}
    for fqn, e in report.parameters.items():
        if e.get("tied_to"):
            tied_modules.setdefault(e["tied_to"], []).append(fqn.rpartition(".")[0])
    # Parameters in forward order; a block's parameters are drawn where its first one comes (T5: the
    # shared embedding, the encoder's blocks, its final norm, the decoder's blocks, ...).
    order: list[tuple[str, Any, Any]] = []  # ("param", module, [(fqn, entry)]) or ("block", stack, index)
    layers: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] = {}
    for fqn, e in params.items():
        stack, idx, rest = _group_key(fqn)
        if idx is None:  # a module's parameters outside the blocks share one card (a norm's weight and bias)
            module = fqn.rpartition(".")[0] or fqn
            if order and order[-1][0] == "param" and order[-1][1] == module:
                order[-1][2].append((fqn, e))
            else:
                order.append(("param", module, [(fqn, e)]))
            continue
        if (stack, idx) not in layers:
            order.append(("block", stack, idx))
        layers.setdefault((stack, idx), []).append((rest, e))

    def signature(stack: str, idx: int) -> tuple:
        return (
            tuple((r, e["style"], tuple(e["local_shape"])) for r, e in layers[stack, idx]),
            tuple(sorted(Counter((_norm(s["after"]), s["kind"]) for ss in sites.values() for s in ss
                                 if block_of(s) == (stack, idx)).items())),
        )

    # Identical consecutive blocks of one stack (same styles and shapes, same collectives) are drawn once.
    groups: list[tuple[str, Any, Any]] = []  # ("param", fqn, entry) or ("blocks", stack, [indices])
    for kind, a, b in order:
        if kind == "block" and groups and groups[-1][0] == "blocks" and groups[-1][1] == a \
                and signature(a, groups[-1][2][0]) == signature(a, b):
            groups[-1][2].append(b)
        else:
            groups.append((kind, a, b) if kind == "param" else ("blocks", a, [b]))

    # A collective outside every block is drawn on the card of the module after which it sits, or
    # else of the module that made the value it moves (GPT-2's embedding sum, reduced after
    # ``transformer`` adds ``wpe``, is drawn with ``wte``), tied modules counting as their card's.
    card_of = {module: module for kind, module, _ in order if kind == "param"}
    card_of.update({tied: fqn.rpartition(".")[0] or fqn for fqn, modules in tied_modules.items() for tied in modules})
    outside: dict[str, list[CollectiveRow]] = {}
    for module, ss in sites.items():
        for s in ss:
            if block_of(s) is None:
                card = card_of.get(module) or card_of.get(s["origin"]) or ""
                outside.setdefault(card, []).append(CollectiveRow(module, s))

    def collectives_after(module: str, where: tuple[str, int] | None) -> list[CollectiveRow]:
        return [CollectiveRow(module, s) for s in sites.get(module, []) if block_of(s) == where]

    def block(title: str, rows: list[tuple[str, dict[str, Any]]], layers: list[int], stack: str = "") -> Block:
        where = (stack, layers[0]) if layers else None
        body: list[ParamRow | CollectiveRow] = [ParamRow(name, e) for name, e in rows] if where is None else []
        if where is None:
            return Block(title, (), (*body, *outside.pop(title, [])))
        done: set[str] = set()
        for name, e in rows:
            body.append(ParamRow(name, e))
            module = f"{stack}.{layers[0]}.{name.rpartition('.')[0]}"
            if module not in done:
                done.add(module)
                body += collectives_after(module, where)
        if where is not None:  # collectives after a module that holds no parameter (e.g. the block)
            for module in sorted(sites):
                if module not in done and any(block_of(s) == where for s in sites[module]):
                    body += collectives_after(module, where)
        return Block(title, tuple(layers), tuple(body))

    blocks: list[Block] = []
    for kind, a, b in groups:
        if kind == "param":
            blocks.append(block(a, b, []))
            continue
        stack, idxs = a, b
        first = idxs[0]
        title = (
            f"{stack}.{first}"
            if len(idxs) == 1
            else f"{stack}.{{{idxs[0]}..{idxs[-1]}}} ({len(idxs)} identical blocks, layer {first} shown)"
        )
        blocks.append(block(title, layers[stack, first], idxs, stack))
    if outside:  # after a module with no card and made by none (none known; drawn rather than lost)
        blocks.append(Block("outside every module", (), tuple(row for rows in outside.values() for row in rows)))
    return blocks


def _summary(report: PlanReport) -> list[tuple[str, Any]]:
    """The summary table of both drawings: model, tp, collectives, bytes per rank, timings."""

    def counts(d: dict[str, int] | None) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items())) or "none"

    dec = report.decode
    return [
        ("model", f"{report.model} ({report.architecture}, {report.num_layers} layers, {report.dtype})"),
        ("tensor-parallel size", report.tp),
        (
            "collectives per forward",
            f"{counts(report.forward.collectives)} (input {tuple(report.forward.input_shape)})",
        ),
        *([(_FIRST_DECODE_TITLE, f"{counts(report.first_decode.collectives)} ({_FIRST_DECODE_NOTE})")]
          if report.first_decode else []),
        ("collectives per generated token", counts(dec.collectives) if dec else report.decode_note),
        (
            "parameter bytes per rank",
            f"{_human(report.param_bytes_per_rank)} of {_human(report.param_bytes_total)}",
        ),
        (
            "KV-cache bytes per rank",
            f"{_human(report.kv_cache_bytes_per_rank)} of {_human(report.kv_cache_bytes_total)} "
            f"(batch {report.batch}, {report.seq_len} positions)",
        ),
        ("timings (seconds)", ", ".join(f"{k} {v:.1f}" for k, v in report.timings.items())),
    ]


def _where(row: CollectiveRow) -> str:
    """``of <global shape> after <module>``: what a collective row moves, and from where."""
    return f"of {tuple(row.site['global_shape'] or ())} after {row.module}"


def render_html(report: PlanReport) -> str:
    """The plan as an HTML page (a string; ``autotp plan --html FILE`` writes it)."""

    def card(b: Block) -> str:
        body = []
        for row in b.rows:
            if isinstance(row, ParamRow):
                body.append(_param_row(row.name, row.entry))
            else:
                body.append(
                    f'<div class="coll">&#9650; {_esc(row.site["kind"])} {_esc(row.site["src"])}&rarr;'
                    f"{_esc(row.site['dst'])} {_esc(_where(row))}</div>"
                )
        return f'<div class="card"><h3>{_esc(b.title)}</h3>{"".join(body)}</div>'

    cards = [card(b) for b in plan_blocks(report)]
    summary = _summary(report)
    legend = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{_esc(s)}</span>' for s, c in _COLORS.items()
    )
    rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in summary)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>autotp plan: {_esc(report.model)} tp={report.tp}</title><style>{_CSS}</style></head><body>"
        f"<h1>autotp plan: {_esc(report.model)} at tp={report.tp}</h1><table>{rows}</table>"
        f"<div class='legend'>{legend}<span style='color:#b2182b'>&#9650; collective (forward)</span>"
        "<span>bar length: the share of the parameter a rank does not hold</span></div>"
        f"<h2>Blocks, in forward order</h2>{''.join(cards)}</body></html>\n"
    )


def render_png(report: PlanReport, path: str | os.PathLike[str]) -> None:
    """Draw the plan into a PNG (``autotp plan --png FILE``): the same blocks as the HTML page, one
    line per parameter (a glyph of the weight split ``tp`` ways along its shard dim, this rank's
    part filled in the style's colour; name; global -> local shape; style) and a red line per
    collective right after the module whose output it moves. Identical layers are one block, so a
    uniform 32-layer decoder is drawn in a few dozen lines. Needs matplotlib (the ``[plot]`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch, Rectangle
    except ImportError as e:
        raise AutoTPError(
            "autotp plan --png needs matplotlib, which is not installed: "
            "pip install 'autotp[plot]' (or pip install matplotlib), or use --html"
        ) from e
    blocks = plan_blocks(report)
    summary = [(key, textwrap.wrap(str(value), 130) or [""]) for key, value in _summary(report)]
    line = 0.24  # inches per text line
    lines = 2 + sum(len(v) for _, v in summary) + 2 + sum(len(b.rows) + 2 for b in blocks)
    width, height = 13.0, lines * line + 0.4
    fig = plt.figure(figsize=(width, height), dpi=110)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 100)
    ax.set_ylim(lines, 0)  # y counts text lines from the top
    ax.axis("off")
    y = 1.0
    ax.text(1, y, f"autotp plan: {report.model} at tp={report.tp}", fontsize=13, weight="bold", va="center")
    y += 1.2
    for key, values in summary:
        ax.text(1, y, f"{key}:", fontsize=9, weight="bold", va="center")
        for value in values:
            ax.text(22, y, value, fontsize=9, va="center")
            y += 1
    x = 1.0
    for style, color in _COLORS.items():
        ax.add_patch(Rectangle((x, y - 0.3), 1.2, 0.6, color=color))
        ax.text(x + 1.6, y, style, fontsize=9, va="center")
        x += 10
    ax.text(
        x,
        y,
        "\u25b2 collective (forward), after the module whose output it moves",
        color="#b2182b",
        fontsize=9,
        va="center",
    )
    y += 1.5
    for b in blocks:
        top = y - 0.6
        ax.text(1.5, y, b.title, fontsize=10, weight="bold", va="center")
        y += 1
        for row in b.rows:
            if isinstance(row, ParamRow):
                _glyph(ax, Rectangle, row.entry, report.tp, 2.0, y)
                ax.text(8, y, row.name, fontsize=8.5, family="monospace", va="center")
                ax.text(
                    50,
                    y,
                    f"{tuple(row.entry['global_shape'])} \u2192 {tuple(row.entry['local_shape'])}",
                    fontsize=8.5,
                    family="monospace",
                    color="#555555",
                    va="center",
                )
                ax.text(
                    82,
                    y,
                    row.entry["style"],
                    fontsize=8.5,
                    va="center",
                    color=_COLORS.get(row.entry["style"], "#1b9e77"),
                )
            else:
                ax.text(
                    4,
                    y,
                    f"\u25b2 {row.site['kind']} {row.site['src']}\u2192{row.site['dst']} {_where(row)}",
                    fontsize=8.5,
                    family="monospace",
                    color="#b2182b",
                    va="center",
                )
            y += 1
        ax.add_patch(
            FancyBboxPatch(
                (0.8, top),
                98.4,
                y - top - 0.4,
                boxstyle="round,pad=0,rounding_size=0.3",
                fill=False,
                edgecolor="#bbbbbb",
                linewidth=0.8,
            )
        )
        y += 1
    fig.savefig(path, format="png")
    plt.close(fig)


def _glyph(ax: Any, rectangle: Any, entry: dict[str, Any], tp: int, x: float, y: float) -> None:
    """A weight's split: a box cut into ``tp`` stripes across its shard dim (rows for dim 0,
    columns for dim 1), the first stripe, one rank's part, filled; a replicated weight is filled
    whole."""
    w, h = 4.0, 0.7
    color = _COLORS.get(entry["style"], "#1b9e77")
    dim = entry.get("shard_dim")
    ndim = len(entry["global_shape"])
    if entry["style"] == "replicate" or dim is None or tp == 1:
        ax.add_patch(rectangle((x, y - h / 2), w, h, facecolor=color, edgecolor="#444444", linewidth=0.5))
        return
    across_rows = dim == 0 and ndim > 1  # dim 0 of a matrix: horizontal stripes
    for i in range(tp):
        if across_rows:
            box = (x, y - h / 2 + i * h / tp), w, h / tp
        else:
            box = (x + i * w / tp, y - h / 2), w / tp, h
        ax.add_patch(
            rectangle(*box, facecolor=color if i == 0 else "#eeeeee", edgecolor="#444444", linewidth=0.5)
        )


def _human(n: int | None) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``0.2 MiB`` reads badly)."""
    if n is None:
        return "n/a"
    value, unit = float(n), "B"
    for u in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, u
    return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"


def _counts_bytes(counts: dict[str, int], nbytes: dict[str, int]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k} {v} ({_human(nbytes.get(k, 0))})" for k, v in sorted(counts.items()))


def _per_block(graph: GraphReport) -> list[str]:
    """One line per stack of blocks (``GraphReport.block_collectives``): what each block issues
    (runs of blocks that issue alike shown once), then the collectives outside every block."""
    lines = []
    for stack, blocks in graph.block_collectives().items():
        runs: list[tuple[list[int], dict[str, int]]] = []
        for index, kinds in blocks.items():
            if runs and runs[-1][1] == kinds and runs[-1][0][-1] == index - 1:
                runs[-1][0].append(index)
            else:
                runs.append(([index], kinds))
        per = "; ".join(f"blocks {r[0]}..{r[-1]}: {kinds}" if len(r) > 1 else f"block {r[0]}: {kinds}"
                        for r, kinds in runs)
        if len(runs) == 1 and runs[0][0] == list(range(len(blocks))):
            per = str(runs[0][1])  # every block alike
        lines.append(f"  per block of {stack}: {per}")
    if lines:
        outside = ", ".join(f"{s['kind']} after {s['after']}" for s in graph.outside_blocks()) or "none"
        lines.append(f"  outside blocks: {outside}")
    return lines


def render_text(report: PlanReport) -> str:
    """The per-layer table and the totals ``autotp plan`` prints."""
    lines = [
        f"autotp plan: {report.model} ({report.architecture}, {report.num_layers} layers, {report.dtype}) "
        f"at tp={report.tp}, on meta (no weights, no process group)"
    ]
    if report.overrides:
        extra = report.forward.extra_cost_of_overrides
        lines.append(
            f"overrides: {report.overrides}"
            + (
                f" (cost +{extra:.1f} byte-equivalents per token over the unconstrained plan)"
                if extra is not None
                else " (the unconstrained plan already satisfies them)"
            )
        )
    params = {k: v for k, v in report.parameters.items()}
    shown = [(k, v) for k, v in params.items() if _group_key(k)[1] in (None, 0)]
    width = max((len(k) for k, _ in shown), default=10)
    lines.append(f"  {'parameter':<{width}}  {'style':<9} {'dim':>3}  {'global shape':<16} local shape")
    for fqn, e in shown:
        style = f"tied to {e['tied_to']}" if e.get("tied_to") else e["style"]
        dim = "-" if e["shard_dim"] is None else str(e["shard_dim"])
        lines.append(
            f"  {fqn:<{width}}  {style:<9} {dim:>3}  {str(tuple(e['global_shape'])):<16} "
            f"{tuple(e['local_shape'])}"
        )
    layer0 = {
        _group_key(k)[2]: (v["style"], v["placement"]) for k, v in params.items() if _group_key(k)[1] == 0
    }
    differ = sorted(
        {
            idx
            for k, v in params.items()
            for _, idx, rest in [_group_key(k)]
            if idx not in (None, 0) and layer0.get(rest) != (v["style"], v["placement"])
        }
    )
    others = sorted({idx for k in params for _, idx, _ in [_group_key(k)] if idx not in (None, 0)})
    if others:
        lines.append(
            f"  layers {others[0]}..{others[-1]}: "
            + ("same styles as layer 0" if not differ else f"differ from layer 0 in layers {differ}")
        )
    f, d = report.forward, report.decode
    lines.append(
        f"collectives per forward (input {tuple(f.input_shape)}, bytes per rank): "
        f"{_counts_bytes(f.collectives, f.collective_bytes)}"
    )
    lines += _per_block(f)
    if f.cost is not None:
        lines.append(
            f"  solver: cost {f.cost:.1f} byte-equivalents per token; "
            + (
                "proved optimal (gap 0)"
                if not f.gap
                else f"the optimum is at least {f.lower_bound:.1f} (gap {f.gap:.1f}: at most what the plan may "
                "lose; neither the beam nor the certificate's linear program, autotp/passes/ilp.py, proved more)"
            )
        )
    first = report.first_decode
    if first is not None:
        lines.append(
            f"{_FIRST_DECODE_TITLE} (input {tuple(first.input_shape)}, {_FIRST_DECODE_NOTE}; bytes per rank): "
            f"{_counts_bytes(first.collectives, first.collective_bytes)}"
        )
        lines += _per_block(first)
    if d is not None:
        lines.append(
            f"collectives per generated token (input {tuple(d.input_shape)}, KV cache of {report.seq_len} "
            f"positions, bytes per rank): {_counts_bytes(d.collectives, d.collective_bytes)}"
        )
        lines += _per_block(d)
    else:
        lines.append(f"collectives per generated token: not available: {report.decode_note}")
    lines.append(
        f"parameter bytes per rank: {_human(report.param_bytes_per_rank)} of {_human(report.param_bytes_total)}"
        + (" (rank 0, which holds the largest chunks)" if any(e.get("uneven") for e in params.values()) else "")
    )
    uneven: dict[str, list[str]] = {}
    for fqn, e in params.items():
        if e.get("uneven") and not e.get("tied_to"):
            uneven.setdefault(e["uneven"], []).append(fqn)
    for note, names in uneven.items():
        lines.append(f"ranks carry unequal work: {note} ({', '.join(names)})")
    if report.kv_cache_bytes_total is not None:
        lines.append(
            f"KV-cache bytes per rank (batch {report.batch}, {report.seq_len} positions): "
            f"{_human(report.kv_cache_bytes_per_rank)} of {_human(report.kv_cache_bytes_total)}"
        )
    t = report.timings
    if "report_cache_read_s" in t:  # the only line that differs from the run that planned it
        lines.append(f"timings: read from the report cache (autotp/report_cache.py) in {t['report_cache_read_s']:.2f} s")
        return "\n".join(lines)
    phases = [k for k in ("trace", "decompose", "solve", "total") if f"{k}_s" in t]
    lines.append(
        "timings, wall / CPU seconds (CPU excludes time other processes took): "
        + ", ".join(f"{k} {t[f'{k}_s']:.1f} / {t.get(f'{k}_cpu_s', float('nan')):.1f}" for k in phases)
        + "; "
        + ", ".join(
            f"{k.removesuffix('_s')} {v:.1f}"
            for k, v in t.items()
            if k.endswith("_s") and not k.endswith("cpu_s") and k.removesuffix("_s") not in phases
        )
        + " (wall)"
    )
    return "\n".join(lines)
