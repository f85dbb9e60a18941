"""Plumbing every hook uses: the reasons a fast path is refused, the counters and the stats file,
patching that comes off cleanly, the one load interception, and eligibility over a module tree.
Knows nothing above it but the configuration and the model list."""
