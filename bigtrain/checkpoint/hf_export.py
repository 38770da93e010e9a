"""Export weights as a transformers model directory (safetensors), and check the export.

The directory holds what `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer` read:
config.json, generation_config.json, model.safetensors (or shards model-0000i-of-0000n.safetensors
and model.safetensors.index.json) and the tokenizer's files. Weights are FP32. Tensors are read
one at a time and written shard by shard, so memory holds at most one shard plus one tensor (plus
the HF tensor it is a part of: GPT-2's c_attn holds q, k and v).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.data.prepare.cache import load_tokenizer
from bigtrain.errors import ConfigError
from bigtrain.model.hf_mapping import HFMapping
from bigtrain.utils.files import usual_permissions

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Where transformers configs keep the longest input the model takes (the position table).
CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")
FP32_BYTES = 4


def export_hf(
    mapping: HFMapping,
    read: Callable[[str], torch.Tensor],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
    max_shard_bytes: int = 5 * 10**9,
    generation: dict[str, Any] | None = None,
) -> list[str]:
    """Write the model described by `mapping` into `out_dir`, a new directory (an existing
    non-empty one is refused: never overwrite a user's files).

    `read(name)` returns the full FP32 tensor of bigtrain canonical name `name`; it is called
    once per tensor, in `mapping.shapes` order, once the shards before its HF tensor's are
    written. `tokenizer_dir`: a transformers tokenizer directory
    (or hub name) whose files are copied and whose bos/eos/pad ids go into config.json and
    generation_config.json. `max_shard_bytes`: the largest safetensors file (a tensor larger than
    that gets a shard of its own). `generation`: more generation_config.json fields (e.g.
    `max_new_tokens`), which win over the tokenizer's ids. Everything is written into a temporary
    directory beside `out_dir` and renamed into place, so a failed export leaves nothing.
    Returns the names of the files written, sorted."""
    out_dir = Path(out_dir)
    _refuse_existing(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-export-", dir=out_dir.parent))
    try:
        tokenizer = load_tokenizer(str(tokenizer_dir)) if tokenizer_dir is not None else None
        ids = _token_ids(tokenizer, mapping.config.get("vocab_size"))
        _write_weights(mapping, read, tmp, max_shard_bytes)
        config = {**mapping.config, **ids}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_generation_config(tmp, {**ids, **(generation or {})})
        if tokenizer is not None:
            _save_tokenizer(tokenizer, mapping.config, tmp)
        usual_permissions(tmp)  # mkdtemp made it 0700, safetensors its files 0600
        _refuse_existing(out_dir)  # someone may have made it meanwhile
        if out_dir.exists():
            out_dir.rmdir()  # empty: the rename below needs the name free
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out_dir.iterdir())
    logger.info("export: %s written to %s (%s)", mapping.architecture, out_dir, ", ".join(files))
    return files


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ConfigError(f"export directory {out_dir} exists and is not empty (choose a new one)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"export directory {out_dir} exists and is a file")


def _token_ids(tokenizer, vocab_size: int | None) -> dict[str, int]:
    """The tokenizer's bos/eos/pad ids that it defines; checks it fits the embedding table."""
    if tokenizer is None:
        return {}
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size "
            f"{vocab_size}: the export would not embed them all"
        )
    found = {key: getattr(tokenizer, key, None) for key in TOKEN_IDS}
    return {key: value for key, value in found.items() if value is not None}


def _save_tokenizer(tokenizer, config: dict[str, Any], directory: Path) -> None:
    """The tokenizer's files, saying the model's context length: transformers' default (1e30)
    lets longer inputs through, which index past GPT-2's position table (an IndexError); with
    the length, transformers truncates (truncation=True) or warns."""
    length = next((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int)), None)
    if length is not None:
        tokenizer.model_max_length = length
    tokenizer.save_pretrained(str(directory))


def _write_generation_config(directory: Path, fields: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    try:
        GenerationConfig(**fields).save_pretrained(str(directory))
    except ValueError as e:
        raise ConfigError(f"export generation settings {fields}: {e}".splitlines()[0]) from None


def plan_shards(hf_shapes: dict[str, tuple[int, ...]], max_shard_bytes: int) -> list[list[str]]:
    """HF tensor names grouped into shards in order, each at most `max_shard_bytes` of FP32
    (a larger tensor alone in its shard), as transformers' save_pretrained splits."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in hf_shapes.items():
        nbytes = FP32_BYTES * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """`model.safetensors` alone, or transformers' `model-00001-of-00003.safetensors` names."""
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def _hf_tensors(
    mapping: HFMapping, read: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, FP32 CPU tensor) in `mapping.hf_shapes()` order, one bigtrain tensor read at a
    time (the few of one HF tensor, GPT-2's q, k and v, before it is written)."""
    read_in_order = (
        (name, read(name).detach().to("cpu", torch.float32)) for name in mapping.shapes
    )
    yield from mapping.split(read_in_order)
    for hf_name, shape in mapping.extra.items():
        yield hf_name, torch.zeros(shape, dtype=torch.float32)


def _write_weights(
    mapping: HFMapping, read: Callable[[str], torch.Tensor], directory: Path, max_shard_bytes: int
) -> None:
    """Safetensors shards (and the index when there are several), streamed shard by shard."""
    from safetensors.torch import save_file

    hf_shapes = mapping.hf_shapes()
    shards = plan_shards(hf_shapes, max_shard_bytes)
    files = shard_file_names(len(shards))
    shard_of = {name: i for i, names in enumerate(shards) for name in names}
    buffer: dict[str, torch.Tensor] = {}
    current = 0
    for hf_name, tensor in _hf_tensors(mapping, read):
        assert shard_of[hf_name] == current, "tensors come in the planned order"
        buffer[hf_name] = tensor
        if len(buffer) == len(shards[current]):  # complete: written before the next read
            save_file(buffer, str(directory / files[current]), metadata={"format": "pt"})
            buffer.clear()
            current += 1
    assert current == len(shards), "every planned tensor was written"
    if len(shards) > 1:
        numel = sum(math.prod(s) for s in hf_shapes.values())
        index = {
            "metadata": {"total_parameters": numel, "total_size": FP32_BYTES * numel},
            "weight_map": {name: files[shard_of[name]] for name in sorted(shard_of)},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def check_export(
    model: nn.Module, out_dir: str | Path, vocab_size: int, seq_len: int, seed: int = 0
) -> dict[str, Any]:
    """Load `out_dir` with transformers and compare its logits with `model`'s (a bigtrain GPT or
    HFCausalLM holding the exported weights; forward(ids) -> logits) on a fixed random batch of
    2 x min(seq_len, 64) token ids, both in eval mode and FP32.

    Returns max_abs_diff, max_rel_diff (max abs diff / max abs logit), the tensors transformers
    found missing, unexpected or of another shape (missing_keys, unexpected_keys,
    mismatched_keys), and ok: max_rel_diff <= 1e-4 with none of those."""
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    hf, info = AutoModelForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32, output_loading_info=True
    )
    hf = hf.to(device).eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (2, min(seq_len, 64)), generator=generator).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ours = model(ids).float()
            theirs = hf(input_ids=ids, use_cache=False).logits.float()
    finally:
        model.train(was_training)
    if ours.shape != theirs.shape:
        raise ConfigError(
            f"logits of shape {tuple(theirs.shape)} from {out_dir}, "
            f"{tuple(ours.shape)} from the model"
        )
    # expensive device-to-host synchronization (twice): the check's numbers go to the host
    max_abs = (ours - theirs).abs().max().item()
    max_rel = max_abs / max(ours.abs().max().item(), 1e-30)
    keys = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return {
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        **keys,
        "ok": max_rel <= 1e-4 and not any(keys.values()),
    }
