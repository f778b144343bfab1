"""``configure_model`` under the local engine: the module is built on the meta device, made real
whole in the one process, and trains bitwise as the same module built eagerly."""

import pytest
from support.meta_models import Configured, Uninitialisable
from support.toy import ToyModule, assert_bitwise_equal, fit, params

from pipeckpt import PipelineStrategy
from pipeckpt._errors import PipeckptConfigError

SEED = 5


def test_a_module_built_in_configure_model_trains_bitwise_as_the_eager_build():
    eager = ToyModule(seed=SEED, batch_norm=True)
    fit(eager, PipelineStrategy(balance=[3, 3], chunks=2), steps=3)
    built = Configured(seed=SEED)
    fit(built, PipelineStrategy(balance=[3, 3], chunks=2), steps=3)
    assert built.built_on == "meta"
    assert_bitwise_equal(params(built), params(eager))


def test_a_layer_that_cannot_initialise_itself_is_refused_before_training():
    module = Uninitialisable(seed=SEED)
    with pytest.raises(PipeckptConfigError, match=r"self\.layers\.6 \(Gain, holding gain\) is on the meta"):
        fit(module, PipelineStrategy(balance=[3, 4], chunks=2), steps=1)
    assert module.global_step == 0
