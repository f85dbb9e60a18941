"""Scaffolding for the demo, the tests and the benchmarks: the real model classes at any size with
random weights (``testing/sensenova.py``), the Qwen-Image-2.1 fast step's buffers made directly
(``qwen_fast``) and the demo (``demo``). Nothing here runs in a server."""
