"""Benchmarks, each a module run from the checkout's root: ``python -m benchmarks.<name> --json``
(``tiers``, ``restart``, ``peers``, ...). Each prints ratios against a baseline measured in the
same run, its JSON last. ``benchmarks.support`` holds what more than one of them uses."""
