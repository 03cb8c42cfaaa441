"""``python -m deferinit``: the command line (see :mod:`deferinit.cli`).

Example::

    $ python -m deferinit demo
"""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
