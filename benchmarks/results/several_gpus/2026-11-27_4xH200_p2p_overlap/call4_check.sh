# The repository's multi-GPU check on every 2- and 4-GPU layout
set -u
source .dev/setup.sh
rm -rf runs/check_layouts
timeout 560 python -m tests.multigpu.check_layouts --share 6 > $OUT/check_layouts.txt 2>&1
echo "rc=$?"
tail -45 $OUT/check_layouts.txt
