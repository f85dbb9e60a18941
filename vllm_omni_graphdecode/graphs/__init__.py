"""Capturing and replaying CUDA graphs: the one capture routine (``capture.py``), per-request
prefix buffers with one captured step per entry (``prefix.py``), and the torch.compile pieces the
fast step bodies share (``compiling.py``). No model."""
