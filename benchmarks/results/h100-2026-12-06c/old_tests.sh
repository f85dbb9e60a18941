#!/bin/bash
# old_tests.sh CALL LABEL KEXPR: when step LABEL of call CALL did not pass, run the same tests
# on the tree without the MLP fusion (417f001, tree-nofuse.tgz beside this script).
summary=/tmp/graphdecode-runs/$1/summary.txt
if grep -q "$2: exit 0" "$summary"; then echo "$2 passed; the old tree not run"; exit 0; fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/old && tar xzf "$here/tree-nofuse.tgz" -C /tmp/old && cd /tmp/old || exit 2
export PYTHONPATH=/tmp/old${PYTHONPATH:+:$PYTHONPATH}
exec python3 -m pytest -m gpu -p no:cacheprovider -q -rfE tests/test_sensenova_batch_gpu.py -k "$3"
