# cuBLASLt without workspace (no memset before FP8 GEMMs): no kernel worse at the 7b shape (delayed, rowwise, blockwise) or for bf16 at 1b?
source .dev/setup.sh >/dev/null 2>&1
T0=$SECONDS
one() { local shape=$1 prec=$2 name=$3; shift 3
  [ $((SECONDS-T0)) -gt 420 ] && { echo "$shape $name skipped"; return; }
  env "$@" RESULTS=$OUT/$name RUN_TIMEOUT=100 PRECISIONS="$prec" PEER_VARIANTS="" timeout 300 bash benchmarks/side_by_side.sh $shape > $OUT/${name}_$shape.log 2>&1
  echo "$shape $name: $(grep -h -E '^\| megafp8 [^|]* \| [0-9]' $OUT/$name/$shape.md | cut -d'|' -f2,3,4 | tr '\n' ' ') t=$((SECONDS-T0))"; }
one 7b "delayed rowwise blockwise" default
one 7b "delayed rowwise blockwise" ws0 CUBLASLT_WORKSPACE_SIZE=0
one 1b "bf16 delayed" default1b
one 1b "bf16 delayed" ws0_1b CUBLASLT_WORKSPACE_SIZE=0
