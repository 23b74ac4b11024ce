"""``bench_gpu``'s sections (sections.py) and what they measure with: models.py (probes, model
arithmetic, the model and runner), step.py, attention.py, server.py."""
