"""The package's version: the one place it is written (pyproject.toml reads it, setuptools' dynamic
version; ``lstmem_peft.__version__`` hands it on)."""

__version__ = "0.1.0"
