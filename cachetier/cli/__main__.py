"""``python -m cachetier.cli``: the ``cachetier`` command."""

from cachetier.cli.main import main

raise SystemExit(main())
