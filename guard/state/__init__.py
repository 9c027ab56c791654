"""Where the counters live: in the process (one guard), or in Redis for several guards (``shared_state``)."""
