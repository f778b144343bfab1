"""pipeline_of under the distributed engine: Hugging Face GPT2LMHeadModel (random
init, tied input embedding / LM head, a padding mask) and lightning.pytorch.demos.Transformer (encoder
output read by every decoder layer), unmodified, pipelined into 2 processes.

One launch of 2 real processes (gloo on CPU, tests/engines/distributed/distributed_real_models_worker.py)
runs every training;
each is compared with the unpipelined module trained in this process: trained weights within 1e-5
relative (dropout off: masks are drawn per rank), and with dropout on, ``always`` bitwise equal to
``never``. Checkpoints hold the model's own keys, each once, and load strict=True into the unmodified
model. Fast tests check the routing of the layers and the refusals without processes.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import support.ranks as ranks
import torch
from support.real_models import client
from support.toy import assert_bitwise_equal, max_relative_difference
from test_distributed_pytree import _state
from torch import nn

from pipeckpt import PipeckptConfigError, pipeline_of
from pipeckpt.engines.distributed.rooted import RootRouting, check_module_pipeline
from pipeckpt.settings import PipeSettings

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_real_models_worker.py"
START_S = 480  # every training below, on a loaded 2-core machine
STEPS = 3
TWO = dict(balance=[2, 2], chunks=4)
RUNS = [  # name, client, distributed settings
    ("gpt2_gpipe_never", "gpt2", dict(TWO, schedule="gpipe", checkpoint="never")),
    ("gpt2_1f1b_always", "gpt2", dict(TWO, schedule="1f1b", checkpoint="always")),
    ("gpt2_gpipe_mix", "gpt2", dict(TWO, schedule="gpipe", checkpoint=["except_last", "offload"])),
    ("gpt2_1f1b_clip", "gpt2", dict(TWO, schedule="1f1b", checkpoint="always")),  # clipped: CLIP
    ("demo_1f1b_never", "demo", dict(TWO, schedule="1f1b", checkpoint="never")),
    ("demo_gpipe_always", "demo", dict(TWO, schedule="gpipe", checkpoint="always")),
    (
        "demo_interleaved_mix",
        "demo",
        dict(
            balance=[1, 1, 1, 1],
            virtual_stages=2,
            chunks=4,
            schedule="interleaved_1f1b",
            checkpoint=["always", "never", "except_last", "always"],
        ),
    ),
]
CLIP = 0.05  # by norm; the parameters outside the layers, held by both ranks, count once
DROPOUT = [("gpt2_dropout_never", "never"), ("gpt2_dropout_always", "always")]


# -- without processes -------------------------------------------------------------------


class _Skip(nn.Module):
    """Three layers and a skip made outside them: layer 2 reads layer 0's output through a sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h0 = self.layers[0](self.inp(x))
        h1 = self.layers[1](h0)
        return self.layers[2](h1 + h0) * scale


def test_each_stage_runs_its_own_layers_and_takes_earlier_outputs_giving_the_plain_forward():
    model, x = _Skip(), torch.randn(2, 3)
    expected = model(x, scale=2.0)
    names = ["layers.0", "layers.1", "layers.2"]
    routing = RootRouting(pipeline_of(model, "layers"), [(0, 1), (1, 3)], names)
    call = ((x,), {"scale": 2.0})
    sent = routing.run(0, live=False, microbatch=0, call=call, received=[])
    assert [i for i, _ in sent] == [0]  # stage 0 stops at the first call of stage 1's layer
    got = routing.run(1, live=False, microbatch=0, call=call, received=sent)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    routing.restore()
    assert "forward" not in model.layers[0].__dict__


def test_a_layer_called_out_of_the_named_order_is_refused_naming_it_and_what_was_sent():
    model, x = _Skip(), torch.randn(2, 3)
    routing = RootRouting(pipeline_of(model, "layers"), [(0, 1), (1, 3)], ["l.0", "l.1", "l.2"])
    wrong = [(1, torch.zeros(2, 4))]
    with pytest.raises(PipeckptConfigError, match=r"(?s)called l\.0 on pipeline stage 1.*\['l\.1'\].*HINT"):
        routing.run(1, live=False, microbatch=0, call=((x,), {}), received=wrong)


def test_a_forward_that_never_reaches_the_next_stage_is_refused_naming_its_first_layer():
    model = _Skip()
    routing = RootRouting(pipeline_of(model, "layers"), [(0, 2), (2, 3)], ["l.0", "l.1", "l.2"])
    routing.root_forward = lambda x: model.layers[1](model.layers[0](x))  # skips layer 2 (stage 1)
    with pytest.raises(PipeckptConfigError, match=r"(?s)without calling l\.2 \(the first layer.*HINT"):
        routing.run(0, live=False, microbatch=0, call=((torch.ones(1, 4),), {}), received=[])


def test_profiling_a_module_pipeline_is_refused_with_the_fix():
    with pytest.raises(PipeckptConfigError, match=r"(?s)balance_by='time' with pipeline_of\(model.*HINT"):
        check_module_pipeline("model", PipeSettings(balance_by="time"))


# -- two real processes ------------------------------------------------------------------


def _launch(runs: List[Dict[str, Any]], out: Path, world: int = 2) -> Path:
    return ranks.launch(WORKER, world, runs, out, within_s=START_S)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Iterator[Path]:
    runs: List[Dict[str, Any]] = [dict(name=n, client=c, strategy=s, steps=STEPS) for n, c, s in RUNS]
    for run in runs:
        if run["name"].endswith("_clip"):
            run["gradient_clip_val"] = CLIP
    for name, mode in DROPOUT:
        strategy = dict(TWO, schedule="1f1b", checkpoint=mode)
        runs.append(dict(name=name, client="gpt2", strategy=strategy, steps=STEPS, dropout=0.1))
    yield _launch(runs, tmp_path_factory.mktemp("real"))


def _unpipelined(name: str, clip: Any = None) -> Dict[str, torch.Tensor]:
    module, loader = client(name)
    torch.manual_seed(123)
    ranks.quiet_trainer("auto", 1, max_steps=STEPS, gradient_clip_val=clip).fit(module, loader)
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("name, client_name, settings", RUNS, ids=[r[0] for r in RUNS])
def test_the_unmodified_model_trains_across_two_processes_like_the_unpipelined_one(
    two_processes, name, client_name, settings
):
    got = _state(two_processes / f"{name}.ckpt")["state_dict"]
    reference = _unpipelined(client_name, CLIP if name.endswith("_clip") else None)
    assert sorted(got) == sorted(reference)  # the model's own keys, each once
    assert max_relative_difference({k: got[k] for k in reference}, reference) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name, client_name", [("gpt2_1f1b_always", "gpt2"), ("demo_gpipe_always", "demo")])
def test_a_checkpoint_loads_strictly_into_the_unmodified_model(two_processes, name, client_name):
    state = _state(two_processes / f"{name}.ckpt")["state_dict"]
    plain = client(client_name)[0].model
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
    if client_name == "gpt2":  # the tie survives: one parameter, trained once
        assert plain.lm_head.weight is plain.transformer.wte.weight


@pytest.mark.slow
def test_recomputing_the_layers_leaves_dropout_training_bitwise_unchanged(two_processes):
    never = _state(two_processes / "gpt2_dropout_never.ckpt")["state_dict"]
    always = _state(two_processes / "gpt2_dropout_always.ckpt")["state_dict"]
    assert_bitwise_equal(always, never)
    assert max_relative_difference(never, client("gpt2", dropout=0.1)[0].state_dict()) > 1e-3  # it trained
