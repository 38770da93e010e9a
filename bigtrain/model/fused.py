"""Names of checkpoints written before the GPT split its fused layers (commit e621a82).

Such checkpoints hold `blocks.N.attn.qkv.{weight,bias}` with rows [q; k; v], and for SwiGLU models
`blocks.N.mlp.up.{weight,bias}` with 2 * hidden rows [gate; up]. Today's GPT has `attn.q`,
`attn.k`, `attn.v`, `mlp.gate` and `mlp.up` of their own. `fused_rows` says where each of today's
tensors lies in the old ones; `bigtrain ckpt convert` reads through it (checkpoint/legacy.py),
so old checkpoints convert to today's names, optimizer state included (and an INT8 calibration,
`unfused_calibration`).
"""

from __future__ import annotations

import re

Shape = tuple[int, ...]

QKV = re.compile(r"^(blocks\.\d+)\.attn\.qkv\.weight$")


def is_fused(names) -> bool:
    """Whether tensor names (canonical) are those of a GPT checkpoint from before the split."""
    return any(QKV.match(name) for name in names)


def fused_rows(shapes: dict[str, Shape]) -> dict[str, tuple[str, int, int]]:
    """Today's name -> (fused name, first row, rows) for every tensor that lies in a fused one of
    `shapes` (canonical names -> shapes); names not in the result are the same in both layouts.

    q has d_model rows (the qkv weight's columns), k and v split the rest; a SwiGLU `mlp.up` is
    fused when it has twice the rows `mlp.down` takes as input: gate first, then up. A bias
    follows its weight's split."""
    out: dict[str, tuple[str, int, int]] = {}
    for name, shape in shapes.items():
        match = QKV.match(name)
        if not match:
            continue
        block, (rows, d_model) = match[1], shape
        kv = (rows - d_model) // 2
        splits = [("q", 0, d_model), ("k", d_model, kv), ("v", d_model + kv, kv)]
        _add(out, shapes, f"{block}.attn.qkv", f"{block}.attn", splits)
        up, down = shapes.get(f"{block}.mlp.up.weight"), shapes.get(f"{block}.mlp.down.weight")
        if up is not None and down is not None and up[0] == 2 * down[1]:
            gate_up = [("gate", 0, down[1]), ("up", down[1], down[1])]
            _add(out, shapes, f"{block}.mlp.up", f"{block}.mlp", gate_up)
    return out


def _add(out, shapes, fused: str, module: str, splits: list[tuple[str, int, int]]) -> None:
    for param in ("weight", "bias"):
        if f"{fused}.{param}" in shapes:
            for part, first, rows in splits:
                out[f"{module}.{part}.{param}"] = (f"{fused}.{param}", first, rows)


def unfused_shapes(shapes: dict[str, Shape]) -> dict[str, Shape]:
    """`shapes` with every fused tensor replaced by today's tensors in it (in its place, in row
    order); the same shapes (as tuples) when nothing is fused."""
    parts: dict[str, list[tuple[str, Shape]]] = {}
    for name, (fused, _, rows) in fused_rows(shapes).items():
        parts.setdefault(fused, []).append((name, (rows, *shapes[fused][1:])))
    out: dict[str, Shape] = {}
    for name, shape in shapes.items():
        out.update(parts.get(name, [(name, tuple(shape))]))
    return out


def unfused_calibration(act_amax: dict[str, list], layers) -> dict[str, list]:
    """An INT8 calibration (max |x| per input channel, by layer name) saved before the split, for
    today's `layers` (names; more than the calibrated ones do no harm): q, k and v saw the fused
    qkv's input, a SwiGLU gate the fused up's (and up keeps its own). The same calibration when
    nothing in it is fused."""
    if not any(name.endswith(".attn.qkv") for name in act_amax):
        return act_amax
    source = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "up"}
    out = {n: v for n, v in act_amax.items() if not n.endswith(".attn.qkv")}
    for name in layers:
        module, _, leaf = name.rpartition(".")
        fused = f"{module}.{source.get(leaf, leaf)}"
        if name not in out and fused in act_amax:
            out[name] = act_amax[fused]
    return out
