"""One harness for drills, tests and benchmarks: real servers on loopback, real clients, real ledgers.

- ``process``: the process supervisor (``ServerProcess``: start ``python -m fairgate ...`` or a server binary,
  wait until it answers, stop / kill -9 / SIGSTOP / SIGCONT it, always reap it; ``free_port``).
- ``threads``: an ASGI app on a thread of this process (``serve_in_thread``).
- ``redis`` / ``postgres``: throwaway ledger servers of their own; ``proxy``: a TCP proxy a test can cut.
- ``replica``: the emulated replicas' cost model (``ReplicaModel``) and what they report (``ReplicaStats``);
  ``tap``: what reached an in-process replica (``EmulatorTap``); ``pacer``: replicas out of lock-step.
- ``config``: tenants (``TenantSpec``), their keys, and the gateway file for them (written with
  ``fairgate.gateway.config_writer``).
- ``stack``: the loopback stack (``StackSpec`` -> ``start_stack`` -> ``Stack``): N replicas, 1..N
  gateways, on threads or as processes, an SQLite or shared ledger.
- ``loadgen`` / ``records``: the load generator on the real ``openai`` client (``LoadGenerator``,
  ``TenantLoad``, ``Request``, ``Cut``, ``HttpRequest``) and what it records (``History``);
  ``rawhttp``: requests written byte for byte.
- ``run``: one load on a fresh stack with ledger readings (``run_on_stack``).
- ``history``: the history checker (``check_history``): every client's attempts, id by id, against the
  ledger's reservations, events and accounts and the replicas' own counts; a typed report of what differs.
- ``ledger``, ``gauges``, ``logs``: what the ledger, a gateway's ``/metrics`` and the gateways' logs say
  (``quiet_hang_ups`` silences what thousands of client hang-ups make servers log).

Layering: the harness uses the gateway, the emulator, the ledger and the core; the drills, the tests and the
benches use the harness; the gateway never imports it.
"""
