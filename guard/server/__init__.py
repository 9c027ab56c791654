"""Start-up wiring: the guard app built from its config, its lifecycle, the health monitor and reloads."""
