"""Peak resident memory of ``pipeckpt.export`` writing a ~134M-parameter Hugging Face Llama (fp32,
512 MiB) as safetensors shards of 50 MB, from a sharded checkpoint directory and from a ``.ckpt``.

Why: the export must never hold the whole model, whatever the checkpoint's size: a few shards at
most. Each measurement is a fresh process: ``imports`` imports the export and builds the model on the
meta device (what does not grow with the model); ``sharded`` and ``ckpt`` export the model from each
kind of checkpoint (written first, in another process). Two peaks: ``ru_maxrss`` (all resident
pages, the ``.ckpt``'s memory-mapped file pages included: clean page cache the kernel may drop) and
the largest anonymous resident memory (``RssAnon``, sampled every 5 ms: what the process itself
holds). Target: each export's anonymous peak over ``imports`` at most 2.5 of its largest shard, and
not growing with the shard: the export reads a shard's tensors 16 MiB at a time and writes each as
read (``pipeckpt.export.safetensors_writer``). From a sharded directory it holds a group, plus the
stored tensor DCP's reader loads whole before copying it out (2x the 94 MiB embedding or head here),
plus what glibc keeps of freed groups; from a ``.ckpt`` it writes the memory-mapped tensors and holds
none of them. A tensor larger than ``max_shard_size`` is a shard of
its own, as in ``save_pretrained`` (the 94 MiB embedding and head here); ``--shard-mb 200`` gives
shards of many tensors.

Command::

    python benchmarks/bench_export.py --out OUT.md     # about 1 min on 2 cores, ~2 GiB at most
    python benchmarks/bench_export.py --layers 36      # 3x the blocks: the same peak over imports
    python benchmarks/bench_export.py --shard-mb 200   # larger shards: the same peak over imports
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from typing import Any, Dict

SHARD = 50_000_000  # bytes, huggingface_hub's unit (50 MB)
CONFIG: Dict[str, Any] = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
    num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256, use_cache=False,
)  # fmt: skip


def _config() -> Any:
    import transformers

    layers = int(os.environ.get("BENCH_EXPORT_LAYERS", CONFIG["num_hidden_layers"]))
    return transformers.LlamaConfig(**dict(CONFIG, num_hidden_layers=layers))


def _write(root: str) -> int:
    """The model's checkpoints under ``root`` (the keys of a LightningModule holding it as
    ``self.model``); returns the model's bytes."""
    import torch
    import transformers

    from pipeckpt.state import sharded

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    sharded.save({"state_dict": state}, os.path.join(root, "sharded"))
    torch.save({"state_dict": state}, os.path.join(root, "run.ckpt"))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _anon() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def _measure(kind: str, root: str) -> str:
    """``"<peak RSS> <peak anonymous RSS>"`` in bytes of this process doing ``kind``."""
    import threading
    import time

    peak = [_anon()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _export(kind, root)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _anon())
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024} {peak[0]}"


def _export(kind: str, root: str) -> None:
    import torch
    import transformers

    from pipeckpt.export import export_hf
    from pipeckpt.export.hf import skeleton

    torch.set_num_threads(1)
    skeleton(_config(), transformers.LlamaForCausalLM)
    if kind != "imports":
        checkpoint = os.path.join(root, "sharded" if kind == "sharded" else "run.ckpt")
        out = os.path.join(root, f"hf-{kind}")
        llama = transformers.LlamaForCausalLM
        shard = int(os.environ.get("BENCH_EXPORT_SHARD", SHARD))
        export_hf(checkpoint, out, prefix="model.", config=_config(), model_class=llama, max_shard_size=shard)


def _run(*args: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's pipeckpt
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="a markdown file for the table (default: print it)")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="a larger model")
    parser.add_argument("--shard-mb", type=int, default=SHARD // 10**6, help="max_shard_size in MB")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, root = args.child
        print(_write(root) if kind == "write" else _measure(kind, root))
        return
    os.environ["BENCH_EXPORT_LAYERS"] = str(args.layers)  # the children build the same model
    os.environ["BENCH_EXPORT_SHARD"] = str(args.shard_mb * 10**6)
    mib = 2**20
    with tempfile.TemporaryDirectory() as root:
        model = int(_run("--child", "write", root))
        peaks = {kind: _run("--child", kind, root).split() for kind in ("imports", "sharded", "ckpt")}
        files = [f for f in os.scandir(os.path.join(root, "hf-sharded")) if f.name.endswith(".safetensors")]
        largest = max(f.stat().st_size for f in files)
    rss0, anon0 = (int(v) for v in peaks["imports"])
    rows = [
        "| process | peak RSS MiB | over imports MiB | peak anonymous MiB | over imports MiB | / model "
        "| / largest shard | within 2.5 shards |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, (rss, anon) in peaks.items():
        over, over_anon = int(rss) - rss0, int(anon) - anon0
        ok = "" if kind == "imports" else ("yes" if over_anon <= 2.5 * largest else "NO")
        rows.append(
            f"| {kind} | {int(rss) / mib:.0f} | {over / mib:.0f} | {int(anon) / mib:.0f} "
            f"| {over_anon / mib:.0f} | {over_anon / model:.2f} | {over_anon / largest:.2f} | {ok} |"
        )
    head = f"model {model / mib:.0f} MiB fp32, {len(files)} shards, the largest {largest / mib:.0f} MiB"
    text = "\n".join([head, "", *rows])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
