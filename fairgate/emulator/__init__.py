"""An OpenAI-compatible replica that runs continuous batching with the core's cost model on a real clock.

The embedded default upstream of the gateway and the stand-in for vLLM in tests (``fairgate emulate``).
"""
