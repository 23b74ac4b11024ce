"""The one benchmark harness of the CPU and GPU sections: ``registry`` (every section),
``context`` (what a section reads), ``report`` (rows, results, the JSON), ``sizes`` (the one
size table: full, quick, dry)."""
