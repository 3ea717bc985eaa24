# cuBLASLt's memsets before GEMMs inside CUDA graphs: counted and costed, default workspace vs none
source .dev/setup.sh >/dev/null 2>&1
DETAIL=1 python .dev/gemm_memset.py
for ws in 0 1024; do CUBLASLT_WORKSPACE_SIZE=$ws DETAIL=1 python .dev/gemm_memset.py; done
