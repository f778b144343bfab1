"""A run of identical blocks profiled once and repeated (pipeckpt/memory/repeated.py) predicts what
the whole model's profile predicts."""

import torch
import torch.nn.functional as F

from pipeckpt.app.models.llama import llama_config, llama_layers
from pipeckpt.checkpointing.modes import ALWAYS, NEVER
from pipeckpt.memory.predict import predict
from pipeckpt.memory.profile import fake_mode, profile
from pipeckpt.memory.repeated import identical_run, repeat_layer, shortened
from pipeckpt.stages.partition import StagePlan

MEMORY = ("params", "grads", "optimizer", "activations", "boundary", "working", "peak", "peak_at")


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def test_the_longest_identical_run_is_the_decoder_blocks() -> None:
    config = llama_config("tiny", seq_len=16)
    config.num_hidden_layers = 7
    assert identical_run(llama_layers(config)) == (1, 8)


def test_three_blocks_repeated_predict_the_memory_of_the_whole_profile() -> None:
    config = llama_config("tiny", seq_len=16)
    config.num_hidden_layers = 7
    with fake_mode():
        layers = llama_layers(config)
        tokens, target = torch.randint(256, (2, 16)), torch.randint(256, (2, 16))
        whole = profile(layers, tokens, loss_fn=_loss, target=target, fake=True)
        short, index, count = shortened(layers)
        assert (len(short), index, count) == (5, 2, 5)
        repeated = repeat_layer(profile(short, tokens, loss_fn=_loss, target=target, fake=True), index, count)
    for modes in ((NEVER, ALWAYS, NEVER), (ALWAYS, NEVER, ALWAYS)):
        plan = StagePlan(balance=(3, 3, 3), devices=(torch.device("cpu"),) * 3, modes=modes)
        for schedule in ("gpipe", "1f1b"):
            a = predict(whole, plan, chunks=4, schedule=schedule)
            b = predict(repeated, plan, chunks=4, schedule=schedule)
            assert [[getattr(s, f) for f in MEMORY] for s in a.stages] == [
                [getattr(s, f) for f in MEMORY] for s in b.stages
            ]
