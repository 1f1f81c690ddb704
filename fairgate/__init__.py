"""fairgate: GPU-time fair scheduling and quotas for multi-tenant LLM inference.

Subpackages:
- ``fairgate.core``: pure scheduling logic (cost model, policies, fairness metrics). No I/O, no clock.
- ``fairgate.sim``: a continuous-batching replica simulator that drives ``core`` on virtual time.
"""

__version__ = "0.1.0"
