"""A plugin package's settings module: :mod:`tests.support.knob_workload`'s build_model sets
``SCALE`` per trial, and its model's forward reads it."""

SCALE = 1.0
