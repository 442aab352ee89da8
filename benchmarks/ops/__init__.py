"""What an operator needs, measured: ``python -m benchmarks.ops``. Each module is one part
(``install``, ``dashboard``, ``report``, ``pins``), the same harness as its test."""
