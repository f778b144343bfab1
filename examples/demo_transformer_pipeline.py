"""Lightning's own ``lightning.pytorch.demos.Transformer`` (encoder-decoder), unmodified,
pipelined: its encoder and decoder layers are the stages' layers; the encoder's output
reaches every decoder layer as the model's own forward passes it (no glue).

    python examples/demo_transformer_pipeline.py
"""

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt


class DemoModule(L.LightningModule):
    def __init__(self, vocab_size: int = 64, dropout: float = 0.2) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=dropout)

    def configure_pipeline(self):
        return pipeckpt.pipeline_of(self.model, "transformer.encoder.layers", "transformer.decoder.layers")

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        output = self.model(inputs, target)  # log-probabilities, (batch * length, vocab)
        return F.nll_loss(output, target.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(n: int = 64, length: int = 12, vocab: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, length + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


if __name__ == "__main__":
    torch.manual_seed(0)
    module = DemoModule()
    strategy = pipeckpt.PipelineStrategy(stages=4, chunks=4, checkpoint="always")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(module, data())
    trainer.save_checkpoint("demo_pipelined.ckpt")
    state = torch.load("demo_pipelined.ckpt", weights_only=True)["state_dict"]
    Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2).load_state_dict(
        {k.removeprefix("model."): v for k, v in state.items()}, strict=True
    )
    print("trained, saved and reloaded into the unmodified demo Transformer")
