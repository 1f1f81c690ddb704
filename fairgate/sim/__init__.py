"""The simulator: continuous-batching replicas on virtual time, driving the same policy objects as the
gateway (``fairgate.core``); workloads, trace loaders, experiments, sweeps, reports and plots."""
