"""A run's data from `data.source=prepared`: the sources of `data.mixture` opened and checked
against each other, packed, and mixed (data/read/mixture.py); validation from `data.val_mixture` or
the held-out tail of each source."""

from __future__ import annotations

import hashlib
import json

import torch

from bigtrain.config.data import DataConfig, MixtureSource
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.data.read.mixture import MixedSamples, MixtureStream, SourceSpec
from bigtrain.data.read.prepared import PreparedData
from bigtrain.data.read.stream import PackedSamples, Samples, TrainingData, split_tokens
from bigtrain.errors import ConfigError
from bigtrain.utils.dist import all_gather_objects

VAL_SEED = 0  # the validation set's order: the same whatever train.seed is


class OrderedSamples:
    """Samples in a stream's order: item i is `samples` item `stream.sample_at(i)`. The
    validation set of a mixture, each source in proportion to its weight."""

    def __init__(self, samples: Samples, stream: MixtureStream) -> None:
        self.samples, self.stream = samples, stream

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, indices: list[int]) -> torch.Tensor:
        return self.samples.get([self.stream.sample_at(i) for i in indices])


def open_mixture(cfg: DataConfig, seq_len: int, seed: int, is_main: bool) -> TrainingData:
    """Rank 0 verifies every shard against its manifest's sha256; every rank then raises the
    same error together (or none), and opens the sources without hashing them again."""
    error = None
    if is_main:
        try:
            _open_checked(cfg, verify=True)
        except ConfigError as e:
            error = str(e)
    error = all_gather_objects(error)[0]
    if error is not None:
        raise ConfigError(error)
    train, val = _open_checked(cfg, verify=False)
    return build_mixture(cfg, train, val, seq_len, seed)


def _open_checked(cfg: DataConfig, verify: bool) -> tuple[list[PreparedData], list[PreparedData]]:
    train = [PreparedData.open(e.path, verify=verify) for e in cfg.mixture]
    val = [PreparedData.open(e.path, verify=verify) for e in cfg.val_mixture]
    check_compatible(train + val)
    for key, sources in (("data.mixture", train), ("data.val_mixture", val)):
        names: dict[str, PreparedData] = {}
        for data in sources:
            if data.name in names:
                raise ConfigError(
                    f"{key}: '{names[data.name].path}' and '{data.path}' have the same directory "
                    "name, which names a source in events and tokens_by_source; rename one"
                )
            names[data.name] = data
    return train, val


def check_compatible(sources: list[PreparedData]) -> None:
    """Every source must have been prepared with the same tokenizer (and so the same EOS): the
    same files, or else the same vocabulary, merges and special tokens (a tokenizer saved again
    by `bigtrain prepare` has other bytes)."""
    first = sources[0]
    for other in sources[1:]:
        same = other.tokenizer_sha256 == first.tokenizer_sha256  # cheap, and enough for most
        same = same or other.tokenizer_identity == first.tokenizer_identity
        if not same or other.eos_id != first.eos_id:
            raise ConfigError(
                f"data.mixture: '{first.path}' and '{other.path}' were prepared with different "
                f"tokenizers (vocabulary, merges or special tokens: "
                f"{_short(first.tokenizer_identity)}, eos {first.eos_id} vs "
                f"{_short(other.tokenizer_identity)}, eos {other.eos_id}); prepare every source "
                "with the same tokenizer (data.tokenizer=DIR/tokenizer of the first)"
            )


def _short(identity: str) -> str:
    kind, _, digest = identity.partition("-")
    return f"{kind} {digest[:12]}"


def _whole(data: PreparedData, seq_len: int, key: str) -> PackedSamples:
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ConfigError(
            f"{key}: '{data.path}' has {len(data)} tokens, too few for model.seq_len={seq_len}"
        )
    return PackedSamples(data, seq_len, 0, count)


def build_mixture(
    cfg: DataConfig,
    train: list[PreparedData],
    val: list[PreparedData],
    seq_len: int,
    seed: int,
) -> TrainingData:
    """Pack and mix opened sources (checked by the caller)."""
    if val:
        train_parts = [_whole(d, seq_len, "data.mixture") for d in train]
        val_parts = [_whole(d, seq_len, "data.val_mixture") for d in val]
        val_entries = cfg.val_mixture
    else:
        split = [
            split_tokens(d, seq_len, cfg.val_fraction, f"data.mixture '{d.path}'") for d in train
        ]
        train_parts, val_parts = [t for t, _ in split], [v for _, v in split]
        val_entries = [MixtureSource(e.path, e.weight) for e in cfg.mixture]
        val = train
    specs = _specs(cfg.mixture, train, train_parts)
    val_specs = _specs(val_entries, val, val_parts)
    val_samples = MixedSamples(val_parts, [d.name for d in val])
    first = train[0]
    summary = CorpusSummary(
        "prepared",
        [e.path for e in cfg.mixture],
        sum(d.num_documents for d in train),
        sum(d.num_tokens for d in train),
    )
    return TrainingData(
        key=mixture_key(train, specs),
        summary=summary,
        vocab_size=first.vocab_size,
        eos_id=first.eos_id,
        tokenizer_dir=str(first.tokenizer_dir),
        train=MixedSamples(train_parts, [d.name for d in train]),
        stream=MixtureStream(specs, seed),
        val=OrderedSamples(val_samples, MixtureStream(val_specs, VAL_SEED)),
        skipped_rows={
            f: n for d in train for f, n in (d.manifest.get("skipped_rows") or {}).items()
        },
    )


def _specs(
    entries: list[MixtureSource], sources: list[PreparedData], parts: list[PackedSamples]
) -> list[SourceSpec]:
    return [
        SourceSpec(d.name, len(p), e.weight, e.max_epochs)
        for e, d, p in zip(entries, sources, parts, strict=True)
    ]


def mixture_key(sources: list[PreparedData], specs: list[SourceSpec]) -> str:
    """Changes when the training tokens or their order would: a shard's content (its sha256 in
    the manifest), the tokenizer, a weight, a max_epochs, a source's number of samples (seq_len,
    val_fraction). Not with what else a manifest records (bigtrain version, source description),
    so the same tokens prepared again are the same corpus."""
    h = hashlib.sha256()
    for data, spec in zip(sources, specs, strict=True):
        content = [data.tokenizer_sha256, data.eos_id, str(data.dtype)]
        content += [shard["sha256"] for shard in data.manifest["shards"]]
        content += [spec.weight, spec.max_epochs, spec.num_samples]
        h.update(json.dumps(content).encode())
    return "mixture-" + h.hexdigest()[:16]


def check_length(stream: MixtureStream, num_positions: int, max_steps: int) -> None:
    """A run must not need more samples than sources with max_epochs hold (skip windows can
    still add some: MixtureStream.take then stops the run)."""
    if stream.end is not None and stream.end < num_positions:
        limits = ", ".join(f"{s.name} max_epochs={s.max_epochs}" for s in stream.specs)
        raise ConfigError(
            f"data.mixture: every source has a max_epochs ({limits}), which allows "
            f"{stream.end} samples, but train.max_steps={max_steps} needs {num_positions}; "
            "raise max_epochs, add a source without it, or lower train.max_steps"
        )
