"""Attack harnesses: adversarial tenants replayed against the engine, straight and through the guard.

Run them as modules from the repository root (``python -m bench.attacks.fill_squeeze``) so that they can
import the shared benchmark helpers (``bench.stack``, ``bench.latency``, ``bench.run_info``).
"""
