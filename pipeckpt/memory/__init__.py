"""The memory model and the planner: profile the layers, predict each stage's peak, and choose
the plan (``checkpoint='auto'``) under a budget."""
