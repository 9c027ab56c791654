"""Decision records: for every request, what the guard decided and why (its stages, the replicas it weighed,
its reservation, the prefix cache it expected and got), kept for ``GET /requests/{id}`` on the admin
listener and, with ``decision_log``, written as JSON lines. A record never holds a prompt, an output or a
key: names, numbers and the guard's own error codes only."""
