"""Functions a user names as `module:function` (a reward of `glm5 rollout --reward`, the task factory of
`glm5 rl-async`'s `task.factory`), imported and checked before any model is read."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from glm5_jax.commands.source import CommandError


def load_callable(spec: str, *, field: str, example: str) -> Callable:
    """The callable named by `spec` ("module:name"); errors name `field`, the value and an `example`."""
    module_name, sep, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not name:
        raise CommandError(f"{field}={spec!r} is invalid: expected module:function, e.g. {example}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CommandError(f"{field}={spec!r}: cannot import module {module_name!r} ({err})") from None
    function = getattr(module, name, None)
    if not callable(function):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CommandError(f"{field}={spec!r}: module {module_name!r} has no function {name!r}; it has {public}")
    return function
