"""Load generator (``kvserve loadtest`` / ``python -m loadtest``): workloads, runs, reports.

``workload`` parses declarative workload files; ``generator`` drives a server over gRPC (open or
closed loop); ``stats`` defines every latency figure; ``report`` builds the JSON and summary;
``plots`` draws PNGs; ``launch`` starts a ``kvserve serve`` subprocess for tests and benchmarks.
"""
