"""The engine's HTTP side: the aiohttp app, OpenAI endpoints, the async engine that drives the step loop
from a thread, SSE, errors and Prometheus metrics. Never waits on a step."""
