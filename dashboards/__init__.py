"""kvguard's Grafana dashboards, generated from plain dicts; ``python -m dashboards [--check]``."""
