# reproduce the tp2dp2 resumed hang; stacks by faulthandler on SIGABRT
set -u
source .dev/setup.sh >/dev/null
export PYTHONFAULTHANDLER=1
( while sleep 5; do for p in $(pgrep -f "megafp8.train"); do a=$(ps -o etimes= -p $p 2>/dev/null | tr -d ' '); [ "${a:-0}" -gt 120 ] && kill -ABRT $p 2>/dev/null; done; done ) &
W=$!
check() { local n=$1; shift
  timeout 250 python3 -m tests.multigpu.check_layouts --layouts tp2dp2 --precisions delayed --kinds straight resumed --output /tmp/$n "$@" > $OUT/$n.log 2>&1
  echo "$n rc=$?"; mkdir -p $OUT/${n}_logs; cp /tmp/$n/logs/* $OUT/${n}_logs/; grep -E "resumed|passed" $OUT/$n.log; }
check A --share 2
if grep -q "FAIL" $OUT/A.log; then
  check B --share 2 --without-tp-comm-overlap & pb=$!
  check C --share 2 --without-distributed-optimizer & pc=$!
  wait $pb $pc
else
  check D --share 6
fi
kill $W
