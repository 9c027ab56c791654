"""The Batch API: OpenAI's ``/v1/files`` and ``/v1/batches`` through the guard (docs/batch.md).

objects.py (the files and batches, in OpenAI's shapes), validate.py (an uploaded file, line by line), store.py
(what a store keeps, and which one a config gets), sqlite_store.py and redis_store.py (the embedded store
and the shared one), line.py (one line through the guard's own request path), pace.py (when another line may
start), results.py (output and error lines), runner.py (running a batch under a lease), routes.py (the
handlers), metrics.py (the series) and install.py (the wiring into the app).
"""
