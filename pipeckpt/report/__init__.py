"""What a run reports: the per-stage report (time, memory) and the memory check against the
model's prediction."""
