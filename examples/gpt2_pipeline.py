"""Hugging Face ``GPT2LMHeadModel``, unmodified, pipelined into stages.

The model is built from a small ``GPT2Config`` (random weights, nothing downloaded),
keeps its tied input embedding / LM head, and reads a padding attention mask. The
only pipeline-specific code is ``configure_pipeline`` (two lines) and the strategy.

    pip install "pipeckpt[hf]"
    python examples/gpt2_pipeline.py
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import pipeckpt


class GPT2Module(L.LightningModule):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(config)

    def configure_pipeline(self):  # the blocks transformer.h.0 ... h.N-1 become the stages' layers
        return pipeckpt.pipeline_of(self.model, "transformer.h")

    def training_step(self, batch, batch_idx):
        ids, mask = batch
        logits = self.model(ids, attention_mask=mask).logits
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # no loss on padding
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(n: int = 64, length: int = 16, vocab: int = 128) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # right padding
    return DataLoader(TensorDataset(ids, mask), batch_size=8)


def config(dropout: float = 0.1) -> GPT2Config:
    return GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


if __name__ == "__main__":
    torch.manual_seed(0)
    module = GPT2Module(config())
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=4, checkpoint="except_last")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(module, data())
    trainer.save_checkpoint("gpt2_pipelined.ckpt")
    # The checkpoint holds the model's own keys: it loads strict=True into the unmodified model.
    state = torch.load("gpt2_pipelined.ckpt", weights_only=True)["state_dict"]
    plain = GPT2LMHeadModel(config())
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    print("trained, saved and reloaded into the unmodified GPT2LMHeadModel")
