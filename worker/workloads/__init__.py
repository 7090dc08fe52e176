"""The built-in workloads (registered by name in :mod:`packtune.workloads`)."""
