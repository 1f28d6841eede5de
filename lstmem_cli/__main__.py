"""``python -m lstmem_cli ARGS``: the ``lstmem`` command."""

from lstmem_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
