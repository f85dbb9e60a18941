"""Several sequences decoding together: paged K/V shared by up to 16 rows (``kv.py``), the rows
at a fixed row count (``decoder.py``), and several requests through a pipeline's own code, one
thread each (``turns.py``). No model."""
