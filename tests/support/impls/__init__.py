"""Two implementations of an activation, one of which a build picks per trial as a module
(``IMPL = tanh_impl``: :mod:`tests.worker.test_outside_edges`)."""
