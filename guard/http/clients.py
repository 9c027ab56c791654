"""The guard's side of its connections to the engines, alive from start-up to clean-up (built whole when the
app starts, guard/server/app.py: what needs the running loop)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from guard.http.tokens import TokenCounter
from guard.wire.relay import Relay


@dataclass(slots=True)
class Clients:
    session: aiohttp.ClientSession
    relay: Relay
    counter: TokenCounter
    tasks: list[asyncio.Task] = field(default_factory=list)  # subscriptions and the health monitor


CLIENTS = web.AppKey("clients", Clients)
