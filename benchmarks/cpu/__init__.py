"""``make bench``'s sections by topic: serving, chat128, cache, models (run_all.py)."""
