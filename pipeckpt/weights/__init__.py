"""Weights from outside a run: a pretrained directory or state-dict file a module built on the meta
device is filled from, each process reading only the tensors it holds (:mod:`.pretrained`)."""
