"""Tokenizing 100k chat rows with data=dataset: time and peak memory, beside a hand-written peer.

Variants, each a fresh process (its peak resident memory, its tokenizing workers' included), run in
interleaved rounds and reported as medians:
- ``pipeckpt``: ``DatasetDataModule.setup`` on a cold cache (chat format, ChatML, labels on the
  assistant's turns, validation split), one tokenizing process and ``num_proc=2``;
- ``pipeckpt, cached``: the same setup again on the cache the first one wrote;
- ``peer``: what a user writes without it: ``load_dataset`` and a ``map`` of
  ``apply_chat_template(tokenize=True)``, one process, no masks, no checks (the floor of the work).

    python benchmarks/bench_dataset_tokenize.py --rows 100000 --rounds 3
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

WORDS = "the cat sat on a mat and the dog ran to it while birds sang over green hills".split()


def _turn(row: int, words: int, step: int) -> str:
    return " ".join(WORDS[(row * step + j) % len(WORDS)] for j in range(words))


def write_chats(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            messages = [
                {"role": "system", "content": "answer briefly"},
                {"role": "user", "content": _turn(i, 8 + i % 9, 3)},
                {"role": "assistant", "content": _turn(i, 6 + i % 7, 5)},
                {"role": "user", "content": _turn(i, 4 + i % 5, 7)},
                {"role": "assistant", "content": _turn(i, 5 + i % 6, 11)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def child(variant: str, data: str, tokenizer: str, cache: str) -> None:
    """One variant, timed in this process; prints its seconds."""
    os.environ["HF_DATASETS_CACHE"] = cache
    import datasets

    datasets.disable_progress_bars()
    start = time.perf_counter()
    if variant == "peer":
        from transformers import AutoTokenizer

        from pipeckpt.app.data.dataset.templates import BUILT_IN

        tok = AutoTokenizer.from_pretrained(tokenizer)
        table = datasets.load_dataset("json", data_files=[data], split="train")
        table.map(
            lambda row: {
                "input_ids": tok.apply_chat_template(row["messages"], chat_template=BUILT_IN["chatml"])
            },
            remove_columns=table.column_names,
        )
    else:
        from pipeckpt.app.data.dataset import DatasetDataModule

        procs = 2 if variant.endswith("2") else 1
        module = DatasetDataModule(
            path=data, tokenizer=tokenizer, format="chat", chat_template="chatml", seq_len=256, num_proc=procs
        )
        module.setup("fit")
    print(json.dumps({"s": time.perf_counter() - start}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=4)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    from pipeckpt.app.tiny_pretrained import make_tiny_pretrained

    work = Path(tempfile.mkdtemp(prefix="bench_tokenize_"))
    tokenizer = make_tiny_pretrained(work / "tiny", "llama")
    data = work / "chat.jsonl"
    write_chats(data, args.rows)
    variants = ["peer", "pipeckpt num_proc=1", "pipeckpt num_proc=2", "pipeckpt, cached"]
    results: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            cache = work / "cache-warm" if variant.endswith("cached") else work / "cache-cold"
            if not variant.endswith("cached"):
                shutil.rmtree(cache, ignore_errors=True)
            elif not cache.exists():
                timed("pipeckpt num_proc=1", data, tokenizer, cache)  # fills the cache once
            results[variant].append(timed(variant, data, tokenizer, cache))
    peer = statistics.median(r["s"] for r in results["peer"])
    print(f"{args.rows:,} chat rows (5 messages each), tiny Llama tokenizer, medians of {args.rounds} rounds")
    print("| variant | time s | rows/s | time / peer | peak RSS MiB (largest process) |")
    print("|---|---|---|---|---|")
    for variant in variants:
        s = statistics.median(r["s"] for r in results[variant])
        peak = statistics.median(r["peak_mib"] for r in results[variant])
        print(f"| {variant} | {s:.1f} | {args.rows / s:,.0f} | {s / peer:.2f} | {peak:,.0f} |")
    shutil.rmtree(work, ignore_errors=True)


def timed(variant: str, data: Path, tokenizer: Path, cache: Path) -> Dict[str, float]:
    """``variant``'s seconds and its peak resident memory: run under a wrapper process, whose
    ``RUSAGE_CHILDREN`` high-water mark is the largest of the variant's process and the tokenizing
    workers it waited on (the largest one process, not their sum)."""
    script = (
        "import resource, subprocess, sys, json;"
        "d = subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True);"
        "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss;"
        "print(d.stdout.strip().splitlines()[-1][:-1] + ', \"peak_kib\": %d}' % r)"
    )
    command = [sys.executable, __file__, "--child", variant, str(data), str(tokenizer), str(cache)]
    done = subprocess.run(
        [sys.executable, "-c", script, *command], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"s": result["s"], "peak_mib": result["peak_kib"] / 1024}


if __name__ == "__main__":
    main()
