"""The app's throughput callback (pipeckpt/app/throughput.py) in real Lightning runs on the CPU: the
tokens it logs are the batches' tokens exactly, its rates are those tokens over the seconds of its
own clock (replaced here by one that advances a second per reading, so every figure is exact), and
under the distributed engine the two stages of one pipeline, which read the same batches, count them
once, each of the 2 processes being one device."""

import csv
import itertools
import re
from pathlib import Path
from typing import Any, Dict, List

import lightning as L
import pytest
import torch
import transformers
from test_hf_model import train  # train.py with the CPU and a 200 kB corpus, ranks launchable
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pipeckpt
from pipeckpt import PipeckptConfigError
from pipeckpt.app import throughput
from pipeckpt.app.throughput import ThroughputLog, batch_tokens, model_flops_per_token
from pipeckpt.app.tiny_pretrained import tiny_config

BATCH, SEQ_LEN, STEPS, VOCAB = 4, 16, 5, 50
FLOPS_PER_TOKEN = 1000


class TokenModel(L.LightningModule):
    """Reads ``(x, y)`` batches of token ids, as the app's GPT does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
        self.flops_per_token = FLOPS_PER_TOKEN

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x).flatten(0, 1), y.flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class VectorModel(L.LightningModule):
    """Reads ``(x, y)`` batches of float vectors: no tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens_loader() -> DataLoader:
    ids = torch.randint(0, VOCAB, (BATCH * 20, SEQ_LEN))
    return DataLoader(TensorDataset(ids, ids), batch_size=BATCH)


@pytest.fixture
def clock(monkeypatch) -> None:
    """The callback's clock: one second later at each reading (a start, each batch's end, each
    validation's start and end)."""
    seconds = itertools.count()
    monkeypatch.setattr(throughput, "perf_counter", lambda: float(next(seconds)))


def fit(quiet_trainer, module: L.LightningModule, loader: DataLoader, **options: Any) -> L.Trainer:
    callback = options.pop("callback", None) or ThroughputLog(window=3)
    trainer = quiet_trainer(callbacks=[callback], max_steps=STEPS, log_every_n_steps=1, **options)
    trainer.fit(module, loader, **({"val_dataloaders": loader} if "val_check_interval" in options else {}))
    return trainer


def logged(trainer: L.Trainer) -> Dict[str, float]:
    return {k: float(v) for k, v in trainer.logged_metrics.items()}


def test_the_logged_token_count_is_steps_times_batch_times_seq_len(quiet_trainer):
    trainer = fit(quiet_trainer, TokenModel(), tokens_loader())
    assert logged(trainer)["tokens"] == STEPS * BATCH * SEQ_LEN


def test_tokens_per_second_are_the_windows_tokens_over_the_callbacks_seconds(quiet_trainer, clock):
    trainer = fit(quiet_trainer, TokenModel(), tokens_loader())
    assert logged(trainer)["tokens_per_sec"] == BATCH * SEQ_LEN  # one batch's tokens per clock second


def test_validation_time_is_left_out_of_the_rate(quiet_trainer, clock):
    trainer = fit(quiet_trainer, TokenModel(), tokens_loader(), val_check_interval=2, limit_val_batches=1)
    assert logged(trainer)["tokens_per_sec"] == BATCH * SEQ_LEN  # each validation's end reads it once more


def test_one_process_on_the_cpu_is_one_device(quiet_trainer, clock):
    strategy = pipeckpt.PipelineStrategy(stages=2, chunks=2)  # both stages on the one CPU device
    metrics = logged(fit(quiet_trainer, TokenModel(), tokens_loader(), strategy=strategy))
    assert metrics["tokens_per_sec_per_device"] == metrics["tokens_per_sec"] == BATCH * SEQ_LEN


def test_mfu_is_the_model_flops_per_second_over_the_devices_peak(quiet_trainer, clock):
    trainer = fit(
        quiet_trainer, TokenModel(), tokens_loader(), callback=ThroughputLog(window=3, peak_flops=1e6)
    )
    assert logged(trainer)["mfu"] == pytest.approx(BATCH * SEQ_LEN * FLOPS_PER_TOKEN / 1e6, rel=1e-6)


def test_no_mfu_is_logged_on_a_cpu_whose_peak_is_unknown(quiet_trainer):
    metrics = logged(fit(quiet_trainer, TokenModel(), tokens_loader()))
    assert "mfu" not in metrics and "tokens_per_sec" in metrics


def test_the_rates_are_on_the_progress_bar(quiet_trainer):
    trainer = fit(
        quiet_trainer, TokenModel(), tokens_loader(), callback=ThroughputLog(window=3, peak_flops=1e6)
    )
    assert {"tokens_per_sec", "tokens_per_sec_per_device", "mfu"} <= set(trainer.progress_bar_metrics)


def test_data_without_tokens_logs_samples_per_second(quiet_trainer, clock):
    x, y = torch.randn(BATCH * 20, 8), torch.randint(0, 2, (BATCH * 20,))
    metrics = logged(fit(quiet_trainer, VectorModel(), DataLoader(TensorDataset(x, y), batch_size=BATCH)))
    assert (metrics["samples"], metrics["samples_per_sec"]) == (STEPS * BATCH, BATCH)
    assert "tokens" not in metrics


def test_the_summary_rate_runs_from_the_first_batchs_end_to_the_last(quiet_trainer, clock):
    callback = ThroughputLog(window=3)
    fit(quiet_trainer, TokenModel(), tokens_loader(), callback=callback)
    assert callback.first is not None and callback.last is not None
    assert (callback.last.tokens - callback.first.tokens, callback.last.seconds - callback.first.seconds) == (
        (STEPS - 1) * BATCH * SEQ_LEN,
        STEPS - 1,
    )
    assert callback.summary()["tokens_per_sec"] == BATCH * SEQ_LEN


def test_a_hugging_face_batch_counts_every_input_id_pads_included():
    ids = torch.ones(3, 7, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[:, 5:] = 0  # padded: the model reads those positions too
    assert batch_tokens({"input_ids": ids, "attention_mask": mask, "labels": ids}) == 21


def test_flops_per_token_are_transformers_six_per_non_embedding_parameter():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))  # untied head
    assert model_flops_per_token(model) == 6 * model.num_parameters(exclude_embeddings=True)


def test_a_window_under_two_batches_is_refused_naming_the_setting():
    with pytest.raises(PipeckptConfigError, match=r"^callbacks\.throughput\.window=1: "):
        ThroughputLog(window=1)


def metrics_rows(out: Path) -> List[Dict[str, str]]:
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_stages_of_one_distributed_pipeline_count_its_batches_once(tmp_path):
    """The default app run (batches of 16 windows of 128 bytes, 4 steps) as 2 stages on 2 processes:
    1 data-parallel replica, so the tokens are those of 4 batches, not 8, over 2 devices."""
    done = train(
        tmp_path,
        "strategy.engine=distributed",
        "trainer.devices=2",
        "validate=false",
        "callbacks.throughput.window=2",
    )
    rows = [r for r in metrics_rows(tmp_path) if r.get("tokens")]
    last = rows[-1]
    assert float(last["tokens"]) == 4 * 16 * 128
    assert float(last["tokens_per_sec_per_device"]) == pytest.approx(
        float(last["tokens_per_sec"]) / 2, rel=1e-6
    )
    total, per_device = re.search(
        r"(\d+) tokens/s \((\d+) per device\)", done.stdout.splitlines()[-1]
    ).groups()
    assert abs(int(total) / 2 - int(per_device)) <= 1  # each printed rounded to a whole token
