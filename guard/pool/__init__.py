"""The engines behind the guard: telemetry subscriptions, health monitoring, circuit breakers and modes."""
