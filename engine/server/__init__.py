"""The engine's HTTP side: the aiohttp app, OpenAI endpoints, SSE, errors, Prometheus metrics and tracing,
over the ``AsyncEngine`` (engine/async_engine.py). Never waits on a step."""
