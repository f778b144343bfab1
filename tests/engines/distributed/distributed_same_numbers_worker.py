"""One process of a test run of tests/engines/distributed/test_distributed_same_numbers.py (the pattern
of distributed_real_models_worker.py), and the modules and loaders that test builds too.

The test starts every rank with LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; a JSON spec
lists trainings run one after the other in the same processes:

    python tests/engines/distributed/distributed_same_numbers_worker.py SPEC.json

Each run seeds as a user does (``seed_everything`` before building the module), trains ``model``
under engine="distributed" on a loader built with ``shuffle``, and writes `<name>.ckpt` and
`<name>.rank<R>.json` (the training sampler Lightning put into the loader) into the spec's `out`.
"""

import json
import os
from typing import Any, Dict

import lightning as L
import torch
from lightning.fabric.utilities.seed import seed_everything
from support.ranks import quiet_trainer, serve
from support.toy import ToyModule, toy_loader
from torch import nn
from torch.utils.data import DataLoader

from pipeckpt import PipelineStrategy, pipeline_of

SEED = 123
DROPOUT = 0.1
VOCAB, LENGTH = 64, 12


class DroppingLM(L.LightningModule):
    """A Hugging Face causal LM (tiny random config, dropout on), trained as its users write it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        import transformers

        if name == "gpt2":  # embedding, residual and attention dropout; the embedding's is outside the layers
            config: Any = transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False,
                resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, bos_token_id=0, eos_token_id=0,
            )  # fmt: skip
            self.model: nn.Module = transformers.GPT2LMHeadModel(config)
            self.layers = "transformer.h"
        else:  # attention dropout only: a float handed to scaled_dot_product_attention, no dropout module
            config = transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                attention_dropout=DROPOUT, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )  # fmt: skip
            self.model = transformers.LlamaForCausalLM(config)
            self.layers = "model.layers"

    def configure_pipeline(self) -> nn.Module:
        return pipeline_of(self.model, self.layers)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # a token mean; every micro-batch holds as many tokens

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lm_loader(n: int = 32, batch_size: int = 8) -> DataLoader:
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(0))
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=batch_size, shuffle=False)


def build(model: str, shuffle: bool = False) -> Any:
    """The module (seeded as a user seeds: ``seed_everything``, then the module) and its loader."""
    seed_everything(SEED, verbose=False)
    if model == "toy":
        module: L.LightningModule = ToyModule()
        plain = toy_loader()
        return module, DataLoader(plain.dataset, batch_size=plain.batch_size, shuffle=shuffle)
    return DroppingLM(model), lm_loader()


def run(spec: Dict[str, Any], out: str, world: int) -> None:
    strategy = PipelineStrategy(engine="distributed", **spec["strategy"])
    module, loader = build(spec["model"], spec.get("shuffle", False))
    trainer = quiet_trainer(
        strategy, world, max_steps=spec["steps"], use_distributed_sampler=spec.get("sampler", False)
    )
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(out, f"{spec['name']}.ckpt"))
    sampler = trainer.train_dataloader.sampler
    seen = {"sampler": type(sampler).__name__, "shuffle": getattr(sampler, "shuffle", None)}
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(0)
        seen.update(order=list(sampler), num_replicas=sampler.num_replicas)
    with open(os.path.join(out, f"{spec['name']}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    serve(run)
