"""The engine's serving side: ``AsyncEngine`` (async_engine.py: the step loop on its own thread, driven from
an event loop), and over it the aiohttp app, OpenAI endpoints, SSE, errors, Prometheus metrics, tracing and
the KV-event feed. The HTTP side never waits on a step."""
