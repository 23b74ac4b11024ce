"""Metrics: the records the engine publishes (``records``) and their Prometheus export
(``prometheus``: the sink + scrape-time Collector and the /metrics HTTP server).

Importing this package imports nothing heavy; ``metrics.prometheus`` pulls in prometheus-client.
"""
