"""A package of the user's whose submodule :mod:`tests.support.lazy_pkg.extra` a model's
forward imports lazily (nothing else imports it)."""
