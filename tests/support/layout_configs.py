"""The app's configs of a layout search on a small HF Llama built from its config (nothing
downloaded), for tests of ``strategy.layout=auto`` (pipeckpt/plan_layout.py)."""

from typing import Any, Sequence

LLAMA = (
    "model.config={model_type:llama,hidden_size:%d,intermediate_size:176,num_hidden_layers:4,"
    "num_attention_heads:%d,num_key_value_heads:%d,vocab_size:%d,max_position_embeddings:64,"
    "tie_word_embeddings:false}"
)


def llama_search(*extra: str, vocab: int = 512, heads: int = 4, kv_heads: int = 2) -> Any:
    """The composed train config: the Llama (``vocab`` tokens, ``heads`` of 16 features each,
    ``kv_heads``), sequence 32, global batch 4, the distributed engine on 2 processes,
    ``strategy.layout=auto``, and ``extra`` (the cluster, say)."""
    overrides = [
        "model=hf",
        LLAMA % (16 * heads, heads, kv_heads, vocab),
        "model.seq_len=32",
        "data.batch_size=4",
    ]
    overrides += ["strategy.engine=distributed", "trainer.devices=2", "strategy.layout=auto", *extra]
    return compose_train(overrides)


def compose_train(overrides: Sequence[str]) -> Any:
    """The app's train config composed with ``overrides``, as ``python train.py`` composes it."""
    from hydra import compose, initialize_config_dir

    from pipeckpt.app.config import register
    from pipeckpt.plan import CONF

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def train_py(args: Sequence[str], run_dir: Any, steps: int = 2) -> Any:
    """``python train.py`` with ``args`` for ``steps`` steps on CPU, no validation, in ``run_dir``,
    as a fresh user's shell runs it (no pick handed on from this process); the finished process (its
    return code, stdout and stderr). The process group is killed after 15 minutes."""
    import os
    import sys
    from pathlib import Path

    from pipeckpt.plan_pick import PICK_VARIABLE
    from support import forkserver

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != PICK_VARIABLE}
    env.update(PYTHONPATH=str(root), PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        "train.py",
        *args,
        f"trainer.max_steps={steps}",
        "trainer.accelerator=cpu",
        "validate=false",
        "trainer.enable_progress_bar=false",
        "strategy.timeout=300",
        f"hydra.run.dir={run_dir}",
    ]
    return forkserver.run(command, cwd=root, env=env, timeout=900)
