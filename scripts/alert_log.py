"""On-call's side of the webhooks in alerts/alertmanager.yml, for the local stack: one line per alert that
Alertmanager sends (``python scripts/alert_log.py [--port 9095]``). In production the same URLs point at a
paging or chat bridge."""

from __future__ import annotations

import argparse

from aiohttp import web


async def receive(request: web.Request) -> web.Response:
    payload = await request.json()
    for alert in payload.get("alerts", []):
        labels = alert.get("labels", {})
        where = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("alertname", "severity"))
        print(f"[{request.match_info['receiver']}] {alert.get('status', '?').upper()} "
              f"{labels.get('alertname')} ({labels.get('severity')}) {where}: "
              f"{alert.get('annotations', {}).get('summary', '')}", flush=True)
    return web.Response()


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=9095)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/{receiver}", receive)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
