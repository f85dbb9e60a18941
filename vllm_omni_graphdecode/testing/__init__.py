"""Scaffolding for the demo, the tests and the benchmarks: the real model classes at any size with
random weights (``random_models``) and the demo (``demo``). Nothing here runs in a server."""
