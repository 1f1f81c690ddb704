"""The admit step both drivers run, so the simulator and the gateway call one policy the same way.

``shared/DESIGN.md`` ("One policy object, two drivers"): a request is handed to the policy (``enqueue``);
whenever a replica has a free slot the policy picks the next request, which is counted running and
charged its own prefill at once (``admit``); decode work is charged as it is spent (``charge``); the
request leaves its slot (``finish``), or leaves its queue unpicked (``remove``). The simulator drives this
on virtual time (``fairgate.sim.admission``), the gateway's dispatcher on the wall clock
(``fairgate.gateway.dispatch``); neither calls the policy's ``pick``, ``finish`` or ``remove`` itself.

Who owns which count: the policy, the requests queued (its queues); the admitter, the requests running
per tenant (the ``RunningView`` every ``pick`` sees), a request of ``sequences`` counting that many.
Pure: the caller passes ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Callable

from fairgate.core.cost import CostModel
from fairgate.core.policy import Policy
from fairgate.core.request import Request, RunningView


class Admitter:
    """One policy and the counts around it (see module docstring).

    Args:
        policy: the scheduling policy (``fairgate.core.policies.factory.make_policy``).
    """

    __slots__ = ("charge", "enqueue", "enqueue_all", "policy", "view")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.view = RunningView()  # running sequences per tenant, as every pick sees them
        # Hand a request to the policy (``Policy.enqueue(request, now_ms)``: it waits in its tenant's queue)
        # and book work spent (``Policy.charge``): the policy's own methods, called once per request and per
        # booked iteration by the simulator, so no layer is added on its hot path.
        self.enqueue = policy.enqueue
        self.enqueue_all = policy.enqueue_all  # ``enqueue`` of several requests handed over at one instant
        self.charge = policy.charge

    def admit(
        self, now_ms: float, batch_size: int, cost: CostModel, accept: Callable[[Request], bool] | None = None
    ) -> tuple[Request, float] | None:
        """Fill one free slot: the policy's next request, counted running and charged its prefill.

        Args:
            now_ms: the driver's clock.
            batch_size: sequences in the batch the request joins, itself included (the batch size its
                prefill is charged at; only ``vtc_calibrated`` reads it).
            cost: the cost model of the replica the slot is on (its prefill charge, seed 002).
            accept: whether a picked request may still run (the gateway's caller may have left in the
                tick its request was picked); one refused is finished unrun, uncharged, and the next is
                picked.

        Returns:
            ``(request, prefill_ms)``, or ``None`` when nothing is queued or the policy holds the slot.
        """
        policy = self.policy
        while True:
            request = policy.pick(now_ms, self.view)
            if request is None:
                return None
            if accept is None or accept(request):
                break
            policy.finish(request, now_ms)
        return request, self._run(request, batch_size, cost)

    def _run(self, request: Request, batch_size: int, cost: CostModel) -> float:
        """``request`` picked: counted running (``n`` sequences hold ``n`` slots) and charged its prefill at
        ``batch_size`` (seed 002). Returns the prefill ms."""
        by_tenant = self.view.by_tenant
        by_tenant[request.tenant] = by_tenant.get(request.tenant, 0) + request.sequences
        prefill_ms = cost.prefill_ms(request.prompt_tokens)
        self.policy.charge(request.tenant, prefill_ms, request.prompt_tokens, 0, batch_size)
        return prefill_ms

    def fill(self, now_ms: float, free_slots: int, running_now: int, cost: CostModel) -> list[tuple[Request, float]]:
        """``admit`` for up to ``free_slots`` slots of one replica running ``running_now`` sequences, each
        request joining the batch the ones before it made; ``(request, prefill_ms)`` of each admitted, in order.

        The simulator's admit step: one call per scheduling point rather than one per slot (every call and
        look-up here runs once per admission of a grid of thousands of runs). ``pick`` on an empty queue is
        ``None`` and changes nothing (``Policy``'s contract), so no ``queued()`` is asked before it.
        """
        policy, view = self.policy, self.view
        pick, by_tenant = policy.pick, view.by_tenant
        admitted: list[tuple[Request, float]] = []
        while len(admitted) < free_slots:
            request = pick(now_ms, view)
            if request is None:
                break
            # ``_run``, written out
            tenant, prompt_tokens = request.tenant, request.prompt_tokens
            by_tenant[tenant] = by_tenant.get(tenant, 0) + request.sequences
            prefill_ms = cost.prefill_ms(prompt_tokens)
            policy.charge(tenant, prefill_ms, prompt_tokens, 0, running_now + len(admitted) + 1)
            admitted.append((request, prefill_ms))
        return admitted

    def finish(self, request: Request, now_ms: float, generated_tokens: int | None = None) -> None:
        """``request`` left its slot after generating ``generated_tokens`` (None: as recorded on it)."""
        if generated_tokens is not None:
            request.generated_tokens = generated_tokens
        self.view.by_tenant[request.tenant] -= request.sequences
        self.policy.finish(request, now_ms)

    def remove(self, request_id: int, now_ms: float) -> Request | None:
        """Take a queued request out unpicked; returns it, or ``None`` if it was not queued."""
        return self.policy.remove(request_id, now_ms)

    def queued(self, tenant: str | None = None) -> int:
        """Requests waiting: of ``tenant``, or of every tenant (None)."""
        return self.policy.queued(tenant)

    def queued_by_tenant(self) -> dict[str, int]:
        """Requests waiting per tenant (tenants with none left out)."""
        return self.policy.queued_by_tenant()

    def running_by_tenant(self) -> dict[str, int]:
        """Requests holding a slot per tenant (tenants with none left out)."""
        return {tenant: n for tenant, n in self.view.by_tenant.items() if n > 0}

    def wake_at(self, now_ms: float) -> float | None:
        """When a held request may become eligible (``Policy.wake_at``)."""
        return self.policy.wake_at(now_ms)
