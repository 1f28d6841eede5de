"""Where a transformers forward and ``generate`` carry the KV cache: the one place that knows.

Memory follows the KV cache: a forward that starts at KV position ``P`` runs from the memory at ``P``
(:mod:`lstmem_peft.tuner.generation`), so the hooks must see the KV cache object of every forward.
transformers has renamed that argument: ``past_key_values`` up to 5.23; ``cache`` from 5.24, with
``past_key_values`` (and the state-space models' ``cache_params``) accepted, deprecated, until 5.40.
A user may pass either name, or the cache positionally. So nothing here trusts a name alone:

* :func:`kv_cache_in` finds the cache among a call's arguments by its known names first, then by its
  type (any :class:`transformers.cache_utils.Cache` among the keyword or positional arguments), so a
  further rename is still found.
* :func:`cache_keyword` is the name a given backbone's forward declares, for the library's own calls
  (``write_history``, the evaluation protocols, the benchmarks): no deprecation warning on either release.
* :func:`check_cache_seen` is the run-time guard for a release that stops passing the cache through
  the arguments at all: a forward whose returned KV cache holds tokens the hooks never saw is refused
  before its memory is committed (docs/design-choices.md, "The KV cache argument").
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache

#: The names transformers has given the KV cache argument, newest first.
CACHE_NAMES = ("cache", "past_key_values", "cache_params")


def kv_cache_in(args: tuple, kwargs: dict):
    """The KV cache passed to a forward or to ``generate`` (``None`` when there is none).

    Looks at ``cache=``, ``past_key_values=`` and ``cache_params=`` first, then at any
    :class:`~transformers.cache_utils.Cache` among the other keyword and positional arguments (a
    positional cache, or a name a later release gives it). Two different caches are an error: memory
    follows one KV cache per call.
    """
    found = [(name, kwargs[name]) for name in CACHE_NAMES if kwargs.get(name) is not None]
    if not found:
        found = [(name, value) for name, value in kwargs.items() if isinstance(value, Cache)]
        found += [
            (f"positional argument {i}", value) for i, value in enumerate(args) if isinstance(value, Cache)
        ]
    if not found:
        return None
    name, cache = found[0]
    for other, value in found[1:]:
        if value is not cache:
            raise ValueError(
                f"two KV caches were passed ({name} and {other}); pass one, as cache= (transformers >= 5.24) or "
                "past_key_values= (older releases)"
            )
    return cache


@functools.cache
def _forward_keyword(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters  # follows functools.wraps (deprecate_kwarg)
    for name in CACHE_NAMES[:2]:
        if name in params:
            return name
    return CACHE_NAMES[0] if _transformers_at_least(5, 24) else CACHE_NAMES[1]


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes the KV cache: ``"cache"`` on transformers
    5.24 and newer, ``"past_key_values"`` before (read from the backbone's own signature; a PEFT
    wrapper is looked through)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_keyword(type(base))


def kv_kwargs(model, cache) -> dict:
    """``{cache_keyword(model): cache}``: pass a KV cache to ``model`` (forward or ``generate``) under
    the name its transformers release reads."""
    return {cache_keyword(model): cache}


def returned_cache(output):
    """The KV cache a forward returned (a ``ModelOutput`` field or a tuple element), or ``None``."""
    values = output.values() if hasattr(output, "values") else output if isinstance(output, tuple) else ()
    for value in values:
        if isinstance(value, Cache):
            return value
    return None


def check_cache_seen(seen, output, length: int) -> None:
    """Refuse a forward whose KV cache the hooks did not see (before its memory is committed).

    Args:
        seen: the KV cache :func:`kv_cache_in` found among the forward's arguments, or ``None``.
        output: what the forward returned.
        length: tokens the forward fed.

    A forward that was passed no cache may create one (the first forward of a call), but then it
    holds only this forward's tokens. A returned cache that holds more came in by a way the hooks do
    not read: attention saw context that memory did not follow, and every later token would be
    silently wrong. Skipped inside a ``torch.compile`` trace (compiled steps always pass their
    static cache, and a graph must not read its length).
    """
    if seen is not None or torch.compiler.is_compiling():
        return
    returned = returned_cache(output)
    if returned is None:
        return
    held = int(returned.get_seq_length())
    if held > length:
        raise RuntimeError(
            stale_cache_message(f"the KV cache it returned holds {held} tokens, this forward fed {length}")
        )


def stale_cache_message(what: str) -> str:
    """The error for a KV cache that reached a forward by a way LSTMem does not read."""
    import transformers

    return (
        f"LSTMem memory cannot follow the KV cache with transformers {transformers.__version__}: {what}, but no "
        f"KV cache was found among the forward's arguments ({', '.join(CACHE_NAMES)} or any Cache instance). "
        "This transformers release passes the cache another way; memory was left as it was. Install a release "
        "lstmem-peft supports (the range in its metadata: pip install lstmem-peft --upgrade) and report the "
        "version at https://github.com/lstmem-peft/lstmem-peft/issues"
    )


def _transformers_at_least(major: int, minor: int) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release[:2] >= (major, minor)
