#!/bin/bash
# old_step.sh OUTDIR ARGS...: benchmarks/sensenova_batch.py of the tree without the MLP fusion.
here=$(cd "$(dirname "$0")" && pwd)
out=$1; shift
mkdir -p /tmp/old && tar xzf "$here/tree-nofuse.tgz" -C /tmp/old && cd /tmp/old || exit 2
export PYTHONPATH=/tmp/old${PYTHONPATH:+:$PYTHONPATH}
exec python3 benchmarks/sensenova_batch.py --out "$out" "$@"
