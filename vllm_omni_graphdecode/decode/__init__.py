"""Token-by-token decode of one sequence: paged K/V with one graph per length bucket
(``paged.py``), its two tiers (``tiers.py``), k tokens per launch (``token_loop.py``), the
sessions a hook serves requests from (``session.py``) and the seeded per-request draws
(``sampling.py``); ``batch/``: several sequences decoding together. No model: a hook supplies the
step."""
