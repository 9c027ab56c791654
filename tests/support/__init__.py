"""What the tests share: one helper for each job. Tests import it as ``from support.<module> import ...``
(pytest puts ``tests/`` on ``sys.path``); the modules import each other relatively.

Servers and processes
- ``net``: ``free_port()``, ``request(url, body)`` (status and body, errors included), ``health(url)``.
- ``wait``: ``wait_for(probe, done, timeout)`` polls until ``done(probe())``; ``until`` is its async twin.
- ``loop_thread``: ``LoopThread``, the one in-process server helper (an event loop on a daemon thread;
  ``run(coro)``, ``call(fn)`` on that loop), and ``AppThread``, an aiohttp app served from one.
- ``engine_server``: ``ServerThread``, the real engine (tiny model, CPU) in-process, on a loopback port.
- ``guard_server``: ``GuardThread``, the real guard in-process; ``guard_config(engine_url, ...)``.
- ``processes``: the one process factory: ``EngineProcess``, ``GuardProcess``, ``Process`` (any server),
  ``Processes`` (a named group stopped together; the ``processes`` fixture); ``run_command(*command)``
  runs a tool or script to completion.

Integrity checks and purpose-built parts
- ``nothing_lost``: the reliability tests' counted ``Client``/``Tally``, ``ready_guard``, and the closing
  check ``assert_nothing_lost`` (every request answered, every block back, nothing held by the guard).
- ``fault_upstream``: ``FaultUpstream``, a fake engine for the faults a real one cannot produce on demand.
- ``redis_server``: ``RedisServer``, a real ``redis-server`` on a free loopback port (restartable, no
  persistence, ``DEBUG SLEEP`` allowed), for the guards' shared state.
- ``blackhole``: ``BlackHole``, a TCP relay in front of a real engine that can swallow everything (connections
  accepted, nothing answered).
- ``haproxy``: ``HAProxy``, Debian's haproxy on deploy/haproxy.cfg with only its addresses changed
  (``render``), and ``server_up`` from its Prometheus exporter.
- ``rolling_restart``: the rolling restart (issue 42): ``start_stack`` (Redis, tiny engines, two guards
  with ``--drain-delay``, haproxy), the checked closed-loop ``Load`` through haproxy, ``rolling_restart``.
- ``fault_matrix``: the fleet fault matrix's ``Fleet`` (Redis and two engines), its cells and ``run_cell``
  (two guards under one fault: preemptions, ok/refused/lost, reservations against the pool, all back).
- ``live_stack``: engine, guard, Prometheus, Alertmanager and an on-call webhook receiver, as processes.
- ``browser``: ``Chromium``, a real headless Chromium driven over the DevTools protocol (``Page.evaluate``,
  ``wait_for`` in the live page, ``screenshot``), for the operator console.
- ``prometheus_tools``: the Prometheus/Alertmanager binaries (``binary(name)``) and ``ALERTS``.
- ``grafana_queries``: the committed dashboards' queries with their template variables substituted.
- ``kubernetes``: deploy/kubernetes/ offline: ``render`` (kustomize, by the wheel's kubectl) and ``problems``
  (strict schema validation of one object, CRDs included).
- ``triton_aot.py``: a script (run by path, in a subprocess) compiling every Triton kernel for a GPU target.
- ``admission_parts``: the guard's admission without engines: ``snapshot`` (a telemetry snapshot),
  ``make_dispatcher``/``ticket`` (one replica), ``pool_of`` (three replicas on real gates, ``POOL_CONFIG``).
- ``admission_backends``: the one admission core on each state backend (``BACKENDS``: local, a real Redis):
  ``admission``/``one_replica`` build dispatchers on either, ``Script`` drives arrivals and ends through one
  on a ``FakeClock`` and writes down every decision, so that two backends' decisions compare whole.
- ``detector_script``: the Fill-and-Squeeze detector on a synthetic clock (``run``, ``squeeze``).
- ``hf_reference`` also holds ``SMALL`` and ``save_hf_model`` (a small random checkpoint saved by HF).
- ``invariants``: the engine's block accounting after any operation (``check_block_accounting``, built on
  ``KVCacheManager.check``) and ``assert_all_blocks_back`` once nothing is live.
- ``single_sequence``: runs one sequence through the model without the scheduler, for attention tests.
- ``gguf_files``: ``write_tiny_gguf``, a small random Qwen2/Llama GGUF (every loadable tensor type, a minimal
  byte-level BPE vocabulary, a ChatML template), written with llama.cpp's writer, for the GGUF loader tests.
- ``hf_reference``: ``transformers`` as the reference: ``hf_greedy`` (never stops at EOS) and
  ``hf_last_logits``.

``ROOT`` is the repository's root.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
