"""The PEFT adapter: the configuration, the wrapped projections, the tuner, the hooks and passes
that carry memory through a backbone's forwards and ``generate``, history writing, quantised
weights, and the loader every entry point uses. Imports ``memory`` and ``utils``."""
