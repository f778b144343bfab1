"""A resume of ``model=hf`` from the directory its checkpoint was written from, checked before any work.

Why: a checkpoint's weights replace the pretrained ones, so a run resumed with another ``model.path``
trains the old run's model under the new directory's name (and tokenizer), or, when the shapes
differ, is refused only after the new model has been read, in the hyper-parameter's own name
(``pretrained_path=``). The checkpoint records its directory (:data:`PATH_HPARAM`); here it is read
from the checkpoint's hyper-parameters alone (weights-only, no tensor:
:mod:`pipeckpt.state.saved_hparams`) and compared with ``model.path`` before the data, the model or
the processes exist.
"""

import os
from typing import List, Optional

from pipeckpt._errors import config_error
from pipeckpt.state.saved_hparams import saved_hyper_parameters
from pipeckpt.weights.hub import local_directory

__all__: List[str] = ["PATH_HPARAM", "check_resumed_path"]

#: The hyper-parameter under which :class:`~pipeckpt.app.models.hf.HFCausalLM` records ``model.path``
#: (``path`` itself is the data's corpus to Lightning, which refuses two values of one hparam).
PATH_HPARAM = "pretrained_path"


def _shown(path: Optional[str]) -> str:
    return "null" if path is None else str(path)


def _same(old: Optional[str], new: Optional[str]) -> bool:
    """One directory, however spelled (relative or absolute, a Hub id or its snapshot, a link)."""
    if old is None or new is None:
        return old is new
    if old == new:
        return True
    were, are = local_directory(old), local_directory(new)
    return were.exists() and are.exists() and os.path.realpath(were) == os.path.realpath(are)


def check_resumed_path(path: Optional[str], ckpt_path: Optional[str]) -> None:
    """Refuses resuming ``ckpt_path`` with ``model.path=path`` when the checkpoint was written by a
    run of another ``model.path``. A checkpoint that is no local file or directory (Lightning's
    ``last``, ``hpc``, a URL), or that records no ``model.path``, is left to the resume's own checks."""
    if ckpt_path is None or not os.path.exists(ckpt_path):
        return
    saved = saved_hyper_parameters(ckpt_path)
    if saved is None or PATH_HPARAM not in saved:
        return
    old = saved[PATH_HPARAM]
    old = None if old is None else str(old)
    if _same(old, path):
        return
    fresh = f" to fine-tune {path} from its own weights" if path is not None else ""
    raise config_error(
        f"model.path={_shown(path)} with ckpt_path={ckpt_path}, written by a run of model.path={_shown(old)}",
        "a checkpoint resumes the model it was written from (its weights replace the pretrained ones, "
        "so the run would go on training the checkpoint's model under another directory's name)",
        f"set model.path={_shown(old)} to resume that run, or start without ckpt_path{fresh}",
    )
