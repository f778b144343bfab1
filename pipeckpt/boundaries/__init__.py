"""What crosses a stage boundary: pytrees cut into micro-batches, side inputs, and how a module
names the part to pipeline (``configure_pipeline``, ``pipeline_of``)."""
