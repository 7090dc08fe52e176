"""Helpers the tests share: processes, a services cluster, tiny workloads, plugins."""
