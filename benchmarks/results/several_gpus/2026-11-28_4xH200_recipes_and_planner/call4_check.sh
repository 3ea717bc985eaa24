# the multi-GPU check's pipeline layouts, straight and resumed runs (stopped by its 230 s limit)
source .dev/setup.sh >/dev/null
timeout 230 python3 -m tests.multigpu.check_layouts --share 6 --layouts pp2 vpp4 tp2pp2 pp2dp2 pp4 --kinds straight resumed --output /tmp/check
